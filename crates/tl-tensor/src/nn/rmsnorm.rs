//! [`RmsNorm`]: root-mean-square normalisation with a learnable gain, as one fused op.

use ndarray::{Array1, ArrayD, IxDyn};
use rayon::prelude::*;

use super::Module;
use crate::kernels::rows::{lane_dot, lane_triple_dot};
use crate::kernels::written::{write_each, write_rows, written_on_pool};
use crate::{Element, Finisher, Tensor};

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
/// The op saves its input (shared, not copied) and one `r` per row. The two sums over a row,
/// `Σ x²` and `Σ ȳ·g·x`, are taken in [`lane_dot`]'s order of eight partial sums: one
/// running sum is a chain of dependent additions, which made the two sums most of the norm's
/// time at the capstone's width (320).
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
            gain: Tensor::param_with(&[dim], || ArrayD::ones(IxDyn(&[dim]))),
            eps,
        }
    }

    /// A normalisation with the given gain `[dim]`, used as it is (pass a parameter to
    /// train it; two norms made from one parameter share it).
    ///
    /// # Panics
    /// If `gain` is not 1-dimensional and non-empty, or `eps` is negative or not finite.
    pub fn from_weight(gain: Tensor<E>, eps: f64) -> Self {
        let shape = gain.shape();
        assert!(
            shape.len() == 1 && shape[0] > 0,
            "RmsNorm::from_weight: the gain must be [dim], got {shape:?}"
        );
        assert!(
            eps.is_finite() && eps >= 0.0,
            "RmsNorm::from_weight: eps must be finite and non-negative, got {eps}"
        );
        Self { gain, eps }
    }

    /// The learnable gain `g`, `[dim]`.
    pub fn weight(&self) -> &Tensor<E> {
        &self.gain
    }

    /// The constant added to the mean square.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// [`forward`](Module::forward), with `finish` applied to each block of output rows as
    /// soon as the block is computed, on the thread that computed it, while it is in cache.
    ///
    /// The VJP reads the op's input, never its output, so `finish` changes what the output's
    /// readers see and not the gradient the norm sends back. That is what autocast wants when
    /// only 16-bit products read the output: they would round it anyway, and rounding it here
    /// saves them a copy (tl-precision's `round_for_products`).
    ///
    /// ```
    /// use tl_tensor::nn::{Module, RmsNorm};
    /// use tl_tensor::Tensor;
    /// let norm = RmsNorm::<f64>::new(2, 0.0);
    /// let x = Tensor::from_vec(vec![3.0, 4.0], &[1, 2])?;
    /// let plain = norm.forward(&x).to_vec();
    /// let doubled = norm.forward_then(&x, &|rows| rows.iter_mut().for_each(|y| *y *= 2.0));
    /// assert_eq!(doubled.to_vec(), vec![2.0 * plain[0], 2.0 * plain[1]]);
    /// # Ok::<(), tl_tensor::TensorError>(())
    /// ```
    ///
    /// # Panics
    /// If the last axis of `x` is not `dim`.
    pub fn forward_then(&self, x: &Tensor<E>, finish: &Finisher<'_, E>) -> Tensor<E> {
        let shape = x.shape();
        let dim = self.gain.numel();
        assert!(
            shape.last() == Some(&dim),
            "RmsNorm: input shape {shape:?} does not end in dim = {dim}"
        );
        let rows = x.numel() / dim;
        let (eps, n) = (E::from_f64(self.eps), E::from_f64(dim as f64));
        let block = ROWS_PER_TASK * dim;
        // The rows' 1/rms is computed with the value, and kept for the VJP.
        let computed = crate::meta::computes(&[x, &self.gain]).then(|| {
            let x_value = x.value();
            let x_std = x_value.as_standard_layout();
            let xs = x_std.as_slice().expect("standard layout");
            let gain = self.gain.value();
            let gain = gain.as_slice().expect("a 1-D gain");
            let mut inv_rms = vec![E::zero(); rows];
            let inputs = inv_rms
                .par_chunks_mut(ROWS_PER_TASK)
                .zip(xs.par_chunks(block));
            let (out, _) = written_on_pool(rows * dim, block, inputs, |out, (inv_rms, xs)| {
                let out = write_rows(out, dim, |i, y| {
                    let x = &xs[i * dim..(i + 1) * dim];
                    let mean_square = lane_dot(x, x) / n;
                    let r = E::one() / (mean_square + eps).sqrt();
                    inv_rms[i] = r;
                    write_each(y, x.iter().zip(gain).map(|(&x, &g)| x * r * g))
                });
                finish(out);
                (out, ())
            });
            let value = ArrayD::from_shape_vec(IxDyn(&shape), out).expect("same count");
            (value, inv_rms)
        });
        let (value, inv_rms) = computed.unzip();
        let value = || value.expect("computed for real inputs");
        let (x_saved, gain_saved) = (x.clone(), self.gain.clone());
        Tensor::from_op_shaped(&shape.clone(), value, &[x, &self.gain], move |grad_out| {
            let inv_rms = inv_rms.expect("a values VJP runs on real gradients only");
            let x_value = x_saved.value();
            let x_std = x_value.as_standard_layout();
            let xs = x_std.as_slice().expect("standard layout");
            let grad_std = grad_out.as_standard_layout();
            let grads = grad_std.as_slice().expect("standard layout");
            let gain = gain_saved.value();
            let gain = gain.as_slice().expect("a 1-D gain");
            // Each task writes its rows of ∂L/∂x and returns its rows' share of ∂L/∂g.
            let inputs = xs
                .par_chunks(block)
                .zip(grads.par_chunks(block))
                .zip(inv_rms.par_chunks(ROWS_PER_TASK));
            let (x_grad, gain_partials) =
                written_on_pool(rows * dim, block, inputs, |dxs, ((xs, dys), inv_rms)| {
                    let mut dg = vec![E::zero(); dim];
                    let dxs = write_rows(dxs, dim, |i, dx| {
                        let (x, dy) = (&xs[i * dim..(i + 1) * dim], &dys[i * dim..(i + 1) * dim]);
                        let r = inv_rms[i];
                        let dot = lane_triple_dot(dy, gain, x);
                        let coefficient = r * r * r / n * dot;
                        for ((dg, &dy), &xi) in dg.iter_mut().zip(dy).zip(x) {
                            *dg += dy * xi * r;
                        }
                        let terms = dy.iter().zip(gain).zip(x);
                        write_each(
                            dx,
                            terms.map(|((&dy, &g), &xi)| r * g * dy - coefficient * xi),
                        )
                    });
                    (dxs, dg)
                });
            let x_grad = x_saved
                .requires_grad()
                .then(|| ArrayD::from_shape_vec(IxDyn(&shape), x_grad).expect("same count"));
            let gain_grad = gain_saved.requires_grad().then(|| {
                let mut gain_grad = Array1::<E>::zeros(dim);
                for partial in &gain_partials {
                    for (g, &p) in gain_grad.iter_mut().zip(partial) {
                        *g += p;
                    }
                }
                gain_grad.into_dyn()
            });
            vec![x_grad, gain_grad]
        })
    }
}

