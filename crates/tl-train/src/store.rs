//! Files of a run: atomic writes, bounded reads, fingerprints, and tensors in safetensors
//! ([`tensors`]).

mod tensors;

use std::fs;
use std::io::Write;
use std::path::Path;

pub use tensors::{
    NamedTensor, TensorMap, TensorSource, TensorVisitor, Values, decode_tensors, encode_tensors,
    read_tensors, write_tensors_atomic,
};

use crate::error::{Result, TrainError};

/// Writes `bytes` to `path` so that a crash leaves either the old file or the new one, never
/// a mix: write a temporary file in the same directory, flush it to disk, then rename it over
/// `path` (a rename within one file system is atomic).
///
/// The temporary file's name carries the process id, so two processes writing the same file
/// never write into each other's temporary (the run directory's lock keeps two trainers out
/// of one run; this is the second line of defence).
///
/// # Errors
/// [`TrainError::Io`] naming the file that failed.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |file| file.write_all(bytes))
}

/// [`write_atomic`] of the bytes `fill` writes into the file (streamed, when they are too
/// many to hold in memory at once).
///
/// # Errors
/// [`TrainError::Io`] naming the file that failed, `fill`'s errors included.
pub(crate) fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut fs::File) -> std::io::Result<()>,
) -> Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let temporary = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let write = || -> std::io::Result<()> {
        fault_point();
        let mut file = fs::File::create(&temporary)?;
        fault_point();
        fill(&mut file)?;
        file.sync_all()?;
        fault_point();
        fs::rename(&temporary, path)?;
        fault_point();
        if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            // Make the rename itself durable.
            fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    };
    write().map_err(|source| {
        let _ = fs::remove_file(&temporary);
        TrainError::io(path, source)
    })
}

/// The bytes of `path`, refusing a file longer than `limit` bytes without reading past
/// the limit (a device such as `/dev/zero` never ends, and a file can grow while it is
/// read): the allocation is bounded by `limit + 1` whatever the file claims to be.
///
/// # Errors
/// [`TrainError::Io`] when the file cannot be read; [`TrainError::FileTooLarge`] naming
/// `name` (the flag or the kind of file) and the bound.
pub fn read_bounded(path: &Path, limit: u64, name: &'static str) -> Result<Vec<u8>> {
    use std::io::Read;
    let file = fs::File::open(path).map_err(|source| TrainError::io(path, source))?;
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|source| TrainError::io(path, source))?;
    if bytes.len() as u64 > limit {
        return Err(TrainError::FileTooLarge {
            name,
            path: path.to_path_buf(),
            limit,
        });
    }
    Ok(bytes)
}

/// Whether `name` is one of [`write_atomic`]'s temporary files.
pub(crate) fn is_temporary(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(".tmp")
}

/// The environment variable that makes the checkpoint writer abort the process: set to `N`,
/// the process aborts (as SIGKILL would end it) just before the `N`-th filesystem operation
/// of the run's file writers. For crash-consistency tests only.
pub const FAULT_ENV: &str = "TINYLLM_FAULT_AFTER_FS_OPS";

/// Counts a filesystem operation of the writers, and aborts the process when
/// [`FAULT_ENV`] asks for it here.
pub(crate) fn fault_point() {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static LIMIT: OnceLock<Option<u64>> = OnceLock::new();
    static DONE: AtomicU64 = AtomicU64::new(0);
    let limit = LIMIT.get_or_init(|| std::env::var(FAULT_ENV).ok()?.parse().ok());
    if let Some(limit) = *limit
        && DONE.fetch_add(1, Ordering::SeqCst) + 1 >= limit
    {
        std::process::abort();
    }
}

/// The SHA-256 of `bytes` as 64 lowercase hex digits, the form `sha256sum` prints: a
/// checkpoint's files can be checked by hand with `sha256sum -c SHA256SUMS`.
pub fn fingerprint(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex(&Sha256::digest(bytes))
}

/// Bytes as lowercase hex digits.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_longer_than_its_bound_is_refused_without_reading_past_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        fs::write(&path, [7u8; 10]).unwrap();
        assert_eq!(read_bounded(&path, 10, "--x").unwrap(), vec![7u8; 10]);
        let error = read_bounded(&path, 9, "--x").unwrap_err();
        assert!(
            matches!(
                error,
                TrainError::FileTooLarge {
                    name: "--x",
                    limit: 9,
                    ..
                }
            ),
            "{error}"
        );
        assert_eq!(
            error.to_string(),
            format!(
                "{}: larger than the 9 bytes allowed for --x",
                path.display()
            )
        );
    }

    #[test]
    fn fingerprints_are_sha256_and_notice_one_flipped_bit() {
        // The published SHA-256 of the empty input and of "abc" (FIPS 180-2, appendix B.1).
        assert_eq!(
            fingerprint(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            fingerprint(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_ne!(fingerprint(&[0, 0, 0]), fingerprint(&[0, 1, 0]));
    }

    #[test]
    fn an_atomic_write_replaces_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        write_atomic(&path, b"old").unwrap();
        write_atomic(&path, b"new").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
        let missing = dir.path().join("no-such-dir").join("f");
        assert!(matches!(
            write_atomic(&missing, b"x"),
            Err(TrainError::Io { .. })
        ));
    }
}
