//! The one-machine launcher: starts N ranks wired for the ring, like torchrun.
//!
//! [`launch`] makes a 0700 rendezvous directory and a random secret, starts `n` copies of a
//! program with the `TINYLLM_*` variables set, prefixes each line a rank writes to stderr
//! with `[rank r] `, forwards SIGINT, SIGTERM and SIGHUP to every rank, and waits for all of
//! them. When a rank fails, the others get [`LaunchOptions::grace`] to finish (they normally
//! fail at once too: their ring closed), then SIGTERM, then after another grace period
//! SIGKILL. The directory is removed at the end.
//!
//! Ranks die with their launcher: each is started with a parent-death signal (SIGTERM, which
//! `tinyllm train` answers with a checkpoint), so a launcher killed outright (SIGKILL) leaves
//! no orphan holding the run's lock. Its rendezvous directory does not outlive it either:
//! rank 0 removes it once the ring has formed (see [`RingComm`](crate::RingComm)), since
//! nobody needs it after that. Only a launcher killed before the ring formed can leave the
//! directory behind, private (0700) and holding no secret.

mod outcome;

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::process::{Pid, Signal, WaitOptions, kill_process, waitpid};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};

use crate::env::{
    ENV_RANK, ENV_RENDEZVOUS, ENV_SECRET, ENV_TIMEOUT_MS, ENV_WORLD_SIZE, MAX_WORLD_SIZE,
    format_secret,
};
use crate::error::{CollectiveError, NEIGHBOUR_FAILED, Result};
use crate::ring::handshake::random_bytes;
use crate::ring::rendezvous::{LAUNCHER_PREFIX, check_socket_paths};
pub use outcome::{LaunchOutcome, RankExit, describe_status, signal_name};

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
    /// The CPUs each rank may run on (rank r on `cores[r]`, as `sched_setaffinity` sets
    /// them before the program starts); `None`, or an empty list for a rank, leaves it the
    /// launcher's [default: none]. See [`rank_cores`].
    pub cores: Option<Vec<Vec<usize>>>,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        LaunchOptions {
            comm_timeout: None,
            grace: Duration::from_secs(5),
            deadline: None,
            env: Vec::new(),
            cores: None,
        }
    }
}

