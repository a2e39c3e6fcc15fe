//! The mutation grade: cargo-mutants over tl-precision and tl-recompute with their own tests.
//!
//! Score = (caught + timeout) / (caught + missed + timeout); unviable mutants do not count.

use std::path::Path;
use std::time::Duration;

use crate::run;
use crate::scratch::Scratch;

/// The crates whose own tests are graded.
pub(crate) const GRADED: &[&str] = &["tl-precision", "tl-recompute"];

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

/// Runs cargo-mutants on one crate inside the scratch copy (in place: the copy is ours, and
/// its persistent target directory keeps the builds incremental).
pub(crate) fn grade_crate(
    workspace: &Path,
    scratch: &Scratch,
    package: &'static str,
    jobs: usize,
    shard: Option<&str>,
) -> Result<CrateGrade, String> {
    let out_dir = workspace
        .join("target")
        .join("xtask")
        .join(format!("mutants-{package}"));
    std::fs::create_dir_all(&out_dir).map_err(|e| e.to_string())?;
    let root = scratch.root.to_string_lossy().into_owned();
    let out = out_dir.to_string_lossy().into_owned();
    let jobs = jobs.to_string();
    let mut args = vec![
        "mutants",
        "--dir",
        &root,
        "--package",
        package,
        "--output",
        &out,
        "--no-shuffle",
    ];
    if let Some(shard) = shard {
        args.extend(["--shard", shard]);
    }
    if jobs == "1" {
        args.push("--in-place");
    } else {
        args.extend(["--jobs", &jobs]);
    }
    let outcome = run::cargo(
        &scratch.root,
        (jobs == "1").then_some(scratch.target_dir.as_path()),
        &args,
        Duration::from_secs(6 * 3600),
    )
    .map_err(|e| format!("cannot run cargo-mutants: {e}"))?;
    let results = out_dir.join("mutants.out");
    if !results.join("outcomes.json").exists() {
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
    Ok(CrateGrade {
        package,
        caught: lines_of(&results, "caught.txt").len(),
        missed: lines_of(&results, "missed.txt"),
        timeout: lines_of(&results, "timeout.txt").len(),
        unviable: lines_of(&results, "unviable.txt").len(),
    })
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
