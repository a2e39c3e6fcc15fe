//! Elementwise functions of one tensor: exponentials, powers and the activations of a
//! transformer, each with its derivative beside it.
//!
//! Two ways to save for backward: an op whose derivative is cheapest from its *input* goes
//! through [`Tensor::map_with_derivative`]; an op whose derivative is a function of its
//! *output* (`exp`, `sqrt`, `tanh`, `sigmoid`, …) saves the output instead, through
//! [`Tensor::map_with_output_derivative`]. The output is stored anyway (the next op usually
//! saves it as its own input), so saving it costs no extra memory.

use std::cell::OnceCell;
use std::rc::Rc;

use ndarray::ArrayD;

use super::elementwise::{map_elementwise, scale_elementwise};
use crate::{Element, Tensor};

/// The logistic function 1 / (1 + e^(−x)), written so that neither branch overflows.
fn logistic(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// Φ(x), the standard normal CDF: ½ (1 + erf(x / √2)).
fn normal_cdf(x: f64) -> f64 {
    0.5 * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2))
}

/// φ(x), the standard normal density: e^(−x²/2) / √(2π).
fn normal_pdf(x: f64) -> f64 {
    const INV_SQRT_TAU: f64 = 0.398_942_280_401_432_7;
    INV_SQRT_TAU * (-0.5 * x * x).exp()
}

/// Applies an `f64` function to an element of any type (the activations whose special
/// functions we evaluate in `f64`, then round once).
fn in_f64<E: Element>(f: impl Fn(f64) -> f64 + Send + Sync) -> impl Fn(E) -> E + Send + Sync {
    move |x| E::from_f64(f(x.to_f64()))
}

impl<E: Element> Tensor<E> {
    /// Records an op whose VJP needs the op's own output: `vjp(grad_out, output)` returns one
    /// gradient per parent, as for [`Tensor::from_op`]. The output is `compute()`, of shape
    /// `shape`, as for [`Tensor::from_op_shaped`].
    ///
    /// The VJP sees the output through a handle that shares its storage and sits outside the
    /// graph: no copy, and no reference cycle from the output's node back to itself. Fused
    /// ops outside this crate (softmax-like ops of a model) use it to save only their output.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// // y = x², written through its output: dy/dx = 2x = 2·sqrt(y) for x ≥ 0.
    /// let x = Tensor::<f64>::param(ndarray::arr1(&[3.0]).into_dyn());
    /// let square = || x.value().mapv(|v| v * v);
    /// let y = Tensor::from_op_saving_output(&[1], square, &[&x], |grad, y| {
    ///     vec![Some(grad * &y.mapv(|v| 2.0 * v.sqrt()))]
    /// });
    /// y.sum_all().backward();
    /// assert_eq!(x.grad().unwrap()[[0]], 6.0);
    /// ```
    pub fn from_op_saving_output(
        shape: &[usize],
        compute: impl FnOnce() -> ArrayD<E>,
        parents: &[&Tensor<E>],
        vjp: impl FnOnce(ArrayD<E>, &ArrayD<E>) -> Vec<Option<ArrayD<E>>> + 'static,
    ) -> Tensor<E> {
        let slot: Rc<OnceCell<Tensor<E>>> = Rc::new(OnceCell::new());
        let saved = Rc::clone(&slot);
        let output = Tensor::from_op_shaped(shape, compute, parents, move |grad_out| {
            let output = saved
                .get()
                .expect("the output is saved as soon as it is made");
            vjp(grad_out, &output.value())
        });
        if output.requires_grad() {
            // Only a recorded node keeps the slot alive; otherwise it is dropped here.
            let _ = slot.set(output.detach());
        }
        output
    }

