//! The SwiGLU gate `silu(g) ⊙ u` as one op: one pass over memory forward, one backward.
//!
//! Built from separate ops, the gate of a SwiGLU MLP costs three passes and three saved
//! tensors (the pre-activation, `silu(g)` and `u`) and evaluates the logistic function twice,
//! once forward and once in the VJP of `silu`. Fused, it reads `g` and `u` once, writes the
//! product once, and saves only its two inputs; the VJP writes both gradients in one pass.

use ndarray::ArrayD;
use rayon::prelude::*;

use crate::kernels::written::written_on_pool;
use crate::{Element, Finisher, Tensor};

/// Elements per rayon task: a few pages of each operand, and the portable loops' buffer of
/// logistic values stays in the L1 cache. The loops themselves are
/// [`kernels::swiglu`](crate::kernels::swiglu)'s.
const CHUNK: usize = 4096;

impl<E: Element> Tensor<E> {
    /// `silu(self) ⊙ up`, the gate of a SwiGLU MLP, with `self` the gate's pre-activation
    /// `g` and `silu(g) = g·σ(g)`.
    ///
    /// Computed in the element type (for `f32`, within a few ulp of the exact value; the
    /// separate [`silu`](Tensor::silu) rounds an `f64` evaluation instead). VJPs, with `ȳ`
    /// the output gradient: `ḡ = ȳ ⊙ u ⊙ σ(g)(1 + g(1 − σ(g)))` and `ū = ȳ ⊙ g·σ(g)`.
    /// Saves only `g` and `u`. Both directions run on the rayon pool, a chunk per task.
    ///
    /// # Panics
    /// If the shapes differ (there is no broadcasting).
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let g = Tensor::<f64>::from_vec(vec![0.0, 2.0], &[2])?;
    /// let u = Tensor::<f64>::from_vec(vec![5.0, 3.0], &[2])?;
    /// let y = g.swiglu(&u).to_vec();
    /// assert_eq!(y[0], 0.0); // silu(0) = 0
    /// assert!((y[1] - 3.0 * 2.0 / (1.0 + (-2f64).exp())).abs() < 1e-15);
    /// # Ok::<(), tl_tensor::TensorError>(())
    /// ```
    pub fn swiglu(&self, up: &Tensor<E>) -> Tensor<E> {
        self.swiglu_then(up, &|_| {})
    }

    /// [`swiglu`](Tensor::swiglu), with `finish` applied to each chunk of the result as soon
    /// as the chunk is computed, on the thread that computed it, while it is in cache.
    ///
    /// The VJP reads the op's inputs, never its result, so `finish` changes what the result's
    /// readers see and not the gradients the op sends back. That is what autocast wants when
    /// only a 16-bit product reads the result (the MLP's down projection): it would round the
    /// result anyway, and rounding it here saves it a copy (tl-precision's
    /// `round_for_products`).
    ///
    /// # Panics
    /// If the shapes differ.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let g = Tensor::<f64>::from_vec(vec![0.0, 2.0], &[2])?;
    /// let u = Tensor::<f64>::from_vec(vec![5.0, 3.0], &[2])?;
    /// let negated = g.swiglu_then(&u, &|chunk| chunk.iter_mut().for_each(|y| *y = -*y));
    /// assert_eq!(negated.to_vec(), g.swiglu(&u).mul_scalar(-1.0).to_vec());
    /// # Ok::<(), tl_tensor::TensorError>(())
    /// ```
    pub fn swiglu_then(&self, up: &Tensor<E>, finish: &Finisher<'_, E>) -> Tensor<E> {
        let (gate_shape, up_shape) = (self.shape(), up.shape());
        assert!(
            gate_shape == up_shape,
            "swiglu: the gate {gate_shape:?} and the up projection {up_shape:?} differ in shape"
        );
        let value = || {
            let (gate, up) = (self.value(), up.value());
            let (gate, up) = (gate.as_standard_layout(), up.as_standard_layout());
            let (gs, us) = (contiguous(&gate), contiguous(&up));
            let inputs = gs.par_chunks(CHUNK).zip(us.par_chunks(CHUNK));
            let (out, _) = written_on_pool(gs.len(), CHUNK, inputs, |y, (gs, us)| {
                let y = E::swiglu(gs, us, y);
                finish(y);
                (y, ())
            });
            ArrayD::from_shape_vec(gate.raw_dim(), out).expect("same count")
        };
        let (gate_saved, up_saved) = (self.clone(), up.clone());
        Tensor::from_op_shaped(&gate_shape, value, &[self, up], move |grad| {
            let (gate, up) = (gate_saved.value(), up_saved.value());
            let (gate, up) = (gate.as_standard_layout(), up.as_standard_layout());
            let (gs, us) = (contiguous(&gate), contiguous(&up));
            // ḡ overwrites the incoming gradient (copied only if it is not in standard layout).
            let mut gate_grad = if grad.is_standard_layout() {
                grad
            } else {
                grad.as_standard_layout().into_owned()
            };
            let dgs = gate_grad.as_slice_mut().expect("standard layout");
            let inputs = dgs
                .par_chunks_mut(CHUNK)
                .zip(gs.par_chunks(CHUNK).zip(us.par_chunks(CHUNK)));
            let (up_grad, _) = written_on_pool(gs.len(), CHUNK, inputs, |dus, (dgs, (gs, us))| {
                (E::swiglu_grads(dgs, gs, us, dus), ())
            });
            let up_grad = ArrayD::from_shape_vec(gate_grad.raw_dim(), up_grad).expect("same count");
            vec![
                gate_saved.requires_grad().then_some(gate_grad),
                up_saved.requires_grad().then_some(up_grad),
            ]
        })
    }
}

