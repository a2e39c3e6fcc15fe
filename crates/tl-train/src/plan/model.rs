//! The capstone Llama as the [`DryRun`] runs it: the same ops in the same order, with the
//! same handles kept and dropped, as `model/{llama,block,attention}.rs`.
//!
//! Each function follows its counterpart in the model line by line; a `release` stands
//! where a Rust value goes out of scope (a temporary at the end of its statement, a local
//! at the end of its block). Only the order of allocations and frees matters, so frees
//! that happen together are written in the order Rust runs them but need not be.

use std::ops::Range;
use std::rc::Rc;

use tl_recompute::segment_sizes;

use super::dry_run::{DryRun, Handle, Segment, Tag, tag};
use super::kind::{Layer, TensorKind};
use super::ops::F32;
use crate::error::Result;
use crate::model::{Checkpointing, ModelConfig};

/// The parameters of one block, in `Block::parameters` order.
struct BlockParams {
    norm1: Handle,
    wq: Handle,
    wk: Handle,
    wv: Handle,
    wo: Handle,
    norm2: Handle,
    w1: Handle,
    w3: Handle,
    w2: Handle,
}

impl BlockParams {
    /// All nine, in `Block::parameters` order.
    fn all(&self) -> [&Handle; 9] {
        [
            &self.norm1,
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.norm2,
            &self.w1,
            &self.w3,
            &self.w2,
        ]
    }
}

/// The replica of a [`Llama`](crate::model::Llama) and one micro-batch's shape.
pub(crate) struct ShadowLlama {
    config: ModelConfig,
    /// Sequences per micro-batch.
    rows: usize,
    embedding: Handle,
    blocks: Vec<BlockParams>,
    norm: Handle,
    head: Handle,
}

impl ShadowLlama {
    /// Allocates the parameters in `Llama::new`'s order.
    pub(crate) fn new(dry: &mut DryRun, config: &ModelConfig, rows: usize) -> Self {
        let (v, d, h) = (
            config.vocab as u64,
            config.d_model as u64,
            config.hidden as u64,
        );
        let embedding = dry.param(v * d * F32, Layer::Embedding);
        let blocks = (0..config.n_layers)
            .map(|i| {
                let mut param = |elements: u64| dry.param(elements * F32, Layer::Block(i));
                BlockParams {
                    norm1: param(d),
                    wq: param(d * d),
                    wk: param(d * d),
                    wv: param(d * d),
                    wo: param(d * d),
                    norm2: param(d),
                    w1: param(d * h),
                    w3: param(d * h),
                    w2: param(h * d),
                }
            })
            .collect();
        let norm = dry.param(d * F32, Layer::Head);
        let head = dry.param(d * v * F32, Layer::Head);
        Self {
            config: config.clone(),
            rows,
            embedding,
            blocks,
            norm,
            head,
        }
    }

    /// Every parameter with its layer, in `Module::parameters` order.
    pub(crate) fn parameters(&self) -> Vec<(&Handle, Layer)> {
        let mut all = vec![(&self.embedding, Layer::Embedding)];
        for (i, b) in self.blocks.iter().enumerate() {
            all.extend(b.all().into_iter().map(|p| (p, Layer::Block(i))));
        }
        all.push((&self.norm, Layer::Head));
        all.push((&self.head, Layer::Head));
        all
    }

    /// ZeRO-3's units (`Llama::units`) with the layer each belongs to: the embedding, each
    /// block, the final norm with the head.
    pub(crate) fn units(&self) -> Vec<(Vec<&Handle>, Layer)> {
        let mut units = vec![(vec![&self.embedding], Layer::Embedding)];
        for (i, b) in self.blocks.iter().enumerate() {
            units.push((b.all().to_vec(), Layer::Block(i)));
        }
        units.push((vec![&self.norm, &self.head], Layer::Head));
        units
    }

    /// Bytes of `elements_per_token` f32 values for every token of a micro-batch.
    fn per_token(&self, elements_per_token: usize) -> u64 {
        (self.rows * self.config.context * elements_per_token) as u64 * F32
    }

