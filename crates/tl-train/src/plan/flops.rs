//! [`StepFlops`]: the floating-point operations of the products one rank runs in a training
//! step, counted from the model's shape and the recipe the way the step runs them.
//!
//! # The count
//!
//! A product of an `m×k` matrix by a `k×n` one is `2mkn` FLOPs (a multiply and an add per
//! term). Per sequence of `T` tokens, width `d`, SwiGLU width `h`, vocabulary `V`:
//!
//! ```text
//!                          forward              backward                      rerun
//! block projections        2T(4d² + 3dh)        2 × forward (dX and dW)       as forward, less
//!                                                                             what the policy keeps
//! block attention          4d·pairs(T)          10d·pairs(T)                  0 (kept)
//! head                     2TdV                 4TdV                          2TdV with the
//!                                                                             chunked loss
//! ```
//!
//! `pairs(T)` is the (query, key) pairs the fused attention computes: it multiplies each block
//! of 64 query rows `r0..r1` by the keys `0..r1` ([`ROW_BLOCK`]), so `pairs(T) = Σ (r1 − r0)·r1`
//! — a little over the causal triangle `T(T+1)/2` (147,456 against 131,328 at `T` = 512).
//! The forward pass makes two products over those pairs (`q·kᵀ`, `P·v`), each `2·d_head` per
//! pair and head, so `4d·pairs` over the heads; the backward pass five (the scores again, then
//! `dO·vᵀ`, `Pᵀ·dO`, `dSᵀ·q`, `dS·k`): `10d·pairs`. The embedding is a lookup, the norms, the
//! rotary embedding, the SwiGLU gate, the loss and AdamW are elementwise: none of them is a
//! product, and the compute rate absorbs their time (see `step_time.rs`).
//!
//! Summed, the projections and the head give the well-known `6·P·T` per sequence, with `P`
//! the parameters that take part in products (all but the embedding and the norms' gains).
//!
//! The chunked loss (`--chunked-loss`, on by default for a vocabulary of 8 widths or more)
//! keeps no logits for backward and multiplies them again there, one block of rows at a
//! time: the head's forward product once more.
//!
//! With checkpointing, every checkpointed block (all but the last segment's) reruns its
//! forward pass during backward, taking the attention's result back rather than recomputing
//! it (selective checkpointing), and skipping the products its policy keeps: `matmuls` keeps
//! all seven, `first-matmul` keeps `x·Wq`.
//!
//! Tensor parallelism over `t` ranks divides every product of a block and of the head by
//! `t` (heads, SwiGLU columns and vocabulary are split evenly); a pipeline rank runs the
//! blocks of its own stages, and the head only on the rank of the last stage.

use serde::Serialize;
use tl_tensor::kernels::attention::ROW_BLOCK;

use super::parallel::DataParallelism;
use crate::error::Result;
use crate::model::{Checkpointing, ModelConfig};
use crate::train::TrainConfig;

/// FLOPs of one rank's products in one optimizer step (all its micro-batches).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StepFlops {
    /// The forward passes.
    pub forward: u64,
    /// The backward passes, without the reruns.
    pub backward: u64,
    /// Checkpointed blocks' forward passes rerun during backward.
    pub recompute: u64,
}

impl StepFlops {
    /// All of them.
    pub fn total(&self) -> u64 {
        self.forward + self.backward + self.recompute
    }
}

/// The (query, key) pairs the fused attention computes for a sequence of `time` tokens:
/// `Σ (r1 − r0)·r1` over its blocks of [`ROW_BLOCK`] query rows.
///
/// ```
/// use tl_train::plan::attention_pairs;
/// // 70 tokens: rows 0..64 see 64 keys, rows 64..70 see 70.
/// assert_eq!(attention_pairs(70), 64 * 64 + 6 * 70);
/// ```
pub fn attention_pairs(time: usize) -> u64 {
    (0..time)
        .step_by(ROW_BLOCK)
        .map(|start| {
            let end = (start + ROW_BLOCK).min(time);
            ((end - start) * end) as u64
        })
        .sum()
}

/// Per-sequence FLOPs of one whole block and of the head, unsplit.
struct SequenceFlops {
    projections: u64,
    attention: u64,
    head: u64,
    /// What a checkpointed block's rerun multiplies again.
    rerun: u64,
}

