//! [`train_step_mixed`]: one optimizer step of mixed-precision training with gradient
//! accumulation, the loop body of the capstone trainer.

use serde::Serialize;
use tl_tensor::memory::{self, Stage};
use tl_tensor::nn::Module;
use tl_tensor::optim::{Optimizer, clip_grad_norm_reduced};
use tl_tensor::{Element, Tensor};

use crate::accumulate::{MicroBatch, grad_accumulate_observed};
use crate::cast::take_underflow_count;
use crate::error::{PrecisionError, Result};
use crate::observer::{StepObserver, StepPhase};
use crate::precision::Precision;
use crate::scaler::{DynamicLossScaler, grad_is_finite};

/// What one [`train_step_mixed`] did.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepReport {
    /// The loss of the whole batch (the row-weighted mean of the micro-batch losses),
    /// unscaled.
    pub loss: f64,
    /// Whether the update was skipped because the scaled gradients overflowed.
    pub skipped: bool,
    /// The loss scale after the step, when a scaler is used.
    pub scale: Option<f64>,
    /// The total 2-norm of the (unscaled) gradients before clipping, when clipping was
    /// asked for and the step was taken.
    pub grad_norm: Option<f64>,
    /// Gradient values the 16-bit casts of this step flushed to zero.
    pub underflows: u64,
}

/// One training step: zero the gradients, accumulate every micro-batch (see
/// [`grad_accumulate`]) under the autocast of `precision`, then update.
///
/// With a `scaler`, the losses are scaled and the scaler's [`step`](DynamicLossScaler::step)
/// checks, unscales, clips and steps (or skips). Without one, a non-finite loss or gradient
/// is an error returned before any parameter changes; otherwise the gradients are clipped to
/// `clip` if asked and the optimizer steps. The parameters checked, clipped and updated are
/// the optimizer's. [`train_step_mixed_observed`] is the same step with a
/// [`StepObserver`] between its phases.
///
/// # Errors
/// Those of [`grad_accumulate`] (no update happens); [`PrecisionError::NonFiniteLoss`] and
/// [`PrecisionError::NonFiniteGradient`] without a scaler; those of
/// [`DynamicLossScaler::step`]; an invalid `clip` as a [`PrecisionError::Tensor`] or
/// [`PrecisionError::InvalidScalerArgument`].
///
/// ```
/// use tl_precision::{Precision, train_step_mixed};
/// use tl_tensor::losses::mse;
/// use tl_tensor::nn::{Linear, Module};
/// use tl_tensor::optim::Sgd;
/// use tl_tensor::{Generator, Tensor};
///
/// let model = Linear::<f32>::new(4, 1, true, &Generator::new(0));
/// let mut opt = Sgd::new(model.parameters(), 0.1)?;
/// let x = Tensor::from_vec((0..24).map(|i| i as f32 / 24.0).collect(), &[6, 4])?;
/// let target = Tensor::ones(&[6, 1]);
/// // Micro-batches of 2 and 4 rows: the step sees the gradient of all 6.
/// let micro_batches = [
///     (x.narrow(0, 0, 2), target.narrow(0, 0, 2)),
///     (x.narrow(0, 2, 4), target.narrow(0, 2, 4)),
/// ];
/// let loss_fn = |m: &Linear<f32>, (x, t): &(Tensor<f32>, Tensor<f32>)| mse(&m.forward(x), t);
/// let first = train_step_mixed(&model, &micro_batches, loss_fn, &mut opt, Precision::Bf16, None, Some(1.0))?;
/// assert!(!first.skipped && first.grad_norm.is_some());
/// let second = train_step_mixed(&model, &micro_batches, loss_fn, &mut opt, Precision::Bf16, None, None)?;
/// assert!(second.loss < first.loss);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn train_step_mixed<E, M, B, F, O>(
    model: &M,
    micro_batches: &[B],
    loss_fn: F,
    opt: &mut O,
    precision: Precision,
    scaler: Option<&mut DynamicLossScaler>,
    clip: Option<f64>,
) -> Result<StepReport>
where
    E: Element,
    M: Module<E> + ?Sized,
    B: MicroBatch,
    F: FnMut(&M, &B) -> Tensor<E>,
    O: Optimizer<E> + ?Sized,
{
    train_step_mixed_observed(
        model,
        micro_batches,
        loss_fn,
        opt,
        precision,
        scaler,
        clip,
        &mut (),
    )
}

