//! [`RmsNorm`]: root-mean-square normalisation with a learnable gain, as one fused op.

use ndarray::{Array1, Array2, ArrayD, ArrayView2, Ix1, IxDyn, Zip};

use super::Module;
use crate::{Element, Tensor};

/// Root-mean-square layer normalisation over the last axis (Zhang & Sennrich, 2019), the
/// normalisation of Llama:
///
/// `y = x / sqrt(mean(x², last axis) + eps) · g`
///
/// with a learnable gain `g` of shape `[dim]`, initialised to ones. Forward and backward are
/// one fused op: with `r = (mean(x²) + eps)^(−1/2)` per row and `n = dim`,
///
/// `∂L/∂x_j = r·g_j·ȳ_j − (r³/n)·x_j·Σ_i ȳ_i·g_i·x_i`, `∂L/∂g_i = Σ_rows ȳ_i·x_i·r`.
///
/// The op saves its input (shared, not copied) and one `r` per row.
///
/// ```
/// use tl_tensor::nn::{Module, RmsNorm};
/// use tl_tensor::Tensor;
/// let norm = RmsNorm::<f64>::new(2, 0.0);
/// // mean(3², 4²) = 12.5, so y = [3, 4] / sqrt(12.5)
/// let y = norm.forward(&Tensor::from_vec(vec![3.0, 4.0], &[1, 2])?);
/// let expected = [3.0 / 12.5f64.sqrt(), 4.0 / 12.5f64.sqrt()];
/// assert!(y.to_vec().iter().zip(expected).all(|(a, b)| (a - b).abs() < 1e-15));
/// # Ok::<(), tl_tensor::TensorError>(())
/// ```
pub struct RmsNorm<E: Element = f32> {
    gain: Tensor<E>,
    eps: f64,
}

impl<E: Element> RmsNorm<E> {
    /// A normalisation of vectors of size `dim`, gain initialised to 1, `eps` added to the
    /// mean square (Llama uses 1e-5 or 1e-6).
    ///
    /// # Panics
    /// If `dim` is 0 or `eps` is negative or not finite.
    pub fn new(dim: usize, eps: f64) -> Self {
        assert!(dim > 0, "RmsNorm::new: dim must be positive");
        assert!(
            eps.is_finite() && eps >= 0.0,
            "RmsNorm::new: eps must be finite and non-negative, got {eps}"
        );
        Self {
            gain: Tensor::param(ArrayD::ones(IxDyn(&[dim]))),
            eps,
        }
    }

    /// The learnable gain `g`, `[dim]`.
    pub fn weight(&self) -> &Tensor<E> {
        &self.gain
    }

    /// The constant added to the mean square.
    pub fn eps(&self) -> f64 {
        self.eps
    }
}

/// `r = (mean(x²) + eps)^(−1/2)` of each row.
fn inverse_rms<E: Element>(rows: ArrayView2<'_, E>, eps: E) -> Array1<E> {
    let n = E::from_f64(rows.ncols() as f64);
    rows.outer_iter()
        .map(|row| {
            let mean_square = row.iter().map(|&v| v * v).sum::<E>() / n;
            E::one() / (mean_square + eps).sqrt()
        })
        .collect()
}

