//! Gradient clipping by global norm: [`clip_grad_norm`], PyTorch's `clip_grad_norm_`, and
//! [`clip_grad_norm_reduced`] for gradients split over several processes.

use crate::kernels::finite::sum_squares;
use crate::ops::elementwise::PARALLEL_MIN_LEN;
use crate::{Element, Result, Tensor, TensorError};

/// Scales all gradients together so their global L2 norm is at most about `max_norm`, and
/// returns the norm they had before.
///
/// The norm `‖g‖ = sqrt(Σ g²)` runs over every element of every parameter's gradient,
/// accumulated in `f64` (parameters without a gradient contribute nothing). As in PyTorch,
/// the gradients are multiplied by `c = max_norm / (‖g‖ + 1e-6)` whenever `c < 1`, so a
/// clipped norm lands just under `max_norm`; `c` is computed in `f64` and rounded once to
/// `E`. A non-finite norm (an overflowed or NaN gradient) is returned as it is and the
/// gradients are left unscaled: scaling by `max_norm/∞ = 0` would hide the overflow from the
/// caller, who should skip the step instead (the loss scaler does).
///
/// # Errors
/// [`TensorError::InvalidArgument`] if `max_norm` is not positive and finite; the gradients
/// are then untouched.
///
/// ```
/// use tl_tensor::optim::clip_grad_norm;
/// use tl_tensor::Tensor;
/// let w = Tensor::<f64>::param(ndarray::arr1(&[0.0, 0.0]).into_dyn());
/// w.set_grad(Some(ndarray::arr1(&[3.0, 4.0]).into_dyn()));
/// let norm = clip_grad_norm(&[w.clone()], 1.0)?;
/// assert_eq!(norm, 5.0);
/// let g = w.grad().unwrap(); // [3, 4]/(5 + 1e-6)
/// assert!((g[0] - 0.6).abs() < 1e-6 && (g[1] - 0.8).abs() < 1e-6);
/// # Ok::<(), tl_tensor::TensorError>(())
/// ```
pub fn clip_grad_norm<E: Element>(parameters: &[Tensor<E>], max_norm: f64) -> Result<f64> {
    clip_grad_norm_reduced(parameters, max_norm, |local| local)
}

/// [`clip_grad_norm`] where `total` turns this process's sum of squares into the sum over
/// every process that holds a part of the gradients (an all-reduce under sharded data
/// parallelism), so that every process clips by the same global norm. `total` is called
/// once, after `max_norm` has been checked.
///
/// # Errors
/// As [`clip_grad_norm`].
///
/// ```
/// use tl_tensor::optim::clip_grad_norm_reduced;
/// use tl_tensor::Tensor;
/// let w = Tensor::<f64>::param(ndarray::arr1(&[3.0]).into_dyn());
/// w.set_grad(Some(ndarray::arr1(&[3.0]).into_dyn()));
/// // Another process holds the gradient 4: the global norm is 5.
/// let norm = clip_grad_norm_reduced(&[w.clone()], 10.0, |local| local + 16.0)?;
/// assert_eq!(norm, 5.0);
/// # Ok::<(), tl_tensor::TensorError>(())
/// ```
pub fn clip_grad_norm_reduced<E: Element>(
    parameters: &[Tensor<E>],
    max_norm: f64,
    total: impl FnOnce(f64) -> f64,
) -> Result<f64> {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return Err(TensorError::InvalidArgument {
            name: "max_norm",
            value: max_norm.to_string(),
            reason: "must be positive and finite".into(),
        });
    }
    let norm = total(grad_sum_squares(parameters)).sqrt();
    if !norm.is_finite() {
        return Ok(norm);
    }
    let coefficient = max_norm / (norm + 1e-6);
    if coefficient < 1.0 {
        scale_grads(parameters, E::from_f64(coefficient));
    }
    Ok(norm)
}

/// Multiplies every parameter's gradient by `factor`, large ones on the rayon pool:
/// clipping's coefficient, or the loss scaler's unscaling.
///
/// ```
/// use tl_tensor::optim::scale_grads;
/// use tl_tensor::Tensor;
/// let w = Tensor::<f32>::param(ndarray::arr1(&[0.0, 0.0]).into_dyn());
/// w.set_grad(Some(ndarray::arr1(&[3.0, -4.0]).into_dyn()));
/// scale_grads(&[w.clone()], 0.5);
/// assert_eq!(w.grad().unwrap(), ndarray::arr1(&[1.5, -2.0]).into_dyn());
/// ```
pub fn scale_grads<E: Element>(parameters: &[Tensor<E>], factor: E) {
    for parameter in parameters {
        parameter.update_grad(|grad| match grad.len() >= PARALLEL_MIN_LEN {
            true => grad.par_mapv_inplace(|g| g * factor),
            false => grad.mapv_inplace(|g| g * factor),
        });
    }
}

