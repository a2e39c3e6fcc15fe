//! Running `tinyllm` as processes, on one rank or under `tinyllm launch`, bounded in time,
//! and reading what the runs wrote: the tests of training on ranks share these.

use std::fs;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use tl_train::train::{Record, read_records};

use super::{TINY_TRAIN, latest_checkpoint};

/// How long any one multi-process command may take before the test fails.
pub const LIMIT: Duration = Duration::from_secs(120);

/// The `tinyllm` binary, with a collective timeout short enough that a hang fails fast
/// instead of holding the test.
pub fn binary() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tinyllm"));
    command.env("TINYLLM_COMM_TIMEOUT_MS", "20000");
    command
}

/// `tinyllm launch -n RANKS -- ARGS` (or plain `tinyllm ARGS` for one rank), run to the end
/// within [`LIMIT`].
pub fn run_ranks(ranks: usize, args: &[String]) -> Output {
    let mut command = binary();
    if ranks > 1 {
        command.args(["launch", "-n", &ranks.to_string(), "--"]);
    }
    let child = command
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_output(child)
}

/// The output of `child`, killed and the test failed if it runs past [`LIMIT`].
pub fn wait_output(mut child: std::process::Child) -> Output {
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > LIMIT {
            let _ = child.kill();
            panic!("tinyllm did not finish within {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// [`run_ranks`], which must succeed; its stderr.
pub fn succeed(ranks: usize, args: &[String]) -> String {
    let output = run_ranks(ranks, args);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        output.status.success(),
        "{args:?} on {ranks} ranks: {stderr}"
    );
    stderr
}

/// The training losses of a run, step by step.
pub fn train_losses(run: &Path) -> Vec<f64> {
    read_records(&run.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .filter_map(|record| match record {
            Record::Train { loss, .. } => Some(*loss),
            Record::Eval { .. } => None,
        })
        .collect()
}

/// The gradient norms of a run's steps (before clipping; clipping on, every step taken).
pub fn grad_norms(run: &Path) -> Vec<f64> {
    read_records(&run.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .filter_map(|record| match record {
            Record::Train { grad_norm, .. } => Some(grad_norm.expect("a clipped step's norm")),
            Record::Eval { .. } => None,
        })
        .collect()
}

/// The JSON header and the float32 weights of a run's latest checkpoint, in file order
/// (safetensors: an 8-byte header length, the JSON header, then the data).
pub fn checkpoint(run: &Path) -> (String, Vec<f32>) {
    let bytes = fs::read(latest_checkpoint(run).join("model.safetensors")).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let values = bytes[8 + header..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (
        String::from_utf8_lossy(&bytes[8..8 + header]).into_owned(),
        values,
    )
}

/// The float32 weights of a run's latest checkpoint, in file order.
pub fn weights(run: &Path) -> Vec<f32> {
    checkpoint(run).1
}

/// The largest absolute difference of two weight lists.
pub fn largest_difference(left: &[f32], right: &[f32]) -> f32 {
    assert_eq!(left.len(), right.len());
    left.iter()
        .zip(right)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

/// The median absolute difference of two weight lists (of at least one weight).
pub fn median_difference(left: &[f32], right: &[f32]) -> f32 {
    assert_eq!(left.len(), right.len());
    let mut differences: Vec<f32> = left.iter().zip(right).map(|(a, b)| (a - b).abs()).collect();
    differences.sort_by(f32::total_cmp);
    differences[differences.len() / 2]
}

/// The CLI tests' tiny run into `out` for 5 steps: micro-batches of `rows` sequences,
/// `accum` of them per data-parallel replica, then `extra`.
pub fn tiny_run(out: &Path, rows: usize, accum: usize, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = TINY_TRAIN.map(String::from).to_vec();
    for (flag, value) in [("--accum", accum), ("--micro-batch", rows)] {
        let at = args.iter().position(|a| a == flag).unwrap();
        args[at + 1] = value.to_string();
    }
    args.extend(["--steps", "5", "--out", out.to_str().unwrap()].map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// The largest relative difference of two runs' per-step values (`right` the reference).
pub fn largest_relative(left: &[f64], right: &[f64]) -> f64 {
    assert_eq!(left.len(), right.len(), "steps");
    left.iter()
        .zip(right)
        .map(|(a, b)| (a - b).abs() / b.abs())
        .fold(0.0, f64::max)
}
