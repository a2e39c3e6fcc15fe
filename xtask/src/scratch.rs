//! A scratch copy of the workspace where mutants are applied, never the working tree.
//!
//! The copy lives under `target/xtask/` with its own persistent target directory. Syncing
//! writes only files whose bytes differ, so unchanged files keep their modification times and
//! cargo's rebuilds after a mutant stay incremental.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Top-level entries of the workspace that are never copied.
const SKIP: &[&str] = &["target", ".git", "mutants.out", "mutants.out.old", "runs"];

/// A synced copy of the workspace.
pub(crate) struct Scratch {
    /// The copy's root: run cargo here.
    pub(crate) root: PathBuf,
    /// The persistent target directory of builds in the copy.
    pub(crate) target_dir: PathBuf,
}

impl Scratch {
    /// Creates or refreshes the copy named `name` of the workspace at `workspace`.
    pub(crate) fn sync(workspace: &Path, name: &str) -> io::Result<Scratch> {
        let base = workspace.join("target").join("xtask");
        let root = base.join(name);
        let target_dir = base.join(format!("{name}-target"));
        fs::create_dir_all(&root)?;
        sync_dir(workspace, &root, true)?;
        Ok(Scratch { root, target_dir })
    }

    /// Reads a file of the copy, by its path relative to the workspace root.
    pub(crate) fn read(&self, relative: &str) -> io::Result<String> {
        fs::read_to_string(self.root.join(relative))
    }

    /// Writes a file of the copy, by its path relative to the workspace root.
    pub(crate) fn write(&self, relative: &str, contents: &str) -> io::Result<()> {
        fs::write(self.root.join(relative), contents)
    }
}

/// Makes `dst` a copy of `src`: new and changed files written, stale ones removed.
pub(crate) fn sync_dir(src: &Path, dst: &Path, top: bool) -> io::Result<()> {
    let mut wanted = Vec::new();
    for entry in fs::read_dir(src)? {
        let entry = entry?;
        let name = entry.file_name();
        if top && SKIP.iter().any(|skip| name == *skip) {
            continue;
        }
        let kind = entry.file_type()?;
        let (from, to) = (entry.path(), dst.join(&name));
        if kind.is_dir() {
            fs::create_dir_all(&to)?;
            sync_dir(&from, &to, false)?;
        } else if kind.is_file() {
            let bytes = fs::read(&from)?;
            if fs::read(&to).ok().as_deref() != Some(bytes.as_slice()) {
                fs::write(&to, bytes)?;
            }
        } else {
            continue;
        }
        wanted.push(name);
    }
    for entry in fs::read_dir(dst)? {
        let entry = entry?;
        if wanted.contains(&entry.file_name()) {
            continue;
        }
        if entry.file_type()?.is_dir() {
            fs::remove_dir_all(entry.path())?;
        } else {
            fs::remove_file(entry.path())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sync_copies_changes_and_removes_stale_files() {
        let base = std::env::temp_dir().join(format!("xtask-sync-{}", std::process::id()));
        let (src, dst) = (base.join("src"), base.join("dst"));
        fs::create_dir_all(src.join("a")).unwrap();
        fs::create_dir_all(src.join("target")).unwrap();
        fs::write(src.join("a/f.rs"), "one").unwrap();
        fs::write(src.join("target/big"), "skip me").unwrap();
        fs::create_dir_all(dst.join("old")).unwrap();
        fs::write(dst.join("old/g.rs"), "stale").unwrap();

        sync_dir(&src, &dst, true).unwrap();
        assert_eq!(fs::read_to_string(dst.join("a/f.rs")).unwrap(), "one");
        assert!(!dst.join("target").exists());
        assert!(!dst.join("old").exists());

        let before = fs::metadata(dst.join("a/f.rs"))
            .unwrap()
            .modified()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        sync_dir(&src, &dst, true).unwrap();
        let after = fs::metadata(dst.join("a/f.rs"))
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(before, after, "an unchanged file must keep its mtime");
        fs::remove_dir_all(base).unwrap();
    }
}
