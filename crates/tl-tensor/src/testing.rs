//! Gradient checks against finite differences, for this crate's tests and any other crate's.
//!
//! Autograd gradients are compared with f64 central differences of a scalar projection of the
//! output, L = Σ f(x) ⊙ R with a fixed random R: one random direction checks every output
//! element's VJP at once (a VJP that is wrong for some element changes L's gradient unless R
//! happens to weight that element by exactly 0).
//!
//! ```
//! use tl_tensor::testing::{GradcheckOptions, check_gradients, random_array};
//! use tl_tensor::Generator;
//! let rng = Generator::new(0);
//! let inputs = [random_array(&[2, 3], &rng), random_array(&[3], &rng)];
//! // f(a, b) = tanh(a ⊙ b), with b broadcast over the rows of a.
//! let result = check_gradients(
//!     |x| (&x[0] * &x[1]).tanh(),
//!     &inputs,
//!     GradcheckOptions::default(),
//! );
//! assert!(result.is_ok(), "{}", result.unwrap_err());
//! ```

use std::fmt;

use ndarray::{ArrayD, Dimension, IxDyn, Zip};

use crate::{Generator, Tensor, no_grad};

/// Settings of a gradient check.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradcheckOptions {
    /// The finite-difference step h: the derivative is estimated as (L(x+h) − L(x−h)) / 2h,
    /// whose error is O(h²) from truncation plus O(ε_f64 · |L| / h) from rounding.
    pub epsilon: f64,
    /// The absolute part of the tolerance.
    pub abs_tolerance: f64,
    /// The relative part of the tolerance, times the finite-difference estimate's magnitude.
    pub rel_tolerance: f64,
    /// Seed of the random projection R.
    pub seed: u64,
}

impl Default for GradcheckOptions {
    /// h = 1e-6 and a tolerance of 1e-6 + 1e-5·|numeric|: the rounding error of the estimate
    /// stays near 1e-10·|L|, far inside it, while a wrong VJP misses by orders of magnitude.
    fn default() -> Self {
        Self {
            epsilon: 1e-6,
            abs_tolerance: 1e-6,
            rel_tolerance: 1e-5,
            seed: 0x6772_6164,
        }
    }
}

/// An input element whose autograd gradient disagrees with its finite-difference estimate.
#[derive(Clone, Debug, PartialEq)]
pub struct GradcheckFailure {
    /// Which input (position in the slice given to the check).
    pub input: usize,
    /// The element's multi-index within that input.
    pub index: Vec<usize>,
    /// The gradient from backward (0 when backward gave the input none).
    pub analytic: f64,
    /// The central-difference estimate.
    pub numeric: f64,
}

impl fmt::Display for GradcheckFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "gradient mismatch at input {} element {:?}: autograd {:e}, finite difference {:e} \
             (difference {:e})",
            self.input,
            self.index,
            self.analytic,
            self.numeric,
            self.analytic - self.numeric
        )
    }
}

impl std::error::Error for GradcheckFailure {}

/// Checks the gradients of `f` with respect to each of its `inputs` against central finite
/// differences, in f64.
///
/// `f` receives the inputs as parameters (leaves requiring grad) and must be deterministic:
/// it is called once with the graph recorded and twice per input element under
/// [`no_grad`].
///
/// # Errors
/// The first element (input by input, in row-major order) where the two gradients differ by
/// more than `abs_tolerance + rel_tolerance · |numeric|`, or where either is not finite.
pub fn check_gradients(
    f: impl Fn(&[Tensor<f64>]) -> Tensor<f64>,
    inputs: &[ArrayD<f64>],
    options: GradcheckOptions,
) -> Result<(), GradcheckFailure> {
    let params: Vec<Tensor<f64>> = inputs.iter().cloned().map(Tensor::param).collect();
    check_parameter_gradients(|| f(&params), &params, options)
}

/// Checks the gradients that `f` gives to `params` — tensors it reads, such as a layer's
/// weights — against central finite differences, in f64.
///
/// The check perturbs each parameter's value in place (and puts back the exact original),
/// so it also works on tensors held inside a module. It clears the parameters' gradients
/// first, and leaves them holding the gradient of L = Σ f() ⊙ R.
///
/// # Errors
/// As [`check_gradients`], with `input` the position in `params`.
///
/// # Panics
/// If a parameter does not require grad.
pub fn check_parameter_gradients(
    f: impl Fn() -> Tensor<f64>,
    params: &[Tensor<f64>],
    options: GradcheckOptions,
) -> Result<(), GradcheckFailure> {
    for (i, param) in params.iter().enumerate() {
        assert!(
            param.requires_grad() && param.is_leaf(),
            "gradcheck: parameter {i} is not a leaf requiring grad"
        );
        param.zero_grad();
    }
    let output = f();
    let projection = random_array(&output.shape(), &Generator::new(options.seed));
    let loss = (&output * &Tensor::from_array(projection.clone())).sum_all();
    drop(output);
    if loss.requires_grad() {
        loss.backward();
    }
    let evaluate = || {
        let _off = no_grad();
        f().to_array()
    };
    for (input, param) in params.iter().enumerate() {
        let analytic = param
            .grad()
            .unwrap_or_else(|| ArrayD::zeros(IxDyn(&param.shape())));
        for (index, &analytic) in analytic.indexed_iter() {
            let original = param.value()[&index];
            let h = options.epsilon;
            param.update_value(|v| v[&index] = original + h);
            let above = evaluate();
            param.update_value(|v| v[&index] = original - h);
            let below = evaluate();
            param.update_value(|v| v[&index] = original);
            // Differences taken element by element before projecting: an output element that
            // is large but constant (a −1e9 mask fill) would otherwise drown the change of L
            // in rounding.
            let numeric = Zip::from(&above)
                .and(&below)
                .and(&projection)
                .fold(0.0, |acc, &a, &b, &r| acc + (a - b) * r)
                / (2.0 * h);
            let tolerance = options.abs_tolerance + options.rel_tolerance * numeric.abs();
            // A NaN on either side makes the comparison false, so it fails the check.
            let agrees = (analytic - numeric).abs() <= tolerance;
            if !agrees {
                return Err(GradcheckFailure {
                    input,
                    index: index.slice().to_vec(),
                    analytic,
                    numeric,
                });
            }
        }
    }
    Ok(())
}

