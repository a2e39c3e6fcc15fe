//! The stages on a world of one (`Single`), fast and deterministic, where the learner's
//! functions of L11.3 decide what a rank holds: ZeRO-1's shard of the weights, ZeRO-2's
//! full gradients dropped, ZeRO-3's gathers and releases around each unit, a checkpointed
//! unit's rerun among them. A world of one trains exactly as one process with AdamW: its
//! weight `n_r/B` is 1 and its collectives copy.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use common::{Batch, Config, Mlp, SEED, loss_fn, unit_forward, weights};
use tl_collective::{CommStats, Communicator, ReduceOp, Single, Slice, SliceMut};
use tl_parallel::{DataParallel, ShardedAdamW, UnitRunner, Zero2AdamW, Zero3};
use tl_precision::{Precision, train_step_mixed};
use tl_tensor::losses::mse;
use tl_tensor::nn::Module;
use tl_tensor::optim::AdamW;
use tl_tensor::{Tensor, no_grad};

const LR: f64 = 1e-2;
const STEPS: usize = 3;

/// Two micro-batches of 2 rows a step.
fn config() -> Config {
    Config {
        precision: Precision::Fp32,
        global_rows: 4,
        micro_batch_rows: 2,
        bucket_bytes: 64, // the MLP's 58 parameters in 4 buckets, parameters split across
        overflow: None,
    }
}

/// A world of one that counts its all-gathers where the test can read them.
struct Counted {
    inner: Single,
    gathers: Arc<AtomicU64>,
}

impl Communicator for Counted {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce(&mut self, data: SliceMut<'_>, op: ReduceOp) -> tl_collective::Result<()> {
        self.inner.all_reduce(data, op)
    }
    fn reduce_scatter(
        &mut self,
        input: Slice<'_>,
        output: SliceMut<'_>,
        op: ReduceOp,
    ) -> tl_collective::Result<()> {
        self.inner.reduce_scatter(input, output, op)
    }
    fn all_gather(&mut self, input: Slice<'_>, output: SliceMut<'_>) -> tl_collective::Result<()> {
        self.gathers.fetch_add(1, Ordering::Relaxed);
        self.inner.all_gather(input, output)
    }
    fn broadcast(&mut self, data: SliceMut<'_>, root: usize) -> tl_collective::Result<()> {
        self.inner.broadcast(data, root)
    }
    fn barrier(&mut self) -> tl_collective::Result<()> {
        self.inner.barrier()
    }
    fn stats(&self) -> CommStats {
        self.inner.stats()
    }
    fn split(&mut self, members: &[usize]) -> tl_collective::Result<Box<dyn Communicator>> {
        self.inner.split(members)
    }
}

/// One process with a plain AdamW: the weights after `STEPS` steps.
fn one_process() -> Vec<f64> {
    let config = config();
    let model = Mlp::<f32>::new(SEED);
    let mut opt = AdamW::new(model.parameters(), LR).unwrap();
    for step in 0..STEPS {
        let batches: Vec<Batch<f32>> = config.micro_batches(step, 1, 0);
        train_step_mixed(
            &model,
            &batches,
            loss_fn,
            &mut opt,
            Precision::Fp32,
            None,
            None,
        )
        .unwrap();
    }
    weights(&model)
}

/// The MLP with each layer a unit, the hidden one checkpointed when `checkpointed`.
fn unit_loss(
    runner: &UnitRunner<f32>,
    model: &Mlp<f32>,
    (x, target): &Batch<f32>,
    checkpointed: bool,
) -> Tensor<f32> {
    mse(&unit_forward(runner, model, x, checkpointed), target)
}

/// ZeRO-3 on a world of one: the gathers of each step, whether every unit was released
/// after it, and the weights at the end.
fn zero3_run(checkpointed: bool) -> (Vec<u64>, Vec<bool>, Vec<f64>) {
    let config = config();
    let gathers = Arc::new(AtomicU64::new(0));
    let comm = Counted {
        inner: Single::new(),
        gathers: Arc::clone(&gathers),
    };
    let model = Mlp::<f32>::new(SEED);
    let adamw = AdamW::new(model.parameters(), LR).unwrap();
    let units = vec![model.hidden.parameters(), model.out.parameters()];
    let mut zero3 = Zero3::new(Box::new(comm), units, &adamw).unwrap();
    let runner = zero3.runner();
    let released = |model: &Mlp<f32>| model.parameters().iter().all(Tensor::is_released);
    let (mut per_step, mut after) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let batches: Vec<Batch<f32>> = config.micro_batches(step, 1, 0);
        let before = gathers.load(Ordering::Relaxed);
        let loss = |m: &Mlp<f32>, b: &Batch<f32>| unit_loss(&runner, m, b, checkpointed);
        zero3
            .train_step(
                &model,
                &batches,
                config.global_rows,
                loss,
                Precision::Fp32,
                None,
                None,
            )
            .unwrap();
        per_step.push(gathers.load(Ordering::Relaxed) - before);
        after.push(released(&model));
    }
    zero3.gather_full_parameters().unwrap();
    (per_step, after, weights(&model))
}

