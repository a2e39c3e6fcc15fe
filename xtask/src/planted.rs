//! Running the pitfall mutants: each planted in the scratch copy, tested, and taken out.

use std::path::Path;
use std::time::Duration;

use crate::chapters::{Chapter, LearnerCrate, Pitfall};
use crate::run::{self, Outcome, TestTool};
use crate::scratch::Scratch;

/// What became of one planted pitfall.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The crate's own tests failed on it.
    Caught,
    /// The crate's own tests ran past the timeout on it (counted as caught).
    Timeout,
    /// The crate's own tests passed: the pitfall slips through.
    Missed,
    /// The mutated code does not compile: the catalog entry is wrong.
    Unviable,
    /// The function or the pattern inside it is not found exactly once: the catalog has rotted.
    Rotted,
}

impl Verdict {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Verdict::Caught => "CAUGHT",
            Verdict::Timeout => "TIMEOUT",
            Verdict::Missed => "MISSED",
            Verdict::Unviable => "UNVIABLE",
            Verdict::Rotted => "ROTTED",
        }
    }

    pub(crate) fn is_caught(self) -> bool {
        matches!(self, Verdict::Caught | Verdict::Timeout)
    }
}

/// The result of one pitfall mutant.
pub(crate) struct PlantedResult {
    pub(crate) pitfall: &'static Pitfall,
    /// By the crate's own tests.
    pub(crate) own: Verdict,
    /// Whether its named course test failed on it (`None` when it was not run).
    pub(crate) course_caught: Option<bool>,
    pub(crate) seconds: f64,
}

impl PlantedResult {
    /// The crate's own tests catch it, and so does the named course test where it ran (in
    /// this repository; a learner's check grades only the learner's tests).
    pub(crate) fn passes(&self) -> bool {
        self.own.is_caught() && self.course_caught != Some(false)
    }
}

/// Whose tests the pitfall mutants are graded against.
#[derive(Clone, Copy)]
pub(crate) enum Mode<'a> {
    /// This repository: the reference's own tests (unit and integration) and the course
    /// test named for each pitfall.
    Reference,
    /// A learner's workspace: the pitfalls are planted in the reference implementation kept
    /// in the course cache (`reference`), and only the learner's tests (the crate's
    /// `tests/` directory) must catch each.
    Learner {
        /// The cached reference of the learner's crates.
        reference: &'a Path,
    },
}

impl Mode<'_> {
    fn is_learner(self) -> bool {
        matches!(self, Mode::Learner { .. })
    }
}