    /// `Llama::loss`: embedding, blocks, final norm, head and cross-entropy.
    ///
    /// # Errors
    /// When a checkpointing budget admits no schedule.
    pub(crate) fn loss(
        self: &Rc<Self>,
        dry: &mut DryRun,
        checkpointing: Checkpointing,
    ) -> Result<Handle> {
        let c = &self.config;
        dry.phase.layer = Layer::Embedding;
        // `gather_rows` keeps only the ids for backward, a plain vector; the reshape is
        // inside the embedding's unit.
        let x0 = dry.run_unit(0, |dry| {
            let rows = dry.saves_nothing(
                &[&self.embedding],
                self.per_token(c.d_model),
                tag(Layer::Embedding, TensorKind::ResidualStream),
            );
            // The embedding's output is block 0's input: counted where it is read.
            let x0 = dry.layout(&rows, tag(Layer::Block(0), TensorKind::ResidualStream));
            dry.release(rows);
            x0
        });
        let last = self.run_blocks(dry, &x0, checkpointing)?;
        dry.phase.layer = Layer::Head;
        let head_tag = |kind| tag(Layer::Head, kind);
        let logits = dry.run_unit(self.blocks.len() + 1, |dry| {
            let normed = dry.rms_norm(&last, &self.norm, head_tag(TensorKind::NormOutputs));
            let normed = dry.round_for_products(normed);
            let logits = dry.linear(
                &normed,
                &self.head,
                self.per_token(c.vocab),
                head_tag(TensorKind::Logits),
            );
            dry.release(normed);
            logits
        });
        dry.release(last);
        dry.release(x0);
        let flat = dry.layout(&logits, head_tag(TensorKind::Logits));
        let loss = dry.cross_entropy(&flat, head_tag(TensorKind::Loss));
        dry.release(flat);
        dry.release(logits);
        Ok(loss)
    }

    /// `Llama::run_blocks`: a plain fold, or `checkpoint_sequential_with` on the schedule.
    fn run_blocks(
        self: &Rc<Self>,
        dry: &mut DryRun,
        x: &Handle,
        checkpointing: Checkpointing,
    ) -> Result<Handle> {
        let n = self.blocks.len();
        let Some(schedule) = checkpointing.schedule(n)? else {
            return Ok(self.run_layers(dry, 0..n, x));
        };
        // `keeping(checkpointing.keep_policy())` around the checkpointed stack.
        let outer_keep = std::mem::replace(&mut dry.keep, checkpointing.keep_policy());
        let sizes = segment_sizes(n, &schedule)?;
        let mut hidden = dry.share(x);
        let mut start = 0;
        for (index, &size) in sizes.iter().enumerate() {
            let layers = start..start + size;
            let output = if index + 1 == sizes.len() {
                self.run_layers(dry, layers, &hidden)
            } else {
                let params: Vec<&Handle> = self.blocks[layers.clone()]
                    .iter()
                    .flat_map(BlockParams::all)
                    .collect();
                let model = Rc::clone(self);
                let range = layers.clone();
                let segment: Segment = Rc::new(move |dry: &mut DryRun, input: &Handle| {
                    model.run_layers(dry, range.clone(), input)
                });
                dry.checkpoint(&hidden, &params, Layer::Block(layers.end), segment)
            };
            dry.release(std::mem::replace(&mut hidden, output));
            start += size;
        }
        dry.keep = outer_keep;
        Ok(hidden)
    }

    /// `run_layers`: `fold(x.clone(), |h, layer| layer.forward(&h))`.
    fn run_layers(&self, dry: &mut DryRun, layers: Range<usize>, x: &Handle) -> Handle {
        let mut hidden = dry.share(x);
        for i in layers {
            // `UnitBlock::forward`: each block is a unit of its own.
            let output = dry.run_unit(i + 1, |dry| self.block(dry, i, &hidden));
            dry.release(std::mem::replace(&mut hidden, output));
        }
        hidden
    }

