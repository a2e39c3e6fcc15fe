//! One pre-norm transformer block: attention and a SwiGLU MLP, each on a residual branch.

use std::rc::Rc;

use tl_parallel::GradElement;
use tl_precision::round_for_products;
use tl_tensor::nn::{Dropout, Linear, Module, RmsNorm};
use tl_tensor::{Generator, Tensor, memory};

use super::attention::CausalSelfAttention;
use super::config::ModelConfig;
use super::fp8::Fp8Slot;
use super::parallel::{BatchShape, TensorSplit, placement};
use super::roles;
use super::rope::Rope;
use crate::error::Result;

/// The MLP of Llama: `y = (silu(x·W1) ⊙ x·W3)·W2`, no biases.
///
/// Split over a tensor-parallel group, rank `r` of `t` holds hidden units
/// `r·h/t .. (r+1)·h/t`: those columns of `W1` and `W3` and those rows of `W2` (the gate is
/// elementwise, so each rank's units need nothing from the others), between a copy-to and a
/// reduce-from (under sequence parallelism, between an all-gather of the ranks' rows and a
/// reduce-scatter back into them).
pub struct SwiGlu<E: GradElement> {
    w1: Linear<E>,
    w3: Linear<E>,
    w2: Linear<E>,
    split: Option<Rc<TensorSplit>>,
    /// The projections' fp8 scales, when the model trains in fp8.
    pub(crate) fp8: Fp8Slot,
}

impl<E: GradElement> SwiGlu<E> {
    /// Projections `d → hidden` (gate W1, value W3) and `hidden → d` (W2), drawn from `rng`
    /// in the order W1, W3, W2.
    pub fn new(d_model: usize, hidden: usize, rng: &Generator) -> Self {
        Self {
            w1: Linear::new(d_model, hidden, false, rng),
            w3: Linear::new(d_model, hidden, false, rng),
            w2: Linear::new(hidden, d_model, false, rng),
            split: None,
            fp8: Fp8Slot::new(4),
        }
    }

    /// This rank's hidden units of the whole MLP `self` over `split`'s group.
    ///
    /// # Errors
    /// [`TrainError::InvalidConfig`](crate::TrainError::InvalidConfig) when `t` does not
    /// divide the hidden size.
    pub(crate) fn split(&self, split: &Rc<TensorSplit>) -> Result<Self> {
        let cut = |linear: &Linear<E>, name: &str| -> Result<Linear<E>> {
            let weight = split.slice("hidden", linear.weight(), placement(name))?;
            Ok(Linear::from_parts(weight, None))
        };
        Ok(Self {
            w1: cut(&self.w1, "w1.weight")?,
            w3: cut(&self.w3, "w3.weight")?,
            w2: cut(&self.w2, "w2.weight")?,
            split: Some(Rc::clone(split)),
            fp8: Fp8Slot::new(4),
        })
    }
}

impl<E: GradElement> Module<E> for SwiGlu<E> {
    /// The MLP of each position of `x`, `[.., d]`; under sequence parallelism `x` is this
    /// rank's rows of the tokens, `[n/t, d]`, gathered into all `n` rows (a position-wise
    /// layer needs no more of the batch's shape) and scattered back.
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        let entered;
        let x = match &self.split {
            Some(split) => {
                entered = split.enter(x);
                &entered
            }
            None => x,
        };
        // The gate's only reader is W2: under autocast, it is rounded as it is written.
        let gated = round_for_products(|finish| {
            let gate = self.fp8.project(0, &self.w1, x);
            let up = self.fp8.project(1, &self.w3, x);
            let _label = memory::label_scope(roles::SWIGLU);
            gate.swiglu_then(&up, finish)
        });
        let output = self.fp8.project(2, &self.w2, &gated);
        match &self.split {
            Some(split) => split.leave(&output),
            None => output,
        }
    }

    fn parameters(&self) -> Vec<Tensor<E>> {
        [&self.w1, &self.w3, &self.w2]
            .iter()
            .flat_map(|layer| layer.parameters())
            .collect()
    }
}

/// `x + attn(norm1(x))`, then `x + mlp(norm2(x))`, with dropout on each branch's output
/// when the model has any.
///
/// A block is a [`Module`] from `[B, T, d]` to `[B, T, d]`, so a stack of them can be run
/// through `tl_recompute::checkpoint_sequential` (as `Rc<Block>`, which is `Clone`). Under
/// sequence parallelism it maps a rank's rows of the tokens, `[B·T/t, d]`, to the same
/// rows, and needs to be told the batch's shape ([`forward_batch`](Self::forward_batch)).
pub struct Block<E: GradElement> {
    norm1: RmsNorm<E>,
    attention: CausalSelfAttention<E>,
    norm2: RmsNorm<E>,
    mlp: SwiGlu<E>,
    dropout: Option<Dropout>,
    split: Option<Rc<TensorSplit>>,
}

