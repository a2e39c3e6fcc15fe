//! Running cargo as a child process, with a timeout and captured output.

use std::fs::File;
use std::io;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How a cargo run ended.
pub(crate) struct Outcome {
    /// Exited with status 0.
    pub(crate) success: bool,
    /// Killed after the timeout.
    pub(crate) timed_out: bool,
    /// Standard output and error, interleaved.
    pub(crate) output: String,
    pub(crate) elapsed: Duration,
}

/// Runs `cargo args..` in `dir` with `CARGO_TARGET_DIR=target_dir` (if given), killing it
/// and everything it started (the test binaries) after `timeout`. Output goes to a file
/// rather than a pipe, so a chatty child never blocks.
pub(crate) fn cargo(
    dir: &Path,
    target_dir: Option<&Path>,
    args: &[&str],
    timeout: Duration,
) -> io::Result<Outcome> {
    cargo_watched(dir, target_dir, args, timeout, &mut || {})
}

/// [`cargo`], calling `tick` about once a second while it runs (to show progress).
pub(crate) fn cargo_watched(
    dir: &Path,
    target_dir: Option<&Path>,
    args: &[&str],
    timeout: Duration,
    tick: &mut dyn FnMut(),
) -> io::Result<Outcome> {
    run_program(&cargo_program(), dir, target_dir, args, timeout, tick)
}

/// The cargo that runs the harness (`$CARGO`), else the one on the path.
fn cargo_program() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// [`cargo_watched`] for any program.
fn run_program(
    program: &str,
    dir: &Path,
    target_dir: Option<&Path>,
    args: &[&str],
    timeout: Duration,
    tick: &mut dyn FnMut(),
) -> io::Result<Outcome> {
    let log_path = std::env::temp_dir().join(format!(
        "xtask-{}-{:?}.log",
        std::process::id(),
        std::thread::current().id()
    ));
    let log = File::create(&log_path)?;
    let mut command = Command::new(program);
    command
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .env("CARGO_TERM_COLOR", "never");
    if let Some(target_dir) = target_dir {
        command.env("CARGO_TARGET_DIR", target_dir);
    }
    #[cfg(unix)]
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let start = Instant::now();
    let mut child = command.spawn()?;
    let mut ticked = start;
    let (status, timed_out) = loop {
        if ticked.elapsed() >= Duration::from_secs(1) {
            tick();
            ticked = Instant::now();
        }
        if let Some(status) = child.try_wait()? {
            break (Some(status), false);
        }
        if start.elapsed() > timeout {
            kill_group(&mut child)?;
            child.wait()?;
            break (None, true);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = std::fs::read_to_string(&log_path).unwrap_or_default();
    let _ = std::fs::remove_file(&log_path);
    Ok(Outcome {
        success: status.is_some_and(|s| s.success()),
        timed_out,
        output,
        elapsed: start.elapsed(),
    })
}

/// Kills `child` and its process group: a test binary that loops on a mutant is cargo's
/// child, and killing cargo alone would leave it spinning.
fn kill_group(child: &mut std::process::Child) -> io::Result<()> {
    #[cfg(unix)]
    {
        let killed = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", child.id())])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if killed.is_ok_and(|s| s.success()) {
            return Ok(());
        }
    }
    child.kill()
}

/// How the harness runs a crate's tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TestTool {
    /// `cargo test`: the default. The chapter's suites take about a second: with the s01
    /// mutant planted, tl-precision's tests ended in 0.55 s under `cargo test` and 1.2 s
    /// under nextest, which spends more on listing and spawning than it saves by stopping
    /// at the first failure.
    Cargo,
    /// cargo-nextest (`XTASK_TEST_TOOL=nextest`): every test in its own process, and the
    /// run stops at the first failure. For a suite where one slow test dominates.
    Nextest,
}

impl TestTool {
    /// `cargo test`, or nextest when `XTASK_TEST_TOOL=nextest` asks for it and
    /// `cargo nextest` works.
    pub(crate) fn detect() -> TestTool {
        let asked = std::env::var("XTASK_TEST_TOOL").is_ok_and(|tool| tool == "nextest");
        if asked && has_subcommand("nextest") {
            TestTool::Nextest
        } else {
            TestTool::Cargo
        }
    }

    /// The arguments of cargo that build (`no_run`) or run the tests of `package` in
    /// `targets` (e.g. `["--lib", "--tests"]`).
    pub(crate) fn args(
        self,
        package: &'static str,
        targets: &[&'static str],
        no_run: bool,
    ) -> Vec<&'static str> {
        let mut args = match self {
            // A crate with no test yet passes: no test failed.
            TestTool::Nextest => vec!["nextest", "run", "--no-tests=pass", "-p", package],
            TestTool::Cargo => vec!["test", "-p", package],
        };
        args.extend_from_slice(targets);
        if no_run {
            args.push("--no-run");
        }
        args
    }

