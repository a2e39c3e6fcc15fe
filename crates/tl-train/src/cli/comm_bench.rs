//! `tinyllm comm-bench`: the all-reduce bandwidth of a backend, as nccl-tests reports it,
//! with memcpy's as the yardstick. Run it under `tinyllm launch -n N` (the ring) or
//! `mpirun -np N` (with `--backend mpi`, in a build with the `mpi` feature).

use std::io::Write;
use std::time::Duration;

use clap::Args;
use tl_collective::bandwidth::{format_table, measure_all_reduce, sizes};

use super::Exit;
use super::backend::{Backend, communicator};
use crate::error::{Result, TrainError};

/// Options of `tinyllm comm-bench`.
#[derive(Debug, Args)]
pub struct CommBenchArgs {
    /// The communicator to measure.
    #[arg(long, value_enum, default_value_t = Backend::Ring)]
    pub backend: Backend,
    /// Smallest all-reduce, in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = 4 << 10)]
    pub min_bytes: usize,
    /// Largest all-reduce, in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = 64 << 20)]
    pub max_bytes: usize,
    /// Each size is this many times the last.
    #[arg(long, value_name = "F", default_value_t = 4)]
    pub factor: usize,
    /// Time spent measuring each size.
    #[arg(long, value_name = "MS", default_value_t = 300)]
    pub budget_ms: u64,
}

/// The largest all-reduce `--max-bytes` takes: checked before anything is allocated (each
/// rank holds the buffer, rank 0 two more for memcpy's yardstick).
const MAX_BYTES: usize = 1 << 30;

/// The longest `--budget-ms`: a minute of measuring per size.
const MAX_BUDGET_MS: u64 = 60_000;

/// The CPU's name, as /proc/cpuinfo gives it.
fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines().find_map(|l| {
                l.strip_prefix("model name")?
                    .split_once(':')
                    .map(|(_, v)| v.trim().to_string())
            })
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// Runs `tinyllm comm-bench`.
pub(super) fn comm_bench(args: &CommBenchArgs) -> Result<Exit> {
    if args.max_bytes > MAX_BYTES {
        return Err(TrainError::InvalidArgument {
            name: "--max-bytes",
            value: args.max_bytes.to_string(),
            reason: format!("at most {MAX_BYTES} bytes, 1 GiB"),
        });
    }
    if !(1..=MAX_BUDGET_MS).contains(&args.budget_ms) {
        return Err(TrainError::InvalidArgument {
            name: "--budget-ms",
            value: args.budget_ms.to_string(),
            reason: format!("between 1 and {MAX_BUDGET_MS} ms (a minute) per size"),
        });
    }
    if args.min_bytes < 4 || args.min_bytes > args.max_bytes {
        return Err(TrainError::InvalidArgument {
            name: "--min-bytes",
            value: args.min_bytes.to_string(),
            reason: "between 4 and --max-bytes".into(),
        });
    }
    let mut comm = communicator(args.backend)?;
    let (rank, n) = (comm.rank(), comm.world_size());
    let budget = Duration::from_millis(args.budget_ms);
    if rank == 0 {
        println!(
            "all_reduce_sum of f32 on {n} rank(s), backend {}, {}; busbw = algbw * 2(N-1)/N",
            args.backend,
            cpu_name()
        );
        println!();
    }
    let mut rows = Vec::new();
    for bytes in sizes(args.min_bytes, args.max_bytes, args.factor) {
        rows.push(measure_all_reduce(comm.as_mut(), bytes, budget)?);
        if rank == 0 {
            eprint!(".");
            let _ = std::io::stderr().flush();
        }
    }
    if rank == 0 {
        eprintln!();
        print!("{}", format_table(&rows));
    }
    Ok(Exit::Success)
}