impl SequenceFlops {
    fn of(model: &ModelConfig, checkpointing: Checkpointing) -> Self {
        let (t, d, h, v) = (
            model.context as u64,
            model.d_model as u64,
            model.hidden as u64,
            model.vocab as u64,
        );
        let projections = 2 * t * (4 * d * d + 3 * d * h);
        let rerun = match checkpointing {
            Checkpointing::Off | Checkpointing::Matmuls => 0,
            Checkpointing::FirstMatmul => projections - 2 * t * d * d,
            Checkpointing::PerBlock | Checkpointing::Budget(_) => projections,
        };
        Self {
            projections,
            attention: 4 * d * attention_pairs(model.context),
            head: 2 * t * d * v,
            rerun,
        }
    }
}

/// The FLOPs of the products world rank `rank` runs in one step of `config` spread as
/// `parallelism` says (see the [module docs](self)).
///
/// ```
/// use tl_train::model::Preset;
/// use tl_train::plan::{DataParallelism, step_flops};
/// use tl_train::train::TrainConfig;
///
/// let mut config = TrainConfig::for_preset(Preset::Capstone);
/// config.micro_batch = 4;
/// config.accum = 1;
/// let flops = step_flops(&config, &DataParallelism::new(2, 0)?, 0)?;
/// // The products of 4 sequences: 6·P·T for the 10,240,000 weights that multiply, plus
/// // the attention's 14·d·pairs(512) per block.
/// assert_eq!(flops.total(), 4 * (6 * 10_240_000 * 512 + 8 * 14 * 320 * 147_456));
/// // Backward is twice forward, but for the attention's 10 against 2 · 4.
/// assert_eq!(flops.backward, 2 * flops.forward + 4 * 8 * 2 * 320 * 147_456);
/// # Ok::<(), tl_train::TrainError>(())
/// ```
///
/// # Errors
/// The config's errors of a pipeline's cut.
pub fn step_flops(
    config: &TrainConfig,
    parallelism: &DataParallelism,
    rank: usize,
) -> Result<StepFlops> {
    let model = &config.model;
    let per = SequenceFlops::of(model, config.checkpointing);
    let tensor = parallelism.tensor.max(1) as u64;
    let pipeline = parallelism.pipeline.max(1);
    // The blocks and the head this rank runs.
    let (blocks, head): (Vec<usize>, bool) = if pipeline > 1 {
        let stages = pipeline * config.parallel.stages_per_rank.max(1);
        let cut = crate::model::pipeline::stage_blocks(
            model,
            stages,
            config.parallel.pipeline_split.as_deref(),
        )?;
        // The mesh's layout, rank = (pp·DP + dp)·TP + tp; stage s runs on pipeline rank
        // s mod p.
        let replicas = parallelism.ranks / (parallelism.tensor * pipeline);
        let pp_rank = rank / (parallelism.tensor * replicas);
        let mine: Vec<usize> = (0..stages).filter(|s| s % pipeline == pp_rank).collect();
        let blocks = mine.iter().flat_map(|&s| cut[s].clone()).collect();
        (blocks, mine.contains(&(stages - 1)))
    } else {
        ((0..model.n_layers).collect(), true)
    };
    let rerun_blocks = match config.checkpointing.schedule(model.n_layers)? {
        // Every segment but the last is checkpointed; segments start at 0.
        Some(starts) => starts.last().copied().unwrap_or(0),
        None => 0,
    };
    let sequences = (config.micro_batch * config.accum) as u64;
    let n_blocks = blocks.len() as u64;
    let n_rerun = blocks.iter().filter(|&&b| b < rerun_blocks).count() as u64;
    let head_forward = if head { per.head } else { 0 };
    let forward = n_blocks * (per.projections + per.attention) + head_forward;
    let backward = n_blocks * (2 * per.projections + 5 * per.attention / 2) + 2 * head_forward;
    // The chunked loss computes the head's logits again in backward, block by block.
    let head_rerun = if config.chunked_loss.resolve(model) {
        head_forward
    } else {
        0
    };
    Ok(StepFlops {
        forward: sequences * forward / tensor,
        backward: sequences * backward / tensor,
        recompute: sequences * (n_rerun * per.rerun + head_rerun) / tensor,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;

    fn tiny(micro_batch: usize, checkpointing: Checkpointing) -> TrainConfig {
        let mut config = TrainConfig::for_preset(Preset::Tiny);
        config.micro_batch = micro_batch;
        config.accum = 1;
        config.checkpointing = checkpointing;
        config
    }

    /// The tiny preset by hand: V 256, d 64, 2 blocks, hidden 176 (SwiGLU), T 64.
    #[test]
    fn the_tiny_preset_counts_what_a_hand_count_gives() {
        let config = tiny(1, Checkpointing::Off);
        let m = &config.model;
        assert_eq!(
            (m.vocab, m.d_model, m.n_layers, m.hidden, m.context),
            (256, 64, 2, 176, 64)
        );
        // One block of 64 query rows against 64 keys: 4096 pairs.
        assert_eq!(attention_pairs(64), 4096);
        // Projections: 4·64² + 3·64·176 = 16,384 + 33,792 = 50,176 weights, 2 FLOPs each
        // per token: 64 tokens × 100,352 = 6,422,528 per block.
        // Attention: 4 · 64 · 4096 = 1,048,576 per block. Head: 2 · 64 · 64 · 256 = 2,097,152.
        // Forward: 2 · (6,422,528 + 1,048,576) + 2,097,152 = 17,039,360.
        let flops = step_flops(&config, &DataParallelism::new(1, 0).unwrap(), 0).unwrap();
        assert_eq!(flops.forward, 17_039_360);
        // Backward: 2 · (2 · 6,422,528 + 2.5 · 1,048,576) + 2 · 2,097,152 = 35,127,296.
        assert_eq!(flops.backward, 35_127_296);
        assert_eq!(flops.recompute, 0);
        // 6·P·T for the product weights (P = 2·50,176 + 64·256 = 116,736), plus attention.
        assert_eq!(flops.total(), 6 * 116_736 * 64 + 2 * (7 * 1_048_576 / 2));
    }

    #[test]
    fn checkpointing_reruns_every_block_but_the_last_without_its_attention() {
        let per_block = 6_422_528;
        let ckpt = |policy| {
            step_flops(&tiny(3, policy), &DataParallelism::new(1, 0).unwrap(), 0)
                .unwrap()
                .recompute
        };
        // Two blocks, the last one's segment never checkpointed: one rerun, three sequences.
        assert_eq!(ckpt(Checkpointing::PerBlock), 3 * per_block);
        assert_eq!(ckpt(Checkpointing::Matmuls), 0);
        // x·Wq is kept: 2 · 64 · 64² FLOPs per sequence fewer.
        assert_eq!(ckpt(Checkpointing::FirstMatmul), 3 * (per_block - 524_288));
        assert_eq!(ckpt(Checkpointing::Off), 0);
    }

    #[test]
    fn the_chunked_loss_multiplies_the_head_once_more_in_backward() {
        use crate::model::head_loss::ChunkedLoss;
        let flops = |chunked, checkpointing| {
            let config = TrainConfig {
                chunked_loss: chunked,
                ..tiny(3, checkpointing)
            };
            step_flops(&config, &DataParallelism::new(1, 0).unwrap(), 0).unwrap()
        };
        // The tiny preset's byte vocabulary is 4 widths: auto is off.
        assert_eq!(flops(ChunkedLoss::Auto, Checkpointing::Off).recompute, 0);
        let on = flops(ChunkedLoss::On, Checkpointing::PerBlock);
        let off = flops(ChunkedLoss::Off, Checkpointing::PerBlock);
        // 2 · 64 tokens · 64 · 256 per sequence, three sequences.
        assert_eq!(on.recompute - off.recompute, 3 * 2_097_152);
        assert_eq!((on.forward, on.backward), (off.forward, off.backward));
    }

    #[test]
    fn tensor_parallelism_divides_and_a_pipeline_rank_runs_its_own_stages() {
        let config = tiny(1, Checkpointing::Off);
        let whole = step_flops(&config, &DataParallelism::new(1, 0).unwrap(), 0).unwrap();
        let split = DataParallelism::new(2, 0).unwrap().with_tensor(2).unwrap();
        assert_eq!(
            step_flops(&config, &split, 1).unwrap().forward,
            whole.forward / 2
        );
        let mut piped = config.clone();
        piped.parallel.pipeline = 2;
        piped.parallel.ranks = 2;
        let pp = DataParallelism::new(2, 0)
            .unwrap()
            .with_pipeline(2)
            .unwrap();
        let first = step_flops(&piped, &pp, 0).unwrap();
        let last = step_flops(&piped, &pp, 1).unwrap();
        // One block each; the head on the last stage only.
        assert_eq!(first.forward, 6_422_528 + 1_048_576);
        assert_eq!(last.forward, first.forward + 2_097_152);
        assert_eq!(first.forward + last.forward, whole.forward);
    }
}