/// A scratch copy of `workspace`, with the reference's sources in place of the learner's
/// in the crates of the chapter named by `overlay` (`(reference, chapter, packages)`); the
/// learner's tests stay.
pub(crate) fn prepare_scratch(
    workspace: &Path,
    name: &str,
    slot: crate::scratch::Slot,
    overlay: Option<(&Path, &Chapter, &[&'static str])>,
) -> std::io::Result<Scratch> {
    let scratch = Scratch::sync(workspace, name, slot)?;
    if let Some((reference, chapter, packages)) = overlay {
        for learner in chapter.crates {
            if packages.contains(&learner.package()) {
                let src = reference.join(learner.dir).join("src");
                crate::scratch::sync_dir(&src, &scratch.root.join(learner.dir).join("src"), false)?;
            }
        }
    }
    Ok(scratch)
}

const BUILD_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The cargo arguments that build (`no_run`) or run the tests that must catch a pitfall of
/// the crate `learner`.
fn own_test_args(
    learner: &'static LearnerCrate,
    mode: Mode<'_>,
    tool: TestTool,
    no_run: bool,
) -> Vec<&'static str> {
    let targets: &[&str] = if mode.is_learner() {
        // The learner's integration tests only: the reference's unit tests are not theirs.
        &["--test", "*"]
    } else {
        learner.own_tests
    };
    tool.args(learner.package(), targets, no_run)
}

/// The chapter's crate whose package is `package`.
fn learner_crate(chapter: &'static Chapter, package: &str) -> &'static LearnerCrate {
    chapter
        .crates
        .iter()
        .find(|c| c.package() == package)
        .expect("a pitfall of one of the chapter's crates")
}

fn course_test_args(chapter: &Chapter, test_path: &str, no_run: bool) -> Vec<String> {
    let mut args: Vec<String> = [
        "test",
        "-p",
        chapter.course_package,
        "--test",
        chapter.test_binary,
    ]
    .map(String::from)
    .to_vec();
    if no_run {
        args.push("--no-run".into());
    } else {
        args.extend(["--".into(), test_path.into(), "--exact".into()]);
    }
    args
}

/// `cargo ARGS..` in the scratch copy, in the copy's slot.
fn cargo_in(scratch: &Scratch, args: &[&str], timeout: Duration) -> std::io::Result<Outcome> {
    let slot = scratch.slot.args();
    let args = crate::scratch::with_after_subcommand(args, &slot);
    run::cargo(&scratch.root, Some(&scratch.target_dir), &args, timeout)
}

/// Builds and tests the unmutated copy; returns the time the own tests take to run, from
/// which each mutant's timeout is set.
pub(crate) fn baseline(
    scratch: &Scratch,
    chapter: &'static Chapter,
    packages: &[&'static str],
    mode: Mode<'_>,
    tool: TestTool,
) -> Result<Duration, String> {
    let mut slowest = Duration::ZERO;
    for &package in packages {
        let learner = learner_crate(chapter, package);
        let build = own_test_args(learner, mode, tool, true);
        let built = cargo_in(scratch, &build, BUILD_TIMEOUT).map_err(|e| e.to_string())?;
        if !built.success {
            return Err(format!(
                "the unmutated {package} does not build{}:\n{}",
                if mode.is_learner() {
                    " with your tests (they must compile against the chapter's interface)"
                } else {
                    ""
                },
                run::tail(&built.output, 30)
            ));
        }
        let run_args = own_test_args(learner, mode, tool, false);
        let tested = cargo_in(scratch, &run_args, BUILD_TIMEOUT).map_err(|e| e.to_string())?;
        if !tested.success {
            return Err(if mode.is_learner() {
                format!(
                    "your tests of {package} fail on the reference implementation, so they \
                     test something the chapter does not ask; fix them first:\n{}",
                    run::tail(&tested.output, 30)
                )
            } else {
                format!(
                    "the unmutated {package} fails its own tests; fix that first:\n{}",
                    run::tail(&tested.output, 30)
                )
            });
        }
        slowest = slowest.max(tested.elapsed);
    }
    if mode.is_learner() {
        return Ok(slowest);
    }
    let course: Vec<String> = course_test_args(chapter, "", true);
    let course: Vec<&str> = course.iter().map(String::as_str).collect();
    let built = cargo_in(scratch, &course, BUILD_TIMEOUT).map_err(|e| e.to_string())?;
    if !built.success {
        return Err(format!(
            "the course tests do not build:\n{}",
            run::tail(&built.output, 30)
        ));
    }
    Ok(slowest)
}

/// Plants one pitfall in the scratch copy, runs the tests, and restores the file.
pub(crate) fn run_one(
    scratch: &Scratch,
    chapter: &'static Chapter,
    pitfall: &'static Pitfall,
    test_timeout: Duration,
    mode: Mode<'_>,
    tool: TestTool,
) -> std::io::Result<PlantedResult> {
    let start = std::time::Instant::now();
    let original = scratch.read(pitfall.file)?;
    let result = |own, course_caught| PlantedResult {
        pitfall,
        own,
        course_caught,
        seconds: start.elapsed().as_secs_f64(),
    };
    let Ok(mutated) = crate::anchor::replace_in(
        &original,
        pitfall.function,
        pitfall.pattern,
        pitfall.replacement,
    ) else {
        return Ok(result(Verdict::Rotted, None));
    };
    scratch.write(pitfall.file, &mutated)?;
    let outcome = (|| {
        let learner = learner_crate(chapter, pitfall.package);
        let own_args = |no_run| own_test_args(learner, mode, tool, no_run);
        // One build for everything this mutant runs: cargo compiles the crate's test
        // binaries and the course tests side by side on both cores.
        let mut build = own_args(true);
        if !mode.is_learner() {
            build.splice(
                build.len() - 1..build.len() - 1,
                ["-p", chapter.course_package],
            );
        }
        if !cargo_in(scratch, &build, BUILD_TIMEOUT)?.success {
            return Ok((Verdict::Unviable, None));
        }
        let own = cargo_in(scratch, &own_args(false), test_timeout)?;
        let own = match (own.success, own.timed_out) {
            (_, true) => Verdict::Timeout,
            (true, false) => Verdict::Missed,
            (false, false) => Verdict::Caught,
        };
        if mode.is_learner() {
            return Ok((own, None));
        }
        let test_path = chapter.test_path(pitfall.course_test);
        let course: Vec<String> = course_test_args(chapter, &test_path, false);
        let course: Vec<&str> = course.iter().map(String::as_str).collect();
        let course = cargo_in(scratch, &course, test_timeout)?;
        let ran_one = course.output.contains("running 1 test");
        Ok::<_, std::io::Error>((own, Some(ran_one && !course.success || course.timed_out)))
    })();
    scratch.write(pitfall.file, &original)?;
    let (own, course_caught) = outcome?;
    Ok(result(own, course_caught))
}

/// Which pitfall mutants to run, and how.
pub(crate) struct Plan<'a> {
    /// The chapter whose pitfalls are planted.
    pub(crate) chapter: &'static Chapter,
    /// Copies of the workspace tested in parallel.
    pub(crate) jobs: usize,
    /// The pitfall ids asked for (`--only`); empty for all.
    pub(crate) only: &'a [String],
    /// The crates graded: a pitfall of another crate is not run.
    pub(crate) packages: &'a [&'static str],
    pub(crate) mode: Mode<'a>,
    pub(crate) tool: TestTool,
}

/// Runs the selected pitfalls over `plan.jobs` scratch copies in parallel, showing each
/// result as it comes with the time elapsed and an estimate of the time left.
pub(crate) fn run_all(workspace: &Path, plan: &Plan<'_>) -> Result<Vec<PlantedResult>, String> {
    let mode = plan.mode;
    let chapter = plan.chapter;
    let selected: Vec<&'static Pitfall> = chapter
        .pitfalls
        .iter()
        .filter(|p| plan.only.is_empty() || plan.only.iter().any(|id| id == p.id))
        .filter(|p| plan.packages.contains(&p.package))
        .collect();
    if selected.is_empty() {
        return Ok(Vec::new());
    }
    let jobs = plan.jobs.clamp(1, selected.len());
    // For a learner, every crate of the chapter is the reference's in the copies.
    let every = chapter.packages();
    let scratches: Vec<Scratch> = (0..jobs)
        .map(|i| {
            // For a learner, the pitfalls are planted in the reference's code.
            let overlay = match mode {
                Mode::Learner { reference } => Some((reference, chapter, &every[..])),
                Mode::Reference => None,
            };
            let slot = crate::scratch::Slot::pitfalls(i);
            prepare_scratch(workspace, &format!("scratch-{i}"), slot, overlay)
        })
        .collect::<Result<_, _>>()
        .map_err(|e| format!("cannot prepare the scratch copy: {e}"))?;
    eprintln!(
        "xtask: building the unmutated workspace in {jobs} scratch cop{} (tests by {})…",
        if jobs == 1 { "y" } else { "ies" },
        plan.tool.name()
    );
    let mut packages: Vec<&'static str> = selected.iter().map(|p| p.package).collect();
    packages.sort_unstable();
    packages.dedup();
    let packages = &packages;
    let baselines: Vec<Duration> = std::thread::scope(|s| {
        let handles: Vec<_> = scratches
            .iter()
            .map(|sc| s.spawn(move || baseline(sc, chapter, packages, mode, plan.tool)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("baseline thread"))
            .collect::<Result<_, _>>()
    })?;
    let slowest = baselines.into_iter().max().unwrap_or_default();
    let test_timeout = (slowest * 5).max(Duration::from_secs(60));
    let progress = run::Progress::new(selected.len());
    let (selected, progress) = (&selected, &progress);
    let mut results: Vec<PlantedResult> = std::thread::scope(|s| {
        let handles: Vec<_> = scratches
            .iter()
            .enumerate()
            .map(|(job, scratch)| {
                s.spawn(move || {
                    selected
                        .iter()
                        .copied()
                        .skip(job)
                        .step_by(jobs)
                        .map(|pitfall| {
                            let r =
                                run_one(scratch, chapter, pitfall, test_timeout, mode, plan.tool);
                            if let Ok(r) = &r {
                                progress.done(&format!(
                                    "{} {:<8} course test {:<6} ({:.0} s)",
                                    pitfall.id,
                                    r.own.label(),
                                    match r.course_caught {
                                        Some(true) => "caught",
                                        Some(false) => "missed",
                                        None => "-",
                                    },
                                    r.seconds
                                ));
                            }
                            r
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("mutant thread"))
            .collect::<std::io::Result<Vec<_>>>()
    })
    .map_err(|e| format!("running the pitfall mutants failed: {e}"))?;
    results.sort_by_key(|r| r.pitfall.id);
    Ok(results)
}
