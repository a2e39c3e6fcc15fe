//! The one-machine launcher: starts N ranks wired for the ring, like torchrun.
//!
//! [`launch`] makes a 0700 rendezvous directory and a random secret, starts `n` copies of a
//! program with the `TINYLLM_*` variables set, prefixes each line a rank writes to stderr
//! with `[rank r] `, forwards SIGINT and SIGTERM to every rank, and waits for all of them.
//! When a rank fails, the others get [`LaunchOptions::grace`] to finish (they normally fail
//! at once too: their ring closed), then SIGTERM, then after another grace period SIGKILL.
//! The directory is removed at the end.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process};
use signal_hook::consts::{SIGINT, SIGTERM};

use crate::env::{
    ENV_RANK, ENV_RENDEZVOUS, ENV_SECRET, ENV_TIMEOUT_MS, ENV_WORLD_SIZE, format_secret,
};
use crate::error::{CollectiveError, Result};

/// How a job is launched.
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// The ranks' collective timeout (`TINYLLM_COMM_TIMEOUT_MS`); `None` leaves the variable
    /// as the environment has it.
    pub comm_timeout: Option<Duration>,
    /// How long the other ranks may run on once one has failed [default: 5 s].
    pub grace: Duration,
    /// Kill every rank once the job has run this long (for tests) [default: none].
    pub deadline: Option<Duration>,
    /// More environment variables for every rank.
    pub env: Vec<(OsString, OsString)>,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        LaunchOptions {
            comm_timeout: None,
            grace: Duration::from_secs(5),
            deadline: None,
            env: Vec::new(),
        }
    }
}

/// How one rank ended.
#[derive(Clone, Copy, Debug)]
pub struct RankExit {
    /// The rank.
    pub rank: usize,
    /// Its exit status (a code, or the signal that killed it).
    pub status: ExitStatus,
    /// When it ended, from the launch.
    pub after: Duration,
}

/// How a launched job ended.
#[derive(Clone, Debug)]
pub struct LaunchOutcome {
    /// Every rank's end, by rank.
    pub ranks: Vec<RankExit>,
    /// The signal (SIGINT or SIGTERM) the launcher received and forwarded, if any.
    pub forwarded_signal: Option<i32>,
    /// Whether [`LaunchOptions::deadline`] was reached.
    pub timed_out: bool,
}

impl LaunchOutcome {
    /// Whether every rank exited successfully.
    pub fn success(&self) -> bool {
        self.ranks.iter().all(|r| r.status.success())
    }

    /// The rank that failed first, if any.
    pub fn first_failure(&self) -> Option<&RankExit> {
        self.ranks
            .iter()
            .filter(|r| !r.status.success())
            .min_by_key(|r| (r.after, r.rank))
    }

    /// `Ok` if every rank succeeded.
    ///
    /// # Errors
    /// [`CollectiveError::RankFailed`] naming the first rank that failed and its status.
    pub fn into_result(self) -> Result<Self> {
        match self.first_failure() {
            None => Ok(self),
            Some(first) => Err(CollectiveError::RankFailed {
                rank: first.rank,
                status: describe_status(first.status),
                others: self.ranks.iter().filter(|r| !r.status.success()).count() - 1,
            }),
        }
    }
}

/// "exit code 3", or "killed by signal 9".
pub fn describe_status(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => status.to_string(),
    }
}

/// Starts `n` ranks of `program args` on this machine and waits for them all.
///
/// Returns the outcome even when ranks failed; [`LaunchOutcome::into_result`] turns a
/// failure into an error.
///
/// # Errors
/// [`CollectiveError::InvalidRank`] for `n == 0`; [`CollectiveError::Io`] if the rendezvous
/// directory, the secret or a process cannot be made (ranks already started are killed).
pub fn launch(
    n: usize,
    program: &Path,
    args: &[OsString],
    options: &LaunchOptions,
) -> Result<LaunchOutcome> {
    if n == 0 {
        return Err(CollectiveError::InvalidRank {
            what: "world size",
            value: 0,
            world_size: 0,
        });
    }
    let dir = tempfile::Builder::new()
        .prefix("tinyllm-rendezvous-")
        .tempdir()
        .map_err(|e| CollectiveError::io("create the rendezvous directory", e))?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))
        .map_err(|e| CollectiveError::io("make the rendezvous directory private", e))?;
    let secret = random_secret()?;

    let signal = Arc::new(AtomicUsize::new(0));
    let mut hooks = Vec::new();
    for sig in [SIGINT, SIGTERM] {
        let id = signal_hook::flag::register_usize(sig, Arc::clone(&signal), sig as usize)
            .map_err(|e| CollectiveError::io("install the signal handlers", e))?;
        hooks.push(id);
    }
    let outcome = run_ranks(n, program, args, options, dir.path(), &secret, &signal);
    for id in hooks {
        signal_hook::low_level::unregister(id);
    }
    drop(dir);
    outcome
}

