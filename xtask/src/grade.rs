//! The mutation grade: cargo-mutants over the chapter's crates (or the files of them the
//! learner writes) with their own tests.
//!
//! Score = (caught + timeout) / (caught + missed + timeout); unviable mutants do not count.

use std::path::Path;
use std::time::Duration;

use crate::chapters::LearnerCrate;
use crate::run;
use crate::scratch::Scratch;

/// The score a crate's tests must reach.
pub(crate) const THRESHOLD: f64 = 0.80;

/// cargo-mutants' outcome for one crate.
pub(crate) struct CrateGrade {
    pub(crate) package: &'static str,
    pub(crate) caught: usize,
    pub(crate) missed: Vec<String>,
    pub(crate) timeout: usize,
    pub(crate) unviable: usize,
}

impl CrateGrade {
    /// (caught + timeout) / (caught + missed + timeout); 1 when no mutant counts.
    pub(crate) fn score(&self) -> f64 {
        let counted = self.caught + self.missed.len() + self.timeout;
        if counted == 0 {
            1.0
        } else {
            (self.caught + self.timeout) as f64 / counted as f64
        }
    }

    pub(crate) fn passes(&self) -> bool {
        self.score() >= THRESHOLD
    }

    fn empty(package: &'static str) -> CrateGrade {
        CrateGrade {
            package,
            caught: 0,
            missed: Vec::new(),
            timeout: 0,
            unviable: 0,
        }
    }

    /// The mutants with an outcome so far.
    fn tested(&self) -> usize {
        self.caught + self.missed.len() + self.timeout + self.unviable
    }

    fn add(mut self, other: CrateGrade) -> CrateGrade {
        self.caught += other.caught;
        self.missed.extend(other.missed);
        self.timeout += other.timeout;
        self.unviable += other.unviable;
        self
    }
}

/// The install hint shown when cargo-mutants is missing.
pub(crate) const INSTALL_HINT: &str =
    "cargo-mutants is not installed; install it with: cargo install cargo-mutants --locked";

fn lines_of(dir: &Path, name: &str) -> Vec<String> {
    std::fs::read_to_string(dir.join(name))
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect()
}

/// cargo-mutants' arguments that choose what `learner`'s grade mutates: its package, and
/// the files the learner writes when that is not the whole crate.
fn selection(learner: &LearnerCrate) -> Vec<String> {
    let mut args = vec!["--package".to_string(), learner.package().to_string()];
    for file in learner.graded_files().unwrap_or_default() {
        args.extend(["--file".to_string(), file]);
    }
    args
}

/// The mutants cargo-mutants finds in `learner`'s code in the tree at `root` (`--list`:
/// no build).
fn count_mutants(root: &str, learner: &LearnerCrate) -> Result<usize, String> {
    let package = learner.package();
    let selection = selection(learner);
    let mut args = vec!["mutants", "--list", "--dir", root];
    args.extend(selection.iter().map(String::as_str));
    let outcome = run::cargo(Path::new(root), None, &args, Duration::from_secs(300))
        .map_err(|e| format!("cannot run cargo-mutants: {e}"))?;
    if !outcome.success {
        return Err(format!(
            "cargo mutants --list failed for {package}:\n{}",
            run::tail(&outcome.output, 30)
        ));
    }
    Ok(outcome
        .output
        .lines()
        .filter(|l| l.contains(".rs:"))
        .count())
}

/// The outcome files of one run of cargo-mutants under `out`, read so far.
fn read_grade(package: &'static str, out: &Path) -> CrateGrade {
    let results = out.join("mutants.out");
    CrateGrade {
        package,
        caught: lines_of(&results, "caught.txt").len(),
        missed: lines_of(&results, "missed.txt"),
        timeout: lines_of(&results, "timeout.txt").len(),
        unviable: lines_of(&results, "unviable.txt").len(),
    }
}

