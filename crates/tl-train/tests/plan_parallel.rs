//! `tinyllm plan --ranks N --zero S` against ranks that train for real: the tiny model
//! trained by tl-parallel's `DataParallel` (stage 0) and with `ShardedAdamW` (stage 1) on
//! N = 2 and N = 4 ranks, each rank a thread (the memory meter is per thread) joined to
//! the others by the socket ring.
//!
//! What is compared: every rank's metered peak (`tl_tensor::memory::peak_bytes`, tensors
//! only) against the plan's `peak_bytes`, and the bytes the rank's communicator counts
//! (`CommStats::bytes_sent`) against the plan's `sent_bytes`, exactly. What is not: the
//! plan's communication-buffer term (the bucket, the ring's scratch, `ShardedAdamW`'s
//! gather vectors are plain `Vec`s the meter does not see today), which enters only the
//! plan's `total_bytes`.

mod common;

use std::thread;
use std::time::Duration;

use tl_collective::{Communicator, RingComm, RingConfig};
use tl_parallel::{DataParallel, ShardedAdamW};
use tl_precision::Precision;
use tl_tensor::Generator;
use tl_tensor::memory;
use tl_tensor::nn::Module;
use tl_tensor::optim::{AdamW, Optimizer};
use tl_train::TrainError;
use tl_train::cli::CliError;
use tl_train::data::{Corpus, sample_batch};
use tl_train::model::{Llama, Preset};
use tl_train::plan::{BUCKET_BYTES, DataParallelism, Recipe, plan_ranks, relative_error};
use tl_train::train::{TrainConfig, batch_loss};

/// The tiny preset, 2 micro-batches of 2 sequences per rank (`common::TINY_TRAIN`'s recipe).
fn tiny_config() -> TrainConfig {
    let mut config = TrainConfig::for_preset(Preset::Tiny);
    config.micro_batch = 2;
    config.accum = 2;
    config
}

/// What one rank's meter and communicator saw.
#[derive(Debug)]
struct RankReading {
    first_step_peak: u64,
    peak: u64,
    sent_first_step: u64,
    sent: u64,
}

/// Two steps of data-parallel training on this thread, measured as `measure_steps` does:
/// from the live bytes before the model exists, the peak reset between the steps.
fn train_rank(comm: RingComm, config: &TrainConfig, stage: usize) -> RankReading {
    let (rank, world) = (comm.rank(), comm.world_size());
    let corpus = Corpus::builtin(0, 40_000);
    let rng = Generator::new(100 + rank as u64);
    let base = memory::live_bytes();
    let model = Llama::<f32>::new(&config.model, config.seed).unwrap();
    let mut ddp = DataParallel::new(Box::new(comm));
    ddp.broadcast_parameters(&model.parameters()).unwrap();
    let adamw = AdamW::new(model.parameters(), config.lr.peak)
        .unwrap()
        .with_weight_decay(config.weight_decay)
        .unwrap();
    let mut opt: Box<dyn Optimizer<f32>> = match stage {
        0 => Box::new(adamw),
        _ => Box::new(ShardedAdamW::new(&ddp, adamw).unwrap()),
    };
    let global_rows = config.micro_batch * config.accum * world;
    let step = |ddp: &mut DataParallel, opt: &mut dyn Optimizer<f32>| {
        let micro_batches: Vec<_> = (0..config.accum)
            .map(|_| {
                sample_batch(
                    &corpus.train,
                    config.micro_batch,
                    config.model.context,
                    &rng,
                )
            })
            .collect();
        let before = ddp.stats().bytes_sent;
        memory::reset_peak();
        let report = ddp
            .train_step(
                &model,
                &micro_batches,
                global_rows,
                batch_loss,
                opt,
                Precision::Fp32,
                None,
                config.clip,
            )
            .unwrap();
        assert!(report.loss.is_finite() && !report.skipped);
        (
            (memory::peak_bytes() - base) as u64,
            ddp.stats().bytes_sent - before,
        )
    };
    let (first_step_peak, sent_first_step) = step(&mut ddp, opt.as_mut());
    let (peak, sent) = step(&mut ddp, opt.as_mut());
    RankReading {
        first_step_peak,
        peak,
        sent_first_step,
        sent,
    }
}

