//! Gradient accumulation: the gradient of one big batch from several small ones.
//!
//! A batch of `N` rows split into micro-batches of `n_i` rows, each with mean loss `L_i`, has
//! loss `L = Σ_i (n_i/N)·L_i`, and by linearity `∇L = Σ_i (n_i/N)·∇L_i`. So backpropagating
//! `(n_i/N)·L_i` for each micro-batch in turn, letting the gradients add up in `.grad`,
//! gives exactly the big batch's gradient (up to the order of the float additions), while
//! only one micro-batch's graph exists at a time. Weighting by `1/k` instead is right only
//! when all micro-batches have the same size.

use tl_tensor::memory::{self, Stage};
use tl_tensor::nn::Module;
use tl_tensor::{Element, Tensor};

use crate::error::{PrecisionError, Result};
use crate::observer::{StepObserver, StepPhase};
use crate::scaler::DynamicLossScaler;

/// A micro-batch: something with a number of rows, the weight of its mean loss.
pub trait MicroBatch {
    /// The number of rows (examples, or sequences) the micro-batch's mean loss averages.
    fn rows(&self) -> usize;
}

/// Rows of a tensor: the length of its first axis (1 for a 0-dimensional tensor).
fn first_axis<E: Element>(tensor: &Tensor<E>) -> usize {
    tensor.shape().first().copied().unwrap_or(1)
}

impl<E: Element> MicroBatch for Tensor<E> {
    fn rows(&self) -> usize {
        first_axis(self)
    }
}

/// An `(input, target)` pair: the rows of the input.
impl<E: Element> MicroBatch for (Tensor<E>, Tensor<E>) {
    fn rows(&self) -> usize {
        first_axis(&self.0)
    }
}

/// Token sequences with their next-token targets: one row per sequence of the input.
impl<E: Element> MicroBatch for (Tensor<E>, Vec<usize>) {
    fn rows(&self) -> usize {
        first_axis(&self.0)
    }
}

impl<B: MicroBatch + ?Sized> MicroBatch for &B {
    fn rows(&self) -> usize {
        (**self).rows()
    }
}

/// Backpropagates every micro-batch's mean loss weighted by its share of the rows,
/// `n_i/N`, times the loss scale if a `scaler` is given, and returns the loss of the whole
/// batch `Σ_i (n_i/N)·L_i` (unscaled).
///
/// `loss_fn(model, micro_batch)` returns the micro-batch's mean loss, a one-element tensor.
/// Gradients add up into the parameters' `.grad` and are not zeroed here (the caller zeroes
/// them before the step). Each micro-batch's graph is consumed by its backward before the
/// next one is built.
///
/// # Errors
/// [`PrecisionError::NoMicroBatches`] for an empty slice and
/// [`PrecisionError::EmptyMicroBatch`] for a micro-batch of zero rows, both before any
/// backward.
///
/// # Panics
/// If a loss is not a one-element tensor that requires grad.
///
/// ```
/// use tl_precision::grad_accumulate;
/// use tl_tensor::losses::mse;
/// use tl_tensor::nn::{Linear, Module};
/// use tl_tensor::{Tensor, ndarray::arr2};
///
/// // One weight w = 1, y = w·x, target 2x: rows {1} and {2, 3, 4}.
/// let model = Linear::from_parts(Tensor::<f64>::param(arr2(&[[1.0]]).into_dyn()), None);
/// let batch = |xs: &[f64]| {
///     let x = Tensor::from_vec(xs.to_vec(), &[xs.len(), 1]).unwrap();
///     let target = x.mul_scalar(2.0);
///     (x, target)
/// };
/// let micro_batches = [batch(&[1.0]), batch(&[2.0, 3.0, 4.0])];
/// let loss = grad_accumulate(&model, &micro_batches, |m, (x, t)| mse(&m.forward(x), t), None)?;
/// assert_eq!(loss, 7.5); // (1 + 4 + 9 + 16)/4
/// assert_eq!(model.weight().grad().unwrap()[[0, 0]], -15.0); // 2·(−1 − 4 − 9 − 16)/4
/// # Ok::<(), tl_precision::PrecisionError>(())
/// ```
pub fn grad_accumulate<E, M, B, F>(
    model: &M,
    micro_batches: &[B],
    loss_fn: F,
    scaler: Option<&DynamicLossScaler>,
) -> Result<f64>
where
    E: Element,
    M: Module<E> + ?Sized,
    B: MicroBatch,
    F: FnMut(&M, &B) -> Tensor<E>,
{
    grad_accumulate_observed(model, micro_batches, loss_fn, scaler, &mut ())
}

/// The memory meter's label of a micro-batch's weighted (and scaled) loss.
pub const LOSS_LABEL: &str = "weighted loss";

/// [`grad_accumulate`] with each micro-batch's forward and backward run as a
/// [`StepPhase::Forward`] and a [`StepPhase::Backward`] of `observer`.
pub(crate) fn grad_accumulate_observed<E, M, B, F, S>(
    model: &M,
    micro_batches: &[B],
    mut loss_fn: F,
    scaler: Option<&DynamicLossScaler>,
    observer: &mut S,
) -> Result<f64>
where
    E: Element,
    M: Module<E> + ?Sized,
    B: MicroBatch,
    F: FnMut(&M, &B) -> Tensor<E>,
    S: StepObserver<E>,
{
    if micro_batches.is_empty() {
        return Err(PrecisionError::NoMicroBatches);
    }
    let rows: Vec<usize> = micro_batches.iter().map(MicroBatch::rows).collect();
    if let Some(index) = rows.iter().position(|&n| n == 0) {
        return Err(PrecisionError::EmptyMicroBatch { index });
    }
    let total_rows: usize = rows.iter().sum();
    let loss_scale = scaler.map_or(1.0, DynamicLossScaler::loss_scale);
    let mut batch_loss = 0.0;
    for (index, (micro_batch, &n)) in micro_batches.iter().zip(&rows).enumerate() {
        // On the memory meter, what this micro-batch makes is its own.
        let _micro_batch = memory::micro_batch_scope(Some(index));
        let (loss, weighted) = observer.phase(StepPhase::Forward { micro_batch: index }, |_| {
            let _forward = memory::stage_scope(Stage::Forward);
            let loss = loss_fn(model, micro_batch);
            let weight = n as f64 / total_rows as f64;
            batch_loss += weight * loss.item().to_f64();
            let _label = memory::label_scope(LOSS_LABEL);
            let weighted = loss.mul_scalar(E::from_f64(weight * loss_scale));
            (loss, weighted)
        });
        // Both losses are moved in and dropped there, the weighted one first, so that the
        // release of the graph belongs to the backward phase.
        observer.phase(StepPhase::Backward { micro_batch: index }, move |_| {
            let _backward = memory::stage_scope(Stage::Backward);
            weighted.backward();
            drop(weighted);
            drop(loss);
        });
    }
    Ok(batch_loss)
}