/// Runs cargo-mutants on one crate, in place in the scratch copies (they are ours): with
/// one copy and `shard`, that shard of the mutants; with several, shard `i` of
/// `scratches.len()` in copy `i`, all at once. All build into the workspace's target
/// directory, so while cargo builds one shard's mutant (its lock serializes the builds),
/// another shard's tests run. Progress (mutants done, time left) is shown as it goes.
pub(crate) fn grade_crate(
    workspace: &Path,
    scratches: &[Scratch],
    learner: &'static LearnerCrate,
    shard: Option<&str>,
    tool: run::TestTool,
    learner_mode: bool,
) -> Result<CrateGrade, String> {
    let package = learner.package();
    let selection = selection(learner);
    let out_dir = workspace
        .join("target")
        .join("xtask")
        .join(format!("mutants-{package}"));
    let _ = std::fs::remove_dir_all(&out_dir);
    let shards: Vec<(String, &Scratch, std::path::PathBuf)> = match (shard, scratches) {
        (Some(shard), [first, ..]) => vec![(shard.to_string(), first, out_dir.clone())],
        (None, [only]) => vec![(String::new(), only, out_dir.clone())],
        (None, many) => many
            .iter()
            .enumerate()
            .map(|(i, sc)| {
                let n = many.len();
                (format!("{i}/{n}"), sc, out_dir.join(format!("shard-{i}")))
            })
            .collect(),
        (Some(_), []) => return Err("no scratch copy to mutate in".into()),
    };
    let root0 = shards[0].1.root.to_string_lossy().into_owned();
    let total = count_mutants(&root0, learner)?;
    let total = match shard {
        // One shard of n holds about 1/n of them.
        Some(shard) => {
            let n: usize = shard
                .split_once('/')
                .map_or(1, |(_, n)| n.parse().unwrap_or(1));
            total.div_ceil(n)
        }
        None => total,
    };
    eprintln!(
        "xtask: {package}: {total} mutants, tests by {}, {} shard{} at once",
        tool.name(),
        shards.len(),
        if shards.len() == 1 { "" } else { "s" }
    );
    let progress = run::Progress::new(total);
    let selection = &selection;
    let outcomes: Vec<run::Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = shards
            .iter()
            .enumerate()
            .map(|(i, (shard, scratch, out))| {
                let (progress, shards) = (&progress, &shards);
                s.spawn(move || {
                    std::fs::create_dir_all(out).map_err(|e| e.to_string())?;
                    let root = scratch.root.to_string_lossy().into_owned();
                    let out_text = out.to_string_lossy().into_owned();
                    let mut args = vec!["mutants", "--in-place", "--dir", &root];
                    args.extend(selection.iter().map(String::as_str));
                    args.extend(["--output", &out_text, "--no-shuffle"]);
                    // Each mutant is tested by the crate's own tests only: in a learner's
                    // workspace the learner's (its tests/, as for the pitfalls: the unit
                    // tests in src/ are the reference's in the files kept as written), here
                    // the targets the chapter names (not the crate's whole suite of
                    // processes and trainers).
                    let targets: &[&str] = if learner_mode {
                        &["--test", "*"]
                    } else {
                        learner.own_tests
                    };
                    let test_args: Vec<String> = targets
                        .iter()
                        .map(|a| format!("--cargo-test-arg={a}"))
                        .collect();
                    args.extend(test_args.iter().map(String::as_str));
                    if !shard.is_empty() {
                        args.extend(["--shard", shard]);
                    }
                    let config: Vec<String> = scratch
                        .slot
                        .config()
                        .iter()
                        .map(|c| format!("--cargo-arg=--config={c}"))
                        .collect();
                    args.extend(config.iter().map(String::as_str));
                    if tool == run::TestTool::Nextest {
                        args.extend(["--test-tool", "nextest"]);
                    }
                    // The first shard's thread reports for all of them.
                    let mut shown = 0;
                    let mut tick = || {
                        if i != 0 {
                            return;
                        }
                        let so_far = shards
                            .iter()
                            .map(|(_, _, out)| read_grade(package, out))
                            .fold(CrateGrade::empty(package), CrateGrade::add);
                        if so_far.tested() > shown {
                            shown = so_far.tested();
                            progress.at(
                                shown,
                                &format!(
                                    "{package}: caught {}, missed {}, timeout {}, unviable {}",
                                    so_far.caught,
                                    so_far.missed.len(),
                                    so_far.timeout,
                                    so_far.unviable
                                ),
                            );
                        }
                    };
                    run::cargo_watched(
                        &scratch.root,
                        Some(&scratch.target_dir),
                        &args,
                        Duration::from_secs(6 * 3600),
                        &mut tick,
                    )
                    .map_err(|e| format!("cannot run cargo-mutants: {e}"))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("cargo-mutants thread"))
            .collect::<Result<_, String>>()
    })?;
    let mut grade = CrateGrade::empty(package);
    for ((_, _, out), outcome) in shards.iter().zip(&outcomes) {
        if !out.join("mutants.out").join("outcomes.json").exists() {
            return Err(format!(
                "cargo-mutants produced no outcomes for {package}:\n{}",
                run::tail(&outcome.output, 30)
            ));
        }
        if outcome
            .output
            .contains("baseline test with no mutations failed")
            || outcome.output.contains("FAILED in baseline")
        {
            return Err(format!(
                "{package}'s own tests fail without any mutation:\n{}",
                run::tail(&outcome.output, 30)
            ));
        }
        grade = grade.add(read_grade(package, out));
    }
    grade.missed.sort();
    Ok(grade)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn score_counts_timeouts_as_caught_and_ignores_unviable() {
        let grade = CrateGrade {
            package: "x",
            caught: 7,
            missed: vec!["a.rs:1:1: replace f with ()".into(); 2],
            timeout: 1,
            unviable: 50,
        };
        assert_eq!(grade.score(), 0.8);
        assert!(grade.passes());
        let worse = CrateGrade { caught: 6, ..grade };
        assert!(!worse.passes());
    }
}
