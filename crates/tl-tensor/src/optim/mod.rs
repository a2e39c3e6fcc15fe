//! Optimizers ([`Sgd`], [`AdamW`]) behind the [`Optimizer`] trait, and gradient clipping.

mod adamw;
mod clip;
mod sgd;

pub use adamw::{AdamW, AdamWParamState, AdamWState, SharedMoments};
pub use clip::{clip_grad_norm, clip_grad_norm_reduced, grad_sum_squares, scale_grads};
pub use sgd::{Sgd, SgdState};

use ndarray::{ArrayD, IxDyn};

use crate::{Element, Result, Tensor, TensorError};

/// Updates parameters from their accumulated gradients.
///
/// Implementations do their arithmetic in the element type `E`, step by step as PyTorch's
/// single-tensor (non-foreach, non-fused) kernels do in `f32`, and keep their state (momenta)
/// in `E` as well.
pub trait Optimizer<E: Element = f32> {
    /// One update of every parameter that has a gradient; parameters without one are left
    /// alone, their state untouched.
    fn step(&mut self);

    /// Drops the gradient of every parameter.
    fn zero_grad(&self) {
        for parameter in self.parameters() {
            parameter.zero_grad();
        }
    }

    /// The parameters being optimized, in the order they were given.
    fn parameters(&self) -> &[Tensor<E>];

    /// The learning rate of the next step.
    fn learning_rate(&self) -> f64;

    /// Changes the learning rate (a schedule calls this before each step).
    ///
    /// # Panics
    /// If `lr` is negative or not finite.
    fn set_learning_rate(&mut self, lr: f64);
}

/// Checks that a hyperparameter is finite and non-negative.
/// The meter's tag scope for the optimizer state of `parameter`: owned where the parameter
/// is.
pub(crate) fn state_scope<E: Element>(parameter: &Tensor<E>) -> crate::memory::TagScope {
    crate::memory::tag_scope(crate::memory::Tag {
        kind: crate::memory::Kind::OptimizerState,
        owner: parameter.memory_tag().owner,
        label: "",
        ..crate::memory::current_tag()
    })
}

pub(crate) fn check_non_negative(name: &'static str, value: f64) -> Result<f64> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(TensorError::InvalidArgument {
            name,
            value: value.to_string(),
            reason: "must be finite and non-negative".into(),
        })
    }
}

/// Checks a learning rate given to `set_learning_rate`, which has no error channel.
pub(crate) fn assert_learning_rate(lr: f64) {
    assert!(
        lr.is_finite() && lr >= 0.0,
        "set_learning_rate: the learning rate must be finite and non-negative, got {lr}"
    );
}

/// Checks that saved per-parameter buffers fit `parameters` (count, and each buffer's
/// shape), so a load can be rejected before anything changes.
pub(crate) fn check_shapes<E: Element>(
    what: &'static str,
    parameters: &[Tensor<E>],
    saved_shapes: &[Vec<usize>],
) -> Result<()> {
    if saved_shapes.len() != parameters.len() {
        return Err(TensorError::StateMismatch {
            what,
            parameter: None,
            expected: format!("{} parameters", parameters.len()),
            found: format!("{} parameters", saved_shapes.len()),
        });
    }
    for (index, (parameter, saved)) in parameters.iter().zip(saved_shapes).enumerate() {
        if parameter.shape() != *saved {
            return Err(TensorError::StateMismatch {
                what,
                parameter: Some(index),
                expected: format!("shape {:?}", parameter.shape()),
                found: format!("shape {saved:?}"),
            });
        }
    }
    Ok(())
}

/// A saved buffer of parameter `index` back as an array of `shape`.
pub(crate) fn restore<E: Element>(
    index: usize,
    values: Vec<f64>,
    shape: &[usize],
) -> Result<ArrayD<E>> {
    let len = values.len();
    ArrayD::from_shape_vec(IxDyn(shape), values.into_iter().map(E::from_f64).collect()).map_err(
        |_| TensorError::StateMismatch {
            what: "a saved buffer",
            parameter: Some(index),
            expected: format!(
                "{} values (shape {shape:?})",
                shape.iter().product::<usize>()
            ),
            found: format!("{len} values"),
        },
    )
}
