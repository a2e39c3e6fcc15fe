//! One pre-norm transformer block: attention and a SwiGLU MLP, each on a residual branch.

use std::rc::Rc;

use tl_tensor::nn::{Dropout, Linear, Module, RmsNorm};
use tl_tensor::{Element, Generator, Tensor};

use super::attention::CausalSelfAttention;
use super::config::ModelConfig;
use super::rope::Rope;

/// The MLP of Llama: `y = (silu(x·W1) ⊙ x·W3)·W2`, no biases.
pub struct SwiGlu<E: Element> {
    w1: Linear<E>,
    w3: Linear<E>,
    w2: Linear<E>,
}

impl<E: Element> SwiGlu<E> {
    /// Projections `d → hidden` (gate W1, value W3) and `hidden → d` (W2), drawn from `rng`
    /// in the order W1, W3, W2.
    pub fn new(d_model: usize, hidden: usize, rng: &Generator) -> Self {
        Self {
            w1: Linear::new(d_model, hidden, false, rng),
            w3: Linear::new(d_model, hidden, false, rng),
            w2: Linear::new(hidden, d_model, false, rng),
        }
    }
}

impl<E: Element> Module<E> for SwiGlu<E> {
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        let gated = self.w1.forward(x).swiglu(&self.w3.forward(x));
        self.w2.forward(&gated)
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
/// through `tl_recompute::checkpoint_sequential` (as `Rc<Block>`, which is `Clone`).
pub struct Block<E: Element> {
    norm1: RmsNorm<E>,
    attention: CausalSelfAttention<E>,
    norm2: RmsNorm<E>,
    mlp: SwiGlu<E>,
    dropout: Option<Dropout>,
}

impl<E: Element> Block<E> {
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
            attention: CausalSelfAttention::new(d, config.n_heads, rope, rng),
            norm2: RmsNorm::new(d, config.norm_eps),
            mlp: SwiGlu::new(d, config.hidden, rng),
            dropout: (config.dropout > 0.0).then(|| {
                Dropout::new(config.dropout, dropout.clone()).expect("validated probability")
            }),
        }
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

    fn branch(&self, x: &Tensor<E>, output: Tensor<E>) -> Tensor<E> {
        match &self.dropout {
            Some(dropout) => x.add(&dropout.forward(&output)),
            None => x.add(&output),
        }
    }
}

impl<E: Element> Module<E> for Block<E> {
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        let x = self.branch(x, self.attention.forward(&self.norm1.forward(x)));
        self.branch(&x, self.mlp.forward(&self.norm2.forward(&x)))
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