impl<E: Element> Module<E> for RmsNorm<E> {
    /// Normalises `x` of shape `[.., dim]`; the output has the same shape.
    ///
    /// # Panics
    /// If the last axis of `x` is not `dim`.
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        let shape = x.shape();
        let dim = self.gain.numel();
        assert!(
            shape.last() == Some(&dim),
            "RmsNorm: input shape {shape:?} does not end in dim = {dim}"
        );
        let rows = x.numel() / dim;
        let (value, inv_rms) = {
            let x_value = x.value();
            let x_std = x_value.as_standard_layout();
            let x_rows = x_std
                .view()
                .into_shape_with_order((rows, dim))
                .expect("contiguous");
            let inv_rms = inverse_rms(x_rows, E::from_f64(self.eps));
            let gain = self.gain.value();
            let gain = gain.view().into_dimensionality::<Ix1>().expect("1-D gain");
            let mut out = x_rows.to_owned();
            Zip::from(out.rows_mut())
                .and(&inv_rms)
                .for_each(|mut row, &r| {
                    Zip::from(&mut row)
                        .and(&gain)
                        .for_each(|y, &g| *y = *y * r * g);
                });
            let value = out
                .into_shape_with_order(IxDyn(&shape))
                .expect("same count");
            (value, inv_rms)
        };
        let (x_saved, gain_saved) = (x.clone(), self.gain.clone());
        Tensor::from_op(value, &[x, &self.gain], move |grad_out| {
            let x_value = x_saved.value();
            let x_std = x_value.as_standard_layout();
            let x_rows = x_std
                .view()
                .into_shape_with_order((rows, dim))
                .expect("contiguous");
            let grad_std = grad_out.as_standard_layout();
            let grad_rows = grad_std
                .view()
                .into_shape_with_order((rows, dim))
                .expect("contiguous");
            let gain = gain_saved.value();
            let gain = gain.view().into_dimensionality::<Ix1>().expect("1-D gain");
            let x_grad = x_saved.requires_grad().then(|| {
                let n = E::from_f64(dim as f64);
                let mut x_grad = Array2::<E>::zeros((rows, dim));
                for (((mut out, x_row), grad_row), &r) in x_grad
                    .outer_iter_mut()
                    .zip(x_rows.outer_iter())
                    .zip(grad_rows.outer_iter())
                    .zip(&inv_rms)
                {
                    let dot = Zip::from(&grad_row)
                        .and(&gain)
                        .and(&x_row)
                        .fold(E::zero(), |acc, &dy, &g, &xi| acc + dy * g * xi);
                    let coefficient = r * r * r / n * dot;
                    Zip::from(&mut out)
                        .and(&grad_row)
                        .and(&gain)
                        .and(&x_row)
                        .for_each(|dx, &dy, &g, &xi| *dx = r * g * dy - coefficient * xi);
                }
                x_grad
                    .into_shape_with_order(IxDyn(&shape))
                    .expect("same count")
            });
            let gain_grad = gain_saved.requires_grad().then(|| {
                let mut gain_grad = Array1::<E>::zeros(dim);
                for ((x_row, grad_row), &r) in x_rows
                    .outer_iter()
                    .zip(grad_rows.outer_iter())
                    .zip(&inv_rms)
                {
                    Zip::from(&mut gain_grad)
                        .and(&grad_row)
                        .and(&x_row)
                        .for_each(|dg, &dy, &xi| *dg += dy * xi * r);
                }
                gain_grad.into_dyn()
            });
            vec![x_grad, gain_grad]
        })
    }

    fn parameters(&self) -> Vec<Tensor<E>> {
        vec![self.gain.clone()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Generator;
    use crate::testing::{GradcheckOptions, check_parameter_gradients, random_array};

    #[test]
    fn output_rows_have_unit_root_mean_square() {
        let norm = RmsNorm::<f64>::new(4, 0.0);
        let x =
            Tensor::from_vec(vec![1.0, -2.0, 3.0, 0.5, 10.0, 20.0, -30.0, 40.0], &[2, 4]).unwrap();
        let y = norm.forward(&x).to_vec();
        for row in y.chunks(4) {
            let mean_square = row.iter().map(|v| v * v).sum::<f64>() / 4.0;
            assert!((mean_square - 1.0).abs() < 1e-14, "{mean_square}");
        }
    }

    #[test]
    fn eps_and_gain_enter_as_written() {
        // x = [1, 1], eps = 2: mean square 1, r = 1/sqrt(3); gain [2, 3] → [2, 3]/sqrt(3)
        let norm = RmsNorm::<f64>::new(2, 2.0);
        norm.weight()
            .update_value(|g| g.assign(&ndarray::arr1(&[2.0, 3.0])));
        let y = norm.forward(&Tensor::ones(&[2])).to_vec();
        let r = 1.0 / 3f64.sqrt();
        assert!((y[0] - 2.0 * r).abs() < 1e-15 && (y[1] - 3.0 * r).abs() < 1e-15);
    }

    #[test]
    fn gradients_match_finite_differences() {
        let rng = Generator::new(2);
        let norm = RmsNorm::<f64>::new(3, 1e-3);
        let gain = norm.weight().clone();
        gain.update_value(|g| g.assign(&random_array(&[3], &rng)));
        let x = Tensor::param(random_array(&[2, 2, 3], &rng));
        let result = check_parameter_gradients(
            || norm.forward(&x),
            &[x.clone(), gain.clone()],
            GradcheckOptions::default(),
        );
        assert!(result.is_ok(), "{}", result.unwrap_err());
    }

    #[test]
    fn constant_input_gets_no_gradient_work() {
        let norm = RmsNorm::<f32>::new(2, 1e-5);
        let y = norm.forward(&Tensor::ones(&[3, 2]));
        y.sum_all().backward();
        // y = g·1/sqrt(1 + eps) on each of 3 rows: dL/dg = 3/sqrt(1 + 1e-5)
        let expected = 3.0 / (1.0f32 + 1e-5).sqrt();
        assert!(
            norm.weight()
                .grad()
                .unwrap()
                .iter()
                .all(|&g| (g - expected).abs() < 1e-6)
        );
    }

    #[test]
    #[should_panic(expected = "RmsNorm: input shape [2, 5] does not end in dim = 4")]
    fn a_wrong_size_names_the_shapes() {
        RmsNorm::<f32>::new(4, 1e-5).forward(&Tensor::ones(&[2, 5]));
    }
}
