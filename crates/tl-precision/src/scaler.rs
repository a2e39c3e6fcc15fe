//! [`DynamicLossScaler`]: keeps fp16 gradients in range by scaling the loss.
//!
//! Backprop is linear in the upstream gradient, so backpropagating `S·L` gives `S·∇L`:
//! small gradients that would flush to zero in fp16 are lifted into its range, and dividing
//! the f32 master gradients by `S` before the update undoes it exactly when `S` is a power of
//! two. The scale is found by detection, not prediction: a step whose gradients overflowed is
//! skipped and `S` multiplied by the backoff factor; after `interval` consecutive good steps
//! `S` is multiplied by the growth factor to probe upward again.

use serde::Serialize;
use tl_tensor::kernels::finite::array_all_finite;
use tl_tensor::optim::{Optimizer, grad_sum_squares, scale_grads};
use tl_tensor::{Element, Tensor};

use crate::cast::take_underflow_count;
use crate::error::{PrecisionError, Result};
use crate::observer::StepObserver;

/// A dynamic loss scale for fp16 training, with the state machine of `torch.amp.GradScaler`
/// plus an optional floor and ceiling and underflow telemetry.
///
/// ```
/// use tl_precision::DynamicLossScaler;
/// use tl_tensor::optim::{Optimizer, Sgd};
/// use tl_tensor::{Tensor, ndarray::arr1};
///
/// let w = Tensor::<f32>::param(arr1(&[0.0]).into_dyn());
/// let mut opt = Sgd::new(vec![w.clone()], 0.5)?;
/// let mut scaler = DynamicLossScaler::new(8.0, 2.0, 0.5, 2)?;
///
/// // L = 3w, dL/dw = 3: backward from 8·L gives 24, unscaled to 3 before the update.
/// scaler.scale(&(&w * 3.0).sum_all()).backward();
/// assert_eq!(w.grad().unwrap()[[0]], 24.0);
/// let outcome = scaler.step(&mut opt, &[w.clone()], None)?;
/// assert!(outcome.stepped);
/// assert_eq!(w.to_vec(), vec![-1.5]); // 0 − 0.5·3
///
/// // An overflow: the step is skipped, the gradient dropped and the scale halved.
/// w.set_grad(Some(arr1(&[f32::INFINITY]).into_dyn()));
/// let outcome = scaler.step(&mut opt, &[w.clone()], None)?;
/// assert!(!outcome.stepped);
/// assert_eq!((outcome.scale, w.to_vec(), w.grad()), (4.0, vec![-1.5], None));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicLossScaler {
    pub(crate) scale: f64,
    pub(crate) growth: f64,
    pub(crate) backoff: f64,
    pub(crate) interval: u32,
    /// Consecutive good steps since the last overflow or growth.
    pub(crate) good_steps: u32,
    pub(crate) floor: Option<f64>,
    pub(crate) ceiling: Option<f64>,
    /// How many consecutive overflows at the floor make [`step`](Self::step) give up.
    pub(crate) floor_patience: u32,
    /// Consecutive overflowing steps taken at the floor scale.
    pub(crate) skips_at_floor: u32,
}

/// What one [`DynamicLossScaler::step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepOutcome {
    /// Whether the optimizer stepped (`false`: the gradients overflowed and were dropped).
    pub stepped: bool,
    /// The loss scale after the step (halved after an overflow, grown after an interval).
    pub scale: f64,
    /// The total 2-norm of the unscaled gradients before clipping, when a clip was asked
    /// for and the step was taken.
    pub grad_norm: Option<f64>,
    /// Gradient values flushed to zero by the casts of this thread since the previous step:
    /// a steady nonzero count under fp16 means the scale is too small.
    pub underflows: u64,
}

pub(crate) fn invalid(name: &'static str, value: f64, reason: &'static str) -> PrecisionError {
    PrecisionError::InvalidScalerArgument {
        name,
        value: value.to_string(),
        reason: reason.into(),
    }
}

impl Default for DynamicLossScaler {
    /// `S = 2^16`, growth 2, backoff 1/2, interval 2000 (PyTorch's defaults); no floor or
    /// ceiling.
    fn default() -> Self {
        Self::new(65536.0, 2.0, 0.5, 2000).expect("the defaults are valid")
    }
}

