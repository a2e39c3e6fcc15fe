//! DDP: the weighted sum of the ranks' gradients, the reduction after the last backward
//! only, the global overflow decision, and equality with one process.

use tl_collective::{Communicator, RingComm};
use tl_parallel::{DataParallel, Zero3};
use tl_precision::{DynamicLossScaler, Precision, StepObserver};
use tl_tensor::Tensor;
use tl_tensor::losses::mse;
use tl_tensor::ndarray::{arr1, arr2};
use tl_tensor::nn::{Linear, Module};
use tl_tensor::optim::AdamW;

use crate::common::{
    Data, Run, Stage, assert_ranks_agree, max_relative, one_process, train, world,
};

/// Rank `rank` of the chapter's two ranks: one weight, gradient 2 on 3 rows (rank 0) or 4
/// on 1 row (rank 1); the reduced gradient.
fn weighted_sum(comm: RingComm) -> f64 {
    let rank = comm.rank();
    let mut ddp = DataParallel::new(Box::new(comm));
    let w = Tensor::<f64>::param(arr1(&[1.0]).into_dyn());
    let (gradient, rows) = [(2.0, 3), (4.0, 1)][rank];
    w.set_grad(Some(arr1(&[gradient]).into_dyn()));
    ddp.begin_step(rows, 4).unwrap();
    StepObserver::gradients_ready(&mut ddp, std::slice::from_ref(&w));
    assert!(ddp.take_error().is_none());
    w.grad().unwrap()[0]
}

#[test]
fn test_hand_example_weights() {
    // B = 4: 3/4 · 2 + 1/4 · 4 = 2.5, the gradient of the mean over the 4 rows, on both
    // ranks. Weighting by 1/N would give 3; by n_r/B and again by 1/N, 1.25; not at all, 6.
    assert_eq!(world(2, weighted_sum), [2.5, 2.5]);
}

/// One step of the chapter's overflow on rank `rank` of two, under DDP or ZeRO-3: a linear
/// model `y = x·w` with `w = (0.5, 0.5)`, a loss scale of 1024; rank 1's row is
/// `(1e30, 0)`, so its gradient is `(inf, 0)` once scaled. Returns (skipped, scale after,
/// weights after, ranks that flagged an inf).
fn overflow_step(comm: RingComm, zero3: bool) -> (bool, f64, Vec<f32>, Option<u64>) {
    let rank = comm.rank();
    let model = Linear::from_parts(Tensor::<f32>::param(arr2(&[[0.5], [0.5]]).into_dyn()), None);
    let x = [[1.0, 1.0], [1e30, 0.0]][rank];
    let batch = (
        Tensor::from_vec(x.to_vec(), &[1, 2]).unwrap(),
        Tensor::<f32>::zeros(&[1, 1]),
    );
    let mut scaler = DynamicLossScaler::new(1024.0, 2.0, 0.5, 1000).unwrap();
    let mut adamw = AdamW::new(model.parameters(), 0.1).unwrap();
    let mut ddp = DataParallel::new(Box::new(comm));
    let (report, flagged) = if zero3 {
        let mut zero3 = Zero3::on(&ddp, vec![model.parameters()], &adamw).unwrap();
        let runner = zero3.runner();
        let loss = |m: &Linear<f32>, (x, t): &(Tensor<f32>, Tensor<f32>)| {
            mse(&runner.run_unit(0, || m.forward(x)), t)
        };
        let report = zero3.train_step(
            &model,
            &[batch],
            2,
            loss,
            Precision::Fp32,
            Some(&mut scaler),
            None,
        );
        zero3.gather_full_parameters().unwrap();
        (report.unwrap(), None)
    } else {
        let loss = |m: &Linear<f32>, (x, t): &(Tensor<f32>, Tensor<f32>)| mse(&m.forward(x), t);
        let report = ddp.train_step(
            &model,
            &[batch],
            2,
            loss,
            &mut adamw,
            Precision::Fp32,
            Some(&mut scaler),
            None,
        );
        (report.unwrap(), ddp.summary().map(|s| s.nonfinite_ranks))
    };
    (
        report.skipped,
        scaler.loss_scale(),
        model.weight().to_vec(),
        flagged,
    )
}

