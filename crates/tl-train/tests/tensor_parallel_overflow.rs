//! An fp16 overflow on one rank of a tensor-parallel group skips the step on every rank, as
//! one process skips it: the loss scaler's decision spans the group.
//!
//! The overflow is made, not injected: one hidden unit of the first block's MLP, in the half
//! that rank 1 of 2 holds, is made loud (its `W1` and `W3` columns scaled up) and silent
//! (its `W2` row zeroed). The block's output does not change, and no activation's gradient
//! grows; only that unit's `W2` gradient, the loud activation times the output's scaled
//! gradient, passes fp16's largest value. Split over two ranks, that gradient is rank 1's
//! alone: rank 0's gradients are all finite. Without the group's agreement rank 0 would
//! step and rank 1 skip, and their loss scales part.
//!
//! The ranks are threads of this test joined by the socket ring, with a timeout.

mod common;

use std::path::Path;
use std::thread;
use std::time::Duration;

use common::overflow::{self, Step};
use tl_collective::{RingComm, RingConfig};
use tl_precision::Precision;
use tl_train::model::{Llama, Preset};
use tl_train::train::{TrainConfig, Trainer};

/// Steps each run takes.
const STEPS: usize = 8;

/// The loud, silent unit: the last hidden unit of block 0.
fn loud_unit(config: &TrainConfig) -> usize {
    config.model.hidden - 1
}

/// Makes the unit `loud_unit` of block 0 loud and silent in `model`, which is rank `rank`'s
/// part of `tensor` (the unit's column and row there, if it holds them).
fn make_unit_loud(model: &Llama<f32>, config: &TrainConfig, rank: usize, tensor: usize) {
    let per_rank = config.model.hidden / tensor;
    let unit = loud_unit(config);
    if unit / per_rank == rank {
        overflow::make_unit_loud(model, unit % per_rank);
    }
}

/// The tiny run in fp16 with clipping over `ranks` ranks split `tensor` ways.
fn config(ranks: usize, tensor: usize) -> TrainConfig {
    let mut config = TrainConfig::for_preset(Preset::Tiny);
    config.precision = Precision::Fp16;
    config.micro_batch = 2;
    config.accum = 2;
    config.steps = STEPS as u64;
    config.parallel.ranks = ranks;
    config.parallel.tensor = tensor;
    config.divergence.max_skipped = STEPS as u32;
    config
}

fn steps(trainer: Trainer) -> Vec<Step> {
    overflow::steps(trainer, STEPS)
}

fn one_process(dir: &Path) -> Vec<Step> {
    let config = config(1, 1);
    let trainer = Trainer::new(config.clone(), dir).unwrap();
    make_unit_loud(trainer.model(), &config, 0, 1);
    steps(trainer)
}

/// Each rank's steps, the ranks being threads over the socket ring.
fn split_in_two(dir: &Path) -> Vec<Vec<Step>> {
    let sockets = tempfile::tempdir().unwrap();
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let ring = RingConfig::new(rank, 2, sockets.path(), [5; 32])
                .unwrap()
                .timeout(Duration::from_secs(60));
            let run_dir = dir.to_path_buf();
            thread::spawn(move || {
                let config = config(2, 2);
                let comm = Box::new(RingComm::connect(ring).unwrap());
                let trainer = Trainer::new_on(config.clone(), &run_dir, comm).unwrap();
                make_unit_loud(trainer.model(), &config, rank, 2);
                steps(trainer)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn an_overflow_on_one_rank_of_the_group_skips_the_step_everywhere() {
    let dir = tempfile::tempdir().unwrap();
    let one = one_process(&dir.path().join("one"));
    let skipped = one.iter().filter(|s| s.1).count();
    eprintln!("one process: {one:?}");
    assert!(
        (1..STEPS).contains(&skipped),
        "the loud unit overflows the first steps, then fits: {one:?}"
    );
    let ranks = split_in_two(&dir.path().join("tp2"));
    for (rank, steps) in ranks.iter().enumerate() {
        eprintln!("rank {rank}: {steps:?}");
        for (step, (got, expected)) in steps.iter().zip(&one).enumerate() {
            let what = format!("rank {rank}, step {}", step + 1);
            assert_eq!(got.1, expected.1, "{what}: skipped");
            assert_eq!(got.2, expected.2, "{what}: loss scale");
            // fp16's rounding before the group's sum (tensor_parallel_training.rs).
            let difference = (got.0 - expected.0).abs() / expected.0;
            assert!(
                difference < 2f64.powi(-11),
                "{what}: loss differs by {difference:e}"
            );
        }
    }
}
