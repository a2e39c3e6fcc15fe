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

/// This workspace's target directory (the parent of cargo's temporary directory for tests).
fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("tmp lies in the target directory")
        .to_path_buf()
}

/// Runs `command` with the course cache, returning whether it passed and its output.
fn output(mut command: Command, cache: &Path) -> (bool, String) {
    command.env("TINYLLM_COURSE_CACHE", cache);
    let Output {
        status,
        stdout,
        stderr,
    } = command.output().expect("it runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&stdout),
        String::from_utf8_lossy(&stderr)
    );
    (status.success(), text)
}

/// `cargo test -p PACKAGE --test BINARY` (a chapter's course tests) in the learner's
/// workspace `dir`, building into this workspace's target directory, so that the
/// dependencies built for this workspace are reused. Cargo would give the learner's
/// `crates/tl-precision` the file names of this workspace's own (it hashes a path crate's
/// path relative to its workspace), so these builds set a value that tells them apart, as
/// the harness's slots do, on every crate the chapter's tests build.
fn course_tests_of(dir: &Path, cache: &Path, package: &str, binary: &str) -> (bool, String) {
    let mut command = Command::new(env!("CARGO"));
    command.args(["test", "-p", package, "--test", binary]);
    for krate in [
        "tl-precision",
        "tl-recompute",
        "tl-collective",
        "tl-parallel",
        package,
    ] {
        command.args([
            "--config",
            &format!("profile.dev.package.{krate}.codegen-units=250"),
        ]);
    }
    command
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", target_dir());
    output(command, cache)
}

fn course_tests(dir: &Path, cache: &Path) -> (bool, String) {
    course_tests_of(dir, cache, "tl-course", "l11_1")
}

/// The harness run in `dir`, as `cargo xtask ARGS..` would run it there, building into this
/// workspace's target directory (its slots keep the learner's artifacts apart). It is this
/// workspace's binary: the learner's is the same source (the test builds it once, apart),
/// and building it into this target directory would replace `target/debug/xtask`.
fn xtask(dir: &Path, cache: &Path, args: &[&str]) -> (bool, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_xtask"));
    command
        .args(args)
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", target_dir());
    output(command, cache)
}

