//! `cargo xtask start MODULE [--into DIR]`: a learner's workspace for a chapter.
//!
//! The learner's tree is this workspace with the chapter's crates turned into stubs (see
//! `stub.rs` and the chapter's [`Sources`]): the whole crate for L11.1 (tl-precision and
//! tl-recompute, but for what lies beyond the chapter), the files of the ring's steps in
//! tl-collective for L11.2, those of data parallelism's pieces in tl-parallel for L11.3. A
//! stubbed file keeps the contract's types, signatures and doc comments, every body a
//! `todo!` naming the function and the guide to read; each learner's crate gets one
//! starter test file in place of the reference's own tests. Everything else (what the
//! chapter builds on, the rest of a crate, what is built on it, the course tests, the
//! harness and the guides) stays as it is, so the learner's functions run inside the real
//! thing: a learner's ring carries real processes' gradients.
//!
//! The reference implementation is not in the learner's tree. `start` copies the chapter's
//! crates into the course cache (`$TINYLLM_COURSE_CACHE`, else `$XDG_CACHE_HOME/tinyllm-course`,
//! else `~/.cache/tinyllm-course`), under a name that holds a hash of their sources, and
//! the learner's tree names that copy in its `.course` file; the harness grades against it
//! and `diff` compares with it. `cargo clean` does not lose it.
//!
//! `start` never overwrites work: `--into` must name a new or empty directory; without it,
//! the current workspace is stubbed in place, and only when git says it has no uncommitted
//! change (so that `git checkout .` undoes it).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::chapters::{Chapter, LearnerCrate, Sources};
use crate::scratch::sync_dir;
use crate::stub::{StubContext, stub_source};

/// The name of the file that marks a learner's workspace and says where its reference is.
pub(crate) const MARKER: &str = ".course";

/// What the learner's `lib.rs` says first, so that the stubs build without a wall of
/// warnings.
const STUB_ALLOW: &str = "// Stubs: the bodies are yours to write. Remove this line when you are done.\n#![allow(unused_variables, unused_imports, unused_mut, dead_code)]\n";

/// Where `start` wrote the learner's workspace and the reference.
#[derive(Debug)]
pub(crate) struct Started {
    /// The learner's workspace.
    pub(crate) workspace: PathBuf,
    /// The cached reference of the learner's crates.
    pub(crate) reference: PathBuf,
}

/// Runs `start` for `chapter` from the reference workspace `source`, into `into` (or
/// `source` itself, in place), keeping the reference under `cache` ([`cache_root`]).
///
/// # Errors
/// A message saying what was refused or failed; nothing is overwritten.
pub(crate) fn start(
    chapter: &Chapter,
    source: &Path,
    into: Option<&Path>,
    cache: &Path,
) -> Result<Started, String> {
    if source.join(MARKER).exists() {
        return Err(format!(
            "{} is already a learner's workspace (it has {MARKER}); start from the course's own \
             repository",
            source.display()
        ));
    }
    let workspace = match into {
        Some(dir) => {
            let empty = fs::read_dir(dir).map(|mut entries| entries.next().is_none());
            match empty {
                Ok(false) => {
                    return Err(format!(
                        "{} exists and is not empty: choose a new directory (start never \
                         overwrites work)",
                        dir.display()
                    ));
                }
                Ok(true) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(format!("{}: {e}", dir.display())),
            }
            dir.to_path_buf()
        }
        None => {
            check_clean(source)?;
            source.to_path_buf()
        }
    };
    let module = chapter.name;
    let reference = cache_reference(chapter, source, cache)?;
    if workspace != source {
        fs::create_dir_all(&workspace).map_err(|e| format!("{}: {e}", workspace.display()))?;
        sync_dir(source, &workspace, true).map_err(|e| format!("copying the workspace: {e}"))?;
    }
    for learner in chapter.crates {
        stub_crate(module, &workspace.join(learner.dir), learner)?;
    }
    let marker = format!(
        "# This is a learner's workspace of the course (cargo xtask start).\nmodule = {module}\nreference = {}\n",
        reference.display()
    );
    write(&workspace.join(MARKER), &marker)?;
    if workspace != source {
        git_init(&workspace, module);
    }
    Ok(Started {
        workspace,
        reference,
    })
}

/// Refuses a workspace with uncommitted changes (or not under git): stubbing it in place
/// must be undoable.
fn check_clean(dir: &Path) -> Result<(), String> {
    let output = Command::new("git")
        .args(["status", "--porcelain"])
        .current_dir(dir)
        .output()
        .map_err(|e| format!("git is needed to start in place ({e}); or use --into DIR"))?;
    if !output.status.success() {
        return Err(format!(
            "{} is not a git checkout: start in place only where git can undo it, or use \
             --into DIR",
            dir.display()
        ));
    }
    if !output.stdout.is_empty() {
        return Err(format!(
            "{} has uncommitted changes: commit or stash them first, or use --into DIR \
             (start never overwrites work)",
            dir.display()
        ));
    }
    Ok(())
}

