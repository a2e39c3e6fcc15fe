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
/// after `timeout`. Output goes to a file rather than a pipe, so a chatty child never blocks.
pub(crate) fn cargo(
    dir: &Path,
    target_dir: Option<&Path>,
    args: &[&str],
    timeout: Duration,
) -> io::Result<Outcome> {
    let log_path = std::env::temp_dir().join(format!(
        "xtask-{}-{:?}.log",
        std::process::id(),
        std::thread::current().id()
    ));
    let log = File::create(&log_path)?;
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
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
    let start = Instant::now();
    let mut child = command.spawn()?;
    let (status, timed_out) = loop {
        if let Some(status) = child.try_wait()? {
            break (Some(status), false);
        }
        if start.elapsed() > timeout {
            child.kill()?;
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

/// Whether a program is installed as a cargo subcommand (`cargo NAME --version` works).
pub(crate) fn has_subcommand(name: &str) -> bool {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
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