impl DynamicLossScaler {
    /// A scaler starting at scale `init`, multiplying it by `growth` after `interval`
    /// consecutive good steps and by `backoff` after each overflow.
    ///
    /// Powers of two keep scaling and unscaling exact.
    ///
    /// # Errors
    /// [`PrecisionError::InvalidScalerArgument`] if `init` is not positive and finite,
    /// `growth` not finite and above 1, `backoff` not strictly between 0 and 1, or
    /// `interval` is 0.
    pub fn new(init: f64, growth: f64, backoff: f64, interval: u32) -> Result<Self> {
        if !(init.is_finite() && init > 0.0) {
            return Err(invalid("init", init, "must be positive and finite"));
        }
        if !(growth.is_finite() && growth > 1.0) {
            return Err(invalid("growth", growth, "must be finite and above 1"));
        }
        if !(backoff > 0.0 && backoff < 1.0) {
            return Err(invalid(
                "backoff",
                backoff,
                "must lie strictly between 0 and 1",
            ));
        }
        if interval == 0 {
            return Err(invalid("interval", 0.0, "must be at least 1"));
        }
        Ok(Self {
            scale: init,
            growth,
            backoff,
            interval,
            good_steps: 0,
            floor: None,
            ceiling: None,
            floor_patience: u32::MAX,
            skips_at_floor: 0,
        })
    }

    /// Keeps the scale at or above `floor`, and makes [`step`](Self::step) fail with
    /// [`PrecisionError::ScaleStuckAtFloor`] after `patience` consecutive overflowing steps
    /// at the floor — a run that would otherwise skip every step from then on.
    ///
    /// # Errors
    /// [`PrecisionError::InvalidScalerArgument`] if `floor` is not positive and finite, lies
    /// above the current scale, or `patience` is 0. (The scale always lies between the floor
    /// and the ceiling, so a floor at most the scale is also at most any ceiling.)
    pub fn with_floor(mut self, floor: f64, patience: u32) -> Result<Self> {
        if !(floor.is_finite() && floor > 0.0 && floor <= self.scale) {
            return Err(invalid(
                "floor",
                floor,
                "must be positive, finite and at most the scale",
            ));
        }
        if patience == 0 {
            return Err(invalid("patience", 0.0, "must be at least 1"));
        }
        (self.floor, self.floor_patience) = (Some(floor), patience);
        Ok(self)
    }

    /// Keeps the scale at or below `ceiling` when it grows.
    ///
    /// # Errors
    /// [`PrecisionError::InvalidScalerArgument`] if `ceiling` is not finite or lies below
    /// the current scale (and so below any floor, which is at most the scale).
    pub fn with_ceiling(mut self, ceiling: f64) -> Result<Self> {
        if !(ceiling.is_finite() && ceiling >= self.scale) {
            return Err(invalid(
                "ceiling",
                ceiling,
                "must be finite and at least the scale",
            ));
        }
        self.ceiling = Some(ceiling);
        Ok(self)
    }

    /// The current loss scale `S`.
    pub fn loss_scale(&self) -> f64 {
        self.scale
    }

    /// Consecutive good steps since the last overflow or growth.
    pub fn good_steps(&self) -> u32 {
        self.good_steps
    }

    /// `S · loss`: backpropagate this instead of the loss.
    pub fn scale<E: Element>(&self, loss: &Tensor<E>) -> Tensor<E> {
        loss.mul_scalar(E::from_f64(self.scale))
    }

    /// Finishes a step whose backward started from [`scale`](Self::scale)`(loss)`.
    ///
    /// If any gradient of `params` is NaN or infinite, the update is skipped, the gradients
    /// are dropped (so a loop that forgets `zero_grad` does not add onto infinity), the scale
    /// is multiplied by the backoff and the good-step count restarts. Otherwise the
    /// gradients are divided by `S`, clipped to a total 2-norm of `clip` in true (unscaled)
    /// units if asked, the optimizer steps, and after `interval` consecutive good steps the
    /// scale grows. Unscaling and clipping are one pass: each gradient is multiplied by
    /// `min(1, clip / (‖g‖ + 1e-6)) / S` with `‖g‖` the unscaled norm.
    ///
    /// # Errors
    /// [`PrecisionError::InvalidScalerArgument`] for a `clip` that is not positive and
    /// finite (nothing changes); [`PrecisionError::ScaleStuckAtFloor`] after the configured
    /// number of consecutive overflows at the floor (the skip itself has been done).
    pub fn step<E: Element, O: Optimizer<E> + ?Sized>(
        &mut self,
        opt: &mut O,
        params: &[Tensor<E>],
        clip: Option<f64>,
    ) -> Result<StepOutcome> {
        self.step_observed(opt, params, clip, &mut ())
    }