/// The course cache's root: `$TINYLLM_COURSE_CACHE`, else `$XDG_CACHE_HOME/tinyllm-course`,
/// else `~/.cache/tinyllm-course`.
///
/// # Errors
/// When none of the three can be found.
pub(crate) fn cache_root() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("TINYLLM_COURSE_CACHE") {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(dir).join("tinyllm-course"));
    }
    let home = std::env::var_os("HOME")
        .ok_or("no HOME to keep the course cache in: set TINYLLM_COURSE_CACHE")?;
    Ok(PathBuf::from(home).join(".cache").join("tinyllm-course"))
}

/// Copies the reference of the learner's crates into the course cache (once per version of
/// their sources) and returns where.
fn cache_reference(chapter: &Chapter, source: &Path, cache: &Path) -> Result<PathBuf, String> {
    let mut files = Vec::new();
    for learner in chapter.crates {
        collect_files(&source.join(learner.dir), &mut files)
            .map_err(|e| format!("reading {}: {e}", learner.dir))?;
    }
    let dir = cache.join(format!(
        "{}-{:016x}",
        chapter.name,
        hash_files(source, files)?
    ));
    if dir.join("COMPLETE").exists() {
        return Ok(dir);
    }
    let partial = dir.with_extension("partial");
    let _ = fs::remove_dir_all(&partial);
    for learner in chapter.crates {
        let to = partial.join(learner.dir);
        fs::create_dir_all(&to).map_err(|e| format!("{}: {e}", to.display()))?;
        sync_dir(&source.join(learner.dir), &to, false)
            .map_err(|e| format!("caching the reference: {e}"))?;
    }
    write(&partial.join("COMPLETE"), "")?;
    let _ = fs::remove_dir_all(&dir);
    fs::rename(&partial, &dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(dir)
}

/// A hash of the learner's sources and tests (both crates' `src/` and `tests/` under
/// `workspace`): what a passing check is recorded against.
///
/// # Errors
/// When a file cannot be read.
pub(crate) fn learner_sources_hash(chapter: &Chapter, workspace: &Path) -> Result<u64, String> {
    let mut files = Vec::new();
    for learner in chapter.crates {
        for part in ["src", "tests"] {
            let dir = workspace.join(learner.dir).join(part);
            if dir.exists() {
                collect_files(&dir, &mut files).map_err(|e| format!("{}: {e}", dir.display()))?;
            }
        }
    }
    hash_files(workspace, files)
}

/// The FNV hash of `files` (under `root`): their paths relative to it and their bytes, in
/// sorted order.
fn hash_files(root: &Path, mut files: Vec<PathBuf>) -> Result<u64, String> {
    files.sort();
    let mut hash = Fnv::default();
    for file in &files {
        let relative = file.strip_prefix(root).unwrap_or(file);
        hash.write(relative.to_string_lossy().as_bytes());
        hash.write(&fs::read(file).map_err(|e| format!("{}: {e}", file.display()))?);
    }
    Ok(hash.0)
}

/// A learner's crate with bodies still to write.
#[derive(Debug, PartialEq)]
pub(crate) struct Unfinished {
    pub(crate) package: &'static str,
    /// How many stubs are left.
    pub(crate) stubs: usize,
    /// The first of them, by file name and order in the file: `(file, function)`.
    pub(crate) first: (String, String),
}

/// The learner's crates under `workspace` whose sources still hold a stub of `chapter`
/// (a body `start` wrote and the learner has not replaced), in the chapter's order.
///
/// # Errors
/// When a source file cannot be read.
pub(crate) fn unfinished(chapter: &Chapter, workspace: &Path) -> Result<Vec<Unfinished>, String> {
    let module = chapter.name;
    let markers = [
        format!("todo!(\"{module}: "),
        format!("panic!(\"not yet implemented: {module}: "),
    ];
    let mut out = Vec::new();
    for learner in chapter.crates {
        let mut files = Vec::new();
        let src = workspace.join(learner.dir).join("src");
        collect_files(&src, &mut files).map_err(|e| format!("{}: {e}", src.display()))?;
        files.sort();
        let (mut stubs, mut first) = (0, None);
        for file in files
            .iter()
            .filter(|f| f.extension().is_some_and(|e| e == "rs"))
        {
            let text = fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
            for marker in &markers {
                for (at, _) in text.match_indices(marker.as_str()) {
                    stubs += 1;
                    let rest = &text[at + marker.len()..];
                    let name = rest.split(" — ").next().unwrap_or(rest);
                    let relative = file.strip_prefix(workspace).unwrap_or(file);
                    first.get_or_insert_with(|| (relative.display().to_string(), name.to_string()));
                }
            }
        }
        if let Some(first) = first {
            out.push(Unfinished {
                package: learner.package(),
                stubs,
                first,
            });
        }
    }
    Ok(out)
}

/// Where a learner's workspace records the sources its last full check passed on.
pub(crate) fn passed_stamp(workspace: &Path) -> PathBuf {
    workspace.join("target").join("xtask").join("check-passed")
}

/// Every file under `dir`.
fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            collect_files(&entry.path(), out)?;
        } else {
            out.push(entry.path());
        }
    }
    Ok(())
}