    /// An elementwise function `f` whose derivative `df_of_output` is expressed through the
    /// output y = f(x): the VJP is `grad_out · df_of_output(y)`. Saves the output, not the
    /// input.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// // y = eˣ, so dy/dx = y.
    /// let x = Tensor::<f64>::param(ndarray::arr1(&[0.0, 1.0]).into_dyn());
    /// let y = x.map_with_output_derivative(f64::exp, |y| y);
    /// y.sum_all().backward();
    /// assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[1.0, 1f64.exp()]);
    /// ```
    pub fn map_with_output_derivative(
        &self,
        f: impl Fn(E) -> E + Send + Sync,
        df_of_output: impl Fn(E) -> E + Send + Sync + 'static,
    ) -> Tensor<E> {
        let value = || map_elementwise(&self.value(), f);
        Tensor::from_op_saving_output(&self.shape(), value, &[self], move |mut grad, output| {
            scale_elementwise(&mut grad, output, df_of_output);
            vec![Some(grad)]
        })
    }

    /// eˣ elementwise. d/dx = eˣ, read from the saved output.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let x = Tensor::<f64>::from_vec(vec![0.0, 1.0], &[2])?;
    /// assert_eq!(x.exp().to_vec(), vec![1.0, std::f64::consts::E]);
    /// # Ok::<(), tl_tensor::TensorError>(())
    /// ```
    pub fn exp(&self) -> Tensor<E> {
        self.map_with_output_derivative(E::exp, |y| y)
    }

    /// The natural logarithm elementwise. d/dx = 1/x (infinite at 0, NaN below).
    pub fn log(&self) -> Tensor<E> {
        self.map_with_derivative(E::ln, |x| x.recip())
    }

    /// √x elementwise. d/dx = 1 / (2√x), read from the saved output.
    pub fn sqrt(&self) -> Tensor<E> {
        let half = E::from_f64(0.5);
        self.map_with_output_derivative(E::sqrt, move |y| half / y)
    }

    /// 1/√x elementwise (RMSNorm's scale). With y = x^(−½), d/dx = −½ x^(−3/2) = −½ y³.
    pub fn rsqrt(&self) -> Tensor<E> {
        let minus_half = E::from_f64(-0.5);
        self.map_with_output_derivative(|x| x.sqrt().recip(), move |y| minus_half * y * y * y)
    }

    /// xⁿ elementwise for an integer n. d/dx = n xⁿ⁻¹ (0 for n = 0).
    pub fn powi(&self, n: i32) -> Tensor<E> {
        let factor = E::from_f64(f64::from(n));
        self.map_with_derivative(
            move |x| x.powi(n),
            move |x| {
                if n == 0 {
                    E::zero()
                } else {
                    factor * x.powi(n - 1)
                }
            },
        )
    }

    /// max(x, 0) elementwise (NaN stays NaN). d/dx = 1 where x > 0, else 0 (0 at the kink,
    /// as in PyTorch); read from the saved output, since y > 0 exactly where x > 0.
    pub fn relu(&self) -> Tensor<E> {
        self.map_with_output_derivative(
            |x| if x < E::zero() { E::zero() } else { x },
            |y| if y > E::zero() { E::one() } else { E::zero() },
        )
    }

    /// The exact GELU, x Φ(x) with Φ the standard normal CDF, Φ(x) = ½ (1 + erf(x/√2)) —
    /// PyTorch's default (`approximate='none'`), not the tanh approximation.
    /// d/dx = Φ(x) + x φ(x), with φ the standard normal density.
    ///
    /// Evaluated in `f64` and rounded once to `E`.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let x = Tensor::<f64>::from_vec(vec![0.0, 1.0], &[2])?;
    /// let y = x.gelu().to_vec();
    /// assert_eq!(y[0], 0.0);
    /// assert!((y[1] - 0.841_344_746_068_542_9).abs() < 1e-15); // Φ(1)
    /// # Ok::<(), tl_tensor::TensorError>(())
    /// ```
    pub fn gelu(&self) -> Tensor<E> {
        self.map_with_derivative(
            in_f64(|x| x * normal_cdf(x)),
            in_f64(|x| normal_cdf(x) + x * normal_pdf(x)),
        )
    }

    /// SiLU (swish), x σ(x) with σ the logistic function: the gate of a SwiGLU MLP.
    /// d/dx = σ(x) (1 + x (1 − σ(x))).
    pub fn silu(&self) -> Tensor<E> {
        self.map_with_derivative(
            in_f64(|x| x * logistic(x)),
            in_f64(|x| {
                let s = logistic(x);
                s * (1.0 + x * (1.0 - s))
            }),
        )
    }