/// Starts `n` ranks of `program args` on this machine and waits for them all.
///
/// Returns the outcome even when ranks failed; [`LaunchOutcome::into_result`] turns a
/// failure into an error.
///
/// # Errors
/// [`CollectiveError::InvalidRank`] for `n` of 0 or over [`MAX_WORLD_SIZE`];
/// [`CollectiveError::SocketPathTooLong`] when `$TMPDIR` is too long a path for the ranks'
/// sockets; [`CollectiveError::Io`] if the rendezvous directory, the secret or a process
/// cannot be made (ranks already started are killed). All before any rank starts.
pub fn launch(
    n: usize,
    program: &Path,
    args: &[OsString],
    options: &LaunchOptions,
) -> Result<LaunchOutcome> {
    if n == 0 || n > MAX_WORLD_SIZE {
        return Err(CollectiveError::InvalidRank {
            what: "world size",
            value: n,
            world_size: n,
        });
    }
    let dir = tempfile::Builder::new()
        .prefix(LAUNCHER_PREFIX)
        .tempdir()
        .map_err(|e| CollectiveError::io("create the rendezvous directory", e))?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))
        .map_err(|e| CollectiveError::io("make the rendezvous directory private", e))?;
    check_socket_paths(dir.path(), n)?;
    let secret = random_bytes()?;

    let signal = Arc::new(AtomicUsize::new(0));
    let mut hooks = Vec::new();
    // SIGHUP too: a closed terminal must stop the ranks as it would `tinyllm train` alone
    // (a checkpoint), not kill the launcher and leave them running.
    for sig in [SIGINT, SIGTERM, SIGHUP] {
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
    let mut ranks: Vec<Running> = Vec::with_capacity(n);
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
        die_with_launcher(&mut command);
        if let Some(cores) = options.cores.as_ref().and_then(|c| c.get(rank))
            && !cores.is_empty()
        {
            bind_to(&mut command, cores);
        }
        if let Some(timeout) = options.comm_timeout {
            command.env(ENV_TIMEOUT_MS, timeout.as_millis().to_string());
        }
        match command.spawn() {
            Ok(child) => ranks.push(Running::watch(rank, child)),
            Err(e) => {
                for running in &mut ranks {
                    let _ = running.child.kill();
                    let _ = running.child.wait();
                }
                return Err(CollectiveError::io(
                    format!("start rank {rank}: {}", program.display()),
                    e,
                ));
            }
        }
    }

    let mut forwarded_signal = None;
    let mut failed_at: Option<Instant> = None;
    let mut terminated = false;
    let mut timed_out = false;
    while ranks.iter().any(|r| r.end.is_none()) {
        let sig = signal.swap(0, Ordering::SeqCst);
        if sig != 0 {
            forwarded_signal = Some(sig as i32);
            signal_all(
                &mut ranks,
                Signal::from_named_raw(sig as i32).unwrap_or(Signal::TERM),
            );
        }
        for running in &mut ranks {
            running.poll(start)?;
            let failed = running.end.as_ref().is_some_and(|e| !e.success());
            if failed && failed_at.is_none() {
                failed_at = Some(Instant::now());
            }
        }
        if let Some(at) = failed_at {
            if !terminated && at.elapsed() >= options.grace {
                signal_all(&mut ranks, Signal::TERM);
                terminated = true;
            } else if at.elapsed() >= options.grace * 2 {
                signal_all(&mut ranks, Signal::KILL);
            }
        }
        if options.deadline.is_some_and(|d| start.elapsed() >= d) {
            signal_all(&mut ranks, Signal::KILL);
            timed_out = true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let ranks = ranks.into_iter().map(Running::finish).collect();
    Ok(LaunchOutcome {
        ranks,
        forwarded_signal,
        timed_out,
    })
}

/// Has `command`'s process receive SIGTERM when this thread ends: the launcher's death
/// (even by SIGKILL) stops its ranks. Linux sends the signal when the *thread* that forked
/// the child exits, so ranks are started from the thread that then waits for them.
fn die_with_launcher(command: &mut Command) {
    let launcher = rustix::process::getpid();
    // SAFETY: runs in the child between fork and exec, where only async-signal-safe calls
    // are allowed: prctl(PR_SET_PDEATHSIG), getppid and kill are single system calls that
    // neither allocate nor take locks, and the error returned is built from an errno
    // without allocating.
    unsafe {
        command.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(Signal::TERM))?;
            // The launcher may have died between fork and prctl, before the signal was
            // armed: then the child is already someone else's and must not run on.
            if rustix::process::getppid() != Some(launcher) {
                return Err(Errno::SRCH.into());
            }
            Ok(())
        });
    }
}

/// The CPUs of `available` that `n` ranks of `threads` compute threads each may own, one
/// disjoint group per rank in order (rank r the r-th run of `threads` CPUs), as mpirun binds
/// ranks to cores; `None` when the ranks need more CPUs than there are. A rank whose threads
/// stay on its own cores keeps its caches, and the system stops moving two ranks' threads
/// onto one core while the other idles: two capstone ranks (one thread each) on a 2-core
/// machine stepped in 1.73–1.76 s bound, 1.80–1.82 s not (and up to 1.90 s in other runs).
///
/// ```
/// use tl_collective::launch::rank_cores;
/// assert_eq!(rank_cores(&[0, 1], 2, 1), Some(vec![vec![0], vec![1]]));
/// assert_eq!(rank_cores(&[2, 3, 5, 7], 2, 2), Some(vec![vec![2, 3], vec![5, 7]]));
/// assert_eq!(rank_cores(&[0, 1], 3, 1), None);
/// ```
pub fn rank_cores(available: &[usize], n: usize, threads: usize) -> Option<Vec<Vec<usize>>> {
    let needed = n.checked_mul(threads)?;
    (threads > 0 && needed <= available.len()).then(|| {
        available[..needed]
            .chunks(threads)
            .map(<[usize]>::to_vec)
            .collect()
    })
}

/// The CPUs this process may run on, in order; `None` where the system does not say.
pub fn available_cores() -> Option<Vec<usize>> {
    let set = rustix::thread::sched_getaffinity(None).ok()?;
    let cores: Vec<usize> = (0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|&cpu| set.is_set(cpu))
        .collect();
    (!cores.is_empty()).then_some(cores)
}

