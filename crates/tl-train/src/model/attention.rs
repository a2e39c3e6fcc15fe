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
/// For `x` of shape `[B, T, d]` and `H` heads of size `hd = d/H`:
///
/// ```text
/// q, k, v = x·Wq, x·Wk, x·Wv            [B, T, d]; head h is columns h·hd..(h+1)·hd
/// q, k    = rotary(q), rotary(k)        each head rotated by its positions
/// P = softmax(q·kᵀ/√hd + M)             per head; M = −∞ above the diagonal
/// y = (P·v, heads side by side)·Wo
/// ```
///
/// The projections go through [`Tensor::matmul`]; the middle two lines are one fused op,
/// [`causal_attention`], which rounds its two products under autocast exactly where the
/// separate ops would (torch's autocast rounds `bmm` too).
///
/// Split over a tensor-parallel group ([`split`](Self::split)), rank `r` of `t` holds heads
/// `r·H/t .. (r+1)·H/t`: the columns of `Wq`, `Wk`, `Wv` and the rows of `Wo` that belong to
/// them. Its input enters through a copy-to (one all-reduce backward), its output leaves
/// through a reduce-from (one all-reduce forward); under sequence parallelism, through an
/// all-gather of the ranks' rows of the tokens into the batch and a reduce-scatter back.
pub struct CausalSelfAttention<E: GradElement> {
    wq: Linear<E>,
    wk: Linear<E>,
    wv: Linear<E>,
    wo: Linear<E>,
    rope: Rc<Rope<E>>,
    /// Heads this rank computes: all of them, or its share under tensor parallelism.
    n_heads: usize,
    split: Option<Rc<TensorSplit>>,
    /// The projections' fp8 scales, when the model trains in fp8.
    pub(crate) fp8: Fp8Slot,
}

impl<E: GradElement> CausalSelfAttention<E> {
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
            split: None,
            fp8: Fp8Slot::new(0),
        }
    }

    /// This rank's heads of the whole attention `self` over `split`'s group.
    ///
    /// # Errors
    /// [`TrainError::InvalidConfig`](crate::TrainError::InvalidConfig) when `t` does not
    /// divide the number of heads.
    pub(crate) fn split(&self, split: &Rc<TensorSplit>) -> Result<Self> {
        let heads = split.part("n_heads", self.n_heads)?;
        let cut = |linear: &Linear<E>, name: &str| -> Result<Linear<E>> {
            let weight = split.slice("d_model", linear.weight(), placement(name))?;
            Ok(Linear::from_parts(weight, None))
        };
        Ok(Self {
            wq: cut(&self.wq, "wq.weight")?,
            wk: cut(&self.wk, "wk.weight")?,
            wv: cut(&self.wv, "wv.weight")?,
            wo: cut(&self.wo, "wo.weight")?,
            rope: Rc::clone(&self.rope),
            n_heads: heads.len(),
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
