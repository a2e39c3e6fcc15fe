//! The process's resident memory, from Linux's `/proc/self`: the whole-process view next to
//! tl-tensor's meter of tensor storage (what `ru_maxrss` or PyTorch's peak RSS report).

use std::fs;

/// The peak resident set size of this process (`VmHWM`), in bytes; `None` where
/// `/proc/self/status` is not available (not Linux).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The machine's physical memory (`MemTotal` of `/proc/meminfo`), in bytes; `None` where
/// it is not available.
pub fn total_memory_bytes() -> Option<u64> {
    let meminfo = fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|line| line.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Resets the peak resident set size to the current one, so that [`peak_rss_bytes`]
/// measures from now (Linux ≥ 4.0: writing 5 to `/proc/self/clear_refs`). Returns whether it
/// worked; when it did not, later peaks include what came before.
pub fn reset_peak_rss() -> bool {
    fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_covers_a_large_allocation_made_after_a_reset() {
        let Some(before) = peak_rss_bytes() else {
            return; // not Linux: nothing to measure
        };
        assert!(before > 0);
        reset_peak_rss();
        let block = vec![1u8; 64 << 20];
        std::hint::black_box(&block);
        let after = peak_rss_bytes().unwrap();
        assert!(after >= 64 << 20, "peak {after} after touching 64 MiB");
    }
}
