//! Losses, each one fused op with its own VJP: [`mse`] and [`cross_entropy`].
//!
//! The loss value is a mean over many elements; both accumulate that sum in `f64` and round
//! the mean once to `E`, so a long `f32` sum does not drift with the number of rows. The
//! gradients are elementwise and computed in `E`.

use ndarray::{ArrayD, ArrayView2, IxDyn, Zip};

use crate::{Element, Tensor};

/// The mean squared error `mean((pred − target)²)`, a 0-dimensional tensor.
///
/// VJP: `∂L/∂pred = 2·(pred − target)/n`, and the negative of it for `target` (which may be
/// a constant, then it gets none).
///
/// # Panics
/// If the shapes differ (no broadcasting: a mismatch here is almost always a bug), naming
/// both.
///
/// ```
/// use tl_tensor::{losses::mse, Tensor};
/// let pred = Tensor::<f64>::param(ndarray::arr1(&[1.0, 2.0]).into_dyn());
/// let target = Tensor::from_vec(vec![0.0, 4.0], &[2])?;
/// let loss = mse(&pred, &target); // ((1 − 0)² + (2 − 4)²)/2 = 2.5
/// assert_eq!(loss.item(), 2.5);
/// loss.backward(); // 2·[1, −2]/2
/// assert_eq!(pred.grad().unwrap().as_slice().unwrap(), &[1.0, -2.0]);
/// # Ok::<(), tl_tensor::TensorError>(())
/// ```
pub fn mse<E: Element>(pred: &Tensor<E>, target: &Tensor<E>) -> Tensor<E> {
    let (pred_shape, target_shape) = (pred.shape(), target.shape());
    assert_eq!(
        pred_shape, target_shape,
        "mse: prediction shape {pred_shape:?} and target shape {target_shape:?} differ"
    );
    let count = pred.numel() as f64;
    // The difference, saved as a tensor so the memory meter counts it, and the mean square.
    let (diff, value) = if crate::meta::computes(&[pred, target]) {
        let diff = &*pred.value() - &*target.value();
        let sum_squares: f64 = diff.iter().map(|&d| d.to_f64() * d.to_f64()).sum();
        let value = ArrayD::from_elem(IxDyn(&[]), E::from_f64(sum_squares / count));
        (Tensor::from_array(diff), Some(value))
    } else {
        (Tensor::meta(&pred_shape), None)
    };
    let value = || value.expect("computed for real inputs");
    let (pred_grad_needed, target_grad_needed) = (pred.requires_grad(), target.requires_grad());
    Tensor::from_op_shaped(&[], value, &[pred, target], move |grad_out| {
        let factor =
            grad_out.iter().next().copied().expect("one element") * E::from_f64(2.0 / count);
        let pred_grad = diff.value().mapv(|d| d * factor);
        let target_grad = target_grad_needed.then(|| pred_grad.mapv(|g| -g));
        vec![pred_grad_needed.then_some(pred_grad), target_grad]
    })
}

/// The mean cross-entropy of softmax probabilities against class indices:
/// `mean_r(log Σ_c exp(z_rc) − z_r,t_r)`, a 0-dimensional tensor.
///
/// `logits` has shape `[.., C]`; all axes before the last are flattened into `N` rows, and
/// `targets` holds one class per row, in row-major order. Each row's log-sum-exp is taken
/// around the row maximum, so logits of ±1000 give finite values. VJP:
/// `∂L/∂z = (softmax(z) − onehot(t))/N`, recomputed in backward from the saved logits
/// (shared, not copied) and each row's log-sum-exp.
///
/// # Panics
/// If `logits` has no axis, `targets` does not have one entry per row, or a target is not
/// below `C` (naming it).
///
/// ```
/// use tl_tensor::{losses::cross_entropy, Tensor};
/// // Two equal logits: softmax [1/2, 1/2], loss ln 2; gradient (softmax − onehot)/1.
/// let logits = Tensor::<f64>::param(ndarray::arr2(&[[0.0, 0.0]]).into_dyn());
/// let loss = cross_entropy(&logits, &[1]);
/// assert!((loss.item() - 2f64.ln()).abs() < 1e-15);
/// loss.backward();
/// assert_eq!(logits.grad().unwrap().as_slice().unwrap(), &[0.5, -0.5]);
/// ```
pub fn cross_entropy<E: Element>(logits: &Tensor<E>, targets: &[usize]) -> Tensor<E> {
    let shape = logits.shape();
    let classes = *shape
        .last()
        .expect("cross_entropy: logits need a class axis, got a 0-dimensional tensor");
    let rows = logits.numel() / classes.max(1);
    assert_eq!(
        targets.len(),
        rows,
        "cross_entropy: logits of shape {shape:?} have {rows} rows but {} targets were given",
        targets.len()
    );
    if let Some((row, &target)) = targets.iter().enumerate().find(|&(_, &t)| t >= classes) {
        panic!("cross_entropy: target {target} (row {row}) is not below the {classes} classes");
    }
    // Each row's log-sum-exp is computed with the value, and kept for the VJP.
    let computed = crate::meta::computes(&[logits]).then(|| {
        let logits_value = logits.value();
        let standard = logits_value.as_standard_layout();
        let by_row = as_rows(standard.view(), rows, classes);
        let log_sum_exp: Vec<E> = by_row
            .outer_iter()
            .map(|row| stable_log_sum_exp(row))
            .collect();
        let total: f64 = by_row
            .outer_iter()
            .zip(targets.iter().zip(&log_sum_exp))
            .map(|(row, (&target, &lse))| (lse - row[target]).to_f64())
            .sum();
        let mean = E::from_f64(total / rows as f64);
        (ArrayD::from_elem(IxDyn(&[]), mean), log_sum_exp)
    });
    let (value, log_sum_exp) = computed.unzip();
    let value = || value.expect("computed for real inputs");
    let (saved, targets) = (logits.clone(), targets.to_vec());
    Tensor::from_op_shaped(&[], value, &[logits], move |grad_out| {
        let log_sum_exp = log_sum_exp.expect("a values VJP runs on real gradients only");
        let scale =
            grad_out.iter().next().copied().expect("one element") / E::from_f64(rows as f64);
        let logits_value = saved.value();
        let standard = logits_value.as_standard_layout();
        let by_row = as_rows(standard.view(), rows, classes);
        let mut grad = by_row.to_owned();
        for ((mut row, &lse), &target) in grad.outer_iter_mut().zip(&log_sum_exp).zip(&targets) {
            row.mapv_inplace(|z| (z - lse).exp() * scale);
            row[target] -= scale;
        }
        let grad = grad
            .into_shape_with_order(IxDyn(&shape))
            .expect("same count");
        vec![Some(grad)]
    })
}

