//! Records which commit tinyllm is built from, for `tinyllm --version` and the `tinyllm` key
//! of a run's `config.json` (see `src/build_info.rs`).
//!
//! Sets `TINYLLM_GIT_COMMIT` to `git rev-parse HEAD` when the source is a git checkout and git
//! runs; outside one (a source tarball, a registry download) it is left unset and the build
//! goes on. `TINYLLM_VERSION_LINE` is always set: the version, and the commit when known.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=TINYLLM_GIT_COMMIT");
    let version = std::env::var("CARGO_PKG_VERSION").unwrap_or_default();
    let given = std::env::var("TINYLLM_GIT_COMMIT")
        .ok()
        .filter(|c| is_commit(c));
    let commit = given.or_else(|| {
        watch_git_files();
        git(&["rev-parse", "HEAD"]).filter(|c| is_commit(c))
    });
    match &commit {
        Some(commit) => {
            println!("cargo:rustc-env=TINYLLM_GIT_COMMIT={commit}");
            println!("cargo:rustc-env=TINYLLM_VERSION_LINE={version} (commit {commit})");
        }
        None => println!("cargo:rustc-env=TINYLLM_VERSION_LINE={version}"),
    }
}

/// A full SHA-1 commit id: 40 hexadecimal digits.
fn is_commit(text: &str) -> bool {
    text.len() == 40 && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The trimmed output of `git ARGS` run in this crate's directory, if it ran and succeeded.
fn git(args: &[&str]) -> Option<String> {
    let dir = std::env::var_os("CARGO_MANIFEST_DIR")?;
    let output = Command::new("git")
        .args(args)
        .current_dir(dir)
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    Some(String::from_utf8(output.stdout).ok()?.trim().to_string())
}

/// Asks cargo to run this script again when the checked-out commit changes: when `HEAD`
/// moves to another branch, when the branch it names gets a new commit (its ref file, or
/// `packed-refs`). Only files that exist are named (cargo reruns every build for a missing
/// one). In a linked worktree `HEAD` is the worktree's and the refs are the repository's.
fn watch_git_files() {
    let (Some(git_dir), Some(common_dir)) = (
        git(&["rev-parse", "--absolute-git-dir"]),
        git(&["rev-parse", "--git-common-dir"]),
    ) else {
        return;
    };
    let git_dir = PathBuf::from(git_dir);
    let common_dir = absolute_in(&common_dir);
    let head = git_dir.join("HEAD");
    let mut watched = vec![head.clone(), common_dir.join("packed-refs")];
    if let Ok(text) = std::fs::read_to_string(&head)
        && let Some(reference) = text.trim().strip_prefix("ref: ")
    {
        watched.push(git_dir.join(reference));
        watched.push(common_dir.join(reference));
    }
    for path in watched.iter().filter(|path| path.is_file()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

/// `path` as git printed it (relative to this crate's directory, or absolute).
fn absolute_in(path: &str) -> PathBuf {
    let path = Path::new(path);
    match std::env::var_os("CARGO_MANIFEST_DIR") {
        Some(dir) if path.is_relative() => Path::new(&dir).join(path),
        _ => path.to_path_buf(),
    }
}
