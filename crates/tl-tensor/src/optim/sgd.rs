//! [`Sgd`]: stochastic gradient descent with optional momentum and weight decay.

use ndarray::Zip;
use serde::{Deserialize, Serialize};

use super::{Optimizer, assert_learning_rate, check_non_negative, check_shapes, restore};
use crate::{Element, Result, Tensor, TensorError};

/// Stochastic gradient descent with PyTorch's `torch.optim.SGD` semantics (no dampening, no
/// Nesterov). For each parameter `p` with gradient `g`:
///
/// ```text
/// g ← g + weight_decay · p                       (if weight_decay ≠ 0)
/// b ← g on the first step, m · b + g afterwards  (if momentum m ≠ 0)
/// p ← p − lr · b                                 (b = g without momentum)
/// ```
///
/// Arithmetic is in `E`, one operation at a time in that order.
///
/// ```
/// use tl_tensor::optim::{Optimizer, Sgd};
/// use tl_tensor::Tensor;
/// let w = Tensor::<f64>::param(ndarray::arr1(&[1.0]).into_dyn());
/// let mut opt = Sgd::new(vec![w.clone()], 0.25)?.with_momentum(0.5)?;
/// w.set_grad(Some(ndarray::arr1(&[2.0]).into_dyn()));
/// opt.step(); // b = 2, w = 1 − 0.25·2
/// assert_eq!(w.item(), 0.5);
/// opt.step(); // b = 0.5·2 + 2 = 3, w = 0.5 − 0.25·3
/// assert_eq!(w.item(), -0.25);
/// # Ok::<(), tl_tensor::TensorError>(())
/// ```
pub struct Sgd<E: Element = f32> {
    parameters: Vec<Tensor<E>>,
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    /// One momentum buffer per parameter, made at its first step; tensors so the memory
    /// meter counts them.
    buffers: Vec<Option<Tensor<E>>>,
}

/// A snapshot of an [`Sgd`]: hyperparameters and momentum buffers, serializable.
///
/// Buffers are stored as `f64` (exact for `f32` and `f64` elements), so loading a saved state
/// continues bit for bit. Through JSON, `f32` values always survive; `f64` values need a
/// parser that round-trips floats exactly (serde_json's `float_roundtrip` feature).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SgdState {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: plain SGD).
    pub momentum: f64,
    /// Coupled (L2) weight decay.
    pub weight_decay: f64,
    /// The shape of each parameter, to check the state fits.
    pub shapes: Vec<Vec<usize>>,
    /// Each parameter's momentum buffer in row-major order, `None` before its first step.
    pub momentum_buffers: Vec<Option<Vec<f64>>>,
}

impl<E: Element> Sgd<E> {
    /// Plain SGD on `parameters` with learning rate `lr`.
    ///
    /// # Errors
    /// [`TensorError::InvalidArgument`] if `lr` is negative or not finite.
    pub fn new(parameters: Vec<Tensor<E>>, lr: f64) -> Result<Self> {
        let buffers = vec![None; parameters.len()];
        Ok(Self {
            parameters,
            lr: check_non_negative("learning rate", lr)?,
            momentum: 0.0,
            weight_decay: 0.0,
            buffers,
        })
    }

    /// Sets the momentum factor.
    ///
    /// # Errors
    /// [`TensorError::InvalidArgument`] if `momentum` is negative or not finite.
    pub fn with_momentum(mut self, momentum: f64) -> Result<Self> {
        self.momentum = check_non_negative("momentum", momentum)?;
        Ok(self)
    }