/// FNV-1a, 64 bits: a stable name for a version of the reference (not a security hash).
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // A separator, so that ("ab", "c") and ("a", "bc") differ.
        self.0 = self.0.rotate_left(5) ^ 0xff;
    }
}

/// Turns the crate at `dir` into the learner's: stubbed sources, no reference tests, the
/// starter tests.
fn stub_crate(module: &str, dir: &Path, learner: &LearnerCrate) -> Result<(), String> {
    let src = dir.join("src");
    let mut sources = Vec::new();
    collect_files(&src, &mut sources).map_err(|e| format!("{}: {e}", dir.display()))?;
    let under_src = |path: &Path| {
        let relative = path.strip_prefix(&src).unwrap_or(path);
        relative.to_string_lossy().replace('\\', "/")
    };
    for path in sources {
        let file = under_src(&path);
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name == "tests.rs" {
            // A `#[cfg(test)] mod tests;` of the reference: the stub of its module drops the
            // declaration, so the file goes with it (a kept module keeps both).
            let parent = file.strip_suffix("tests.rs").unwrap_or("");
            let module = parent.trim_end_matches('/');
            let stubbed = if module.is_empty() {
                learner.writes("lib.rs")
            } else {
                learner.writes(&format!("{module}.rs"))
                    || learner.writes(&format!("{module}/mod.rs"))
            };
            if stubbed {
                fs::remove_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            }
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") || !learner.writes(&file) {
            continue;
        }
        let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let context = StubContext {
            module,
            guide: learner.guide(&file),
        };
        let mut stub =
            stub_source(&text, &context).map_err(|e| format!("{}: {e}", path.display()))?;
        // The stubs leave imports and helpers' types unused: said once, where the crate
        // starts, or in each file when only some are the learner's.
        if name == "lib.rs" || matches!(learner.sources, Sources::Only(_)) {
            stub = with_allow(&stub);
        }
        write(&path, &stub)?;
    }
    let tests = dir.join("tests");
    if tests.exists() {
        fs::remove_dir_all(&tests).map_err(|e| format!("{}: {e}", tests.display()))?;
    }
    fs::create_dir_all(&tests).map_err(|e| format!("{}: {e}", tests.display()))?;
    write(&tests.join("my_tests.rs"), learner.starter)
}