/// A standard-layout array viewed as `[rows, classes]`.
fn as_rows<E: Element>(
    view: ndarray::ArrayViewD<'_, E>,
    rows: usize,
    classes: usize,
) -> ArrayView2<'_, E> {
    view.into_shape_with_order((rows, classes))
        .expect("standard layout, same count")
}

/// `log Σ exp(z)` computed as `m + log Σ exp(z − m)` with `m` the maximum, so no term
/// overflows and the largest is exactly 1.
fn stable_log_sum_exp<E: Element>(row: ndarray::ArrayView1<'_, E>) -> E {
    let max = row.iter().copied().fold(E::neg_infinity(), E::max);
    if !max.is_finite() {
        // All −∞ (or a +∞/NaN present): the shifted form would compute ∞ − ∞.
        return max;
    }
    let sum = Zip::from(&row).fold(E::zero(), |acc, &z| acc + (z - max).exp());
    max + sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Generator;
    use crate::testing::{assert_gradients, random_array};
    use ndarray::arr2;

    #[test]
    fn mse_gradient_matches_finite_differences() {
        let rng = Generator::new(3);
        let inputs = [random_array(&[2, 3], &rng), random_array(&[2, 3], &rng)];
        assert_gradients(|x| mse(&x[0], &x[1]), &inputs);
    }

    #[test]
    #[should_panic(expected = "mse: prediction shape [2, 3] and target shape [3, 2] differ")]
    fn mse_names_both_shapes() {
        mse(&Tensor::<f32>::zeros(&[2, 3]), &Tensor::zeros(&[3, 2]));
    }

    #[test]
    fn cross_entropy_hand_example() {
        // Row [ln 1, ln 3] = softmax [1/4, 3/4]; target 1: loss −ln(3/4) = ln(4/3).
        let logits = Tensor::<f64>::param(arr2(&[[0.0, 3f64.ln()]]).into_dyn());
        let loss = cross_entropy(&logits, &[1]);
        assert!((loss.item() - (4.0f64 / 3.0).ln()).abs() < 1e-15);
        loss.backward();
        // (softmax − onehot)/1 = [1/4, 3/4 − 1]
        let grad = logits.grad().unwrap();
        assert!((grad[[0, 0]] - 0.25).abs() < 1e-15 && (grad[[0, 1]] + 0.25).abs() < 1e-15);
    }

    #[test]
    fn cross_entropy_gradient_matches_finite_differences() {
        // [2, 2, 3]: four rows of three classes, leading axes flattened.
        let rng = Generator::new(4);
        let logits = [random_array(&[2, 2, 3], &rng).mapv(|z| 2.0 * z)];
        assert_gradients(|x| cross_entropy(&x[0], &[2, 0, 1, 1]), &logits);
    }

    #[test]
    fn cross_entropy_is_stable_for_huge_logits() {
        // Row 1: [1000, −1000], target 0: loss ≈ 0 (e^−2000 underflows to 0).
        // Row 2: [−1000, 1000], target 0: loss = 2000 + ln(1 + e^−2000) ≈ 2000.
        let logits = Tensor::<f32>::param(arr2(&[[1000.0, -1000.0], [-1000.0, 1000.0]]).into_dyn());
        let loss = cross_entropy(&logits, &[0, 0]);
        assert_eq!(loss.item(), 1000.0); // (0 + 2000)/2
        loss.backward();
        // (softmax − onehot)/2: row 1 [0, 0], row 2 [(0 − 1)/2, 1/2].
        let grad = logits.grad().unwrap();
        assert_eq!(grad, arr2(&[[0.0, 0.0], [-0.5, 0.5]]).into_dyn());
    }

    #[test]
    #[should_panic(expected = "cross_entropy: target 5 (row 1) is not below the 3 classes")]
    fn cross_entropy_names_an_out_of_range_target() {
        cross_entropy(&Tensor::<f32>::zeros(&[2, 3]), &[0, 5]);
    }

    #[test]
    #[should_panic(expected = "logits of shape [2, 3] have 2 rows but 3 targets were given")]
    fn cross_entropy_checks_the_target_count() {
        cross_entropy(&Tensor::<f32>::zeros(&[2, 3]), &[0, 1, 2]);
    }
}