#[test]
fn test_hand_example_overflow() {
    for zero3 in [false, true] {
        let ranks = world(2, |comm| overflow_step(comm, zero3));
        for (rank, (skipped, scale, weights, flagged)) in ranks.iter().enumerate() {
            let what = format!("{}, rank {rank}", if zero3 { "ZeRO-3" } else { "DDP" });
            // The flags sum to 1: both ranks skip and halve the scale to 512.
            assert!(skipped, "{what}: stepped");
            assert_eq!(*scale, 512.0, "{what}");
            assert_eq!(*weights, [0.5, 0.5], "{what}: a weight moved");
            if !zero3 {
                assert_eq!(*flagged, Some(1), "{what}: ranks that flagged an inf");
            }
        }
    }
}

/// Three micro-batches per rank: the spy's counters, read by the loss function as each
/// micro-batch starts, show no collective before the last micro-batch's backward, with
/// the reduction after backward or overlapping it. DDP reduces its 4 buckets in one
/// all-reduce each, the loss, the overflow flag and the underflows riding in the last.
#[test]
fn test_no_collective_before_the_last_backward() {
    let data = Data::fp32(12, 2); // 6 rows a rank at N = 2
    for (stage, overlap) in [
        (Stage::Ddp, false),
        (Stage::Ddp, true),
        (Stage::Zero1, false),
        (Stage::Zero2, false),
        (Stage::Zero2, true),
    ] {
        let run = Run {
            overlap,
            ..Run::new(stage, 2, data)
        };
        let outcomes = train(run);
        for (rank, outcome) in outcomes.iter().enumerate() {
            let what = format!("{stage:?}, overlap {overlap}, rank {rank}");
            assert_eq!(
                outcome.mid_step, 0,
                "{what}: collectives during earlier micro-batches"
            );
            if stage == Stage::Ddp {
                assert_eq!(outcome.collectives, 4, "{what}: one all-reduce a bucket");
            }
        }
        assert_ranks_agree(&outcomes, &format!("{stage:?}"));
    }
}

#[test]
fn test_ddp_equals_one_process() {
    // N = 2, one micro-batch of 4 rows per rank: the weights 1/2 are exact and a sum of two
    // numbers does not depend on its order, so DDP is one process bit for bit.
    let data = Data::fp32(8, 4);
    let (weights, reports) = one_process(data, 3, Some(100.0));
    let outcomes = train(Run {
        clip: Some(100.0),
        ..Run::new(Stage::Ddp, 2, data)
    });
    for outcome in &outcomes {
        assert_eq!(
            outcome.weights, weights,
            "N = 2 is not one process bit for bit"
        );
        for (got, want) in outcome.reports.iter().zip(&reports) {
            assert_eq!(got.grad_norm, want.grad_norm);
        }
    }

    // N = 3, 11 rows (4, 4 and 3), micro-batches of 2: the ring adds in another order than
    // one process's accumulation, so they agree to rounding.
    let data = Data::fp32(11, 2);
    let (weights, reports) = one_process(data, 3, Some(100.0));
    let outcomes = train(Run {
        clip: Some(100.0),
        ..Run::new(Stage::Ddp, 3, data)
    });
    assert_ranks_agree(&outcomes, "N = 3");
    for outcome in &outcomes {
        let relative = max_relative(&outcome.weights, &weights);
        assert!(relative < 1e-6, "N = 3: weights differ by {relative:e}");
        for (got, want) in outcome.reports.iter().zip(&reports) {
            assert!(
                (got.loss - want.loss).abs() <= 1e-6 * want.loss.abs(),
                "{got:?} {want:?}"
            );
            let (g, w) = (got.grad_norm.unwrap(), want.grad_norm.unwrap());
            assert!((g - w).abs() <= 1e-6 * w, "gradient norm {g} against {w}");
        }
    }
}