    /// Sets the (coupled, L2) weight decay, added to the gradient as `weight_decay · p`.
    ///
    /// # Errors
    /// [`TensorError::InvalidArgument`] if `weight_decay` is negative or not finite.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Result<Self> {
        self.weight_decay = check_non_negative("weight decay", weight_decay)?;
        Ok(self)
    }

    /// The momentum factor.
    pub fn momentum(&self) -> f64 {
        self.momentum
    }

    /// The weight decay.
    pub fn weight_decay(&self) -> f64 {
        self.weight_decay
    }

    /// The hyperparameters and momentum buffers, to save.
    pub fn state_dict(&self) -> SgdState {
        SgdState {
            lr: self.lr,
            momentum: self.momentum,
            weight_decay: self.weight_decay,
            shapes: self.parameters.iter().map(Tensor::shape).collect(),
            momentum_buffers: self
                .buffers
                .iter()
                .map(|buffer| {
                    buffer
                        .as_ref()
                        .map(|b| b.to_vec().into_iter().map(Element::to_f64).collect())
                })
                .collect(),
        }
    }

    /// Restores a saved state: hyperparameters and momentum buffers.
    ///
    /// # Errors
    /// [`TensorError::StateMismatch`] if the state is for a different number of parameters,
    /// different shapes, or a buffer has the wrong length; [`TensorError::InvalidArgument`]
    /// for an invalid hyperparameter. On error nothing changes.
    pub fn load_state_dict(&mut self, state: SgdState) -> Result<()> {
        check_shapes("SGD state", &self.parameters, &state.shapes)?;
        if state.momentum_buffers.len() != self.parameters.len() {
            return Err(TensorError::StateMismatch {
                what: "SGD state",
                parameter: None,
                expected: format!("{} momentum buffers", self.parameters.len()),
                found: format!("{} momentum buffers", state.momentum_buffers.len()),
            });
        }
        let mut buffers = Vec::with_capacity(self.parameters.len());
        for (index, (saved, shape)) in state
            .momentum_buffers
            .into_iter()
            .zip(&state.shapes)
            .enumerate()
        {
            buffers.push(match saved {
                None => None,
                Some(values) => Some(Tensor::from_array(restore(index, values, shape)?)),
            });
        }
        let lr = check_non_negative("learning rate", state.lr)?;
        let momentum = check_non_negative("momentum", state.momentum)?;
        let weight_decay = check_non_negative("weight decay", state.weight_decay)?;
        (self.lr, self.momentum, self.weight_decay) = (lr, momentum, weight_decay);
        self.buffers = buffers;
        Ok(())
    }
}

impl<E: Element> Optimizer<E> for Sgd<E> {
    fn step(&mut self) {
        let lr = E::from_f64(self.lr);
        let momentum = E::from_f64(self.momentum);
        let weight_decay = E::from_f64(self.weight_decay);
        for (parameter, buffer) in self.parameters.iter().zip(&mut self.buffers) {
            if parameter.is_meta() || parameter.grad_is_meta() {
                // A meta step: the momentum buffer is made as a real step makes it.
                if parameter.grad().is_some() && self.momentum != 0.0 && buffer.is_none() {
                    let _state = super::state_scope(parameter);
                    *buffer = Some(Tensor::meta(&parameter.shape()));
                }
                continue;
            }
            let Some(mut direction) = parameter.grad() else {
                continue;
            };
            if self.weight_decay != 0.0 {
                Zip::from(&mut direction)
                    .and(&*parameter.value())
                    .for_each(|g, &p| *g += weight_decay * p);
            }
            if self.momentum != 0.0 {
                match buffer {
                    None => {
                        let _state = super::state_scope(parameter);
                        *buffer = Some(Tensor::from_array(direction.clone()));
                    }
                    Some(buffer) => {
                        buffer.update_value(|b| {
                            Zip::from(&mut *b)
                                .and(&direction)
                                .for_each(|b, &g| *b = *b * momentum + g);
                            direction.assign(&*b);
                        });
                    }
                }
            }
            parameter.update_value(|p| {
                Zip::from(p).and(&direction).for_each(|p, &d| *p -= lr * d);
            });
        }
    }

    fn parameters(&self) -> &[Tensor<E>] {
        &self.parameters
    }

