//! Causal multi-head self-attention with rotary positions.

use std::rc::Rc;

use ndarray::ArrayView1;
use rayon::prelude::*;
use tl_tensor::nn::{Linear, Module};
use tl_tensor::{Element, Generator, Tensor};

use super::rope::Rope;

/// Multi-head attention where position `t` attends to positions `0..=t`, as in a decoder.
///
/// For `x` of shape `[B, T, d]` and `H` heads of size `hd = d/H`:
///
/// ```text
/// q, k, v = x·Wq, x·Wk, x·Wv            each reshaped to [B, H, T, hd]; q and k rotated
/// P = softmax(q·kᵀ/√hd + M)             M = −∞ above the diagonal
/// y = (P·v reshaped to [B, T, d])·Wo
/// ```
///
/// Every product goes through [`Tensor::matmul`], so autocast rounds the attention products
/// as it rounds the projections (torch's autocast does the same for `bmm`).
pub struct CausalSelfAttention<E: Element> {
    wq: Linear<E>,
    wk: Linear<E>,
    wv: Linear<E>,
    wo: Linear<E>,
    rope: Rc<Rope<E>>,
    n_heads: usize,
}

impl<E: Element> CausalSelfAttention<E> {
    /// Four bias-free `d × d` projections drawn from `rng` in the order q, k, v, o.
    pub fn new(d_model: usize, n_heads: usize, rope: Rc<Rope<E>>, rng: &Generator) -> Self {
        let projection = || Linear::new(d_model, d_model, false, rng);
        Self {
            wq: projection(),
            wk: projection(),
            wv: projection(),
            wo: projection(),
            rope,
            n_heads,
        }
    }

    /// `[B, T, d]` → `[B, H, T, hd]`, rotated if `rotate`.
    fn heads(&self, projected: Tensor<E>, rotate: bool) -> Tensor<E> {
        let shape = projected.shape();
        let (batch, time, d_model) = (shape[0], shape[1], shape[2]);
        let split = projected.reshape(&[batch, time, self.n_heads, d_model / self.n_heads]);
        let split = if rotate {
            self.rope.apply(&split)
        } else {
            split
        };
        split.permute(&[0, 2, 1, 3])
    }
}

impl<E: Element> Module<E> for CausalSelfAttention<E> {
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        let shape = x.shape();
        let (batch, time, d_model) = (shape[0], shape[1], shape[2]);
        let head_dim = d_model / self.n_heads;
        let q = self.heads(self.wq.forward(x), true);
        let k_t = self.heads(self.wk.forward(x), true).transpose(2, 3);
        let v = self.heads(self.wv.forward(x), false);
        let scores = q.matmul(&k_t);
        let probs = causal_softmax(&scores, 1.0 / (head_dim as f64).sqrt());
        let mixed = probs
            .matmul(&v)
            .permute(&[0, 2, 1, 3])
            .reshape(&[batch, time, d_model]);
        self.wo.forward(&mixed)
    }

    fn parameters(&self) -> Vec<Tensor<E>> {
        [&self.wq, &self.wk, &self.wv, &self.wo]
            .iter()
            .flat_map(|layer| layer.parameters())
            .collect()
    }
}

/// `softmax(scale · s + M)` over the last axis of `scores` `[.., T, T]`, with `M = −∞` above
/// the diagonal: scaling, masking and softmax as one op that saves only its output `P`.
///
/// Row `t` has `t + 1` live entries; the masked ones are exactly 0 in `P`. With
/// `ḡ` the output gradient, the VJP is `scale · P ⊙ (ḡ − Σ_j ḡ_j P_j)` per row (masked
/// entries get 0 because their `P` is 0).
///
/// # Panics
/// If the last two axes of `scores` are not equal.
pub fn causal_softmax<E: Element>(scores: &Tensor<E>, scale: f64) -> Tensor<E> {
    let shape = scores.shape();
    let n = shape.len();
    assert!(
        n >= 2 && shape[n - 1] == shape[n - 2],
        "causal_softmax: expected [.., T, T] scores, got {shape:?}"
    );
    let time = shape[n - 1];
    let scale = E::from_f64(scale);
    let mut probs = scores.value().as_standard_layout().into_owned();
    // Each T × T matrix is independent: spread them over the rayon pool. No value depends on
    // how they are spread, so the result is the same bits on any number of threads.
    probs
        .as_slice_mut()
        .expect("standard layout")
        .par_chunks_mut(time * time)
        .for_each(|matrix| {
            for (t, row) in matrix.chunks_exact_mut(time).enumerate() {
                let (live, masked) = row.split_at_mut(t + 1);
                let max = live
                    .iter()
                    .fold(E::neg_infinity(), |m, &s| m.max(s * scale));
                let mut sum = E::zero();
                for s in live.iter_mut() {
                    *s = (*s * scale - max).exp();
                    sum += *s;
                }
                for s in live.iter_mut() {
                    *s /= sum;
                }
                masked.fill(E::zero());
            }
        });
    Tensor::from_op_saving_output(probs, &[scores], move |grad, probs| {
        let mut grad = if grad.is_standard_layout() {
            grad
        } else {
            grad.as_standard_layout().into_owned()
        };
        let probs = probs.as_standard_layout();
        grad.as_slice_mut()
            .expect("standard layout")
            .par_chunks_mut(time * time)
            .zip(
                probs
                    .as_slice()
                    .expect("standard layout")
                    .par_chunks(time * time),
            )
            .for_each(|(grad_matrix, p_matrix)| {
                for (grad_row, p_row) in grad_matrix
                    .chunks_exact_mut(time)
                    .zip(p_matrix.chunks_exact(time))
                {
                    let dot = ArrayView1::from(&*grad_row).dot(&ArrayView1::from(p_row));
                    for (g, &p) in grad_row.iter_mut().zip(p_row) {
                        *g = scale * p * (*g - dot);
                    }
                }
            });
        vec![Some(grad)]
    })
}