/// Writes the learner's `krate` as the reference has it: its `src/` and `tests/`.
fn copy_reference(reference: &Path, learner: &Path, krate: &str) {
    for what in ["src", "tests"] {
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

    let (ok, out) = xtask(&workspace(), &cache, &["start", "L11.1", "--into", into]);
    assert!(ok, "{out}");
    let (ok, out) = xtask(&workspace(), &cache, &["start", "L11.1", "--into", into]);
    assert!(!ok && out.contains("not empty"), "start twice: {out}");
    let marker = fs::read_to_string(learner.join(".course")).unwrap();
    let reference = PathBuf::from(
        marker
            .lines()
            .find_map(|l| l.strip_prefix("reference = "))
            .expect("the marker names the reference"),
    );

    // `cargo xtask` works in the learner's tree (its own harness, built apart).
    let mut alias = Command::new(env!("CARGO"));
    alias
        .args(["xtask", "tests", "L11.1"])
        .current_dir(&learner)
        .env("CARGO_TARGET_DIR", target_dir().join("xtask-learner-e2e"));
    let (ok, out) = output(alias, &cache);
    assert!(ok && out.contains("test_hand_example_bf16_matmul"), "{out}");

    // The stubs build, and the course tests fail naming what to write.
    let (ok, out) = course_tests(&learner, &cache);
    assert!(!ok, "the stubs pass the course tests?");
    assert!(
        out.contains("not yet implemented: L11.1: autocast — see docs/mixed-precision.md"),
        "{out}"
    );

    // tl-recompute written first (the reference's bodies and tests), tl-precision not yet:
    // check names what is left, and --ref-deps grades tl-recompute alone.
    copy_reference(&reference, &learner, "crates/tl-recompute");
    let recompute = ["check", "L11.1", "--pitfalls-only", "--only", "s01,s20"];
    let (ok, out) = xtask(&learner, &cache, &recompute);
    assert!(!ok, "{out}");
    assert!(out.contains("tl-precision: "), "{out}");
    assert!(
        out.contains("bodies are left to write, starting with `"),
        "{out}"
    );
    assert!(out.contains("cargo xtask check L11.1 --ref-deps"), "{out}");
    let (ok, out) = xtask(
        &learner,
        &cache,
        &[&recompute[..], &["--ref-deps"]].concat(),
    );
    assert!(ok, "{out}");
    assert!(
        out.contains("pitfalls caught by your tests                    1/1  ok"),
        "only s20, of tl-recompute: {out}"
    );
    assert!(
        out.contains("PASS, in part: the reference stood in for tl-precision"),
        "{out}"
    );
    assert!(
        !out.contains("FAIL"),
        "the reference passes its course tests: {out}"
    );

    // Then tl-precision: every body written, check passes.
    copy_reference(&reference, &learner, "crates/tl-precision");
    let check = ["check", "L11.1", "--pitfalls-only", "--only", "s01,s07"];
    let (ok, out) = xtask(&learner, &cache, &check);
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
    let (ok, out) = xtask(&learner, &cache, &check);
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
    let (ok, out) = xtask(&learner, &cache, &check);
    assert!(!ok, "{out}");
    assert!(
        out.contains("s07 not caught: none of your tests of tl-precision fails when micro-batches weighted 1/k"),
        "{out}"
    );
    let _ = fs::remove_dir_all(&base);
}

/// The reference's `files` (paths under the crate) written into the learner's crate.
fn copy_reference_files(reference: &Path, learner: &Path, krate: &str, files: &[&str]) {
    for file in files {
        let to = learner.join(krate).join(file);
        fs::create_dir_all(to.parent().unwrap()).unwrap();
        fs::copy(reference.join(krate).join(file), to).unwrap();
    }
}

/// A chapter whose learner writes some files of a crate (L11.2: the ring's steps): start
/// stubs them alone, the course tests name the first function to write, the reference's
/// bodies and own tests pass `check`, a pitfall written back is named, and emptied tests
/// leave the pitfalls uncaught.
#[test]
#[ignore = "minutes: builds a learner's workspace and plants pitfalls (CI runs it)"]
fn a_learner_of_l11_2_writes_the_rings_steps_and_check_grades_them() {
    let base = std::env::temp_dir().join(format!("xtask-learner-l112-{}", std::process::id()));
    let _ = fs::remove_dir_all(&base);
    let (learner, cache) = (base.join("learner"), base.join("cache"));
    let (ok, out) = xtask(
        &workspace(),
        &cache,
        &["start", "L11.2", "--into", learner.to_str().unwrap()],
    );
    assert!(ok, "{out}");
    assert!(
        out.contains("crates/tl-collective/src/ring_steps.rs"),
        "{out}"
    );
    let krate = "crates/tl-collective";
    let steps = fs::read_to_string(learner.join(krate).join("src/ring_steps.rs")).unwrap();
    assert!(
        steps.contains("todo!(\"L11.2: ring_reduce_scatter — see docs/course/L11.2.md\")"),
        "{steps}"
    );
    // The rest of the crate is the reference's, as written.
    for kept in ["src/ring/mod.rs", "src/shard.rs", "src/channel_ring.rs"] {
        assert_eq!(
            fs::read(learner.join(krate).join(kept)).unwrap(),
            fs::read(workspace().join(krate).join(kept)).unwrap(),
            "{kept} is kept"
        );
    }
    let marker = fs::read_to_string(learner.join(".course")).unwrap();
    let reference = PathBuf::from(
        marker
            .lines()
            .find_map(|l| l.strip_prefix("reference = "))
            .expect("the marker names the reference"),
    );

    let (ok, out) = course_tests_of(&learner, &cache, "tl-course-l11-2", "l11_2");
    assert!(!ok, "the stubs pass the course tests?");
    assert!(out.contains("not yet implemented: L11.2: "), "{out}");

    // The reference's steps and its own tests of them: check passes.
    copy_reference_files(
        &reference,
        &learner,
        krate,
        &["src/ring_steps.rs", "tests/ring_steps.rs"],
    );
    let check = ["check", "L11.2", "--pitfalls-only", "--only", "c01,c08"];
    let (ok, out) = xtask(&learner, &cache, &check);
    assert!(ok, "{out}");
    assert!(
        out.contains("pitfalls caught by your tests                    2/2  ok"),
        "{out}"
    );

    // c08 written back into the learner's steps: its course test fails and says so.
    let path = learner.join(krate).join("src/ring_steps.rs");
    let good = fs::read_to_string(&path).unwrap();
    let bug = "reduce_into(op, &mut target[at], piece);";
    assert_eq!(good.matches(bug).count(), 1);
    fs::write(
        &path,
        good.replace(bug, "target[at].copy_from_slice(piece);"),
    )
    .unwrap();
    let (ok, out) = xtask(&learner, &cache, &check);
    assert!(!ok, "{out}");
    assert!(
        out.contains("FAIL     test_hand_example_three_ranks_step_by_step  (it catches c02"),
        "{out}"
    );
    fs::write(&path, good).unwrap();

    // Tests emptied: the pitfalls are named as uncaught.
    let tests = learner.join(krate).join("tests");
    fs::remove_dir_all(&tests).unwrap();
    fs::create_dir_all(&tests).unwrap();
    fs::write(tests.join("my_tests.rs"), "#[test]\nfn nothing_yet() {}\n").unwrap();
    let (ok, out) = xtask(&learner, &cache, &check);
    assert!(!ok, "{out}");
    assert!(
        out.contains("c08 not caught: none of your tests of tl-collective fails when"),
        "{out}"
    );
    let _ = fs::remove_dir_all(&base);
}

/// L11.3, whose learner writes five files of tl-parallel: start stubs them alone, the course
/// tests name a function to write, the reference's bodies and the reference's own test of
/// them pass `check`, a pitfall written back is named by its course test, and emptied
/// tests leave the pitfalls uncaught.
#[test]
#[ignore = "minutes: builds a learner's workspace and plants pitfalls (CI runs it)"]
fn a_learner_of_l11_3_writes_data_parallelisms_pieces_and_check_grades_them() {
    let base = std::env::temp_dir().join(format!("xtask-learner-l113-{}", std::process::id()));
    let _ = fs::remove_dir_all(&base);
    let (learner, cache) = (base.join("learner"), base.join("cache"));
    let (ok, out) = xtask(
        &workspace(),
        &cache,
        &["start", "L11.3", "--into", learner.to_str().unwrap()],
    );
    assert!(ok, "{out}");
    assert!(
        out.contains("crates/tl-parallel/src/zero3/unit.rs"),
        "{out}"
    );
    let krate = "crates/tl-parallel";
    let unit = fs::read_to_string(learner.join(krate).join("src/zero3/unit.rs")).unwrap();
    assert!(
        unit.contains("todo!(\"L11.3: run_unit — see docs/course/L11.3.md\")"),
        "{unit}"
    );
    // The rest of the crate is the reference's, as written.
    for kept in ["src/ddp.rs", "src/zero3/mod.rs", "src/runs.rs"] {
        assert_eq!(
            fs::read(learner.join(krate).join(kept)).unwrap(),
            fs::read(workspace().join(krate).join(kept)).unwrap(),
            "{kept} is kept"
        );
    }
    let marker = fs::read_to_string(learner.join(".course")).unwrap();
    let reference = PathBuf::from(
        marker
            .lines()
            .find_map(|l| l.strip_prefix("reference = "))
            .expect("the marker names the reference"),
    );

    let (ok, out) = course_tests_of(&learner, &cache, "tl-course-l11-3", "l11_3");
    assert!(!ok, "the stubs pass the course tests?");
    assert!(out.contains("not yet implemented: L11.3: "), "{out}");

    // The reference's five files and its own test of them: check passes.
    copy_reference_files(
        &reference,
        &learner,
        krate,
        &[
            "src/batch.rs",
            "src/bucket.rs",
            "src/decide.rs",
            "src/shard_step.rs",
            "src/zero3/unit.rs",
            "tests/learner_surface.rs",
            "tests/common/mod.rs",
        ],
    );
    let check = ["check", "L11.3", "--pitfalls-only", "--only", "d12,d14"];
    let (ok, out) = xtask(&learner, &cache, &check);
    assert!(ok, "{out}");
    assert!(
        out.contains("pitfalls caught by your tests                    2/2  ok"),
        "{out}"
    );

    // d14 written back into the learner's unit: its course test fails and says so.
    let path = learner.join(krate).join("src/zero3/unit.rs");
    let good = fs::read_to_string(&path).unwrap();
    let release = "self.core.borrow().release(unit);";
    assert_eq!(good.matches(release).count(), 1);
    fs::write(&path, good.replace(release, "")).unwrap();
    let (ok, out) = xtask(&learner, &cache, &check);
    assert!(!ok, "{out}");
    assert!(
        out.contains("FAIL     test_zero3_releases_after_forward_and_backward  (it catches d14"),
        "{out}"
    );
    fs::write(&path, good).unwrap();

    // Tests emptied: the pitfalls are named as uncaught.
    let tests = learner.join(krate).join("tests");
    fs::remove_dir_all(&tests).unwrap();
    fs::create_dir_all(&tests).unwrap();
    fs::write(tests.join("my_tests.rs"), "#[test]\nfn nothing_yet() {}\n").unwrap();
    let (ok, out) = xtask(&learner, &cache, &check);
    assert!(!ok, "{out}");
    assert!(
        out.contains("d12 not caught: none of your tests of tl-parallel fails when"),
        "{out}"
    );
    let _ = fs::remove_dir_all(&base);
}