    /// `Block::forward`: `x + attn(norm1(x))`, then `+ mlp(norm2(·))`, each norm's output
    /// rounded for the projections that read it. Its output is
    /// counted in the layer that reads it next.
    fn block(&self, dry: &mut DryRun, i: usize, x: &Handle) -> Handle {
        dry.phase.layer = Layer::Block(i);
        let params = &self.blocks[i];
        let here = |kind| tag(Layer::Block(i), kind);
        let next = if i + 1 == self.blocks.len() {
            Layer::Head
        } else {
            Layer::Block(i + 1)
        };
        let normed = dry.rms_norm(x, &params.norm1, here(TensorKind::NormOutputs));
        let normed = dry.round_for_products(normed);
        let attended = self.attention(dry, i, &normed);
        let x1 = self.branch(dry, x, attended, here(TensorKind::ResidualStream));
        dry.release(normed);
        let normed = dry.rms_norm(&x1, &params.norm2, here(TensorKind::NormOutputs));
        let normed = dry.round_for_products(normed);
        let mlp = self.mlp(dry, i, &normed);
        let x2 = self.branch(dry, &x1, mlp, tag(next, TensorKind::ResidualStream));
        dry.release(normed);
        dry.release(x1);
        x2
    }

    /// `Block::branch`: `x + dropout(output)` (dropout only when the model has any).
    fn branch(&self, dry: &mut DryRun, x: &Handle, output: Handle, sum_tag: Tag) -> Handle {
        let sum = if self.config.dropout > 0.0 {
            let dropped = dry.dropout(&output, tag(sum_tag.layer, TensorKind::LinearOutputs));
            let sum = dry.saves_nothing(&[x, &dropped], x.bytes, sum_tag);
            dry.release(dropped);
            sum
        } else {
            dry.saves_nothing(&[x, &output], x.bytes, sum_tag)
        };
        dry.release(output);
        sum
    }

    /// `CausalSelfAttention::forward`: each projection of q and k is rotated and dropped at
    /// the end of its statement; the fused attention saves the rotated q, k and v.
    fn attention(&self, dry: &mut DryRun, i: usize, x: &Handle) -> Handle {
        let params = &self.blocks[i];
        let here = |kind| tag(Layer::Block(i), kind);
        let width = self.per_token(self.config.d_model);
        let rotated = |dry: &mut DryRun, name, weight| {
            let projected = dry.projection(name, x, weight, width, here(TensorKind::Heads));
            let rotated = dry.layout(&projected, here(TensorKind::Heads));
            dry.release(projected);
            rotated
        };
        let q = rotated(dry, "wq", &params.wq);
        let k = rotated(dry, "wk", &params.wk);
        let v = dry.projection("wv", x, &params.wv, width, here(TensorKind::Heads));
        let mixed = dry.causal_attention(&q, &k, &v, here(TensorKind::LinearOutputs));
        let output = dry.projection(
            "wo",
            &mixed,
            &params.wo,
            width,
            here(TensorKind::LinearOutputs),
        );
        for local in [mixed, v, k, q] {
            dry.release(local);
        }
        output
    }

    /// `SwiGlu::forward`: `w2(swiglu(w1·x, w3·x))`, the gate rounded for `w2`.
    fn mlp(&self, dry: &mut DryRun, i: usize, x: &Handle) -> Handle {
        let (c, params) = (&self.config, &self.blocks[i]);
        let here = |kind| tag(Layer::Block(i), kind);
        let hidden = self.per_token(c.hidden);
        let gate_in = dry.projection("w1", x, &params.w1, hidden, here(TensorKind::MlpHidden));
        let up = dry.projection("w3", x, &params.w3, hidden, here(TensorKind::MlpHidden));
        let product = dry.swiglu(&gate_in, &up, here(TensorKind::MlpHidden));
        let product = dry.round_for_products(product);
        // Both projections are temporaries of the model's one statement, dropped at its end
        // in reverse order of creation.
        dry.release(up);
        dry.release(gate_in);
        let output = dry.projection(
            "w2",
            &product,
            &params.w2,
            self.per_token(c.d_model),
            here(TensorKind::LinearOutputs),
        );
        dry.release(product);
        output
    }
}
