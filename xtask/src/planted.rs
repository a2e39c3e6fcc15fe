//! Running the pitfall mutants: each planted in the scratch copy, tested, and taken out.

use std::path::Path;
use std::time::Duration;

use crate::pitfalls::{PITFALLS, Pitfall};
use crate::run::{self, Outcome};
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
    /// Both the crate's own tests and the named course test catch it.
    pub(crate) fn passes(&self) -> bool {
        self.own.is_caught() && self.course_caught == Some(true)
    }
}

const BUILD_TIMEOUT: Duration = Duration::from_secs(30 * 60);

fn own_test_args(pitfall: &Pitfall, no_run: bool) -> Vec<&'static str> {
    let mut args = vec!["test", "-p", pitfall.package, "--lib", "--tests"];
    if no_run {
        args.push("--no-run");
    }
    args
}

fn course_test_args(test_path: &str, no_run: bool) -> Vec<String> {
    let mut args: Vec<String> = ["test", "-p", "tl-course", "--test", "l11_1"]
        .map(String::from)
        .to_vec();
    if no_run {
        args.push("--no-run".into());
    } else {
        args.extend(["--".into(), test_path.into(), "--exact".into()]);
    }
    args
}

fn cargo_in(scratch: &Scratch, args: &[&str], timeout: Duration) -> std::io::Result<Outcome> {
    run::cargo(&scratch.root, Some(&scratch.target_dir), args, timeout)
}

/// Builds and tests the unmutated copy; returns the time the own tests take to run, from
/// which each mutant's timeout is set.
pub(crate) fn baseline(scratch: &Scratch) -> Result<Duration, String> {
    let mut slowest = Duration::ZERO;
    for package in ["tl-precision", "tl-recompute"] {
        let build = ["test", "-p", package, "--lib", "--tests", "--no-run"];
        let built = cargo_in(scratch, &build, BUILD_TIMEOUT).map_err(|e| e.to_string())?;
        if !built.success {
            return Err(format!(
                "the unmutated {package} does not build:\n{}",
                run::tail(&built.output, 30)
            ));
        }
        let tested = cargo_in(scratch, &build[..5], BUILD_TIMEOUT).map_err(|e| e.to_string())?;
        if !tested.success {
            return Err(format!(
                "the unmutated {package} fails its own tests; fix that first:\n{}",
                run::tail(&tested.output, 30)
            ));
        }
        slowest = slowest.max(tested.elapsed);
    }
    let course: Vec<String> = course_test_args("", true);
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
    pitfall: &'static Pitfall,
    test_timeout: Duration,
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
        if !cargo_in(scratch, &own_test_args(pitfall, true), BUILD_TIMEOUT)?.success {
            return Ok((Verdict::Unviable, None));
        }
        let own = cargo_in(scratch, &own_test_args(pitfall, false), test_timeout)?;
        let own = match (own.success, own.timed_out) {
            (_, true) => Verdict::Timeout,
            (true, false) => Verdict::Missed,
            (false, false) => Verdict::Caught,
        };
        let test_path = crate::catalog::L11_1
            .iter()
            .find(|t| t.name == pitfall.course_test)
            .map(|t| t.path())
            .unwrap_or_else(|| pitfall.course_test.to_string());
        let build: Vec<String> = course_test_args(&test_path, true);
        let build: Vec<&str> = build.iter().map(String::as_str).collect();
        if !cargo_in(scratch, &build, BUILD_TIMEOUT)?.success {
            return Ok((own, Some(false)));
        }
        let course: Vec<String> = course_test_args(&test_path, false);
        let course: Vec<&str> = course.iter().map(String::as_str).collect();
        let course = cargo_in(scratch, &course, test_timeout)?;
        let ran_one = course.output.contains("running 1 test");
        Ok::<_, std::io::Error>((own, Some(ran_one && !course.success || course.timed_out)))
    })();
    scratch.write(pitfall.file, &original)?;
    let (own, course_caught) = outcome?;
    Ok(result(own, course_caught))
}

/// Runs the selected pitfalls over `jobs` scratch copies in parallel.
pub(crate) fn run_all(
    workspace: &Path,
    jobs: usize,
    only: &[String],
) -> Result<Vec<PlantedResult>, String> {
    let selected: Vec<&'static Pitfall> = PITFALLS
        .iter()
        .filter(|p| only.is_empty() || only.iter().any(|id| id == p.id))
        .collect();
    let jobs = jobs.clamp(1, selected.len().max(1));
    let scratches: Vec<Scratch> = (0..jobs)
        .map(|i| Scratch::sync(workspace, &format!("scratch-{i}")))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("cannot prepare the scratch copy: {e}"))?;
    eprintln!(
        "xtask: building the unmutated workspace in {jobs} scratch cop{}…",
        if jobs == 1 { "y" } else { "ies" }
    );
    let baselines: Vec<Duration> = std::thread::scope(|s| {
        let handles: Vec<_> = scratches
            .iter()
            .map(|sc| s.spawn(|| baseline(sc)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("baseline thread"))
            .collect::<Result<_, _>>()
    })?;
    let slowest = baselines.into_iter().max().unwrap_or_default();
    let test_timeout = (slowest * 5).max(Duration::from_secs(60));
    let selected = &selected;
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
                            let r = run_one(scratch, pitfall, test_timeout);
                            if let Ok(r) = &r {
                                eprintln!(
                                    "xtask: {} {:<8} course test {:<6} ({:.0} s)",
                                    pitfall.id,
                                    r.own.label(),
                                    match r.course_caught {
                                        Some(true) => "caught",
                                        Some(false) => "missed",
                                        None => "-",
                                    },
                                    r.seconds
                                );
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
