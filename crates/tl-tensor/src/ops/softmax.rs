//! Softmax and log-softmax along one axis, numerically stable, each with a fused VJP that
//! reads only the saved output.

use ndarray::{ArrayViewMut1, Axis, Zip};

use crate::{Element, Tensor};

/// Checks that `axis` exists, naming the op and the shape.
fn check_axis(op: &str, axis: usize, shape: &[usize]) {
    assert!(
        axis < shape.len(),
        "{op}: axis {axis} out of range for shape {shape:?}"
    );
}

/// The largest element of a lane: subtracting it keeps every exponent ≤ 0, so no e^x
/// overflows, and the largest term is exactly 1, so the sum cannot underflow to 0.
fn lane_max<E: Element>(lane: &ArrayViewMut1<'_, E>) -> E {
    lane.iter().fold(E::neg_infinity(), |max, &x| max.max(x))
}

impl<E: Element> Tensor<E> {
    /// Softmax along `axis`: yᵢ = e^(xᵢ − m) / Σⱼ e^(xⱼ − m), with m the lane maximum (which
    /// cancels, and keeps the exponentials in range).
    ///
    /// VJP, fused over the saved output: x̄ = y ⊙ (ȳ − Σ ȳ ⊙ y), the sum over the lane.
    ///
    /// # Panics
    /// If `axis` is out of range.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let x = Tensor::<f64>::from_vec(vec![0.0, 0.0, 1000.0, 1000.0], &[2, 2])?;
    /// assert_eq!(x.softmax(1).to_vec(), vec![0.5, 0.5, 0.5, 0.5]);
    /// # Ok::<(), tl_tensor::TensorError>(())
    /// ```
    pub fn softmax(&self, axis: usize) -> Tensor<E> {
        check_axis("softmax", axis, &self.shape());
        let value = || {
            let mut value = self.to_array();
            for mut lane in value.lanes_mut(Axis(axis)) {
                let max = lane_max(&lane);
                lane.mapv_inplace(|x| (x - max).exp());
                let sum = lane.sum();
                lane.mapv_inplace(|e| e / sum);
            }
            value
        };
        Tensor::from_op_saving_output(&self.shape(), value, &[self], move |mut grad, output| {
            Zip::from(grad.lanes_mut(Axis(axis)))
                .and(output.lanes(Axis(axis)))
                .for_each(|mut grad_lane, y_lane| {
                    let dot = grad_lane.dot(&y_lane);
                    Zip::from(&mut grad_lane)
                        .and(&y_lane)
                        .for_each(|g, &y| *g = y * (*g - dot));
                });
            vec![Some(grad)]
        })
    }

    /// Log-softmax along `axis`: yᵢ = xᵢ − m − ln Σⱼ e^(xⱼ − m), with m the lane maximum.
    /// More accurate than `softmax(axis).log()`, which loses tiny probabilities to 0.
    ///
    /// VJP, fused over the saved output: x̄ = ȳ − softmax(x) · Σ ȳ, with softmax(x) = e^y.
    ///
    /// # Panics
    /// If `axis` is out of range.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let x = Tensor::<f64>::from_vec(vec![0.0, 0.0], &[2])?;
    /// let y = x.log_softmax(0).to_vec();
    /// assert_eq!(y, vec![-std::f64::consts::LN_2; 2]);
    /// # Ok::<(), tl_tensor::TensorError>(())
    /// ```
    pub fn log_softmax(&self, axis: usize) -> Tensor<E> {
        check_axis("log_softmax", axis, &self.shape());
        let value = || {
            let mut value = self.to_array();
            for mut lane in value.lanes_mut(Axis(axis)) {
                let max = lane_max(&lane);
                let log_sum = lane.iter().map(|&x| (x - max).exp()).sum::<E>().ln();
                lane.mapv_inplace(|x| x - max - log_sum);
            }
            value
        };
        Tensor::from_op_saving_output(&self.shape(), value, &[self], move |mut grad, output| {
            Zip::from(grad.lanes_mut(Axis(axis)))
                .and(output.lanes(Axis(axis)))
                .for_each(|mut grad_lane, y_lane| {
                    let total = grad_lane.sum();
                    Zip::from(&mut grad_lane)
                        .and(&y_lane)
                        .for_each(|g, &y| *g -= y.exp() * total);
                });
            vec![Some(grad)]
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::arr2;

    #[test]
    fn softmax_rows_sum_to_one_and_ignore_a_shift() {
        // softmax([0, ln 3]) = [1/4, 3/4], and adding 50 to the lane changes nothing.
        let ln3 = 3f64.ln();
        let x = Tensor::<f64>::from_array(arr2(&[[0.0, ln3], [50.0, 50.0 + ln3]]).into_dyn());
        let y = x.softmax(1).to_vec();
        for (got, want) in y.iter().zip([0.25, 0.75, 0.25, 0.75]) {
            assert!((got - want).abs() < 1e-15, "{got} vs {want}");
        }
    }

    #[test]
    fn softmax_gradient_of_a_one_hot_weight() {
        // L = y₀ with y = softmax([0, ln 3]) = [1/4, 3/4]:
        // dL/dx₀ = y₀(1 − y₀) = 3/16, dL/dx₁ = −y₀y₁ = −3/16.
        let x = Tensor::<f64>::param(ndarray::arr1(&[0.0, 3f64.ln()]).into_dyn());
        let weights = Tensor::from_vec(vec![1.0, 0.0], &[2]).unwrap();
        (&x.softmax(0) * &weights).sum_all().backward();
        let grad = x.grad().unwrap();
        assert!((grad[[0]] - 3.0 / 16.0).abs() < 1e-15);
        assert!((grad[[1]] + 3.0 / 16.0).abs() < 1e-15);
    }

    #[test]
    fn log_softmax_stays_finite_where_softmax_underflows() {
        // softmax([0, −800]) rounds its second entry to 0, whose log is −∞; log_softmax
        // gives −800 − ln(1 + e^−800) = −800 exactly in f64.
        let x = Tensor::<f64>::from_vec(vec![0.0, -800.0], &[2]).unwrap();
        assert_eq!(x.log_softmax(0).to_vec(), vec![0.0, -800.0]);
        assert_eq!(x.softmax(0).to_vec()[1], 0.0);
    }

    #[test]
    fn log_softmax_gradient_sums_to_zero_per_lane() {
        // Σᵢ x̄ᵢ = Σ ȳ − Σ softmax · Σ ȳ = 0, whatever ȳ is.
        let x = Tensor::<f64>::param(arr2(&[[0.3, -1.0, 2.0], [1.0, 1.0, 1.0]]).into_dyn());
        let weights = Tensor::from_vec(vec![1.0, 2.0, 3.0, -1.0, 0.0, 5.0], &[2, 3]).unwrap();
        (&x.log_softmax(1) * &weights).sum_all().backward();
        for row in x.grad().unwrap().outer_iter() {
            assert!(row.sum().abs() < 1e-14, "{row}");
        }
    }

    #[test]
    #[should_panic(expected = "softmax: axis 2 out of range for shape [2, 3]")]
    fn softmax_names_a_bad_axis() {
        Tensor::<f32>::zeros(&[2, 3]).softmax(2);
    }
}
