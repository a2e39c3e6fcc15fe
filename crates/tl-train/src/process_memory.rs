//! The process's resident memory: the whole-process view next to tl-tensor's meter of tensor
//! storage (what `ru_maxrss` or PyTorch's peak RSS report).
//!
//! On Linux it comes from `/proc/self`, and the peak can be reset ([`reset_peak_rss`]) so
//! that it covers one run. On macOS it is `getrusage(RUSAGE_SELF)`'s `ru_maxrss`, which
//! cannot be reset: the peak there covers the whole process, from its start. Elsewhere it is
//! not measured, and the figures say "unavailable".

use std::fs;

/// The peak resident set size of this process, in bytes: Linux's `VmHWM` (since the last
/// [`reset_peak_rss`]), macOS's `ru_maxrss` (since the process started); `None` where
/// neither is available.
pub fn peak_rss_bytes() -> Option<u64> {
    linux_peak_rss_bytes().or_else(macos_peak_rss_bytes)
}

/// `VmHWM` of `/proc/self/status`, in bytes.
fn linux_peak_rss_bytes() -> Option<u64> {
    kib_line_bytes(&fs::read_to_string("/proc/self/status").ok()?, "VmHWM:")
}

/// The value of the line `key N kB` of a `/proc` file's `text`, in bytes.
fn kib_line_bytes(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|line| line.starts_with(key))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// `ru_maxrss` of `getrusage(RUSAGE_SELF)`: bytes on macOS (Linux reports KiB, and is read
/// from `/proc` instead).
#[cfg(target_os = "macos")]
fn macos_peak_rss_bytes() -> Option<u64> {
    // SAFETY: `getrusage` only writes the `rusage` it is given, which is plain data for
    // which all zeros is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a valid, writable `rusage`; RUSAGE_SELF is a valid `who`.
    let status = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    if status != 0 {
        return None;
    }
    u64::try_from(usage.ru_maxrss)
        .ok()
        .filter(|&bytes| bytes > 0)
}

#[cfg(not(target_os = "macos"))]
fn macos_peak_rss_bytes() -> Option<u64> {
    None
}

/// The peak process memory as `tinyllm` prints it after a figure: `, peak process memory
/// 12.3 MiB`, or `, peak process memory unavailable` where it is not measured.
pub fn describe_peak(peak_rss_bytes: Option<u64>) -> String {
    match peak_rss_bytes {
        Some(bytes) => format!(
            ", peak process memory {:.1} MiB",
            bytes as f64 / f64::from(1u32 << 20)
        ),
        None => ", peak process memory unavailable".to_string(),
    }
}

/// The most memory this process can hold, and what sets that bound.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryBound {
    /// Bytes.
    pub bytes: u64,
    /// What sets it: the machine's free memory, a cgroup's limit, or `ulimit -v`.
    pub source: &'static str,
}

/// The least of the bounds on this process's memory that the system reports: the memory
/// the machine has free now (`MemAvailable`, plus what this process already holds), its
/// cgroup's `memory.max` (a container's or a job's limit), and its address-space limit
/// (`ulimit -v`, less what the process has reserved but not touched). `None` where none is
/// reported (not Linux).
pub fn memory_bound() -> Option<MemoryBound> {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    let status_bytes = |key: &str| kib_line_bytes(&status, key);
    let held = status_bytes("VmRSS:").unwrap_or(0);
    let mut bounds = Vec::new();
    if let Some(free) = meminfo_bytes("MemAvailable:") {
        bounds.push(MemoryBound {
            bytes: free.saturating_add(held),
            source: "the memory this machine has free",
        });
    }
    if let Some(limit) = cgroup_limit() {
        bounds.push(MemoryBound {
            bytes: limit,
            source: "this process's cgroup limit (memory.max)",
        });
    }
    if let Some(limit) = address_space_limit() {
        // Reserved but untouched (thread stacks, allocator arenas) counts against the limit
        // and not as resident memory.
        let reserved = status_bytes("VmSize:").unwrap_or(0).saturating_sub(held);
        bounds.push(MemoryBound {
            bytes: limit.saturating_sub(reserved),
            source: "this process's address-space limit (ulimit -v)",
        });
    }
    bounds.into_iter().min_by_key(|bound| bound.bytes)
}

/// A line of `/proc/meminfo`, in bytes.
fn meminfo_bytes(key: &str) -> Option<u64> {
    kib_line_bytes(&fs::read_to_string("/proc/meminfo").ok()?, key)
}

/// The cgroup v2 `memory.max` of this process, when it sets one.
fn cgroup_limit() -> Option<u64> {
    let cgroup = fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = cgroup.lines().find_map(|line| line.strip_prefix("0::"))?;
    let limit = fs::read_to_string(format!("/sys/fs/cgroup{}/memory.max", path.trim())).ok()?;
    limit.trim().parse().ok()
}

/// `RLIMIT_AS` (`ulimit -v`), when it is set.
fn address_space_limit() -> Option<u64> {
    let limit = rustix::process::getrlimit(rustix::process::Resource::As);
    limit.current
}

/// Resets the peak resident set size to the current one, so that [`peak_rss_bytes`]
/// measures from now (Linux ≥ 4.0: writing 5 to `/proc/self/clear_refs`). Returns whether it
/// worked; when it did not (always on macOS, where the peak cannot be reset), later peaks
/// include what came before.
pub fn reset_peak_rss() -> bool {
    fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_covers_a_large_allocation_made_after_a_reset() {
        let Some(before) = peak_rss_bytes() else {
            return; // neither Linux nor macOS: nothing to measure
        };
        assert!(before > 0);
        reset_peak_rss();
        let block = vec![1u8; 64 << 20];
        std::hint::black_box(&block);
        let after = peak_rss_bytes().unwrap();
        assert!(after >= 64 << 20, "peak {after} after touching 64 MiB");
    }

    #[test]
    fn a_peak_that_is_not_measured_says_so() {
        assert_eq!(
            describe_peak(Some(3 << 20)),
            ", peak process memory 3.0 MiB"
        );
        assert_eq!(describe_peak(None), ", peak process memory unavailable");
    }
}