    fn learning_rate(&self) -> f64 {
        self.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        assert_learning_rate(lr);
        self.lr = lr;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::arr1;

    fn param(values: &[f64]) -> Tensor<f64> {
        Tensor::param(arr1(values).into_dyn())
    }

    fn set_grad(p: &Tensor<f64>, values: &[f64]) {
        p.set_grad(Some(arr1(values).into_dyn()));
    }

    #[test]
    fn plain_step_is_lr_times_gradient() {
        let p = param(&[1.0, -2.0]);
        let mut opt = Sgd::new(vec![p.clone()], 0.5).unwrap();
        set_grad(&p, &[4.0, -1.0]);
        opt.step(); // [1 − 2, −2 + 0.5]
        assert_eq!(p.to_vec(), vec![-1.0, -1.5]);
    }

    #[test]
    fn momentum_accumulates_as_in_pytorch() {
        // lr 0.25, m 0.5, constant g = 2: b = 2, 3, 3.5; p = 1 − 0.5 = 0.5, 0.5 − 0.75 = −0.25,
        // −0.25 − 0.875 = −1.125.
        let p = param(&[1.0]);
        let mut opt = Sgd::new(vec![p.clone()], 0.25)
            .unwrap()
            .with_momentum(0.5)
            .unwrap();
        let mut trace = Vec::new();
        for _ in 0..3 {
            set_grad(&p, &[2.0]);
            opt.step();
            trace.push(p.item());
        }
        assert_eq!(trace, vec![0.5, -0.25, -1.125]);
    }

    #[test]
    fn weight_decay_is_added_to_the_gradient() {
        // g' = 1 + 0.5·2 = 2, p = 2 − 0.25·2 = 1.5
        let p = param(&[2.0]);
        let mut opt = Sgd::new(vec![p.clone()], 0.25)
            .unwrap()
            .with_weight_decay(0.5)
            .unwrap();
        set_grad(&p, &[1.0]);
        opt.step();
        assert_eq!(p.item(), 1.5);
    }

    #[test]
    fn parameters_without_gradient_are_skipped() {
        let (with, without) = (param(&[1.0]), param(&[1.0]));
        let mut opt = Sgd::new(vec![with.clone(), without.clone()], 1.0)
            .unwrap()
            .with_momentum(0.9)
            .unwrap();
        set_grad(&with, &[1.0]);
        opt.step();
        assert_eq!((with.item(), without.item()), (0.0, 1.0));
        assert!(opt.state_dict().momentum_buffers[1].is_none());
        opt.zero_grad();
        assert!(with.grad().is_none());
    }

    #[test]
    fn invalid_hyperparameters_are_rejected() {
        assert!(Sgd::<f32>::new(vec![], -0.1).is_err());
        assert!(Sgd::<f32>::new(vec![], f64::NAN).is_err());
        assert!(
            Sgd::<f32>::new(vec![], 0.1)
                .unwrap()
                .with_momentum(-1.0)
                .is_err()
        );
        assert!(
            Sgd::<f32>::new(vec![], 0.1)
                .unwrap()
                .with_weight_decay(f64::INFINITY)
                .is_err()
        );
    }

    #[test]
    fn a_state_for_other_shapes_is_rejected_and_changes_nothing() {
        let p = param(&[1.0, 2.0]);
        let mut opt = Sgd::new(vec![p.clone()], 0.1)
            .unwrap()
            .with_momentum(0.9)
            .unwrap();
        set_grad(&p, &[1.0, 1.0]);
        opt.step();
        let before = opt.state_dict();
        let mut wrong_shape = before.clone();
        wrong_shape.shapes = vec![vec![3]];
        assert!(matches!(
            opt.load_state_dict(wrong_shape),
            Err(TensorError::StateMismatch { .. })
        ));
        let mut wrong_length = before.clone();
        wrong_length.momentum_buffers = vec![Some(vec![0.0])];
        wrong_length.lr = 0.5;
        assert!(matches!(
            opt.load_state_dict(wrong_length),
            Err(TensorError::StateMismatch { .. })
        ));
        assert_eq!(opt.state_dict(), before);
    }
}