/// [`train_step_mixed`] with `observer` called around and between its phases (see
/// [`StepObserver`] for the order): the one training step, for callers that must see a
/// phase or change what happens between two of them. With `&mut ()` it is
/// `train_step_mixed`, bit for bit.
///
/// # Errors
/// As [`train_step_mixed`].
///
/// ```
/// use tl_precision::{Precision, StepObserver, train_step_mixed_observed};
/// use tl_tensor::losses::mse;
/// use tl_tensor::nn::{Linear, Module};
/// use tl_tensor::optim::Sgd;
/// use tl_tensor::{Generator, Tensor};
///
/// /// Halves the gradients before the update, as an average over two processes would.
/// struct Halve;
/// impl StepObserver<f32> for Halve {
///     fn gradients_ready(&mut self, params: &[Tensor<f32>]) {
///         params.iter().for_each(|p| p.update_grad(|g| g.mapv_inplace(|v| v / 2.0)));
///     }
/// }
///
/// let model = Linear::<f32>::new(2, 1, false, &Generator::new(0));
/// let mut opt = Sgd::new(model.parameters(), 0.1)?;
/// let batch = [(Tensor::from_vec(vec![1.0, 2.0], &[1, 2])?, Tensor::ones(&[1, 1]))];
/// let loss_fn = |m: &Linear<f32>, (x, t): &(Tensor<f32>, Tensor<f32>)| mse(&m.forward(x), t);
/// let report = train_step_mixed_observed(
///     &model, &batch, loss_fn, &mut opt, Precision::Fp32, None, Some(100.0), &mut Halve,
/// )?;
/// let grad = model.weight().grad().unwrap();
/// let norm = grad.iter().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>().sqrt();
/// assert_eq!(report.grad_norm, Some(norm)); // the norm of the halved gradient
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn train_step_mixed_observed<E, M, B, F, O, S>(
    model: &M,
    micro_batches: &[B],
    loss_fn: F,
    opt: &mut O,
    precision: Precision,
    scaler: Option<&mut DynamicLossScaler>,
    clip: Option<f64>,
    observer: &mut S,
) -> Result<StepReport>
where
    E: Element,
    M: Module<E> + ?Sized,
    B: MicroBatch,
    F: FnMut(&M, &B) -> Tensor<E>,
    O: Optimizer<E> + ?Sized,
    S: StepObserver<E>,
{
    observer.phase(StepPhase::ZeroGrad, |_| start_step(model, opt));
    let loss = {
        let _autocast = precision.autocast();
        grad_accumulate_observed(model, micro_batches, loss_fn, scaler.as_deref(), observer)?
    };
    finish_step_observed(opt, loss, scaler, clip, observer)
}

/// The start of a step: drops the model's and the optimizer's gradients, and the count of
/// underflows so far (the step's report counts its own). What [`train_step_mixed`] does
/// first, for a caller that accumulates the gradients its own way (a pipeline's stages).
pub fn start_step<E, M, O>(model: &M, opt: &mut O)
where
    E: Element,
    M: Module<E> + ?Sized,
    O: Optimizer<E> + ?Sized,
{
    model.zero_grad();
    opt.zero_grad();
    take_underflow_count();
}

/// The end of a step whose gradients are all in the parameters of `opt` (accumulated,
/// weighted and, with a `scaler`, scaled as [`grad_accumulate`](crate::grad_accumulate)
/// does): `observer`'s [`gradients_ready`](StepObserver::gradients_ready), then the checks,
/// the unscaling and clipping and the update, as the [`StepPhase::Update`] of `observer`.
/// `loss` is the batch's loss, reported. What [`train_step_mixed_observed`] does after its
/// micro-batches, for a caller that accumulates the gradients its own way.
///
/// # Errors
/// As [`train_step_mixed`]'s update.
pub fn finish_step_observed<E, O, S>(
    opt: &mut O,
    loss: f64,
    scaler: Option<&mut DynamicLossScaler>,
    clip: Option<f64>,
    observer: &mut S,
) -> Result<StepReport>
where
    E: Element,
    O: Optimizer<E> + ?Sized,
    S: StepObserver<E>,
{
    let params = opt.parameters().to_vec();
    observer.gradients_ready(&params);
    observer.phase(StepPhase::Update, |observer| {
        let _update = memory::stage_scope(Stage::Update);
        update(opt, &params, loss, scaler, clip, observer)
    })
}

/// The end of a step whose gradients are all there: check, unscale and clip, step.
fn update<E, O, S>(
    opt: &mut O,
    params: &[Tensor<E>],
    loss: f64,
    scaler: Option<&mut DynamicLossScaler>,
    clip: Option<f64>,
    observer: &mut S,
) -> Result<StepReport>
where
    E: Element,
    O: Optimizer<E> + ?Sized,
    S: StepObserver<E>,
{
    if let Some(scaler) = scaler {
        let outcome = scaler.step_observed(opt, params, clip, observer)?;
        return Ok(StepReport {
            loss,
            skipped: !outcome.stepped,
            scale: Some(outcome.scale),
            grad_norm: outcome.grad_norm,
            underflows: outcome.underflows,
        });
    }
    if !loss.is_finite() {
        return Err(PrecisionError::NonFiniteLoss { loss });
    }
    // Asked of the observer on this path too: when the processes hold shards of the
    // gradients, a non-finite value on one of them must stop every one of them.
    let non_finite = params.iter().position(|p| !grad_is_finite(p));
    if !observer.all_finite(non_finite.is_none()) {
        return Err(PrecisionError::NonFiniteGradient { index: non_finite });
    }
    let grad_norm = clip
        .map(|max_norm| {
            clip_grad_norm_reduced(params, max_norm, |local| observer.total_sum_squares(local))
        })
        .transpose()?;
    opt.step();
    Ok(StepReport {
        loss,
        skipped: false,
        scale: None,
        grad_norm,
        underflows: take_underflow_count(),
    })
}
