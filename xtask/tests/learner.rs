//! A learner's way through L11.1, end to end: `start`, the stubs failing the course tests,
//! the bodies written (here: copied from the reference) and `check` passing, then a pitfall
//! reintroduced and the learner's tests emptied, each named by `check`.
//!
//! It builds a second workspace and plants pitfalls in it: minutes, so `#[ignore]`d in the
//! default run; CI runs it (`cargo test -p xtask -- --ignored`).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// `cargo ARGS..` in `dir`, with the course cache. In a learner's workspace the builds go to
/// a target directory of their own under this workspace's `target/` (kept across runs, so
/// the dependencies build once); never this workspace's own, where the learner's `xtask`
/// binary would replace this one's.
fn cargo(dir: &Path, cache: &Path, args: &[&str]) -> (bool, String) {
    let mut command = Command::new(env!("CARGO"));
    command
        .args(args)
        .current_dir(dir)
        .env("TINYLLM_COURSE_CACHE", cache);
    if dir != workspace() {
        command.env(
            "CARGO_TARGET_DIR",
            workspace().join("target").join("xtask-learner-e2e"),
        );
    }
    let Output {
        status,
        stdout,
        stderr,
    } = command.output().expect("cargo runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&stdout),
        String::from_utf8_lossy(&stderr)
    );
    (status.success(), text)
}

/// Replaces the learner's crate directories `src/` and `tests/` with the reference's.
fn copy_reference(reference: &Path, learner: &Path, what: &str) {
    for krate in ["crates/tl-precision", "crates/tl-recompute"] {
        let (from, to) = (
            reference.join(krate).join(what),
            learner.join(krate).join(what),
        );
        let _ = fs::remove_dir_all(&to);
        copy_dir(&from, &to);
    }
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            fs::copy(entry.path(), target).unwrap();
        }
    }
}

#[test]
#[ignore = "minutes: builds a learner's workspace and plants pitfalls (CI runs it)"]
fn a_learner_goes_from_start_to_a_passing_check_and_check_names_what_falls_short() {
    let base = std::env::temp_dir().join(format!("xtask-learner-{}", std::process::id()));
    let _ = fs::remove_dir_all(&base);
    let (learner, cache) = (base.join("learner"), base.join("cache"));
    let into = learner.to_str().unwrap();

    let (ok, out) = cargo(
        &workspace(),
        &cache,
        &["xtask", "start", "L11.1", "--into", into],
    );
    assert!(ok, "{out}");
    let (ok, out) = cargo(
        &workspace(),
        &cache,
        &["xtask", "start", "L11.1", "--into", into],
    );
    assert!(!ok && out.contains("not empty"), "start twice: {out}");
    let marker = fs::read_to_string(learner.join(".course")).unwrap();
    let reference = PathBuf::from(
        marker
            .lines()
            .find_map(|l| l.strip_prefix("reference = "))
            .expect("the marker names the reference"),
    );

    // The stubs build, and the course tests fail naming what to write.
    let (ok, out) = cargo(
        &learner,
        &cache,
        &["test", "-p", "tl-course", "--test", "l11_1"],
    );
    assert!(!ok, "the stubs pass the course tests?");
    assert!(
        out.contains("not yet implemented: L11.1: autocast — see docs/mixed-precision.md"),
        "{out}"
    );

    // The learner writes every body (the reference's) and the reference's tests: check passes.
    copy_reference(&reference, &learner, "src");
    copy_reference(&reference, &learner, "tests");
    let check = [
        "xtask",
        "check",
        "L11.1",
        "--pitfalls-only",
        "--only",
        "s01,s07",
    ];
    let (ok, out) = cargo(&learner, &cache, &check);
    assert!(ok, "{out}");
    assert!(
        out.contains("pitfalls caught by your tests                    2/2  ok"),
        "{out}"
    );

    // A pitfall reintroduced in the learner's code: its course test fails, and check says
    // which pitfall that test guards against.
    let autocast = learner.join("crates/tl-precision/src/autocast.rs");
    let good = fs::read_to_string(&autocast).unwrap();
    assert_eq!(good.matches("cast_owned(product, f)").count(), 1);
    fs::write(&autocast, good.replace("cast_owned(product, f)", "product")).unwrap();
    let (ok, out) = cargo(&learner, &cache, &check);
    assert!(!ok, "{out}");
    assert!(
        out.contains("FAIL     test_hand_example_bf16_matmul  (it catches s01"),
        "{out}"
    );
    fs::write(&autocast, good).unwrap();

    // The learner's tests emptied to the starter file: the pitfalls are named as uncaught.
    for krate in ["crates/tl-precision", "crates/tl-recompute"] {
        let tests = learner.join(krate).join("tests");
        fs::remove_dir_all(&tests).unwrap();
        fs::create_dir_all(&tests).unwrap();
        fs::write(tests.join("my_tests.rs"), "#[test]\nfn nothing_yet() {}\n").unwrap();
    }
    let (ok, out) = cargo(&learner, &cache, &check);
    assert!(!ok, "{out}");
    assert!(
        out.contains("s07 not caught: none of your tests of tl-precision fails when micro-batches weighted 1/k"),
        "{out}"
    );
    let _ = fs::remove_dir_all(&base);
}