impl<E: GradElement> Block<E> {
    /// A block of `config`'s sizes, weights drawn from `rng` (attention first, then the
    /// MLP); `dropout` is the model's shared dropout stream, used when `config.dropout > 0`.
    pub fn new(
        config: &ModelConfig,
        rope: Rc<Rope<E>>,
        rng: &Generator,
        dropout: &Generator,
    ) -> Self {
        let d = config.d_model;
        Self {
            norm1: RmsNorm::new(d, config.norm_eps),
            attention: CausalSelfAttention::new(d, (config.n_heads, config.kv_heads()), rope, rng),
            norm2: RmsNorm::new(d, config.norm_eps),
            mlp: SwiGlu::new(d, config.hidden, rng),
            dropout: (config.dropout > 0.0).then(|| {
                Dropout::new(config.dropout, dropout.clone()).expect("validated probability")
            }),
            split: None,
        }
    }

    /// This rank's part of the whole block `self` over `split`'s group: the attention's
    /// heads and the MLP's hidden units split, the norms whole (sharing the whole block's
    /// gains: every rank computes them on the whole activations, or under sequence
    /// parallelism on its rows), the same dropout stream.
    ///
    /// # Errors
    /// [`TrainError::InvalidConfig`](crate::TrainError::InvalidConfig) when `t` does not
    /// divide the heads or the hidden size.
    pub(crate) fn split(&self, split: &Rc<TensorSplit>) -> Result<Self> {
        Ok(Self {
            norm1: RmsNorm::from_weight(self.norm1.weight().clone(), self.norm1.eps()),
            attention: self.attention.split(split)?,
            norm2: RmsNorm::from_weight(self.norm2.weight().clone(), self.norm2.eps()),
            mlp: self.mlp.split(split)?,
            dropout: self.dropout.as_ref().map(|dropout| {
                Dropout::new(dropout.p(), dropout.generator().clone()).expect("a valid p")
            }),
            split: Some(Rc::clone(split)),
        })
    }

    /// The named parameters of the block, in [`Module::parameters`] order, named as in
    /// `llama_ref.py` (`n1.w`, `wq.weight`, ...).
    pub fn named_parameters(&self) -> Vec<(&'static str, Tensor<E>)> {
        const NAMES: [&str; 9] = [
            "n1.w",
            "wq.weight",
            "wk.weight",
            "wv.weight",
            "wo.weight",
            "n2.w",
            "w1.weight",
            "w3.weight",
            "w2.weight",
        ];
        NAMES.into_iter().zip(self.parameters()).collect()
    }

    /// Trains the block's projections in fp8 as layers `first..first + 7` of `state` (or
    /// plainly again, with `None`).
    pub(crate) fn set_fp8(
        &self,
        state: Option<(&Rc<std::cell::RefCell<tl_precision::Fp8State>>, usize)>,
    ) {
        self.attention
            .fp8
            .set(state.map(|(s, first)| (Rc::clone(s), first)));
        self.mlp
            .fp8
            .set(state.map(|(s, first)| (Rc::clone(s), first)));
    }

    fn branch(
        &self,
        x: &Tensor<E>,
        output: Tensor<E>,
        batch: BatchShape,
        label: &'static str,
    ) -> Tensor<E> {
        let output = match &self.dropout {
            Some(dropout) => {
                let _label = memory::label_scope(roles::DROPOUT);
                match self
                    .split
                    .as_deref()
                    .filter(|split| split.sequence_parallel())
                {
                    // The rows of the mask one process draws for the whole [B·T, d] branch
                    // output: every rank's stream advances by the whole mask's draws, and
                    // a checkpoint's rerun replays them as it replays one process's.
                    Some(split) => {
                        let [rows, time] = batch;
                        let mine = (split.token_rows(rows, time))
                            .expect("the batch was checked to split over the group");
                        dropout.forward_rows(&output, mine.start, rows * time)
                    }
                    None => dropout.forward(&output),
                }
            }
            None => output,
        };
        let _label = memory::label_scope(label);
        x.add(&output)
    }

    /// Advances the dropout stream past the masks [`forward_batch`](Self::forward_batch)
    /// draws on a batch shaped `batch`: one mask of the whole `[B, T, d]` output of each
    /// branch (under sequence parallelism too, whose ranks draw the whole mask and keep
    /// their rows); nothing without dropout, in evaluation or in meta mode. Every block
    /// draws the same, so a pipeline stage skips the blocks before it with any of its own.
    pub(crate) fn skip_dropout(&self, [rows, time]: BatchShape) {
        if let Some(dropout) = &self.dropout {
            let d_model = self.norm1.weight().shape()[0];
            for _branch in ["attention", "mlp"] {
                dropout.skip(rows * time * d_model);
            }
        }
    }