/// `Σ g²` over every element of every parameter's gradient, accumulated in `f64`
/// (parameters without a gradient contribute nothing): the square of the norm that clipping
/// and the loss scaler measure. Each gradient is summed on the rayon pool in the order
/// [`sum_squares`] documents, the same on any number of threads, and the sums are added in
/// parameter order.
///
/// ```
/// use tl_tensor::optim::grad_sum_squares;
/// use tl_tensor::Tensor;
/// let w = Tensor::<f32>::param(ndarray::arr1(&[0.0, 0.0]).into_dyn());
/// assert_eq!(grad_sum_squares(&[w.clone()]), 0.0);
/// w.set_grad(Some(ndarray::arr1(&[3.0, 4.0]).into_dyn()));
/// assert_eq!(grad_sum_squares(&[w]), 25.0);
/// ```
pub fn grad_sum_squares<E: Element>(parameters: &[Tensor<E>]) -> f64 {
    parameters
        .iter()
        .map(|p| {
            p.with_grad(|grad| {
                grad.map_or(0.0, |g| match g.as_slice() {
                    Some(values) => sum_squares(values),
                    None => sum_squares(&g.iter().copied().collect::<Vec<_>>()),
                })
            })
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::arr1;

    fn with_grad(values: &[f32]) -> Tensor<f32> {
        let p = Tensor::param(ndarray::ArrayD::zeros(ndarray::IxDyn(&[values.len()])));
        p.set_grad(Some(arr1(values).into_dyn()));
        p
    }

    fn grad_values(parameter: &Tensor<f32>) -> Vec<f32> {
        parameter.grad().unwrap().iter().copied().collect()
    }

    fn norm_of(parameters: &[Tensor<f32>]) -> f64 {
        parameters
            .iter()
            .flat_map(|p| p.grad().unwrap().into_iter())
            .map(|g| f64::from(g) * f64::from(g))
            .sum::<f64>()
            .sqrt()
    }

    #[test]
    fn a_norm_five_gradient_is_clipped_to_one() {
        // Split over two parameters: [3] and [4] have global norm 5.
        let parameters = [with_grad(&[3.0]), with_grad(&[4.0])];
        let norm = clip_grad_norm(&parameters, 1.0).unwrap();
        assert_eq!(norm, 5.0);
        // Scaled by 1/(5 + 1e-6): the new norm is 5/(5 + 1e-6) = 1 − 2e-7.
        assert!((norm_of(&parameters) - 1.0).abs() < 1e-6);
        assert!((parameters[0].grad().unwrap()[0] - 0.6).abs() < 1e-6);
    }

    #[test]
    fn a_large_gradient_is_clipped_on_the_pool_as_a_small_one_is() {
        // Past PARALLEL_MIN_LEN the norm and the scaling run on the pool: the norm is the
        // documented sum's, and every value is scaled by the one coefficient in E.
        let values: Vec<f32> = (0..PARALLEL_MIN_LEN + 3)
            .map(|i| ((i % 7) as f32 - 3.0) * 0.25)
            .collect();
        let parameters = [with_grad(&values), with_grad(&[2.0])];
        let norm = clip_grad_norm(&parameters, 1.0).unwrap();
        assert_eq!(norm, (sum_squares(&values) + 4.0).sqrt());
        let coefficient = (1.0 / (norm + 1e-6)) as f32;
        let expected: Vec<f32> = values.iter().map(|&g| g * coefficient).collect();
        assert_eq!(grad_values(&parameters[0]), expected);
        assert_eq!(grad_values(&parameters[1]), [2.0 * coefficient]);
    }

    #[test]
    fn a_small_gradient_is_left_alone() {
        let parameters = [with_grad(&[0.3, 0.4])];
        assert!((clip_grad_norm(&parameters, 1.0).unwrap() - 0.5).abs() < 1e-7);
        assert_eq!(grad_values(&parameters[0]), vec![0.3, 0.4]);
    }

    #[test]
    fn a_non_finite_norm_is_returned_and_nothing_scaled() {
        let parameters = [with_grad(&[f32::INFINITY, 1.0]), with_grad(&[2.0])];
        assert_eq!(clip_grad_norm(&parameters, 1.0).unwrap(), f64::INFINITY);
        assert_eq!(grad_values(&parameters[1]), vec![2.0]);
        let nan = [with_grad(&[f32::NAN])];
        assert!(clip_grad_norm(&nan, 1.0).unwrap().is_nan());
    }

    #[test]
    fn parameters_without_gradient_are_skipped() {
        let without = Tensor::<f32>::param(ndarray::ArrayD::zeros(ndarray::IxDyn(&[2])));
        let parameters = [without.clone(), with_grad(&[0.0, 2.0])];
        assert_eq!(clip_grad_norm(&parameters, 1.0).unwrap(), 2.0);
        assert!(without.grad().is_none());
    }

    #[test]
    fn invalid_max_norm_is_rejected_and_nothing_scaled() {
        let parameters = [with_grad(&[3.0, 4.0])];
        for max_norm in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                clip_grad_norm(&parameters, max_norm),
                Err(TensorError::InvalidArgument {
                    name: "max_norm",
                    ..
                })
            ));
        }
        assert_eq!(grad_values(&parameters[0]), vec![3.0, 4.0]);
    }
}
