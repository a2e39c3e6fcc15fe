//! How a launched job ended, and which rank to blame when it failed.
//!
//! When one rank dies, its neighbours fail a moment later (their ring closed), often within
//! the launcher's same poll; and a rank that is stopped (SIGSTOP) does not end at all while
//! the others time out waiting for it. So the first rank seen to end is not always the cause.
//! The launcher records what it knows of each rank's end, and [`LaunchOutcome::first_failure`]
//! ranks them: a rank seen stopped first, then one killed by a signal the launcher did not
//! send, then one that failed by itself, then one that failed because a neighbour did (its
//! error said so), and last one the launcher stopped.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use crate::error::{CollectiveError, Result};

/// How one rank ended.
#[derive(Clone, Copy, Debug)]
pub struct RankExit {
    /// The rank.
    pub rank: usize,
    /// Its exit status (a code, or the signal that killed it).
    pub status: ExitStatus,
    /// When it ended, from the launch.
    pub after: Duration,
    /// The signal that stopped it (SIGSTOP, SIGTSTP, ...) while the job ran, if the launcher
    /// saw it stopped: its neighbours then waited for it in vain.
    pub stopped_by: Option<i32>,
    /// Whether the launcher had signalled it (a forwarded signal, or the stop of the job
    /// after another rank failed) before it ended.
    pub signalled: bool,
    /// Whether its error output reported a neighbour that exited or went silent: its
    /// failure followed another rank's.
    pub after_neighbour: bool,
}

impl RankExit {
    /// Whether the rank ran to a successful end.
    pub fn success(&self) -> bool {
        self.status.success() && self.stopped_by.is_none()
    }

    /// How little this end explains the job's failure: 0 is the likeliest cause.
    fn innocence(&self) -> u8 {
        if self.stopped_by.is_some() {
            0
        } else if self.status.signal().is_some() && !self.signalled {
            1
        } else if self.signalled {
            4
        } else if self.after_neighbour {
            3
        } else {
            2
        }
    }

    /// "exit code 3", "killed by SIGKILL", or "stopped by SIGSTOP (its neighbours waited for
    /// it in vain)".
    pub fn describe(&self) -> String {
        match self.stopped_by {
            Some(signal) => format!(
                "stopped by {} (its neighbours waited for it in vain)",
                signal_name(signal)
            ),
            None => describe_status(self.status),
        }
    }
}

/// How a launched job ended.
#[derive(Clone, Debug)]
pub struct LaunchOutcome {
    /// Every rank's end, by rank.
    pub ranks: Vec<RankExit>,
    /// The signal (SIGINT, SIGTERM or SIGHUP) the launcher received and forwarded, if any.
    pub forwarded_signal: Option<i32>,
    /// Whether [`LaunchOptions::deadline`](super::LaunchOptions::deadline) was reached.
    pub timed_out: bool,
}

impl LaunchOutcome {
    /// Whether every rank exited successfully.
    pub fn success(&self) -> bool {
        self.ranks.iter().all(RankExit::success)
    }

    /// The rank whose failure most likely ended the job, if any failed (see the
    /// [module docs](self) for the order).
    pub fn first_failure(&self) -> Option<&RankExit> {
        self.ranks
            .iter()
            .filter(|r| !r.success())
            .min_by_key(|r| (r.innocence(), r.after, r.rank))
    }

    /// `Ok` if every rank succeeded.
    ///
    /// # Errors
    /// [`CollectiveError::RankFailed`] naming the rank to blame, its status and its exit
    /// code (so that a command can exit as its rank did).
    pub fn into_result(self) -> Result<Self> {
        match self.first_failure() {
            None => Ok(self),
            Some(first) => Err(CollectiveError::RankFailed {
                rank: first.rank,
                status: first.describe(),
                code: first.stopped_by.map_or(first.status.code(), |_| None),
                others: self.ranks.iter().filter(|r| !r.success()).count() - 1,
            }),
        }
    }
}