#[test]
fn zero3_gathers_a_unit_around_its_forward_and_again_for_its_backward() {
    let (gathers, released, _) = zero3_run(false);
    // 2 micro-batches × 2 units × (forward + backward).
    assert_eq!(gathers, [8; STEPS]);
    assert_eq!(released, [true; STEPS], "a unit kept after its backward");
}

#[test]
fn zero3_a_forward_without_a_graph_gathers_and_releases_each_unit_once() {
    let gathers = Arc::new(AtomicU64::new(0));
    let comm = Counted {
        inner: Single::new(),
        gathers: Arc::clone(&gathers),
    };
    let model = Mlp::<f32>::new(SEED);
    let adamw = AdamW::new(model.parameters(), LR).unwrap();
    let units = vec![model.hidden.parameters(), model.out.parameters()];
    let zero3 = Zero3::new(Box::new(comm), units, &adamw).unwrap();
    let batch = config().rows::<f32>(0, 0..2);
    for round in 1..=2 {
        let _no_grad = no_grad();
        unit_loss(&zero3.runner(), &model, &batch, false);
        assert_eq!(gathers.load(Ordering::Relaxed), 2 * round);
        assert!(
            model.parameters().iter().all(Tensor::is_released),
            "a unit kept after its forward"
        );
    }
}

#[test]
fn zero3_a_checkpointed_unit_keeps_what_its_rerun_gathered_for_its_backward() {
    let (gathers, released, checkpointed) = zero3_run(true);
    // The checkpointed unit: its forward and its rerun; the backward finds the values.
    assert_eq!(gathers, [8; STEPS]);
    assert_eq!(released, [true; STEPS]);
    let (_, _, plain) = zero3_run(false);
    assert_eq!(checkpointed, plain);
}

#[test]
fn zero3_on_one_rank_trains_as_one_process() {
    assert_eq!(zero3_run(false).2, one_process());
}

#[test]
fn zero1_on_one_rank_trains_as_one_process() {
    let config = config();
    let ddp_model = Mlp::<f32>::new(SEED);
    let mut ddp = DataParallel::new(Box::new(Single::new())).with_bucket_bytes(config.bucket_bytes);
    let mut opt = ShardedAdamW::new(&ddp, AdamW::new(ddp_model.parameters(), LR).unwrap()).unwrap();
    for step in 0..STEPS {
        let batches: Vec<Batch<f32>> = config.micro_batches(step, 1, 0);
        ddp.train_step(
            &ddp_model,
            &batches,
            config.global_rows,
            loss_fn,
            &mut opt,
            Precision::Fp32,
            None,
            None,
        )
        .unwrap();
    }
    assert_eq!(weights(&ddp_model), one_process());
}

#[test]
fn zero2_on_one_rank_trains_as_one_process_and_keeps_no_full_gradient() {
    let config = config();
    let model = Mlp::<f32>::new(SEED);
    let mut ddp = DataParallel::new(Box::new(Single::new())).with_bucket_bytes(config.bucket_bytes);
    let mut opt = Zero2AdamW::new(&mut ddp, AdamW::new(model.parameters(), LR).unwrap()).unwrap();
    for step in 0..STEPS {
        let batches: Vec<Batch<f32>> = config.micro_batches(step, 1, 0);
        ddp.train_step(
            &model,
            &batches,
            config.global_rows,
            loss_fn,
            &mut opt,
            Precision::Fp32,
            None,
            None,
        )
        .unwrap();
        let kept: Vec<bool> = model
            .parameters()
            .iter()
            .map(|p| p.grad().is_some())
            .collect();
        assert!(
            kept.iter().all(|k| !k),
            "step {step}: full gradients kept {kept:?}"
        );
    }
    assert_eq!(weights(&model), one_process());
}
