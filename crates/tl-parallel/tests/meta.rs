//! Every stage on meta tensors (`tl_tensor::meta_mode`) over a `Phantom`, rank by rank,
//! against the same ranks training for real over the ring: the same meter events, in order,
//! with their bytes and tags, and the same collectives and bytes sent.

mod common;

use common::{Batch, Config, Mlp, SEED, loss_fn, unit_forward as forward, world};
use tl_collective::{CommStats, Communicator, Phantom};
use tl_parallel::{DataParallel, ShardedAdamW, Zero2AdamW, Zero3, ZeroStage};
use tl_precision::Precision;
use tl_tensor::memory::{self, Event};
use tl_tensor::meta_mode;
use tl_tensor::nn::Module;
use tl_tensor::optim::{AdamW, Optimizer};

const STEPS: usize = 2;

/// `STEPS` steps of `stage` on `comm`'s rank, every tensor meta when `meta`: the meter's
/// events from before the model exists to after it is gone, and what `comm` counted.
fn rank(
    comm: Box<dyn Communicator>,
    config: &Config,
    stage: ZeroStage,
    recompute: bool,
    meta: bool,
) -> (Vec<Event>, CommStats) {
    let _meta = meta.then(meta_mode);
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let (stats, events) = memory::record(|| {
        let model = Mlp::<f32>::new(SEED);
        let adamw = AdamW::new(model.parameters(), 1e-2).unwrap();
        let mut ddp = DataParallel::new(comm).with_bucket_bytes(config.bucket_bytes);
        ddp.broadcast_parameters(&model.parameters()).unwrap();
        let mut zero3 = (stage == ZeroStage::Parameters).then(|| {
            let units = vec![model.hidden.parameters(), model.out.parameters()];
            Zero3::on(&ddp, units, &adamw).unwrap()
        });
        let mut opt: Box<dyn Optimizer<f32>> = match stage {
            ZeroStage::Ddp | ZeroStage::Parameters => Box::new(adamw),
            ZeroStage::Optimizer => Box::new(ShardedAdamW::new(&ddp, adamw).unwrap()),
            ZeroStage::Gradients => Box::new(Zero2AdamW::new(&mut ddp, adamw).unwrap()),
        };
        for step in 0..STEPS {
            let batches: Vec<Batch<f32>> = config.micro_batches(step, world_size, rank);
            let report = match &mut zero3 {
                Some(zero3) => {
                    let runner = zero3.runner();
                    let loss = |m: &Mlp<f32>, (x, t): &Batch<f32>| {
                        tl_tensor::losses::mse(&forward(&runner, m, x, recompute), t)
                    };
                    let (global, precision) = (config.global_rows, config.precision);
                    zero3.train_step(&model, &batches, global, loss, precision, None, None)
                }
                None => ddp.train_step(
                    &model,
                    &batches,
                    config.global_rows,
                    loss_fn,
                    opt.as_mut(),
                    config.precision,
                    None,
                    Some(1.0),
                ),
            };
            assert!(!report.unwrap().skipped);
            // As the trainer ends a step.
            match &zero3 {
                Some(zero3) => zero3.zero_grad(),
                None => opt.zero_grad(),
            }
        }
        ddp.stats()
    });
    (events, stats)
}

fn assert_meta_is_real(config: &Config, world_size: usize, stage: ZeroStage, recompute: bool) {
    let real = world(world_size, |comm| {
        rank(Box::new(comm), config, stage, recompute, false)
    });
    for (r, (real_events, real_stats)) in real.iter().enumerate() {
        let (meta_events, meta_stats) = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let phantom = Phantom::new(r, world_size).unwrap();
                    rank(Box::new(phantom), config, stage, recompute, true)
                })
                .join()
                .unwrap()
        });
        let what = format!("stage {stage}, rank {r} of {world_size}, recompute {recompute}");
        let first = meta_events
            .iter()
            .zip(real_events)
            .position(|(m, r)| m != r);
        assert_eq!(
            (first, meta_events.len()),
            (None, real_events.len()),
            "{what}: first differing event, then the counts"
        );
        assert_eq!(meta_stats, *real_stats, "{what}: communication");
    }
}

fn config(precision: Precision, bucket_bytes: usize) -> Config {
    Config {
        precision,
        global_rows: 11,
        micro_batch_rows: 2,
        bucket_bytes,
        overflow: None,
    }
}

#[test]
fn every_stage_runs_on_meta_tensors_as_on_real_ones() {
    // 11 rows over 3 ranks: unequal shares (4, 4, 3) of micro-batches of 2 rows.
    for stage in ZeroStage::ALL {
        assert_meta_is_real(&config(Precision::Fp32, 64), 3, stage, false);
    }
    assert_meta_is_real(
        &config(Precision::Bf16, 1 << 20),
        2,
        ZeroStage::Gradients,
        false,
    );
}

#[test]
fn a_checkpointed_zero3_unit_gathers_on_meta_tensors_as_on_real_ones() {
    for precision in [Precision::Fp32, Precision::Bf16] {
        assert_meta_is_real(&config(precision, 64), 2, ZeroStage::Parameters, true);
    }
}