/// Has `command`'s process run on `cores` only, from before its program starts (so that
/// every thread it makes inherits the mask).
fn bind_to(command: &mut Command, cores: &[usize]) {
    let mut set = rustix::thread::CpuSet::new();
    for &cpu in cores {
        set.set(cpu);
    }
    // SAFETY: runs in the child between fork and exec: sched_setaffinity is a single system
    // call on a mask built before the fork, allocating nothing and taking no lock.
    unsafe {
        command.pre_exec(move || {
            rustix::thread::sched_setaffinity(None, &set)?;
            Ok(())
        });
    }
}

/// A started rank, watched until it ends.
struct Running {
    rank: usize,
    child: Child,
    /// Copies its error output to ours; notes whether it blamed a neighbour.
    forwarder: Option<JoinHandle<()>>,
    after_neighbour: Arc<AtomicBool>,
    stopped_by: Option<i32>,
    signalled: bool,
    end: Option<RankExit>,
}

impl Running {
    fn watch(rank: usize, mut child: Child) -> Self {
        let stderr = child.stderr.take().expect("stderr is piped");
        let after_neighbour = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&after_neighbour);
        let forwarder = std::thread::spawn(move || {
            let _ = copy_lines(
                stderr,
                &format!("[rank {rank}] "),
                &mut std::io::stderr(),
                |line| {
                    let line = String::from_utf8_lossy(line);
                    if NEIGHBOUR_FAILED.iter().any(|mark| line.contains(mark)) {
                        flag.store(true, Ordering::SeqCst);
                    }
                },
            );
        });
        Running {
            rank,
            child,
            forwarder: Some(forwarder),
            after_neighbour,
            stopped_by: None,
            signalled: false,
            end: None,
        }
    }

    /// Notes whether the rank ended, stopped or continued since the last look. Our own
    /// `waitpid` rather than `Child::try_wait`, which does not report stops.
    ///
    /// # Errors
    /// [`CollectiveError::Io`] if the rank cannot be waited for (it is no child of ours).
    fn poll(&mut self, start: Instant) -> Result<()> {
        if self.end.is_some() {
            return Ok(());
        }
        let pid = Pid::from_child(&self.child);
        let flags = WaitOptions::NOHANG | WaitOptions::UNTRACED | WaitOptions::CONTINUED;
        let status = match waitpid(Some(pid), flags) {
            Ok(None) | Err(Errno::INTR) => return Ok(()),
            Ok(Some((_, status))) => status,
            Err(e) => {
                let context = format!("wait for rank {}", self.rank);
                return Err(CollectiveError::io(context, e.into()));
            }
        };
        if status.stopped() {
            self.stopped_by = status.stopping_signal();
        } else if status.continued() {
            self.stopped_by = None;
        } else {
            // Its error output may still be in the pipe: read it before judging it (with a
            // bound, since a child of the rank could hold the pipe open).
            let waited = Instant::now();
            while self.forwarder.as_ref().is_some_and(|f| !f.is_finished())
                && waited.elapsed() < Duration::from_millis(200)
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            self.end = Some(RankExit {
                rank: self.rank,
                status: ExitStatus::from_raw(status.as_raw()),
                after: start.elapsed(),
                stopped_by: self.stopped_by,
                signalled: self.signalled,
                after_neighbour: self.after_neighbour.load(Ordering::SeqCst),
            });
        }
        Ok(())
    }

    fn finish(mut self) -> RankExit {
        if let Some(forwarder) = self.forwarder.take() {
            let _ = forwarder.join();
        }
        self.end.expect("every rank ended")
    }
}

/// Sends `signal` to every rank still running (and SIGCONT after it to a stopped one, which
/// would otherwise hold a SIGTERM unanswered until it is killed).
fn signal_all(ranks: &mut [Running], signal: Signal) {
    for running in ranks.iter_mut().filter(|r| r.end.is_none()) {
        let pid = Pid::from_child(&running.child);
        // A rank that exited in the meantime is no error.
        let _ = kill_process(pid, signal);
        if running.stopped_by.is_some() {
            let _ = kill_process(pid, Signal::CONT);
        }
        running.signalled = true;
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
    copy_lines(input, prefix, output, |_| {})
}

/// [`prefix_lines`], showing each line to `inspect` first.
fn copy_lines(
    input: impl Read,
    prefix: &str,
    output: &mut impl Write,
    mut inspect: impl FnMut(&[u8]),
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
        inspect(&line);
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
