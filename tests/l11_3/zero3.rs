//! ZeRO-3's gather and release around each unit, and around a checkpointed unit's rerun.

use std::sync::{Arc, Mutex};

use tl_collective::{Communicator, RingComm};
use tl_parallel::{DataParallel, UnitRunner, Zero3};
use tl_precision::Precision;
use tl_recompute::checkpoint;
use tl_tensor::losses::mse;
use tl_tensor::nn::{Linear, Module};
use tl_tensor::optim::AdamW;
use tl_tensor::{Tensor, no_grad};

use crate::common::{Batch, Data, Mlp, Spy, unit_loss, world};

/// The MLP's loss with its hidden layer checkpointed: its forward runs without a graph,
/// and reruns in backward.
fn checkpointed_loss(runner: &UnitRunner<f32>, model: &Mlp, (x, target): &Batch) -> Tensor<f32> {
    let params = model.hidden.parameters();
    let copy = Linear::from_parts(params[0].clone(), params.get(1).cloned());
    let rerunner = runner.clone();
    let hidden = checkpoint(
        move |xs| rerunner.run_unit(0, || copy.forward(&xs[0])),
        std::slice::from_ref(x),
        &params,
        &[],
    );
    mse(
        &runner.run_unit(1, || model.out.forward(&hidden.tanh())),
        target,
    )
}

/// What a rank saw: all-gathers of each step, whether every parameter was released after
/// each step, its weights at the end.
struct Seen {
    gathers: Vec<u64>,
    released: Vec<bool>,
    weights: Vec<f32>,
}

/// Three steps of ZeRO-3 on the MLP (a unit a layer) at N = 2, two micro-batches a rank,
/// the hidden layer checkpointed when `checkpointed`.
fn zero3_rank(comm: RingComm, checkpointed: bool) -> Seen {
    let (rank, n) = (comm.rank(), comm.world_size());
    let spy = Spy::new(comm);
    let gathers = Arc::clone(&spy.gathers);
    let count = |gathers: &Arc<Mutex<u64>>| *gathers.lock().unwrap();
    let ddp = DataParallel::new(Box::new(spy));
    let model = Mlp::new();
    let adamw = AdamW::new(model.parameters(), 1e-2).unwrap();
    let mut zero3 = Zero3::on(&ddp, model.units(), &adamw).unwrap();
    let released = |model: &Mlp| model.parameters().iter().all(Tensor::is_released);
    assert!(
        released(&model),
        "rank {rank}: a unit's values are there only while it runs"
    );

    // A forward without a graph gathers each unit once and releases it after.
    let runner = zero3.runner();
    let data = Data::fp32(8, 2);
    let before = count(&gathers);
    {
        let _no_grad = no_grad();
        let batch = data.rows(0, 0..2);
        unit_loss(&runner, &model, &batch);
    }
    assert_eq!(
        count(&gathers) - before,
        2,
        "rank {rank}: one gather a unit"
    );
    assert!(
        released(&model),
        "rank {rank}: a unit kept after its forward"
    );

    let mut seen = Seen {
        gathers: Vec::new(),
        released: Vec::new(),
        weights: Vec::new(),
    };
    for step in 0..3 {
        let batches = data.micro_batches(step, n, rank);
        let loss = |m: &Mlp, b: &Batch| match checkpointed {
            true => checkpointed_loss(&runner, m, b),
            false => unit_loss(&runner, m, b),
        };
        let before = count(&gathers);
        zero3
            .train_step(&model, &batches, 8, loss, Precision::Fp32, None, None)
            .unwrap();
        seen.gathers.push(count(&gathers) - before);
        seen.released.push(released(&model));
    }
    zero3.gather_full_parameters().unwrap();
    seen.weights = model.weights();
    seen
}

/// Each unit is gathered before its forward and released after it, gathered again before
/// its backward and released when its backward is done: per micro-batch two gathers a
/// unit, and nothing held between steps.
#[test]
fn test_zero3_releases_after_forward_and_backward() {
    for (rank, seen) in world(2, |comm| zero3_rank(comm, false)).iter().enumerate() {
        // 2 micro-batches × 2 units × (forward + backward).
        assert_eq!(seen.gathers, [8, 8, 8], "rank {rank}: gathers a step");
        assert_eq!(
            seen.released, [true; 3],
            "rank {rank}: released after each step"
        );
    }
}

/// A checkpointed unit gathers for its forward (no graph, released after) and again for
/// its rerun in backward, and keeps the values for the backward that follows at once: two
/// gathers a micro-batch, as a plain unit, not three. The training is the plain run's,
/// bit for bit.
#[test]
fn test_zero3_checkpointed_unit_gathers_for_its_rerun() {
    let plain = world(2, |comm| zero3_rank(comm, false));
    let checkpointed = world(2, |comm| zero3_rank(comm, true));
    for (rank, (seen, plain)) in checkpointed.iter().zip(&plain).enumerate() {
        assert_eq!(seen.gathers, [8, 8, 8], "rank {rank}: gathers a step");
        assert_eq!(
            seen.released, [true; 3],
            "rank {rank}: released after each step"
        );
        assert_eq!(
            seen.weights, plain.weights,
            "rank {rank}: not the plain run's bits"
        );
    }
}
