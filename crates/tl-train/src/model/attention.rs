//! Causal multi-head self-attention with rotary positions.

use std::rc::Rc;

use tl_parallel::GradElement;
use tl_tensor::nn::{Linear, Module};
use tl_tensor::{Generator, Tensor, memory};

use super::block::batch_of;
use super::causal_attention::causal_attention;
use super::fp8::Fp8Slot;
use super::parallel::{BatchShape, TensorSplit, placement};
use super::roles;
use super::rope::Rope;
use crate::error::Result;

/// Multi-head attention where position `t` attends to positions `0..=t`, as in a decoder.
///
/// For `x` of shape `[B, T, d]`, `H` query heads of size `hd = d/H` and `H_kv` key/value
/// heads (`H_kv` divides `H`; `H_kv = H` is multi-head attention):
///
/// ```text
/// q = x·Wq                              [B, T, d]; head h is columns h·hd..(h+1)·hd
/// k, v = x·Wk, x·Wv                     [B, T, H_kv·hd]
/// q, k = rotary(q), rotary(k)           each head rotated by its positions
/// P = softmax(q_h·k_gᵀ/√hd + M)         per query head h, with g = h / (H/H_kv); M = −∞
///                                       above the diagonal
/// y = (P·v_g, heads side by side)·Wo
/// ```
///
/// The projections go through [`Tensor::matmul`]; the middle two lines are one fused op,
/// [`causal_attention`], which rounds its two products under autocast exactly where the
/// separate ops would (torch's autocast rounds `bmm` too).
///
/// Split over a tensor-parallel group ([`split`](Self::split)), rank `r` of `t` holds query
/// heads `r·H/t .. (r+1)·H/t` and the key/value heads they read, `r·H_kv/t .. (r+1)·H_kv/t`:
/// the columns of `Wq`, `Wk`, `Wv` and the rows of `Wo` that belong to them. The key/value
/// heads are divided among the ranks, never replicated, so `t` must divide `H_kv`. Its input enters through a copy-to (one all-reduce backward), its output leaves
/// through a reduce-from (one all-reduce forward); under sequence parallelism, through an
/// all-gather of the ranks' rows of the tokens into the batch and a reduce-scatter back.
pub struct CausalSelfAttention<E: GradElement> {
    wq: Linear<E>,
    wk: Linear<E>,
    wv: Linear<E>,
    wo: Linear<E>,
    rope: Rc<Rope<E>>,
    /// Query heads this rank computes: all of them, or its share under tensor parallelism.
    n_heads: usize,
    /// Key/value heads this rank holds.
    n_kv_heads: usize,
    split: Option<Rc<TensorSplit>>,
    /// The projections' fp8 scales, when the model trains in fp8.
    pub(crate) fp8: Fp8Slot,
}

impl<E: GradElement> CausalSelfAttention<E> {
    /// Four bias-free projections drawn from `rng` in the order q, k, v, o: `d × d` for q
    /// and o, `d × n_kv_heads·hd` for k and v.
    ///
    /// # Panics
    /// If `n_heads` does not divide `d_model` or `n_kv_heads` does not divide `n_heads`
    /// (a validated [`ModelConfig`](super::ModelConfig) does not).
    pub fn new(
        d_model: usize,
        (n_heads, n_kv_heads): (usize, usize),
        rope: Rc<Rope<E>>,
        rng: &Generator,
    ) -> Self {
        assert!(
            n_heads > 0
                && d_model.is_multiple_of(n_heads)
                && n_kv_heads > 0
                && n_heads.is_multiple_of(n_kv_heads),
            "CausalSelfAttention: {n_heads} query and {n_kv_heads} key/value heads do not fit \
             a width of {d_model}"
        );
        let kv_width = n_kv_heads * (d_model / n_heads);
        let projection = |out| Linear::new(d_model, out, false, rng);
        Self {
            wq: projection(d_model),
            wk: projection(kv_width),
            wv: projection(kv_width),
            wo: projection(d_model),
            rope,
            n_heads,
            n_kv_heads,
            split: None,
            fp8: Fp8Slot::new(0),
        }
    }

    /// This rank's heads of the whole attention `self` over `split`'s group.
    ///
    /// # Errors
    /// [`TrainError::InvalidConfig`](crate::TrainError::InvalidConfig) when `t` does not
    /// divide the number of query heads or of key/value heads.
    pub(crate) fn split(&self, split: &Rc<TensorSplit>) -> Result<Self> {
        let heads = split.part("n_heads", self.n_heads)?;
        let kv_heads = split.part("n_kv_heads", self.n_kv_heads)?;
        let cut = |linear: &Linear<E>, name: &str, what| -> Result<Linear<E>> {
            let weight = split.slice(what, linear.weight(), placement(name))?;
            Ok(Linear::from_parts(weight, None))
        };
        Ok(Self {
            wq: cut(&self.wq, "wq.weight", "d_model")?,
            wk: cut(&self.wk, "wk.weight", "n_kv_heads")?,
            wv: cut(&self.wv, "wv.weight", "n_kv_heads")?,
            wo: cut(&self.wo, "wo.weight", "d_model")?,
            rope: Rc::clone(&self.rope),
            n_heads: heads.len(),
            n_kv_heads: kv_heads.len(),
            split: Some(Rc::clone(split)),
            fp8: Fp8Slot::new(0),
        })
    }
}

