//! [`RunLock`]: one process at a time in a run directory.
//!
//! Two trainers in one run directory would interleave their metrics, overwrite each other's
//! checkpoints and leave a config of one run beside the weights of the other. Every command
//! that writes a run takes an exclusive advisory lock on its `.lock` file first, and holds it
//! until it exits; the lock goes with the process, however it ends (a SIGKILL included), so a
//! stale lock file never blocks a later run.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Result, TrainError};

/// The lock file's name in a run directory.
pub const LOCK_FILE: &str = ".lock";

/// The exclusive lock of a run directory, released when dropped.
#[derive(Debug)]
pub struct RunLock {
    _file: File,
    path: PathBuf,
}

impl RunLock {
    /// Takes the lock of `run_dir` (which must exist), writing this process's id and command
    /// into the lock file so that a second process can say who holds it.
    ///
    /// # Errors
    /// [`TrainError::Locked`] naming the holder when another process has it;
    /// [`TrainError::Io`] when the lock file cannot be opened or written.
    pub fn acquire(run_dir: &Path) -> Result<Self> {
        let path = run_dir.join(LOCK_FILE);
        let io = |source| TrainError::io(&path, source);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let holder = fs::read_to_string(&path).unwrap_or_default();
                let holder = match holder.trim() {
                    "" => "a process that has not written its id yet".to_string(),
                    holder => holder.to_string(),
                };
                return Err(TrainError::Locked {
                    path: run_dir.to_path_buf(),
                    holder,
                });
            }
            Err(TryLockError::Error(source)) => return Err(io(source)),
        }
        let command: Vec<String> = std::env::args().collect();
        file.set_len(0).map_err(io)?;
        writeln!(
            file,
            "process {}: {}",
            std::process::id(),
            command.join(" ")
        )
        .map_err(io)?;
        Ok(Self { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_one_directory_is_refused_naming_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunLock::acquire(dir.path()).unwrap();
        // A second open file description conflicts like a second process would.
        let error = RunLock::acquire(dir.path()).unwrap_err();
        match &error {
            TrainError::Locked { path, holder } => {
                assert_eq!(path, dir.path());
                assert!(
                    holder.contains(&format!("process {}", std::process::id())),
                    "{holder}"
                );
            }
            other => panic!("expected Locked, got {other:?}"),
        }
        assert!(error.to_string().contains("in use by another tinyllm"));
        drop(first);
        RunLock::acquire(dir.path()).expect("free again once dropped");
    }
}
