//! The other side of the plan: the peak that `tl_tensor::memory` measures on a real
//! [`Trainer`] step of the same recipe.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tl_collective::{CommStats, Communicator, Phantom};
use tl_tensor::memory;

use super::recorder::{Calls, Recorder};
use crate::error::{Result, TrainError};
use crate::train::{DataSource, Record, TrainConfig, Trainer};

/// Steps a `--fp16` measurement may skip (loss scale too high) before one is taken.
const MAX_WARMUP_STEPS: u32 = 32;

/// Peak live bytes of real training steps, as the memory meter counts them on this thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Measurement {
    /// Peak of the first step of a fresh model, above what was live before the trainer
    /// existed.
    pub first_step_peak_bytes: u64,
    /// Peak of the step after the first update (moments allocated), counted from a
    /// `reset_peak` between the steps.
    pub peak_bytes: u64,
    /// Live bytes right before that step.
    pub between_steps_bytes: u64,
}

/// The relative error `(predicted − measured) / measured`.
pub fn relative_error(predicted: u64, measured: u64) -> f64 {
    (predicted as f64 - measured as f64) / measured as f64
}

/// Trains a fresh model of `config` for one step, then once more, and reads the memory
/// meter around each step. The data is a small built-in corpus (it does not change the
/// bytes of a step) and the run lives in a temporary directory that is removed afterwards.
///
/// Under fp16 a step the loss scaler skips makes no moments, so steps run until one is
/// taken before the measured one.
///
/// # Errors
/// Those of [`Trainer::new`] and [`Trainer::train_step`], or [`TrainError::InvalidArgument`]
/// when fp16 skips every warm-up step.
pub fn measure_steps(config: &TrainConfig) -> Result<Measurement> {
    let mut config = config.clone();
    config.data = DataSource::Builtin {
        seed: 0,
        bytes: 40 * (config.model.context + 1),
    };
    let run_dir = scratch_dir();
    let outcome = measure_in(&config, &run_dir);
    // Best effort: a leftover scratch directory is harmless and must not hide the outcome.
    let _ = std::fs::remove_dir_all(&run_dir);
    outcome
}

/// [`measure_steps`] on a [meta](tl_tensor::meta) trainer ([`Trainer::meta_on`]): the same
/// steps of the same code, counted by the same meter, with shapes and no values. Instant at
/// any size, and equal to the real figures byte for byte.
///
/// # Errors
/// Those of [`Trainer::meta_on`] and [`Trainer::train_step`].
pub fn measure_meta_steps(config: &TrainConfig) -> Result<Measurement> {
    measure_meta_steps_on(config, 0, 1)
}

fn measure_in(config: &TrainConfig, run_dir: &std::path::Path) -> Result<Measurement> {
    let base = memory::live_bytes();
    let trainer = Trainer::new(config.clone(), run_dir)?;
    measure_trainer(trainer, base)
}

/// Steps `trainer` (made when `base` bytes were live) as [`measure_steps`] describes.
fn measure_trainer(mut trainer: Trainer, base: usize) -> Result<Measurement> {
    memory::reset_peak();
    let mut taken = !skipped(&trainer.train_step()?);
    let first_step_peak_bytes = (memory::peak_bytes() - base) as u64;
    let mut warmups = 1;
    while !taken {
        if warmups == MAX_WARMUP_STEPS {
            return Err(TrainError::InvalidArgument {
                name: "fp16",
                value: format!("{warmups} steps"),
                reason: "the loss scaler skipped every step; no steady state to measure".into(),
            });
        }
        taken = !skipped(&trainer.train_step()?);
        warmups += 1;
    }
    let between_steps_bytes = (memory::live_bytes() - base) as u64;
    memory::reset_peak();
    trainer.train_step()?;
    Ok(Measurement {
        first_step_peak_bytes,
        peak_bytes: (memory::peak_bytes() - base) as u64,
        between_steps_bytes,
    })
}

fn skipped(record: &Record) -> bool {
    matches!(record, Record::Train { skipped: true, .. })
}

/// A fresh directory name under the system's temporary directory.
fn scratch_dir() -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::env::temp_dir().join(format!("tinyllm-plan-{}-{nanos}", std::process::id()))
}

/// [`measure_steps`] on one rank of a data-parallel run: the rank's meter, and what its
/// communicator counted during the steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankMeasurement {
    /// The rank's meter, read as [`measure_steps`] reads it.
    pub memory: Measurement,
    /// Collectives called and bytes sent by this rank from its first step to its last.
    pub comm: CommStats,
}

/// [`measure_steps`] as one rank of `comm`'s ranks ([`Trainer::new_on`], at the config's
/// ZeRO stage and buckets): every rank calls it with the same config, at the same time.
/// Rank 0 makes the run directory, a fresh one under the system's temporary directory,
/// and removes it afterwards.
///
/// # Errors
/// Those of [`Trainer::new_on`] and [`Trainer::train_step`], as for [`measure_steps`].
pub fn measure_rank(config: &TrainConfig, comm: Box<dyn Communicator>) -> Result<RankMeasurement> {
    let mut config = config.clone();
    config.data = DataSource::Builtin {
        seed: 0,
        bytes: 40 * (config.model.context + 1),
    };
    let run_dir = scratch_dir();
    let outcome = (|| {
        let base = memory::live_bytes();
        let (comm, calls) = Recorder::new(comm);
        let trainer = Trainer::new_on(config, &run_dir, Box::new(comm))?;
        measure_recorded(trainer, base, &calls)
    })();
    // Best effort, as in `measure_steps`; only rank 0 made it.
    let _ = std::fs::remove_dir_all(&run_dir);
    outcome
}

/// [`measure_meta_steps`] as rank `rank` of a world of `world_size`, on a
/// [`Phantom`](tl_collective::Phantom): the steps of [`measure_rank`]'s rank, shapes only,
/// in one process whatever the world size.
///
/// # Errors
/// [`TrainError::Collective`] for a rank outside the world; those of [`Trainer::meta_on`]
/// and [`Trainer::train_step`].
pub fn measure_meta_steps_on(
    config: &TrainConfig,
    rank: usize,
    world_size: usize,
) -> Result<Measurement> {
    Ok(measure_meta_rank(config, rank, world_size)?.memory)
}

/// [`measure_meta_steps_on`] with what the phantom counted: equal to [`measure_rank`] of
/// the same rank, byte for byte and collective for collective.
///
/// # Errors
/// As [`measure_meta_steps_on`].
pub fn measure_meta_rank(
    config: &TrainConfig,
    rank: usize,
    world_size: usize,
) -> Result<RankMeasurement> {
    let phantom = Phantom::new(rank, world_size)?;
    let _meta = tl_tensor::meta_mode();
    let base = memory::live_bytes();
    let (comm, calls) = Recorder::new(Box::new(phantom));
    let trainer = Trainer::meta_on(config.clone(), Box::new(comm))?;
    measure_recorded(trainer, base, &calls)
}

/// Steps `trainer` as [`measure_steps`] does, with what its communicator's recorder saw
/// meanwhile.
fn measure_recorded(trainer: Trainer, base: usize, calls: &Calls) -> Result<RankMeasurement> {
    let before = calls.lock().expect("the plan's log").len();
    let memory = measure_trainer(trainer, base)?;
    let calls = calls.lock().expect("the plan's log");
    let stepped = &calls[before..];
    Ok(RankMeasurement {
        memory,
        comm: CommStats {
            collectives: stepped.len() as u64,
            bytes_sent: stepped.iter().map(|call| call.bytes_sent).sum(),
            ..CommStats::default()
        },
    })
}