/// [`check_gradients`] with default options, panicking with the failure's message: the
/// one-line form for tests.
///
/// # Panics
/// When the gradients disagree (see [`check_gradients`]).
pub fn assert_gradients(f: impl Fn(&[Tensor<f64>]) -> Tensor<f64>, inputs: &[ArrayD<f64>]) {
    if let Err(failure) = check_gradients(f, inputs, GradcheckOptions::default()) {
        panic!("{failure}");
    }
}

/// An array of standard normal draws from `rng`, in row-major order.
pub fn random_array(shape: &[usize], rng: &Generator) -> ArrayD<f64> {
    ArrayD::from_shape_simple_fn(IxDyn(shape), || rng.next_normal())
}

/// An array of uniform draws from `[low, high)` — positive inputs for `log`, `sqrt`, `rsqrt`.
pub fn random_uniform(shape: &[usize], low: f64, high: f64, rng: &Generator) -> ArrayD<f64> {
    ArrayD::from_shape_simple_fn(IxDyn(shape), || low + (high - low) * rng.next_f64())
}

/// An array whose magnitudes are uniform in `[min_abs, min_abs + 1)` with random signs —
/// inputs kept away from the kink at 0 of `relu` and `abs`, where finite differences
/// straddle two slopes.
pub fn random_away_from_zero(shape: &[usize], min_abs: f64, rng: &Generator) -> ArrayD<f64> {
    ArrayD::from_shape_simple_fn(IxDyn(shape), || {
        let magnitude = min_abs + rng.next_f64();
        if rng.next_u64() & 1 == 0 {
            magnitude
        } else {
            -magnitude
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_correct_vjp_passes() {
        let rng = Generator::new(1);
        let x = random_array(&[3, 2], &rng);
        assert_gradients(|x| (&x[0] * &x[0]).sum_axes(&[1], false), &[x]);
    }

    #[test]
    fn a_wrong_vjp_is_caught_and_located() {
        // y = x² with a VJP of x instead of 2x: off by exactly x at every element.
        let squared_with_wrong_vjp = |x: &[Tensor<f64>]| {
            let saved = x[0].clone();
            let value = x[0].value().mapv(|v| v * v);
            Tensor::from_op(value, &[&x[0]], move |grad| {
                vec![Some(grad * &*saved.value())]
            })
        };
        let x = ndarray::arr1(&[0.0, 2.0]).into_dyn();
        let failure = check_gradients(squared_with_wrong_vjp, &[x], GradcheckOptions::default())
            .expect_err("the VJP is wrong");
        // Element 0 is x = 0, where x and 2x agree; element 1 is the first mismatch.
        assert_eq!((failure.input, failure.index.clone()), (0, vec![1]));
        assert!((failure.analytic / failure.numeric - 0.5).abs() < 1e-6);
        assert!(
            failure
                .to_string()
                .starts_with("gradient mismatch at input 0 element [1]")
        );
    }

    #[test]
    fn an_input_without_gradient_is_compared_as_zero() {
        // f ignores its second input: its true gradient is 0, and backward gives it none.
        let inputs = [
            ndarray::arr1(&[1.0]).into_dyn(),
            ndarray::arr1(&[5.0]).into_dyn(),
        ];
        assert_gradients(|x| x[0].mul_scalar(3.0), &inputs);
    }

    #[test]
    fn a_large_constant_output_does_not_drown_the_difference() {
        // Half the output is filled with −1e9: L ≈ 1e9 has a rounding step of ~1e-7, the
        // size of the change h·R ≈ 1e-6 that a difference of L itself would measure.
        let mask = ndarray::arr1(&[false, true, false, true]).into_dyn();
        let x = ndarray::arr1(&[0.5, 1.0, -2.0, 3.0]).into_dyn();
        assert_gradients(|x| x[0].masked_fill(&mask, -1e9), &[x]);
    }

    #[test]
    fn parameters_are_restored_exactly() {
        let w = Tensor::<f64>::param(ndarray::arr1(&[0.1, 0.7]).into_dyn());
        let before = w.to_vec();
        check_parameter_gradients(|| w.exp(), std::slice::from_ref(&w), Default::default())
            .unwrap();
        assert_eq!(w.to_vec(), before);
        assert!(w.grad().is_some());
    }
}
