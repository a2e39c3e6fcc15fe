//! The rendezvous directory: where each rank's socket lives, and the checks that make it a
//! safe place to meet.
//!
//! Any process that can create a file in the directory can bind a rank's socket path before
//! the rank does, or after it is removed, and so be dialled by the rank's neighbour. So the
//! directory must be the user's own and writable by nobody else: [`check`] refuses a
//! directory that another user owns or that its group or others can write (a hand-set
//! `TINYLLM_RENDEZVOUS=/tmp`, for instance).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{CollectiveError, Result};

/// How the names of the directories `tinyllm launch` makes begin: such a directory is the
/// run's alone, and its ranks remove it once the ring has formed.
pub(crate) const LAUNCHER_PREFIX: &str = "tinyllm-rendezvous-";

/// Removes `dir` if the launcher made it and it is empty (every rank's socket is gone once
/// the ring has formed): a hand-set directory is the user's, and stays.
pub(crate) fn remove_if_launchers(dir: &Path) {
    let launchers = dir
        .file_name()
        .is_some_and(|name| name.to_string_lossy().starts_with(LAUNCHER_PREFIX));
    if launchers {
        // Already removed (by the launcher), or not empty: either way nothing to do.
        let _ = std::fs::remove_dir(dir);
    }
}

/// The longest socket path Linux takes: `sun_path` holds 108 bytes with the final NUL.
pub const MAX_SOCKET_PATH: usize = 107;

/// The socket path of `rank` in `dir`.
pub fn socket_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.sock"))
}

/// Checks that the sockets of a world of `world_size` ranks fit in `dir`'s paths.
///
/// # Errors
/// [`CollectiveError::SocketPathTooLong`] naming the longest path, its length and the limit.
pub fn check_socket_paths(dir: &Path, world_size: usize) -> Result<()> {
    let longest = socket_path(dir, world_size.saturating_sub(1));
    let len = longest.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(CollectiveError::SocketPathTooLong {
            path: longest,
            len,
            limit: MAX_SOCKET_PATH,
        });
    }
    Ok(())
}

/// Checks that `dir` is a directory of this user's that nobody else can write.
///
/// # Errors
/// [`CollectiveError::UnsafeRendezvous`] naming the directory, its mode and owner;
/// [`CollectiveError::Io`] if it cannot be examined.
pub(crate) fn check(dir: &Path) -> Result<()> {
    let meta = std::fs::metadata(dir).map_err(|e| {
        CollectiveError::io(
            format!("examine the rendezvous directory {}", dir.display()),
            e,
        )
    })?;
    let me = rustix::process::geteuid().as_raw();
    judge(dir, meta.is_dir(), meta.mode() & 0o7777, meta.uid(), me)
}

/// [`check`]'s verdict on a directory's kind, mode and owner, for a process of user `me`.
fn judge(dir: &Path, is_dir: bool, mode: u32, owner: u32, me: u32) -> Result<()> {
    let refuse = |reason: String| CollectiveError::UnsafeRendezvous {
        path: dir.to_path_buf(),
        mode,
        owner,
        reason,
    };
    if !is_dir {
        return Err(refuse("not a directory".into()));
    }
    if owner != me {
        return Err(refuse(format!(
            "owned by another user than this process's (uid {me}): its owner could listen \
             in a rank's place"
        )));
    }
    if mode & 0o022 != 0 {
        return Err(refuse(
            "group or others can write to it, so any of them could listen in a rank's place: \
             use a directory only you can write (chmod go-w, or let tinyllm launch make one)"
                .into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_private_directory_of_ones_own_passes() {
        for mode in [0o700, 0o755, 0o500] {
            judge(Path::new("/r"), true, mode, 1000, 1000).unwrap();
        }
    }

    #[test]
    fn a_directory_others_can_write_is_refused_naming_its_mode() {
        for mode in [0o777, 0o1777, 0o770, 0o702] {
            let err = judge(Path::new("/tmp/r"), true, mode, 1000, 1000).unwrap_err();
            let text = err.to_string();
            assert!(text.contains("/tmp/r"), "{text}");
            assert!(text.contains(&format!("mode {mode:04o}")), "{text}");
        }
    }

    #[test]
    fn a_directory_of_another_user_is_refused_naming_its_owner() {
        let err = judge(Path::new("/r"), true, 0o700, 65534, 1000).unwrap_err();
        assert!(
            matches!(err, CollectiveError::UnsafeRendezvous { owner: 65534, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("uid 65534"), "{err}");
    }

    #[test]
    fn socket_paths_over_the_limit_are_refused_naming_length_and_limit() {
        let dir = PathBuf::from(format!("/{}", "d".repeat(90)));
        check_socket_paths(&dir, 8).unwrap();
        // "/" + 90 + "/rank-1000.sock" (15) = 106; "/rank-10000.sock" = 107; one more: 108.
        check_socket_paths(&dir, 10_001).unwrap();
        let err = check_socket_paths(&dir, 100_001).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("108 bytes") && text.contains("107"), "{text}");
    }
}