fn random_secret() -> Result<[u8; 32]> {
    let mut secret = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut secret))
        .map_err(|e| CollectiveError::io("read a secret from /dev/urandom", e))?;
    Ok(secret)
}

fn run_ranks(
    n: usize,
    program: &Path,
    args: &[OsString],
    options: &LaunchOptions,
    dir: &Path,
    secret: &[u8; 32],
    signal: &AtomicUsize,
) -> Result<LaunchOutcome> {
    let start = Instant::now();
    let mut children: Vec<Child> = Vec::with_capacity(n);
    let mut forwarders: Vec<JoinHandle<()>> = Vec::with_capacity(n);
    for rank in 0..n {
        let mut command = Command::new(program);
        command
            .args(args)
            .env(ENV_RANK, rank.to_string())
            .env(ENV_WORLD_SIZE, n.to_string())
            .env(ENV_RENDEZVOUS, dir)
            .env(ENV_SECRET, format_secret(secret))
            .envs(options.env.iter().map(|(k, v)| (k, v)))
            .stderr(Stdio::piped())
            // Own process group: a terminal's Ctrl-C reaches the launcher only, which forwards
            // it once, instead of every rank getting it twice.
            .process_group(0);
        if let Some(timeout) = options.comm_timeout {
            command.env(ENV_TIMEOUT_MS, timeout.as_millis().to_string());
        }
        match command.spawn() {
            Ok(mut child) => {
                let stderr = child.stderr.take().expect("stderr is piped");
                forwarders.push(std::thread::spawn(move || {
                    let _ =
                        prefix_lines(stderr, &format!("[rank {rank}] "), &mut std::io::stderr());
                }));
                children.push(child);
            }
            Err(e) => {
                for child in &mut children {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(CollectiveError::io(
                    format!("start rank {rank}: {}", program.display()),
                    e,
                ));
            }
        }
    }

    let mut ends: Vec<Option<RankExit>> = vec![None; n];
    let mut forwarded_signal = None;
    let mut failed_at: Option<Instant> = None;
    let mut terminated = false;
    let mut timed_out = false;
    while ends.iter().any(Option::is_none) {
        let sig = signal.swap(0, Ordering::SeqCst);
        if sig != 0 {
            forwarded_signal = Some(sig as i32);
            signal_all(
                &children,
                &ends,
                Signal::from_named_raw(sig as i32).unwrap_or(Signal::TERM),
            );
        }
        for (rank, (child, end)) in children.iter_mut().zip(ends.iter_mut()).enumerate() {
            if end.is_some() {
                continue;
            }
            if let Ok(Some(status)) = child.try_wait() {
                *end = Some(RankExit {
                    rank,
                    status,
                    after: start.elapsed(),
                });
                if !status.success() && failed_at.is_none() {
                    failed_at = Some(Instant::now());
                }
            }
        }
        if let Some(at) = failed_at {
            if !terminated && at.elapsed() >= options.grace {
                signal_all(&children, &ends, Signal::TERM);
                terminated = true;
            } else if at.elapsed() >= options.grace * 2 {
                signal_all(&children, &ends, Signal::KILL);
            }
        }
        if options.deadline.is_some_and(|d| start.elapsed() >= d) {
            signal_all(&children, &ends, Signal::KILL);
            timed_out = true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for forwarder in forwarders {
        let _ = forwarder.join();
    }
    Ok(LaunchOutcome {
        ranks: ends
            .into_iter()
            .map(|e| e.expect("every rank ended"))
            .collect(),
        forwarded_signal,
        timed_out,
    })
}

/// Sends `signal` to every rank still running.
fn signal_all(children: &[Child], ends: &[Option<RankExit>], signal: Signal) {
    for (child, end) in children.iter().zip(ends) {
        if end.is_none() {
            // A rank that exited in the meantime is no error.
            let _ = kill_process(Pid::from_child(child), signal);
        }
    }
}

/// Copies `input` to `output` line by line, each line prefixed (bytes, not text: a rank's
/// output need not be UTF-8); a last line without a newline gets one.
///
/// # Errors
/// The first I/O error of either side.
pub fn prefix_lines(
    input: impl Read,
    prefix: &str,
    output: &mut impl Write,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(input);
    let mut line = Vec::new();
    loop {
        line.clear();
        if reader.read_until(b'\n', &mut line)? == 0 {
            return Ok(());
        }
        if line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        // One write per line, so that the ranks' lines do not interleave mid-line.
        let mut whole = Vec::with_capacity(prefix.len() + line.len());
        whole.extend_from_slice(prefix.as_bytes());
        whole.extend_from_slice(&line);
        output.write_all(&whole)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_gets_the_prefix() {
        let mut out = Vec::new();
        prefix_lines(&b"first\nsecond\nno newline"[..], "[rank 3] ", &mut out).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "[rank 3] first\n[rank 3] second\n[rank 3] no newline\n"
        );
    }
}