/// The reference: the same computation from the library's separate ops.
#[cfg(test)]
pub(crate) fn causal_softmax_unfused<E: Element>(scores: &Tensor<E>, scale: f64) -> Tensor<E> {
    let shape = scores.shape();
    let time = shape[shape.len() - 1];
    let mask =
        ndarray::ArrayD::from_shape_fn(ndarray::IxDyn(&[time, time]), |index| index[1] > index[0]);
    scores
        .mul_scalar(E::from_f64(scale))
        .masked_fill(&mask, E::neg_infinity())
        .softmax(shape.len() - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_tensor::testing::{assert_gradients, random_array};

    #[test]
    fn the_first_row_attends_only_to_itself_and_the_last_row_to_everything() {
        // Zero scores: row t spreads 1/(t+1) over its t+1 live entries.
        let probs = causal_softmax(&Tensor::<f64>::zeros(&[1, 3, 3]), 1.0).to_vec();
        assert_eq!(probs[..3], [1.0, 0.0, 0.0]);
        assert_eq!(probs[3..6], [0.5, 0.5, 0.0]);
        assert_eq!(probs[6..], [1.0 / 3.0; 3]);
    }

    #[test]
    fn fused_agrees_with_the_separate_ops_and_with_finite_differences() {
        let scores = random_array(&[2, 3, 5, 5], &Generator::new(7));
        let fused = causal_softmax(&Tensor::from_array(scores.clone()), 0.5).to_vec();
        let reference = causal_softmax_unfused(&Tensor::from_array(scores.clone()), 0.5).to_vec();
        for (a, b) in fused.iter().zip(&reference) {
            assert!((a - b).abs() < 1e-15, "{a} vs {b}");
        }
        assert_gradients(|xs| causal_softmax(&xs[0], 0.5), &[scores]);
    }

    #[test]
    fn attention_gradients_match_finite_differences() {
        let rng = Generator::new(3);
        let rope = Rc::new(Rope::new(4, 6, 10_000.0));
        let attention = CausalSelfAttention::<f64>::new(8, 2, rope, &rng);
        let x = random_array(&[2, 6, 8], &rng);
        assert_gradients(|xs| attention.forward(&xs[0]), std::slice::from_ref(&x));
        let x = Tensor::from_array(x);
        tl_tensor::testing::check_parameter_gradients(
            || attention.forward(&x),
            &attention.parameters(),
            Default::default(),
        )
        .unwrap();
    }

    #[test]
    fn a_position_does_not_see_the_future() {
        // Changing the last token's input must leave every earlier output unchanged.
        let rng = Generator::new(5);
        let attention =
            CausalSelfAttention::<f64>::new(8, 2, Rc::new(Rope::new(4, 4, 10_000.0)), &rng);
        let x = random_array(&[1, 4, 8], &rng);
        let mut changed = x.clone();
        changed.index_axis_mut(ndarray::Axis(1), 3).fill(9.0);
        let (a, b) = (
            attention.forward(&Tensor::from_array(x)).to_vec(),
            attention.forward(&Tensor::from_array(changed)).to_vec(),
        );
        assert_eq!(a[..24], b[..24]);
        assert_ne!(a[24..], b[24..]);
    }
}