/// `world` ranks as threads over a fresh socket directory, each training two steps.
fn train_world(config: &TrainConfig, world: usize, stage: usize) -> Vec<RankReading> {
    let dir = tempfile::tempdir().unwrap();
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let ring = RingConfig::new(rank, world, dir.path(), [7; 32])
                .unwrap()
                .timeout(Duration::from_secs(120));
            let config = config.clone();
            thread::spawn(move || train_rank(RingComm::connect(ring).unwrap(), &config, stage))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn check_world(world: usize, stage: usize) {
    let config = tiny_config();
    let plan = plan_ranks(
        &Recipe::from(&config),
        &DataParallelism::new(world, stage).unwrap(),
    )
    .unwrap();
    let readings = train_world(&config, world, stage);
    for (rank, (reading, predicted)) in readings.iter().zip(&plan.ranks).enumerate() {
        println!(
            "N={world} ZeRO-{stage} rank {rank}: peak predicted {} measured {} \
             (first step {} / {}), sent predicted {} measured {} (first step {}); \
             unmetered comm buffers predicted {} in the reduction, {} in the gather; most \
             alive with them {} ({})",
            predicted.peak_bytes,
            reading.peak,
            predicted.first_step_peak_bytes.unwrap(),
            reading.first_step_peak,
            predicted.sent_bytes,
            reading.sent,
            reading.sent_first_step,
            predicted.terms.buffers_reduce,
            predicted.terms.buffers_update,
            predicted.total_bytes,
            predicted.phase.label(),
        );
        let error = relative_error(predicted.peak_bytes, reading.peak);
        assert!(error.abs() <= 0.01, "rank {rank}: peak off by {error:.4}");
        let first = predicted.first_step_peak_bytes.unwrap();
        let error = relative_error(first, reading.first_step_peak);
        assert!(
            error.abs() <= 0.01,
            "rank {rank}: first step off by {error:.4}"
        );
        // Both steps make the same collectives on buffers of the same lengths.
        assert_eq!(
            reading.sent, predicted.sent_bytes,
            "rank {rank}: bytes sent"
        );
        assert_eq!(reading.sent_first_step, predicted.sent_bytes, "rank {rank}");
    }
}

#[test]
fn ddp_ranks_peak_and_send_what_the_plan_predicts() {
    check_world(2, 0);
    check_world(4, 0);
}

#[test]
fn zero1_ranks_peak_and_send_what_the_plan_predicts() {
    check_world(2, 1);
    check_world(4, 1);
}

#[test]
fn the_plan_buckets_as_tl_parallel_does() {
    assert_eq!(BUCKET_BYTES, tl_parallel::DEFAULT_BUCKET_BYTES as u64);
}

#[test]
fn large_shapes_are_for_the_plan_only() {
    // `train` has no `--shape`, and the shapes are no presets.
    assert!(matches!(
        common::tinyllm(&["train", "--shape", "7b"]),
        Err(CliError::Usage(_))
    ));
    assert!(matches!(
        common::run_error(&["train", "--preset", "7b"]),
        TrainError::UnknownPreset { .. }
    ));
    // The plan takes them, and refuses what is not a shape or a stage, typed.
    assert!(matches!(
        common::run_error(&["plan", "--shape", "13b"]),
        TrainError::InvalidArgument { name: "shape", .. }
    ));
    assert!(matches!(
        common::run_error(&["plan", "--preset", "tiny", "--ranks", "2", "--zero", "4"]),
        TrainError::InvalidArgument { name: "zero", .. }
    ));
    assert!(matches!(
        common::run_error(&["plan", "--preset", "tiny", "--ranks", "0"]),
        TrainError::InvalidArgument { name: "ranks", .. }
    ));
    assert!(matches!(
        common::run_error(&["plan", "--preset", "tiny", "--ranks", "100000"]),
        TrainError::InvalidArgument { name: "ranks", .. }
    ));
}