/// `lib.rs` with [`STUB_ALLOW`] after its inner doc comment.
fn with_allow(lib: &str) -> String {
    let header: usize = lib
        .lines()
        .take_while(|line| line.starts_with("//!") || line.trim().is_empty())
        .map(|line| line.len() + 1)
        .sum();
    let header = header.min(lib.len());
    format!("{}{STUB_ALLOW}\n{}", &lib[..header], &lib[header..])
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Makes the new workspace a git repository with one commit, so that the learner sees their
/// own changes (`git diff`); quietly nothing when git is missing.
fn git_init(dir: &Path, module: &str) {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(dir)
            .env("GIT_AUTHOR_NAME", "tinyllm course")
            .env("GIT_AUTHOR_EMAIL", "course@tinyllm.invalid")
            .env("GIT_COMMITTER_NAME", "tinyllm course")
            .env("GIT_COMMITTER_EMAIL", "course@tinyllm.invalid")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let _ = git(&["init", "-q"])
        && git(&["add", "-A"])
        && git(&["commit", "-q", "-m", &format!("Start {module}: the stubs")]);
}

/// The chapter a learner's workspace was started for, from its [`MARKER`], if it is one.
pub(crate) fn learner_module(workspace: &Path) -> Option<String> {
    let marker = fs::read_to_string(workspace.join(MARKER)).ok()?;
    marker
        .lines()
        .find_map(|line| line.strip_prefix("module = "))
        .map(str::to_string)
}

/// The reference a learner's workspace names in its [`MARKER`], if it is one.
pub(crate) fn learner_reference(workspace: &Path) -> Option<PathBuf> {
    let marker = fs::read_to_string(workspace.join(MARKER)).ok()?;
    marker
        .lines()
        .find_map(|line| line.strip_prefix("reference = "))
        .map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l11_1() -> &'static Chapter {
        crate::chapters::chapter("L11.1").unwrap()
    }

    /// A throwaway directory under the system's temporary directory.
    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-start-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn start_writes_stubs_keeps_the_reference_outside_and_refuses_to_overwrite() {
        let (into, cache) = (temp("learner"), temp("cache"));
        let source = crate::workspace_root();
        let started = start(l11_1(), &source, Some(&into), &cache).unwrap();
        assert_eq!(learner_reference(&into), Some(started.reference.clone()));
        assert!(
            started.reference.starts_with(&cache),
            "outside the learner's tree"
        );

        let cast = fs::read_to_string(into.join("crates/tl-precision/src/cast.rs")).unwrap();
        assert!(cast.contains("pub fn cast<"), "the contract stays");
        assert!(cast.contains("todo!(\"L11.1: cast — see docs/mixed-precision.md\")"));
        assert!(!cast.contains("fn cast_vjp"), "private helpers go");
        assert!(!cast.contains("mod tests"), "the reference's tests go");
        for kept in [
            "tl-precision/src/fp8.rs",
            "tl-precision/src/tensor_core.rs",
            "tl-recompute/src/policy.rs",
        ] {
            let path = format!("crates/{kept}");
            let learner = fs::read(into.join(&path)).unwrap();
            assert_eq!(
                learner,
                fs::read(source.join(&path)).unwrap(),
                "{kept} is kept"
            );
        }
        let reference_cast =
            fs::read_to_string(started.reference.join("crates/tl-precision/src/cast.rs")).unwrap();
        assert_eq!(
            reference_cast,
            fs::read_to_string(source.join("crates/tl-precision/src/cast.rs")).unwrap()
        );
        let scaler = fs::read_to_string(into.join("crates/tl-precision/src/scaler.rs")).unwrap();
        assert!(scaler.contains("see docs/loss-scaling.md"));
        let lib = fs::read_to_string(into.join("crates/tl-recompute/src/lib.rs")).unwrap();
        assert!(lib.contains("#![allow(unused_variables"));
        assert!(
            !into
                .join("crates/tl-recompute/src/schedule/tests.rs")
                .exists()
        );
        assert!(!into.join("crates/tl-precision/tests/behaviour").exists());
        assert!(into.join("crates/tl-precision/tests/my_tests.rs").exists());
        assert!(
            into.join("crates/tl-tensor/src/lib.rs").exists(),
            "the rest stays"
        );
        assert!(!into.join("target").exists());

        // Twice into the same place, or from the learner's tree: refused.
        let again = start(l11_1(), &source, Some(&into), &cache).unwrap_err();
        assert!(again.contains("not empty"), "{again}");
        let nested = start(l11_1(), &into, Some(&temp("nested")), &cache).unwrap_err();
        assert!(nested.contains("already a learner's workspace"), "{nested}");
        let _ = fs::remove_dir_all(&into);
        let _ = fs::remove_dir_all(&cache);
    }

    #[test]
    fn unfinished_counts_the_stubs_left_and_names_the_first() {
        let (into, cache) = (temp("unfinished"), temp("unfinished-cache"));
        let source = crate::workspace_root();
        let started = start(l11_1(), &source, Some(&into), &cache).unwrap();
        let left = unfinished(l11_1(), &into).unwrap();
        assert_eq!(
            left.iter().map(|u| u.package).collect::<Vec<_>>(),
            ["tl-precision", "tl-recompute"]
        );
        assert!(left.iter().all(|u| u.stubs > 3), "{left:?}");
        assert!(
            left[0].first.0.starts_with("crates/tl-precision/src/"),
            "{left:?}"
        );
        assert!(!left[0].first.1.contains('"'), "a bare name: {left:?}");

        // tl-recompute written (the reference's sources): only tl-precision is left.
        let src = into.join("crates/tl-recompute/src");
        fs::remove_dir_all(&src).unwrap();
        fs::create_dir_all(&src).unwrap();
        sync_dir(
            &started.reference.join("crates/tl-recompute/src"),
            &src,
            false,
        )
        .unwrap();
        let left = unfinished(l11_1(), &into).unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].package, "tl-precision");
        assert!(
            unfinished(l11_1(), &source).unwrap().is_empty(),
            "the reference"
        );
        let _ = fs::remove_dir_all(&into);
        let _ = fs::remove_dir_all(&cache);
    }

    #[test]
    fn lib_rs_gets_the_allow_after_its_doc_comment() {
        let lib = with_allow("//! Docs.\n//! More.\n\nmod a;\n");
        assert!(lib.starts_with("//! Docs.\n//! More.\n\n// Stubs"), "{lib}");
        assert!(lib.ends_with("dead_code)]\n\nmod a;\n"), "{lib}");
    }
}