    /// An RMSNorm's output, rounded for the projections that read it.
    fn norm(norm: &RmsNorm<E>, x: &Tensor<E>) -> Tensor<E> {
        let _label = memory::label_scope(roles::NORM);
        round_for_products(|finish| norm.forward_then(x, finish))
    }
}

impl<E: GradElement> Block<E> {
    /// The block on the tokens of a batch shaped `batch`: `x` is `[B, T, d]`, or under
    /// sequence parallelism this rank's rows of the tokens, `[B·T/t, d]` (as the output).
    pub fn forward_batch(&self, x: &Tensor<E>, batch: BatchShape) -> Tensor<E> {
        // Each norm's output feeds only projections: under autocast, it is rounded as it is
        // written rather than copied by them (see `round_for_products`).
        let normed = Self::norm(&self.norm1, x);
        let attended = self.attention.forward_batch(&normed, batch);
        let x = self.branch(x, attended, batch, roles::RESIDUAL);
        drop(normed); // freed before the MLP's norm makes its own

        let normed = Self::norm(&self.norm2, &x);
        let output = self.mlp.forward(&normed);
        self.branch(&x, output, batch, roles::BLOCK_OUTPUT)
    }
}

/// The `[B, T]` of a `[B, T, d]` batch.
///
/// # Panics
/// If `x` is not 3-D (a sequence-parallel rank's rows do not say their batch's shape).
pub(crate) fn batch_of<E: GradElement>(x: &Tensor<E>) -> BatchShape {
    match x.shape()[..] {
        [rows, time, _] => [rows, time],
        ref shape => panic!(
            "expected a [batch, time, features] batch, got {shape:?} (rows of a \
             sequence-parallel batch run through forward_batch)"
        ),
    }
}

impl<E: GradElement> Module<E> for Block<E> {
    /// The block on a `[B, T, d]` batch.
    ///
    /// # Panics
    /// If `x` is not 3-D.
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        self.forward_batch(x, batch_of(x))
    }

    fn parameters(&self) -> Vec<Tensor<E>> {
        let mut parameters = self.norm1.parameters();
        parameters.extend(self.attention.parameters());
        parameters.extend(self.norm2.parameters());
        parameters.extend(self.mlp.parameters());
        parameters
    }

    fn set_training(&self, training: bool) {
        if let Some(dropout) = &self.dropout {
            Module::<E>::set_training(dropout, training);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_precision::{Format, autocast, cast, take_underflow_count};
    use tl_tensor::testing::random_array;

    /// Values, every gradient and the underflow count of one forward and backward pass.
    type Run = (Vec<f64>, Vec<Vec<f64>>, u64);

    #[test]
    fn under_autocast_the_mlp_is_its_separate_casts_bit_for_bit() {
        // The MLP rounds its gate as it writes it, for W2 (`round_for_products`); written out
        // with a separate cast at every 16-bit boundary, the graph must give the same bits.
        let rng = Generator::new(4);
        let mlp = SwiGlu::<f64>::new(6, 10, &rng);
        let input = random_array(&[5, 6], &rng);
        // Gradients small enough that fp16 flushes some of them.
        let grad_out = random_array(&[5, 6], &rng).mapv(|v| v * 1e-6);
        for format in Format::SIXTEEN_BIT {
            let run = |fused: bool| -> Run {
                take_underflow_count();
                let x = Tensor::param(input.clone());
                let y = if fused {
                    let _guard = autocast(format);
                    mlp.forward(&x)
                } else {
                    let product = |a: &Tensor<f64>, w: &Tensor<f64>| {
                        cast(&cast(a, format).matmul_plain(&cast(w, format)), format)
                    };
                    let gate = product(&x, mlp.w1.weight()).swiglu(&product(&x, mlp.w3.weight()));
                    product(&gate, mlp.w2.weight())
                };
                y.backward_with(grad_out.clone());
                let grads = std::iter::once(x)
                    .chain(mlp.parameters())
                    .map(|p| {
                        let grad = p.grad().expect("a gradient").iter().copied().collect();
                        p.zero_grad();
                        grad
                    })
                    .collect();
                (y.to_vec(), grads, take_underflow_count())
            };
            let (fused, separate) = (run(true), run(false));
            assert_eq!(fused, separate, "{format}");
            if format == Format::Fp16 {
                assert!(separate.2 > 0, "the fp16 case flushes something");
            }
        }
    }
}