    /// The name shown in reports.
    pub(crate) fn name(self) -> &'static str {
        match self {
            TestTool::Nextest => "cargo nextest",
            TestTool::Cargo => "cargo test",
        }
    }
}

/// Counts finished mutants and prints each with the elapsed time and the time left,
/// estimated from the mean so far.
pub(crate) struct Progress {
    total: usize,
    done: std::sync::atomic::AtomicUsize,
    start: std::time::Instant,
}

impl Progress {
    pub(crate) fn new(total: usize) -> Progress {
        Progress {
            total,
            done: 0.into(),
            start: std::time::Instant::now(),
        }
    }

    /// Records one more finished mutant and prints `line` with the count and the times.
    pub(crate) fn done(&self, line: &str) {
        let done = 1 + self.done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.at(done, line);
    }

    /// Prints `line` with `done` mutants finished so far, and the times.
    pub(crate) fn at(&self, done: usize, line: &str) {
        let elapsed = self.start.elapsed().as_secs_f64();
        eprintln!("xtask: {}", self.line(done.min(self.total), elapsed, line));
    }

    fn line(&self, done: usize, elapsed: f64, line: &str) -> String {
        let left = elapsed / done as f64 * (self.total - done) as f64;
        let width = self.total.to_string().len();
        format!(
            "[{done:>width$}/{}] {line}  {} elapsed, about {} left",
            self.total,
            clock(elapsed),
            clock(left)
        )
    }
}

/// `seconds` as `1h02m`, `3m07s` or `42s`.
pub(crate) fn clock(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

/// Whether a program is installed as a cargo subcommand (`cargo NAME --version` works).
pub(crate) fn has_subcommand(name: &str) -> bool {
    Command::new(cargo_program())
        .args([name, "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The last lines of a long output, for error messages.
pub(crate) fn tail(output: &str, lines: usize) -> String {
    let all: Vec<&str> = output.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_reads_like_a_stopwatch() {
        assert_eq!(clock(0.4), "0s");
        assert_eq!(clock(42.0), "42s");
        assert_eq!(clock(187.0), "3m07s");
        assert_eq!(clock(3720.0), "1h02m");
    }

    #[test]
    fn test_tools_build_then_run_the_same_targets() {
        let nextest = TestTool::Nextest.args("tl-precision", &["--test", "*"], true);
        assert_eq!(
            nextest,
            [
                "nextest",
                "run",
                "--no-tests=pass",
                "-p",
                "tl-precision",
                "--test",
                "*",
                "--no-run"
            ]
        );
        let cargo = TestTool::Cargo.args("tl-recompute", &["--lib", "--tests"], false);
        assert_eq!(cargo, ["test", "-p", "tl-recompute", "--lib", "--tests"]);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_timed_out_run_is_killed_with_its_children() {
        let dir = std::env::temp_dir();
        let pid_file = dir.join(format!("xtask-kill-{}", std::process::id()));
        let script = format!("sleep 30 & echo $! > {}; wait", pid_file.display());
        let started = Instant::now();
        // The program here is sh, whose child sleeps (as cargo's test binary would run):
        // both must go at the timeout.
        let outcome = run_program(
            "sh",
            &dir,
            None,
            &["-c", &script],
            Duration::from_millis(500),
            &mut || {},
        )
        .unwrap();
        assert!(outcome.timed_out && !outcome.success);
        assert!(started.elapsed() < Duration::from_secs(10));
        let pid = std::fs::read_to_string(&pid_file).unwrap();
        let _ = std::fs::remove_file(&pid_file);
        std::thread::sleep(Duration::from_millis(100));
        // Gone, or a zombie no one has reaped yet (a container's init may never): not running.
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.trim()));
        let state = stat.map(|s| {
            s.rsplit(") ")
                .next()
                .and_then(|rest| rest.chars().next())
                .unwrap_or('?')
        });
        assert!(
            matches!(state, Err(_) | Ok('Z' | 'X')),
            "the grandchild {} outlived the timeout: {state:?}",
            pid.trim()
        );
    }

    #[test]
    fn progress_counts_and_estimates_from_the_mean_so_far() {
        let progress = Progress::new(24);
        // 3 done in a minute: 20 s each, so 21 left take 7 minutes.
        let line = progress.line(3, 60.0, "s03 CAUGHT");
        assert_eq!(line, "[ 3/24] s03 CAUGHT  1m00s elapsed, about 7m00s left");
        assert!(progress.line(24, 480.0, "s24").ends_with("about 0s left"));
    }
}