/// Rows per rayon task, in both directions. It is also the block of rows whose gain
/// gradients are summed first: the blocks' partial sums are then added in order, so the
/// result does not depend on the number of threads.
const ROWS_PER_TASK: usize = 256;

impl<E: Element> Module<E> for RmsNorm<E> {
    /// Normalises `x` of shape `[.., dim]`; the output has the same shape.
    ///
    /// # Panics
    /// If the last axis of `x` is not `dim`.
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        self.forward_then(x, &|_| {})
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
    fn many_rows_split_over_threads_keep_every_row_and_the_same_bits() {
        // 2 full blocks of rows and 3 more: each row's output and input gradient is its own
        // computation; the gain gradient adds up every block's share, whatever the threads.
        let rng = Generator::new(6);
        let rows = 2 * ROWS_PER_TASK + 3;
        let x = random_array(&[rows, 5], &rng).mapv(|v| v as f32);
        let dy = random_array(&[rows, 5], &rng).mapv(|v| v as f32);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let norm = RmsNorm::<f32>::new(5, 1e-5);
                let input = Tensor::param(x.clone());
                let y = norm.forward(&input);
                y.backward_with(dy.clone());
                let grad = |t: &Tensor<f32>| t.grad().unwrap().iter().copied().collect::<Vec<_>>();
                (y.to_vec(), grad(&input), grad(norm.weight()))
            })
        };
        let (y, dx, dg) = run(1);
        assert_eq!((y.clone(), dx.clone(), dg.clone()), run(3));
        // Against the formulas row by row, in f64.
        let mut expected_dg = [0.0f64; 5];
        for row in 0..rows {
            let xr: Vec<f64> = (0..5).map(|j| f64::from(x[[row, j]])).collect();
            let r = 1.0 / (xr.iter().map(|v| v * v).sum::<f64>() / 5.0 + 1e-5).sqrt();
            let dot: f64 = (0..5).map(|j| f64::from(dy[[row, j]]) * xr[j]).sum();
            for j in 0..5 {
                assert!((f64::from(y[row * 5 + j]) - xr[j] * r).abs() < 1e-5);
                let expected_dx = r * f64::from(dy[[row, j]]) - r * r * r / 5.0 * xr[j] * dot;
                assert!((f64::from(dx[row * 5 + j]) - expected_dx).abs() < 1e-4);
                expected_dg[j] += f64::from(dy[[row, j]]) * xr[j] * r;
            }
        }
        for (g, e) in dg.iter().zip(expected_dg) {
            assert!(
                (f64::from(*g) - e).abs() < 1e-3 * e.abs().max(1.0),
                "{g} vs {e}"
            );
        }
    }

    #[test]
    fn the_finisher_sees_each_row_once_and_leaves_the_gradients_alone() {
        // Several blocks of rows: the finisher adds 1 to what it is given, so a row it
        // skipped or saw twice shows; the gradients are the plain norm's, since the VJP
        // reads the input and the gain.
        let rng = Generator::new(9);
        let rows = 2 * ROWS_PER_TASK + 3;
        let x = random_array(&[rows, 4], &rng);
        let norm = RmsNorm::<f64>::new(4, 1e-5);
        let run = |finish: &Finisher<'_, f64>| {
            let xt = Tensor::param(x.clone());
            let y = norm.forward_then(&xt, finish);
            y.sum_all().backward();
            let grads = (xt.grad().unwrap(), norm.weight().grad().unwrap());
            norm.weight().zero_grad();
            (y.to_vec(), grads)
        };
        let (plain, finished) = (
            run(&|_| {}),
            run(&|rows| rows.iter_mut().for_each(|y| *y += 1.0)),
        );
        let shifted: Vec<f64> = plain.0.iter().map(|y| y + 1.0).collect();
        assert_eq!(finished.0, shifted);
        assert_eq!(finished.1, plain.1);
    }

    #[test]
    #[should_panic(expected = "RmsNorm: input shape [2, 5] does not end in dim = 4")]
    fn a_wrong_size_names_the_shapes() {
        RmsNorm::<f32>::new(4, 1e-5).forward(&Tensor::ones(&[2, 5]));
    }
}
