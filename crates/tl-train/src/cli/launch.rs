//! `tinyllm launch -n N -- <command>`: runs a tinyllm command as N ranks on this machine,
//! wired for the ring backend of tl-collective (torchrun's job, for tinyllm).

use std::ffi::OsString;
use std::time::Duration;

use clap::Args;
use tl_collective::launch::{LaunchOptions, launch as launch_ranks};

use super::Exit;
use crate::error::{Result, TrainError};

/// The variable that sizes a process's compute thread pool (rayon's global pool).
const THREADS_ENV: &str = "RAYON_NUM_THREADS";

/// Options of `tinyllm launch`.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Number of ranks (processes) to start.
    #[arg(short = 'n', long = "nproc", value_name = "N")]
    pub nproc: usize,
    /// A collective that moves no byte for this long fails on every rank
    /// [default: $TINYLLM_COMM_TIMEOUT_MS, else 10000].
    #[arg(long, value_name = "MS")]
    pub timeout_ms: Option<u64>,
    /// Compute threads of each rank [default: $RAYON_NUM_THREADS, else the machine's cores
    /// shared out, at least 1], so that N ranks on one machine do not oversubscribe it.
    #[arg(long, value_name = "T")]
    pub threads_per_rank: Option<usize>,
    /// Once a rank fails, how long the others may go on before they are stopped.
    #[arg(long, value_name = "MS", default_value_t = 5000)]
    pub grace_ms: u64,
    /// The tinyllm command and flags every rank runs, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// Runs `tinyllm launch`: re-executes this program as every rank.
pub(super) fn launch(args: &LaunchArgs) -> Result<Exit> {
    if args.nproc == 0 {
        return Err(TrainError::InvalidArgument {
            name: "--nproc",
            value: "0".into(),
            reason: "at least one rank".into(),
        });
    }
    if args.timeout_ms == Some(0) {
        return Err(TrainError::InvalidArgument {
            name: "--timeout-ms",
            value: "0".into(),
            reason: "at least 1 ms".into(),
        });
    }
    let exe = std::env::current_exe().map_err(|e| TrainError::io("the tinyllm executable", e))?;
    if args.threads_per_rank == Some(0) {
        return Err(TrainError::InvalidArgument {
            name: "--threads-per-rank",
            value: "0".into(),
            reason: "at least 1".into(),
        });
    }
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let threads = match (args.threads_per_rank, std::env::var_os(THREADS_ENV)) {
        (Some(threads), _) => Some(threads),
        (None, Some(_)) => None, // the environment's choice reaches the ranks as it is
        (None, None) => Some((cores / args.nproc).max(1)),
    };
    let options = LaunchOptions {
        comm_timeout: args.timeout_ms.map(Duration::from_millis),
        grace: Duration::from_millis(args.grace_ms),
        env: threads
            .map(|t| (OsString::from(THREADS_ENV), OsString::from(t.to_string())))
            .into_iter()
            .collect(),
        ..LaunchOptions::default()
    };
    let outcome = launch_ranks(args.nproc, &exe, &args.command, &options)?;
    // A forwarded SIGINT or SIGTERM that every rank answered as `tinyllm train` does (a
    // checkpoint, exit 128 + signal) is an interruption, not a failure.
    if let Some(signal) = outcome.forwarded_signal
        && outcome
            .ranks
            .iter()
            .all(|r| r.status.code() == Some(128 + signal))
    {
        return Ok(Exit::Interrupted { signal });
    }
    outcome.into_result()?;
    Ok(Exit::Success)
}
