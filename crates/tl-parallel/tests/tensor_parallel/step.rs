//! A data-parallel step beside a tensor-parallel group ([`DataParallel::with_tensor_parallel`]):
//! its decisions span the group. The model: each rank holds columns of `W` (split) and the
//! whole `b` (replicated); the loss is `Σ (x·W)² + Σ b²`, the columns' sums added over the
//! group by a reduce-from, so every rank has the whole loss and its own slice's gradient.

use std::slice::from_ref;

use tl_collective::{Communicator, RingComm, Single};
use tl_parallel::{DataParallel, TensorParallel};
use tl_precision::{DynamicLossScaler, Precision};
use tl_tensor::Tensor;
use tl_tensor::ndarray::{ArrayD, IxDyn, s};
use tl_tensor::nn::Module;
use tl_tensor::optim::Sgd;

use super::common::world;
use super::matrix;

const ROWS: usize = 3;
const IN: usize = 4;
const COLUMNS: usize = 8;

/// A rank's part: its columns of `W`, the whole `b`.
struct Part {
    w: Tensor<f32>,
    b: Tensor<f32>,
}

impl Module<f32> for Part {
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        x.matmul(&self.w)
    }
    fn parameters(&self) -> Vec<Tensor<f32>> {
        vec![self.w.clone(), self.b.clone()]
    }
}

fn whole_w(scale_columns_from: usize, scale: f64) -> ArrayD<f32> {
    matrix(0..IN, COLUMNS, |r, c| {
        let v = ((r * 5 + c * 3) as f64 * 0.41).cos() * 0.5;
        if c >= scale_columns_from {
            v * scale
        } else {
            v
        }
    })
}

fn x() -> Tensor<f32> {
    Tensor::from_array(matrix(0..ROWS, IN, |r, c| ((r * 7 + c) as f64 * 0.3).sin()))
}

/// One step on rank `comm.rank()` of a group of `t`: the report and the weights after.
fn step(
    comm: RingComm,
    w: &ArrayD<f32>,
    precision: Precision,
    scaler: Option<DynamicLossScaler>,
    clip: Option<f64>,
) -> (tl_precision::StepReport, Vec<f32>) {
    let tp = TensorParallel::new(Box::new(comm));
    let columns = tp.split("columns", COLUMNS).unwrap();
    let part = Part {
        w: Tensor::param(w.slice(s![.., columns]).to_owned().into_dyn()),
        b: Tensor::param(ArrayD::from_elem(IxDyn(&[2]), 0.5)),
    };
    let mut ddp = DataParallel::new(Box::new(Single::new()))
        .with_tensor_parallel(tp.clone(), vec![false, true]);
    let mut opt = Sgd::new(part.parameters(), 0.1).unwrap();
    let mut scaler = scaler;
    let loss = |m: &Part, x: &Tensor<f32>| {
        let y = m.forward(x);
        let columns = tp.reduce_from(&y.mul(&y).sum_all()).unwrap();
        columns.add(&m.b.mul(&m.b).sum_all())
    };
    let report = ddp
        .train_step(
            &part,
            from_ref(&x()),
            ROWS,
            loss,
            &mut opt,
            precision,
            scaler.as_mut(),
            clip,
        )
        .unwrap();
    let after = part.w.to_vec().into_iter().chain(part.b.to_vec()).collect();
    (report, after)
}

/// The whole model's gradient norm: `‖2·xᵀ(x·W)‖` and `‖2b‖` together.
fn whole_norm(w: &ArrayD<f32>) -> f64 {
    let x = x();
    let w = Tensor::param(w.clone());
    let b = Tensor::param(ArrayD::from_elem(IxDyn(&[2]), 0.5f32));
    let y = x.matmul(&w);
    y.mul(&y).sum_all().add(&b.mul(&b).sum_all()).backward();
    let squares = |t: &Tensor<f32>| -> f64 {
        t.grad()
            .unwrap()
            .iter()
            .map(|&g| f64::from(g) * f64::from(g))
            .sum()
    };
    (squares(&w) + squares(&b)).sqrt()
}

