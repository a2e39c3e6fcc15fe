//! A scratch copy of the workspace where mutants are applied, never the working tree.
//!
//! The copy lives under `target/xtask/`. Syncing writes only files whose bytes differ, so
//! unchanged files keep their modification times and cargo's rebuilds after a mutant stay
//! incremental.
//!
//! Every copy builds into the workspace's own target directory, so the dependencies (gemm,
//! rayon, proptest: minutes at opt-level 3) are built once for the workspace and all its
//! copies. That needs care: cargo names a path crate's artifacts by a hash of its path
//! *relative to its workspace root*, so a copy's `crates/tl-precision`, mutated, would get
//! the very file names of the workspace's own, and a later build of either could take the
//! other's artifact as up to date. So every build of a copy's (or the check's) chapter
//! crates runs in a [`Slot`] of its own: its settings ([`Slot::config`]) differ in a value
//! that changes nothing but that hash. Cargo holds the target directory's lock while it
//! builds, not while tests run, so copies tested in parallel still overlap.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// The crates whose builds depend on the slot: the chapters' crates, which are mutated (or
/// are the learner's), and the course tests built on them. The others (tl-numerics,
/// tl-tensor) are the same bytes in the workspace and each of its copies, so sharing their
/// artifacts is sound. (A crate that depends on a slotted one, tl-train say, gets another
/// hash through it: cargo folds the dependencies' metadata into a crate's.)
fn slotted() -> Vec<&'static str> {
    let mut crates = crate::chapters::all_packages();
    crates.extend(crate::chapters::CHAPTERS.iter().map(|c| c.course_package));
    crates.sort_unstable();
    crates.dedup();
    crates
}

/// A set of artifacts of the chapter's crates in the shared target directory: one for the
/// course tests of `check`, one per scratch copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slot(u32);

impl Slot {
    /// The course tests that `check` runs in the workspace itself.
    pub(crate) const COURSE: Slot = Slot(1);
    /// The course tests on the copy where the reference stands in (`--ref-deps`).
    pub(crate) const COURSE_REF: Slot = Slot(2);

    /// The `i`-th copy where pitfalls are planted.
    pub(crate) fn pitfalls(i: usize) -> Slot {
        Slot(10 + u32::try_from(i).expect("a few copies"))
    }

    /// The `i`-th copy where cargo-mutants mutates the crates.
    pub(crate) fn mutants(i: usize) -> Slot {
        Slot(40 + u32::try_from(i).expect("a few copies"))
    }

    /// This slot, for the workspace at `workspace`: a learner's workspace uses other slots
    /// than the reference's, so that the two never share an artifact of different code
    /// even when they share a target directory.
    pub(crate) fn of(self, workspace: &Path) -> Slot {
        if workspace.join(crate::start::MARKER).exists() {
            Slot(self.0 + 100)
        } else {
            self
        }
    }

    /// The cargo settings (`--config` values) of the builds in this slot. The slotted
    /// crates build at opt-level 0 without debug info: measured on the s01 mutant, its
    /// rebuild took 5 s instead of 30 (most of it was the optimised, debug-annotated
    /// integration test binaries), and the tests ran as fast (about a second per crate:
    /// their kernels live in tl-tensor, which keeps the workspace's opt-level). Their
    /// number of codegen units, harmless at opt-level 0, is what tells the slots apart.
    pub(crate) fn config(self) -> Vec<String> {
        slotted()
            .into_iter()
            .flat_map(|krate| {
                [
                    format!("profile.dev.package.{krate}.opt-level=0"),
                    format!("profile.dev.package.{krate}.debug=false"),
                    format!("profile.dev.package.{krate}.codegen-units={}", 16 + self.0),
                ]
            })
            .collect()
    }

    /// [`Slot::config`] as `cargo` arguments, to go right after the subcommand
    /// (`cargo --config .. nextest` would not pass them on to nextest's build).
    pub(crate) fn args(self) -> Vec<String> {
        self.config()
            .into_iter()
            .flat_map(|c| ["--config".to_string(), c])
            .collect()
    }
}

/// `args` (a cargo subcommand and its arguments) with `extra` after the subcommand's name,
/// before its first flag.
pub(crate) fn with_after_subcommand<'a>(args: &[&'a str], extra: &'a [String]) -> Vec<&'a str> {
    let at = args
        .iter()
        .position(|a| a.starts_with('-'))
        .unwrap_or(args.len());
    args[..at]
        .iter()
        .copied()
        .chain(extra.iter().map(String::as_str))
        .chain(args[at..].iter().copied())
        .collect()
}

/// Top-level entries of the workspace that are never copied.
const SKIP: &[&str] = &["target", ".git", "mutants.out", "mutants.out.old", "runs"];

/// A synced copy of the workspace.
pub(crate) struct Scratch {
    /// The copy's root: run cargo here.
    pub(crate) root: PathBuf,
    /// The target directory of builds in the copy: the workspace's own (see the module's
    /// documentation).
    pub(crate) target_dir: PathBuf,
    /// Its artifacts of the chapter's crates.
    pub(crate) slot: Slot,
}

impl Scratch {
    /// Creates or refreshes the copy named `name` of the workspace at `workspace`, building
    /// in `slot` (of that workspace: see [`Slot::of`]).
    pub(crate) fn sync(workspace: &Path, name: &str, slot: Slot) -> io::Result<Scratch> {
        let root = workspace.join("target").join("xtask").join(name);
        fs::create_dir_all(&root)?;
        sync_dir(workspace, &root, true)?;
        Ok(Scratch {
            root,
            target_dir: target_dir(workspace),
            slot: slot.of(workspace),
        })
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

/// The workspace's target directory: `$CARGO_TARGET_DIR` (relative to the current
/// directory, as cargo reads it) or `target/` under the workspace.
pub(crate) fn target_dir(workspace: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => std::env::current_dir()
            .map(|cwd| cwd.join(&dir))
            .unwrap_or_else(|_| PathBuf::from(dir)),
        _ => workspace.join("target"),
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
    fn every_slot_builds_apart_and_a_learners_slots_are_not_the_references() {
        let slots = [
            Slot::COURSE,
            Slot::COURSE_REF,
            Slot::pitfalls(0),
            Slot::pitfalls(1),
            Slot::mutants(0),
            Slot::mutants(1),
        ];
        let base = std::env::temp_dir().join(format!("xtask-slot-{}", std::process::id()));
        let learner = base.join("learner");
        fs::create_dir_all(&learner).unwrap();
        fs::write(learner.join(crate::start::MARKER), "").unwrap();
        let mut configs: Vec<Vec<String>> = slots.iter().map(|s| s.of(&base).config()).collect();
        configs.extend(slots.iter().map(|s| s.of(&learner).config()));
        for (i, a) in configs.iter().enumerate() {
            for b in &configs[i + 1..] {
                assert_ne!(a, b, "two slots would share artifacts");
            }
        }
        assert!(configs[0].contains(&"profile.dev.package.tl-precision.opt-level=0".into()));
        fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn settings_go_after_the_subcommand() {
        let extra = vec!["--config".to_string(), "k=v".to_string()];
        assert_eq!(
            with_after_subcommand(&["nextest", "run", "-p", "x"], &extra),
            ["nextest", "run", "--config", "k=v", "-p", "x"]
        );
        assert_eq!(
            with_after_subcommand(&["test", "--", "name"], &extra),
            ["test", "--config", "k=v", "--", "name"]
        );
    }

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
