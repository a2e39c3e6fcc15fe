//! `tinyllm launch -n N -- <command>`: runs a tinyllm command as N ranks on this machine,
//! wired for the ring backend of tl-collective (torchrun's job, for tinyllm).

use std::ffi::OsString;
use std::time::Duration;

use clap::Args;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use tl_collective::launch::{
    LaunchOptions, LaunchOutcome, available_cores, launch as launch_ranks, rank_cores,
};

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
    /// Where the ranks run: `cores` gives each its own T cores (rank r the r-th T of the
    /// cores this launcher may use), as mpirun binds ranks, when N·T of them exist; `none`
    /// lets the system move every thread over every core.
    #[arg(long, value_enum, default_value_t = Bind::Cores)]
    pub bind: Bind,
    /// Once a rank fails, how long the others may go on before they are stopped.
    #[arg(long, value_name = "MS", default_value_t = 5000)]
    pub grace_ms: u64,
    /// The tinyllm command and flags every rank runs, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// Where `launch` puts its ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Bind {
    /// Each rank on cores of its own, when there are enough (else as `none`).
    #[default]
    Cores,
    /// Anywhere: the system schedules every rank's threads over all the cores.
    None,
}

/// The most ranks `launch` starts on one machine: far past its cores, short of a fork bomb.
const MAX_LOCAL_RANKS: usize = 256;

/// Runs `tinyllm launch`: re-executes this program as every rank.
pub(super) fn launch(args: &LaunchArgs) -> Result<Exit> {
    if !(1..=MAX_LOCAL_RANKS).contains(&args.nproc) {
        return Err(TrainError::InvalidArgument {
            name: "--nproc",
            value: args.nproc.to_string(),
            reason: format!(
                "1 to {MAX_LOCAL_RANKS} ranks on this machine (each is a process; across \
                 machines, use mpirun)"
            ),
        });
    }
    if args.timeout_ms == Some(0) {
        return Err(TrainError::InvalidArgument {
            name: "--timeout-ms",
            value: "0".into(),
            reason: "at least 1 ms".into(),
        });
    }
    check_multi_rank(&args.command)?;
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
    // The threads each rank computes on, where known (the environment's choice may not
    // be a number rayon understands: then the ranks are not bound).
    let rank_threads = threads.or_else(|| {
        let value = std::env::var(THREADS_ENV).ok()?;
        value.trim().parse().ok().filter(|&t: &usize| t > 0)
    });
    let binding = match (args.bind, rank_threads, available_cores()) {
        (Bind::Cores, Some(t), Some(available)) => rank_cores(&available, args.nproc, t),
        _ => None,
    };
    let options = LaunchOptions {
        comm_timeout: args.timeout_ms.map(Duration::from_millis),
        grace: Duration::from_millis(args.grace_ms),
        env: threads
            .map(|t| (OsString::from(THREADS_ENV), OsString::from(t.to_string())))
            .into_iter()
            .collect(),
        cores: binding,
        ..LaunchOptions::default()
    };
    let outcome = launch_ranks(args.nproc, &exe, &args.command, &options)?;
    if let Some(signal) = interrupted(&outcome) {
        return Ok(Exit::Interrupted { signal });
    }
    let failures: Vec<_> = outcome.ranks.iter().filter(|r| !r.success()).collect();
    if !failures.is_empty() && failures.iter().all(|r| r.status.code() == Some(3)) {
        // `compare` on rank 0 found MS-L11 missed: a verdict, not a failure.
        return Ok(Exit::MilestoneMissed);
    }
    // Otherwise the error names the rank to blame and carries its exit code, which the
    // process exits with when it is a documented one (2 refused, 4 diverged).
    outcome.into_result()?;
    Ok(Exit::Success)
}

/// The commands that run as ranks: those that take `--backend` (and so join the other
/// ranks); any other would run N times side by side, each writing the same files.
fn multi_rank_commands() -> Vec<String> {
    <super::Cli as clap::CommandFactory>::command()
        .get_subcommands()
        .filter(|sub| sub.get_arguments().any(|arg| arg.get_id() == "backend"))
        .map(|sub| sub.get_name().to_string())
        .collect()
}

/// Refuses a command that would not run as ranks of one job.
///
/// # Errors
/// [`TrainError::InvalidArgument`] naming the command and the ones that run as ranks.
fn check_multi_rank(command: &[OsString]) -> Result<()> {
    let name = command.first().map(|c| c.to_string_lossy().into_owned());
    let commands = multi_rank_commands();
    match name {
        Some(name) if commands.contains(&name) => Ok(()),
        name => Err(TrainError::InvalidArgument {
            name: "COMMAND",
            value: name.unwrap_or_default(),
            reason: format!(
                "launch runs only the commands that run as ranks: {}",
                commands.join(", ")
            ),
        }),
    }
}

/// The stopping signal every rank answered as `tinyllm train` does (a checkpoint, exit
/// 128 + signal), whether the launcher forwarded it or one rank received it and the run
/// stopped on all: an interruption, not a failure.
fn interrupted(outcome: &LaunchOutcome) -> Option<i32> {
    let code = outcome.ranks.first()?.status.code()?;
    let signal = [SIGHUP, SIGINT, SIGTERM]
        .into_iter()
        .find(|&s| code == 128 + s)?;
    let all = outcome.ranks.iter().all(|r| r.status.code() == Some(code));
    all.then_some(signal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_commands_that_take_a_backend_run_as_ranks() {
        let mut commands = multi_rank_commands();
        commands.sort();
        assert_eq!(commands, ["bench", "comm-bench", "compare", "train"]);
        for refused in ["export", "sample", "plan", "launch", "--help"] {
            let err = check_multi_rank(&[OsString::from(refused)]).unwrap_err();
            assert!(err.to_string().contains("train"), "{err}");
        }
        check_multi_rank(&[OsString::from("train"), OsString::from("--quiet")]).unwrap();
    }
}