#[test]
fn the_clip_norm_is_the_whole_models_with_the_replicated_parameters_counted_once() {
    let w = whole_w(COLUMNS, 1.0);
    let expected = whole_norm(&w);
    for t in [2, 4] {
        let runs = world(t, |comm| step(comm, &w, Precision::Fp32, None, Some(1e-3)));
        for (rank, (report, _)) in runs.iter().enumerate() {
            let norm = report.grad_norm.expect("clipping was asked for");
            // f64 sums of f32 squares in another order: a few ulps of f64 at most.
            assert!(
                (norm - expected).abs() <= 1e-12 * expected,
                "t {t} rank {rank}: {norm} vs the whole model's {expected}"
            );
        }
    }
}

#[test]
fn an_overflow_on_one_rank_of_the_group_skips_the_step_on_every_rank() {
    // Rank 1's columns (4..8 of 8) are 2000 times larger: under a loss scale of 2^15 their
    // fp16 gradients overflow, rank 0's do not.
    let w = whole_w(COLUMNS / 2, 2000.0);
    let runs = world(2, |comm| {
        let scaler = DynamicLossScaler::new(32768.0, 2.0, 0.5, 2000).unwrap();
        step(comm, &w, Precision::Fp16, Some(scaler), None)
    });
    for (rank, (report, after)) in runs.iter().enumerate() {
        assert!(
            report.skipped,
            "rank {rank} stepped on another rank's overflow"
        );
        assert_eq!(
            report.scale,
            Some(16384.0),
            "rank {rank}: the scale halves everywhere"
        );
        let columns = rank * COLUMNS / 2..(rank + 1) * COLUMNS / 2;
        let before: Vec<f32> = w
            .slice(s![.., columns])
            .iter()
            .copied()
            .chain([0.5, 0.5])
            .collect();
        assert_eq!(
            after, &before,
            "rank {rank}: a skipped step changes no weight"
        );
    }
}

/// Under sequence parallelism each rank trains the whole `b` on its own rows only: here
/// rank `r`'s share of the loss is `(r + 1)·Σ b²`, summed over the group by a reduce-from
/// (identity backward), so rank `r`'s gradient is `2(r + 1)·b`, a share of the whole
/// `2·Σ_r (r + 1)·b`. [`DataParallel::with_sequence_parallel`] sums the shares before the
/// step: every rank takes the whole model's step and the clip norm counts `b` once.
#[test]
fn the_shares_of_a_replicated_gradient_are_summed_over_the_group_before_the_step() {
    for t in [2, 4] {
        let runs = world(t, |comm| {
            let rank = comm.rank();
            let tp = TensorParallel::new(Box::new(comm));
            let before = tp.stats().collectives;
            let b = Tensor::<f32>::param(ArrayD::from_elem(IxDyn(&[2]), 0.5));
            let part = Part {
                w: Tensor::param(ArrayD::from_elem(IxDyn(&[IN, 1]), 0.0)),
                b: b.clone(),
            };
            let mut ddp = DataParallel::new(Box::new(Single::new()))
                .with_tensor_parallel(tp.clone(), vec![false, true])
                .with_sequence_parallel(vec![false, true]);
            let mut opt = Sgd::new(part.parameters(), 0.1).unwrap();
            let loss = |m: &Part, _: &Tensor<f32>| {
                let share = m.b.mul(&m.b).sum_all().mul_scalar((rank + 1) as f32);
                tp.reduce_from(&share).unwrap()
            };
            let report = ddp
                .train_step(
                    &part,
                    from_ref(&x()),
                    ROWS,
                    loss,
                    &mut opt,
                    Precision::Fp32,
                    None,
                    Some(1e3),
                )
                .unwrap();
            (report, b.to_vec(), tp.stats().collectives - before)
        });
        // The whole gradient 2·0.5·Σ_r (r + 1) = t(t + 1)/2, the same on every rank: one
        // step of 0.1 along it, and its norm √2 times that, counted once.
        let whole = (t * (t + 1) / 2) as f32;
        for (rank, (report, b, collectives)) in runs.iter().enumerate() {
            assert_eq!(b, &[0.5 - 0.1 * whole; 2], "t {t} rank {rank}");
            let norm = report.grad_norm.unwrap();
            let expected = f64::from(whole) * 2f64.sqrt();
            assert!(
                (norm - expected).abs() < 1e-6 * expected,
                "t {t} rank {rank}: {norm}"
            );
            // The loss's reduce-from, the shares' sum, the overflow flag, the clip norm.
            assert_eq!(*collectives, 4, "t {t} rank {rank}");
        }
    }
}
