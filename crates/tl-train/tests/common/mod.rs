//! Helpers shared by the integration tests: `tinyllm` run in-process.

// Each test crate includes this module and uses its own subset of it.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};

use tl_train::TrainError;
use tl_train::cli::{CliError, Exit, run};
use tl_train::train::{Record, read_records};

pub mod overflow;
pub mod ranks;

/// `tinyllm train` on the tiny preset, 2 × 2 sequences of 64 bytes per step on 40 kB of
/// built-in corpus, without a progress bar: the run most integration tests train (the run
/// directory and further flags follow).
pub const TINY_TRAIN: [&str; 10] = [
    "train",
    "--preset",
    "tiny",
    "--micro-batch",
    "2",
    "--accum",
    "2",
    "--corpus-bytes",
    "40000",
    "--quiet",
];

/// Runs `tinyllm ARGS..` in-process.
pub fn tinyllm(args: &[&str]) -> Result<Exit, CliError> {
    run(std::iter::once("tinyllm").chain(args.iter().copied()))
}

/// The standard output of the built `tinyllm` binary run with `ARGS..`, which must succeed
/// (its standard error in the panic message otherwise).
pub fn stdout_of(args: &[&str]) -> String {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tinyllm"))
        .args(args)
        .output()
        .expect("tinyllm runs");
    assert!(
        output.status.success(),
        "tinyllm {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("UTF-8 output")
}

/// The error of a `tinyllm ARGS..` that must fail after parsing its arguments.
///
/// # Panics
/// If the command succeeds or fails with a usage error.
pub fn run_error(args: &[&str]) -> TrainError {
    match tinyllm(args) {
        Err(CliError::Run(error)) => error,
        other => panic!("tinyllm {args:?}: expected a run error, got {other:?}"),
    }
}

/// `tinyllm compare` on the tiny preset (6 steps, 2 × 2 sequences) with `extra` flags, into
/// `out`; its report.
pub fn tiny_compare(out: &Path, extra: &[&str]) -> tl_train::compare::Comparison {
    // TINY_TRAIN's model and batches, for compare.
    let mut args = vec!["compare"];
    args.extend_from_slice(&TINY_TRAIN[1..]);
    args.extend(["--steps", "6", "--out", out.to_str().unwrap()]);
    args.extend(extra);
    tinyllm(&args).unwrap();
    serde_json::from_slice(&fs::read(out.join("comparison.json")).unwrap()).unwrap()
}

/// The directory of a run's latest checkpoint.
pub fn latest_checkpoint(run: &Path) -> PathBuf {
    run.join(
        fs::read_to_string(run.join("LATEST"))
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
}

/// The bytes of the latest checkpoint's `model.safetensors`.
pub fn model_bytes(run: &Path) -> Vec<u8> {
    fs::read(latest_checkpoint(run).join("model.safetensors")).unwrap()
}

/// Training steps logged in a run's `metrics.jsonl` (none when it does not exist yet).
pub fn train_steps(run: &Path) -> usize {
    read_records(&run.join("metrics.jsonl"))
        .unwrap_or_default()
        .iter()
        .filter(|record| matches!(record, Record::Train { .. }))
        .count()
}

/// Runs `program` as every rank of a ring of `n` threads of this process, each with its
/// own sockets, meeting in a fresh directory; a rank that waits `timeout` fails, so nothing
/// hangs. The results in rank order.
pub fn thread_world<T: Send>(
    n: usize,
    timeout: std::time::Duration,
    program: impl Fn(tl_collective::RingComm) -> T + Sync,
) -> Vec<T> {
    use tl_collective::{RingComm, RingConfig};
    let dir = tempfile::tempdir().unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (dir, program) = (dir.path(), &program);
                scope.spawn(move || {
                    let config = RingConfig::new(rank, n, dir, [7; 32])
                        .unwrap()
                        .timeout(timeout);
                    program(RingComm::connect(config).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The tiny preset on 20 kB of built-in text, one micro-batch of 2 sequences a step: the
/// config of the in-process multi-rank tests.
pub fn tiny_ranks_config() -> tl_train::train::TrainConfig {
    use tl_train::train::{DataSource, TrainConfig};
    TrainConfig {
        data: DataSource::Builtin {
            seed: 0,
            bytes: 20_000,
        },
        micro_batch: 2,
        accum: 1,
        ..TrainConfig::for_preset(tl_train::model::Preset::Tiny)
    }
}

/// `tinyllm ARGS..` as a process whose address space is capped at `limit_mib` MiB (`ulimit
/// -v`, so an unbounded read or allocation fails inside it and never reaches the test
/// machine's memory), killed past `time_limit` (and the test failed).
pub fn capped(
    args: &[&str],
    limit_mib: u64,
    time_limit: std::time::Duration,
) -> std::process::Output {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let child = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v {} && exec \"$0\" \"$@\"",
            limit_mib * 1024
        ))
        .arg(env!("CARGO_BIN_EXE_tinyllm"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let id = child.id().to_string();
    let started = std::time::Instant::now();
    let done = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            while started.elapsed() < time_limit {
                if done.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let _ = std::process::Command::new("kill")
                .args(["-9", &id])
                .status();
        })
    };
    let output = child.wait_with_output().unwrap();
    done.store(true, Ordering::SeqCst);
    let _ = watchdog.join();
    assert!(
        started.elapsed() < time_limit,
        "tinyllm {args:?} ran past {time_limit:?}"
    );
    output
}
