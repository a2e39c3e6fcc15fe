//! [`StepObserver`]: the seam between the phases of [`train_step_mixed_observed`], so that
//! whatever needs to see or change a step from outside — a memory profile that records each
//! phase, data parallelism that all-reduces the gradients and makes the overflow decision and
//! the clip norm global — fills it instead of copying the step.
//!
//! [`train_step_mixed_observed`]: crate::train_step_mixed_observed

use tl_tensor::{Element, Tensor};

/// A phase of one training step, in the order the step runs them: `ZeroGrad`, then
/// `Forward` and `Backward` for each micro-batch in turn, then `Update`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepPhase {
    /// The model's and the optimizer's gradients are dropped.
    ZeroGrad,
    /// Micro-batch `micro_batch` (counted from 0): its loss, and the loss weighted by its
    /// share of the rows (times the loss scale), under the step's autocast.
    Forward {
        /// Which micro-batch.
        micro_batch: usize,
    },
    /// The backward pass of that weighted loss, and the release of its graph and of both
    /// losses.
    Backward {
        /// Which micro-batch.
        micro_batch: usize,
    },
    /// The checks, the unscaling and clipping, and the optimizer's step (or the skip).
    Update,
}

/// Callbacks around the phases of a training step. Every method has a default that does
/// nothing (or keeps the local value), and `()` is the observer that changes nothing, which
/// is what [`train_step_mixed`](crate::train_step_mixed) passes.
///
/// The step calls, in order: [`phase`](Self::phase) for `ZeroGrad`; `phase` for each
/// micro-batch's `Forward` and `Backward`; [`gradients_ready`](Self::gradients_ready) once,
/// when every backward is done; `phase` for `Update`, during which
/// [`all_finite`](Self::all_finite) decides whether the gradients overflowed (with a loss
/// scaler the step is then skipped, without one it is refused) and
/// [`total_sum_squares`](Self::total_sum_squares) gives the clip norm's square.
/// A data-parallel observer all-reduces the gradients in `gradients_ready`; when each
/// process holds only a shard of them, it also reduces the flag and the sum across
/// processes, so that every process skips, clips and steps alike. tl-precision itself knows
/// nothing about processes.
///
/// ```
/// use tl_precision::{Precision, StepObserver, StepPhase, train_step_mixed_observed};
/// use tl_tensor::losses::mse;
/// use tl_tensor::nn::{Linear, Module};
/// use tl_tensor::optim::Sgd;
/// use tl_tensor::{Generator, Tensor};
///
/// /// Writes down the phases as they run.
/// #[derive(Default)]
/// struct Phases(Vec<StepPhase>);
/// impl StepObserver<f32> for Phases {
///     fn phase<R>(&mut self, phase: StepPhase, run: impl FnOnce(&mut Self) -> R) -> R {
///         self.0.push(phase);
///         run(self)
///     }
/// }
///
/// let model = Linear::<f32>::new(2, 1, true, &Generator::new(0));
/// let mut opt = Sgd::new(model.parameters(), 0.1)?;
/// let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2])?;
/// let micro_batches = [(x.narrow(0, 0, 1), Tensor::ones(&[1, 1])), (x.narrow(0, 1, 1), Tensor::ones(&[1, 1]))];
/// let loss_fn = |m: &Linear<f32>, (x, t): &(Tensor<f32>, Tensor<f32>)| mse(&m.forward(x), t);
/// let mut phases = Phases::default();
/// train_step_mixed_observed(&model, &micro_batches, loss_fn, &mut opt, Precision::Fp32, None, None, &mut phases)?;
/// use StepPhase::*;
/// assert_eq!(phases.0, [
///     ZeroGrad,
///     Forward { micro_batch: 0 }, Backward { micro_batch: 0 },
///     Forward { micro_batch: 1 }, Backward { micro_batch: 1 },
///     Update,
/// ]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait StepObserver<E: Element> {
    /// Runs one phase: `run` is the phase itself and must be called exactly once, with the
    /// observer (the update reads [`all_finite`](Self::all_finite) and
    /// [`total_sum_squares`](Self::total_sum_squares) through it); the observer may do what
    /// it likes around it, such as record the memory it allocates.
    fn phase<R>(&mut self, phase: StepPhase, run: impl FnOnce(&mut Self) -> R) -> R
    where
        Self: Sized,
    {
        let _ = phase;
        run(self)
    }

    /// Called once every micro-batch's backward is done, before anything reads the
    /// gradients of `params` (the optimizer's parameters): the place to all-reduce them, or
    /// to change them otherwise. The step checks, unscales, clips and applies whatever
    /// gradients are there when it returns.
    fn gradients_ready(&mut self, _params: &[Tensor<E>]) {}

    /// Whether the gradients are finite everywhere, given whether this process's are.
    fn all_finite(&mut self, local: bool) -> bool {
        local
    }

    /// The sum of the squared gradients everywhere, given this process's sum.
    fn total_sum_squares(&mut self, local: f64) -> f64 {
        local
    }
}

/// The observer that changes nothing: a step on one process, unrecorded.
impl<E: Element> StepObserver<E> for () {}
