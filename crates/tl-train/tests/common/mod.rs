//! Helpers shared by the integration tests: `tinyllm` run in-process.

// Each test crate includes this module and uses its own subset of it.
#![allow(dead_code)]

use tl_train::TrainError;
use tl_train::cli::{CliError, Exit, run};

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