/// "exit code 3", or "killed by SIGKILL".
pub fn describe_status(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => format!("killed by {}", signal_name(signal)),
        _ => status.to_string(),
    }
}

/// The conventional name of a Linux signal ("SIGKILL"), or "signal N".
pub fn signal_name(signal: i32) -> String {
    const NAMES: [&str; 31] = [
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGILL",
        "SIGTRAP",
        "SIGABRT",
        "SIGBUS",
        "SIGFPE",
        "SIGKILL",
        "SIGUSR1",
        "SIGSEGV",
        "SIGUSR2",
        "SIGPIPE",
        "SIGALRM",
        "SIGTERM",
        "SIGSTKFLT",
        "SIGCHLD",
        "SIGCONT",
        "SIGSTOP",
        "SIGTSTP",
        "SIGTTIN",
        "SIGTTOU",
        "SIGURG",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGVTALRM",
        "SIGPROF",
        "SIGWINCH",
        "SIGIO",
        "SIGPWR",
        "SIGSYS",
    ];
    usize::try_from(signal)
        .ok()
        .and_then(|s| NAMES.get(s.wrapping_sub(1)))
        .map_or_else(|| format!("signal {signal}"), |name| (*name).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn end(rank: usize, raw: i32, after_ms: u64) -> RankExit {
        RankExit {
            rank,
            status: ExitStatus::from_raw(raw),
            after: Duration::from_millis(after_ms),
            stopped_by: None,
            signalled: false,
            after_neighbour: false,
        }
    }

    #[test]
    fn signals_are_named_as_kill_names_them() {
        assert_eq!(signal_name(9), "SIGKILL");
        assert_eq!(signal_name(15), "SIGTERM");
        assert_eq!(signal_name(19), "SIGSTOP");
        assert_eq!(signal_name(0), "signal 0");
        assert_eq!(signal_name(64), "signal 64");
        assert_eq!(
            describe_status(ExitStatus::from_raw(9)),
            "killed by SIGKILL"
        );
        assert_eq!(describe_status(ExitStatus::from_raw(4 << 8)), "exit code 4");
    }

    #[test]
    fn a_killed_rank_is_blamed_before_the_neighbour_that_noticed_first() {
        // Rank 0 saw its ring close and exited 1 in the same poll as rank 1's SIGKILL.
        let mut rank0 = end(0, 1 << 8, 10);
        rank0.after_neighbour = true;
        let outcome = LaunchOutcome {
            ranks: vec![rank0, end(1, 9, 10)],
            forwarded_signal: None,
            timed_out: false,
        };
        assert_eq!(outcome.first_failure().unwrap().rank, 1);
        match outcome.into_result() {
            Err(CollectiveError::RankFailed {
                rank: 1,
                status,
                code: None,
                others: 1,
            }) => assert_eq!(status, "killed by SIGKILL"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_stopped_rank_is_blamed_before_the_ranks_that_timed_out() {
        let mut timed_out = [end(0, 1 << 8, 100), end(1, 1 << 8, 100)];
        for rank in &mut timed_out {
            rank.after_neighbour = true;
        }
        let mut stopped = end(2, 9, 900);
        stopped.stopped_by = Some(19);
        stopped.signalled = true;
        let outcome = LaunchOutcome {
            ranks: vec![timed_out[0], timed_out[1], stopped],
            forwarded_signal: None,
            timed_out: false,
        };
        let first = outcome.first_failure().unwrap();
        assert_eq!(first.rank, 2);
        assert!(
            first.describe().starts_with("stopped by SIGSTOP"),
            "{}",
            first.describe()
        );
    }

    #[test]
    fn a_rank_that_failed_by_itself_is_blamed_before_one_the_launcher_stopped() {
        let mut stopped = end(0, 15, 50);
        stopped.signalled = true;
        let outcome = LaunchOutcome {
            ranks: vec![stopped, end(1, 4 << 8, 60)],
            forwarded_signal: None,
            timed_out: false,
        };
        let first = outcome.first_failure().unwrap();
        assert_eq!((first.rank, first.status.code()), (1, Some(4)));
    }
}