/// The elements of a standard-layout array, in order.
fn contiguous<'a, E>(array: &'a ndarray::CowArray<'_, E, ndarray::IxDyn>) -> &'a [E] {
    array.as_slice().expect("standard layout")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Generator;
    use crate::testing::{assert_gradients, random_array};

    #[test]
    fn agrees_with_silu_times_up_and_with_finite_differences() {
        let rng = Generator::new(11);
        let (g, u) = (random_array(&[3, 7], &rng), random_array(&[3, 7], &rng));
        let fused = Tensor::from_array(g.clone()).swiglu(&Tensor::from_array(u.clone()));
        let separate = Tensor::from_array(g.clone())
            .silu()
            .mul(&Tensor::from_array(u.clone()));
        for (a, b) in fused.to_vec().iter().zip(separate.to_vec()) {
            assert!((a - b).abs() < 1e-15, "{a} vs {b}");
        }
        assert_gradients(|xs| xs[0].swiglu(&xs[1]), &[g, u]);
    }

    #[test]
    fn large_arrays_split_over_threads_give_the_same_bits() {
        // Several chunks for the pool; each element alone, so the bits agree with an
        // element-by-element evaluation (with the same vectorized exp), forward and backward.
        let rng = Generator::new(2);
        let n = 3 * CHUNK + 3;
        let (g, u) = (
            random_array(&[n], &rng).mapv(|x| (4.0 * x) as f32),
            random_array(&[n], &rng).mapv(|x| x as f32),
        );
        let (gt, ut) = (Tensor::param(g.clone()), Tensor::param(u.clone()));
        let y = gt.swiglu(&ut);
        y.sum_all().backward();
        let (dg, du) = (gt.grad().unwrap(), ut.grad().unwrap());
        for i in [0, 1, n / 2, n - 1] {
            let s = 1.0 / (1.0 + crate::kernels::exp::exp(-g[i]));
            assert_eq!(y.to_vec()[i], g[i] * s * u[i]);
            assert_eq!(du[i], g[i] * s);
            assert_eq!(dg[i], u[i] * s * (1.0 + g[i] * (1.0 - s)));
        }
    }

    #[test]
    fn the_finisher_sees_each_value_once_and_leaves_the_gradients_alone() {
        // Several chunks: the finisher adds 1 to what it is given, so a value it skipped or
        // saw twice shows; the gradients are the plain op's, since the VJP reads the inputs.
        let rng = Generator::new(6);
        let n = 2 * CHUNK + 5;
        let [g, u] = [0, 1].map(|_| random_array(&[n], &rng));
        let run = |finish: &Finisher<'_, f64>| {
            let (gt, ut) = (Tensor::param(g.clone()), Tensor::param(u.clone()));
            let y = gt.swiglu_then(&ut, finish);
            y.sum_all().backward();
            (y.to_vec(), gt.grad().unwrap(), ut.grad().unwrap())
        };
        let (plain, finished) = (
            run(&|_| {}),
            run(&|chunk| chunk.iter_mut().for_each(|y| *y += 1.0)),
        );
        let shifted: Vec<f64> = plain.0.iter().map(|y| y + 1.0).collect();
        assert_eq!(finished.0, shifted);
        assert_eq!((finished.1, finished.2), (plain.1, plain.2));
    }

    #[test]
    fn a_very_negative_gate_closes_without_nan() {
        let g = Tensor::<f32>::param(ndarray::arr1(&[-200.0f32, 200.0]).into_dyn());
        let u = Tensor::<f32>::param(ndarray::arr1(&[1.0f32, 1.0]).into_dyn());
        let y = g.swiglu(&u);
        assert_eq!(y.to_vec(), vec![-0.0, 200.0]);
        y.sum_all().backward();
        assert_eq!(g.grad().unwrap().as_slice().unwrap(), &[0.0, 1.0]);
    }

    #[test]
    #[should_panic(expected = "differ in shape")]
    fn shapes_must_agree() {
        let _ = Tensor::<f32>::zeros(&[2, 3]).swiglu(&Tensor::zeros(&[3, 2]));
    }
}