    /// The logistic sigmoid σ(x) = 1 / (1 + e^(−x)), without overflow for large |x|.
    /// d/dx = y (1 − y), read from the saved output.
    pub fn sigmoid(&self) -> Tensor<E> {
        self.map_with_output_derivative(in_f64(logistic), |y| y * (E::one() - y))
    }

    /// tanh x elementwise. d/dx = 1 − y², read from the saved output.
    pub fn tanh(&self) -> Tensor<E> {
        self.map_with_output_derivative(E::tanh, |y| E::one() - y * y)
    }

    /// |x| elementwise. d/dx = sign(x), and 0 at x = 0 (as PyTorch).
    pub fn abs(&self) -> Tensor<E> {
        self.map_with_derivative(E::abs, |x| {
            if x > E::zero() {
                E::one()
            } else if x < E::zero() {
                -E::one()
            } else {
                E::zero()
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::arr1;

    fn param(values: &[f64]) -> Tensor<f64> {
        Tensor::param(arr1(values).into_dyn())
    }

    #[test]
    fn relu_and_abs_have_zero_gradient_at_zero() {
        let x = param(&[-2.0, 0.0, 3.0]);
        (x.relu() + x.abs()).sum_all().backward();
        // relu' = [0, 0, 1], abs' = [-1, 0, 1]
        assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[-1.0, 0.0, 2.0]);
    }

    #[test]
    fn activations_at_hand_computed_points() {
        let x = param(&[0.0]);
        // σ(0) = ½; silu(0) = 0 with slope σ(0) = ½; gelu(0) = 0 with slope Φ(0) = ½;
        // tanh(0) = 0 with slope 1.
        assert_eq!(x.sigmoid().item(), 0.5);
        let total = x.silu() + x.gelu() + x.tanh();
        assert_eq!(total.item(), 0.0);
        total.backward();
        assert_eq!(x.grad().unwrap()[[0]], 2.0);
    }

    #[test]
    fn f32_results_are_the_f64_results_rounded_once() {
        let inputs = [-3.0f32, -0.5, 0.25, 2.0];
        let x32 = Tensor::<f32>::from_vec(inputs.to_vec(), &[4]).unwrap();
        let x64 = Tensor::<f64>::from_vec(inputs.map(f64::from).to_vec(), &[4]).unwrap();
        let pairs = [
            (x32.gelu(), x64.gelu()),
            (x32.silu(), x64.silu()),
            (x32.sigmoid(), x64.sigmoid()),
        ];
        for (single, double) in pairs {
            let rounded: Vec<f32> = double.to_vec().iter().map(|&v| v as f32).collect();
            assert_eq!(single.to_vec(), rounded);
        }
    }

    #[test]
    fn sigmoid_saturates_without_overflow() {
        let y = param(&[-800.0, 800.0]).sigmoid().to_vec();
        assert_eq!(y, vec![0.0, 1.0]);
    }

    #[test]
    fn output_saving_ops_share_the_output_storage() {
        // A saved output is the output itself: making y allocates y and nothing more.
        let x = param(&[1.0, 4.0, 9.0]);
        let before = crate::memory::live_bytes();
        let y = x.sqrt();
        assert_eq!(crate::memory::live_bytes() - before, 3 * 8);
        assert_eq!(y.to_vec(), vec![1.0, 2.0, 3.0]);
        y.sum_all().backward();
        // d√x/dx = 1/(2√x) = [1/2, 1/4, 1/6]
        let grad = x.grad().unwrap();
        assert_eq!(grad[[0]], 0.5);
        assert_eq!(grad[[1]], 0.25);
        assert!((grad[[2]] - 1.0 / 6.0).abs() < 1e-15);
    }

    #[test]
    fn a_dropped_output_frees_its_storage_without_backward() {
        // The saved handle lives in the output's own node: a strong handle there would be a
        // reference cycle, and the output would leak.
        let x = param(&[1.0, 2.0]);
        let before = crate::memory::live_bytes();
        let y = x.exp();
        assert_eq!(crate::memory::live_bytes() - before, 2 * 8);
        drop(y);
        assert_eq!(crate::memory::live_bytes(), before);
    }
}