impl<E: GradElement> CausalSelfAttention<E> {
    /// The attention of a batch shaped `batch`: `x` is `[B, T, d]`, or under sequence
    /// parallelism this rank's rows of the tokens, `[B·T/t, d]` (as the output).
    pub(crate) fn forward_batch(&self, x: &Tensor<E>, batch: BatchShape) -> Tensor<E> {
        let rotated = |projected: Tensor<E>| {
            let _label = memory::label_scope(roles::ROPE);
            self.rope.apply(&projected)
        };
        let entered;
        let x = match &self.split {
            Some(split) => {
                entered = split.enter_batch(x, batch);
                &entered
            }
            None => x,
        };
        let q = rotated(self.fp8.project(0, &self.wq, x));
        let k = rotated(self.fp8.project(1, &self.wk, x));
        let v = self.fp8.project(2, &self.wv, x);
        let mixed = causal_attention(&q, &k, &v, self.n_heads);
        let output = self.fp8.project(3, &self.wo, &mixed);
        match &self.split {
            Some(split) => split.leave(&output),
            None => output,
        }
    }
}

impl<E: GradElement> Module<E> for CausalSelfAttention<E> {
    /// The attention of a `[B, T, d]` batch.
    ///
    /// # Panics
    /// If `x` is not 3-D.
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        self.forward_batch(x, batch_of(x))
    }

    fn parameters(&self) -> Vec<Tensor<E>> {
        [&self.wq, &self.wk, &self.wv, &self.wo]
            .iter()
            .flat_map(|layer| layer.parameters())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_tensor::testing::{assert_gradients, random_array};

    #[test]
    fn attention_gradients_match_finite_differences() {
        let rng = Generator::new(3);
        let rope = Rc::new(Rope::new(4, 6, 10_000.0));
        let attention = CausalSelfAttention::<f64>::new(8, (2, 2), rope, &rng);
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

    /// Grouped-query attention against the textbook formula written here in f64, for one,
    /// two and as many key/value heads as query heads; its gradients against finite
    /// differences.
    #[test]
    fn grouped_query_attention_is_the_textbook_formula() {
        let (batch, time, d, n_heads) = (2, 5, 16, 4);
        let hd = d / n_heads;
        for n_kv_heads in [1, 2, 4] {
            let rng = Generator::new(7 + n_kv_heads as u64);
            let rope = Rc::new(Rope::new(hd, time, 10_000.0));
            let attention =
                CausalSelfAttention::<f64>::new(d, (n_heads, n_kv_heads), Rc::clone(&rope), &rng);
            let x = random_array(&[batch, time, d], &rng);
            let got = attention.forward(&Tensor::from_array(x.clone()));
            let x = Tensor::from_array(x);
            let project = |w: &Linear<f64>| x.matmul(w.weight()).value().clone();
            let rotate =
                |a: ndarray::ArrayD<f64>| rope.apply(&Tensor::from_array(a)).value().clone();
            let (q, k, v) = (
                rotate(project(&attention.wq)),
                rotate(project(&attention.wk)),
                project(&attention.wv),
            );
            let group = n_heads / n_kv_heads;
            let mut mixed = ndarray::ArrayD::<f64>::zeros(ndarray::IxDyn(&[batch, time, d]));
            for b in 0..batch {
                for h in 0..n_heads {
                    let g = h / group;
                    for t in 0..time {
                        let scores: Vec<f64> = (0..=t)
                            .map(|j| {
                                (0..hd)
                                    .map(|c| q[[b, t, h * hd + c]] * k[[b, j, g * hd + c]])
                                    .sum::<f64>()
                                    / (hd as f64).sqrt()
                            })
                            .collect();
                        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                        let total: f64 = weights.iter().sum();
                        for c in 0..hd {
                            mixed[[b, t, h * hd + c]] = (0..=t)
                                .map(|j| weights[j] / total * v[[b, j, g * hd + c]])
                                .sum();
                        }
                    }
                }
            }
            let expected = Tensor::from_array(mixed).matmul(attention.wo.weight());
            for (a, b) in got.to_vec().iter().zip(expected.to_vec()) {
                assert!((a - b).abs() < 1e-12, "{n_kv_heads} kv heads: {a} vs {b}");
            }
            assert_eq!(attention.wk.weight().shape(), vec![d, n_kv_heads * hd]);
            tl_tensor::testing::check_parameter_gradients(
                || attention.forward(&x),
                &attention.parameters(),
                Default::default(),
            )
            .unwrap();
        }
    }

    #[test]
    fn a_position_does_not_see_the_future() {
        // Changing the last token's input must leave every earlier output unchanged.
        let rng = Generator::new(5);
        let attention =
            CausalSelfAttention::<f64>::new(8, (2, 2), Rc::new(Rope::new(4, 4, 10_000.0)), &rng);
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