    /// [`step`](Self::step) with the overflow decision and the clip norm made global by
    /// `observer` ([`StepObserver::all_finite`], [`StepObserver::total_sum_squares`]), so
    /// that processes holding parts of the gradients skip, clip and step alike.
    ///
    /// # Errors
    /// As [`step`](Self::step).
    pub fn step_observed<E, O, S>(
        &mut self,
        opt: &mut O,
        params: &[Tensor<E>],
        clip: Option<f64>,
        observer: &mut S,
    ) -> Result<StepOutcome>
    where
        E: Element,
        O: Optimizer<E> + ?Sized,
        S: StepObserver<E>,
    {
        if let Some(max_norm) = clip.filter(|&c| !(c.is_finite() && c > 0.0)) {
            return Err(invalid("clip", max_norm, "must be positive and finite"));
        }
        let underflows = take_underflow_count();
        let finite = observer.all_finite(params.iter().all(grad_is_finite));
        if !finite {
            params.iter().for_each(Tensor::zero_grad);
            self.record_overflow()?;
            return Ok(StepOutcome {
                stepped: false,
                scale: self.scale,
                grad_norm: None,
                underflows,
            });
        }
        let inv_scale = 1.0 / self.scale;
        // The clip bound is a norm of the true gradient, so measure the norm unscaled.
        let grad_norm = clip.map(|_| total_norm(params, observer) * inv_scale);
        let clip_coef = clip
            .zip(grad_norm)
            .map_or(1.0, |(max, n)| (max / (n + 1e-6)).min(1.0));
        scale_grads(params, E::from_f64(inv_scale * clip_coef));
        opt.step();
        self.record_good_step();
        Ok(StepOutcome {
            stepped: true,
            scale: self.scale,
            grad_norm,
            underflows,
        })
    }

    fn bounded(&self, scale: f64) -> f64 {
        let floor = self.floor.unwrap_or(0.0);
        scale.clamp(floor, self.ceiling.unwrap_or(f64::INFINITY))
    }

    fn record_overflow(&mut self) -> Result<()> {
        let at_floor = self.floor == Some(self.scale);
        self.scale = self.bounded(self.scale * self.backoff);
        self.good_steps = 0;
        self.skips_at_floor = if at_floor { self.skips_at_floor + 1 } else { 0 };
        if self.skips_at_floor >= self.floor_patience {
            return Err(PrecisionError::ScaleStuckAtFloor {
                scale: self.scale,
                skips: self.skips_at_floor,
            });
        }
        Ok(())
    }

    fn record_good_step(&mut self) {
        self.skips_at_floor = 0;
        // The count wraps to 0 exactly when it reaches the interval: that is a growth.
        self.good_steps = (self.good_steps + 1) % self.interval;
        if self.good_steps == 0 {
            self.scale = self.bounded(self.scale * self.growth);
        }
    }
}

/// Whether a parameter's gradient (if it has one) holds only finite values: the check a
/// training step makes before it may update.
///
/// ```
/// use tl_precision::grad_is_finite;
/// use tl_tensor::Tensor;
/// let w = Tensor::<f32>::param(tl_tensor::ndarray::arr1(&[1.0]).into_dyn());
/// assert!(grad_is_finite(&w)); // no gradient yet
/// w.set_grad(Some(tl_tensor::ndarray::arr1(&[f32::INFINITY]).into_dyn()));
/// assert!(!grad_is_finite(&w));
/// ```
pub fn grad_is_finite<E: Element>(param: &Tensor<E>) -> bool {
    param.with_grad(|grad| grad.is_none_or(array_all_finite))
}

/// The 2-norm of all gradients together, summed in f64 and made global by `observer`.
fn total_norm<E: Element>(params: &[Tensor<E>], observer: &mut impl StepObserver<E>) -> f64 {
    observer.total_sum_squares(grad_sum_squares(params)).sqrt()
}
