//! ZeRO's stages on tinyllm's ranks in closed form: what each stage keeps on a rank and what
//! it sends per step, term by term ([`stage_terms`], [`stage_collectives`]), next to the
//! paper's arithmetic ([`paper_figures`]).
//!
//! The parallel plan's figures do not come from here: its dry run replicates what
//! tl-parallel does at every stage, allocation for allocation and call for call, and a
//! test checks it against real ranks. These formulas say the same in a few lines, and the
//! unit tests check them against the dry run:
//!
//! - **ZeRO-1** (`ShardedAdamW`): DDP's reduction, then AdamW on the rank's `1/N` of the
//!   flattened parameters and an all-gather of the updated weights in rounds of a bucket.
//! - **ZeRO-2** (`Zero2AdamW`): every micro-batch but the last accumulates full gradients
//!   locally, as DDP does; during the last one's backward each bucket is reduce-scattered
//!   as soon as its gradients are in, and the rank keeps only its chunk of each. It updates
//!   its chunks, and the updated weights are all-gathered bucket by bucket.
//! - **ZeRO-3** (`Zero3`): the weights are partitioned per *unit* (the embedding, each
//!   block, the final norm with the head); a unit's weights are all-gathered before its
//!   forward pass and again before its backward pass (a checkpointed unit's rerun gathers
//!   instead, and keeps them for its backward) and released after each, and its gradients
//!   are reduce-scattered as soon as its backward is done, every micro-batch. Each rank
//!   updates its shards; nothing is gathered after the update.
//!
//! Under ZeRO-2 and 3 one small all-reduce makes the loss, the overflow flag and the
//! underflows global, and when the gradients are clipped one more adds the shards' sums
//! of squares (an f64).
//!
//! All sizes are of f32 elements (tinyllm keeps weights, gradients and moments in f32 even
//! under autocast), so "4P" below is the bytes of the `P` parameters.

use std::fmt;

use serde::{Serialize, Serializer};
use tl_collective::shard_range;

use super::collectives::{Collective, RING_HEADER_BYTES};
use crate::error::{Result, TrainError};
use crate::model::ModelConfig;

/// Bytes per bucket of tl-parallel's gradient reduction (its `DEFAULT_BUCKET_BYTES`,
/// PyTorch DDP's 25 MiB; a test checks the two agree).
pub const BUCKET_BYTES: u64 = 25 << 20;

/// The scalars `DataParallel` appends to the last bucket: the loss, the non-finite flag and
/// the underflow count.
pub const STEP_EXTRAS: u64 = 3;

/// The most ranks a plan takes: far past any run of this design, and small enough that
/// every per-rank figure stays exact in 64 bits.
pub const MAX_RANKS: usize = 1 << 16;

/// Bytes of an f32.
const F32: u64 = 4;

/// How much of the model state each rank keeps: ZeRO's stages, 0 being plain DDP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ZeroStage {
    /// Stage 0: plain DDP, every rank keeps everything.
    Ddp,
    /// Stage 1: AdamW's state sharded.
    OptimizerStates,
    /// Stage 2: the gradients sharded too.
    Gradients,
    /// Stage 3: the weights sharded too.
    Parameters,
}

impl ZeroStage {
    /// The four stages, in order.
    pub const ALL: [ZeroStage; 4] = [
        ZeroStage::Ddp,
        ZeroStage::OptimizerStates,
        ZeroStage::Gradients,
        ZeroStage::Parameters,
    ];

    /// The stage's number, 0 to 3.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The stage numbered `index`.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`] (`zero`) for a number above 3.
    pub fn from_index(index: usize) -> Result<Self> {
        ZeroStage::ALL
            .get(index)
            .copied()
            .ok_or_else(|| TrainError::InvalidArgument {
                name: "zero",
                value: index.to_string(),
                reason: "a ZeRO stage is 0 (plain DDP), 1, 2 or 3".into(),
            })
    }
}

impl fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.index())
    }
}

impl Serialize for ZeroStage {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.serialize_u64(self.index() as u64)
    }
}

/// The model's sizes as the stages need them, in elements.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ModelSizes {
    /// All parameters, `P`.
    pub parameters: u64,
    /// ZeRO-3's units in forward order: the embedding `V·d`, each block
    /// `4d² + 3dh + 2d`, the final norm with the head `d + dV`.
    pub units: Vec<u64>,
    /// The largest single parameter (a `.grad` that exists whole before it is bucketed).
    pub largest_parameter: u64,
}

impl ModelSizes {
    /// The sizes of `config`'s model.
    pub fn of(config: &ModelConfig) -> Self {
        let (v, d, h) = (
            config.vocab as u64,
            config.d_model as u64,
            config.hidden as u64,
        );
        let mut units = vec![v * d];
        units.extend((0..config.n_layers).map(|_| 4 * d * d + 3 * d * h + 2 * d));
        units.push(d + d * v);
        Self {
            parameters: units.iter().sum(),
            units,
            largest_parameter: (v * d).max(d * h).max(d * d),
        }
    }

    /// The largest unit.
    pub fn largest_unit(&self) -> u64 {
        self.units.iter().copied().max().unwrap_or(0)
    }
}

/// Elements of `len` that rank `rank` of `ranks` owns (`shard_range`).
fn shard(len: u64, ranks: usize, rank: usize) -> u64 {
    shard_range(len as usize, ranks, rank).len() as u64
}

/// Elements per bucket, and the buckets' lengths: full ones, then the last (without the
/// extras), as tl-parallel's bucket plan cuts the flattened gradients.
fn buckets(parameters: u64, bucket_bytes: u64) -> (u64, u64, u64) {
    let capacity = (bucket_bytes / F32).max(1);
    let count = parameters.div_ceil(capacity).max(1);
    let last = parameters - (count - 1) * capacity;
    (capacity, count - 1, last)
}

/// What one rank holds in each phase of a steady-state step under one stage, in bytes.
///
/// A closed-form model: the parallel plan's peaks come from the dry run. "Buffers" are the
/// vectors the reduction and the gathers work in (tl-parallel's buckets and gathers, which
/// it counts on the meter, and the ring's scratch, which it does not).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StageTerms {
    /// Weights kept between steps: `4P`, or `4P/N` of shards under stage 3.
    pub weights: u64,
    /// Stage 3: the full weights of the largest unit while it runs (gathered, then freed).
    pub gathered_weights: u64,
    /// Gradients that can be alive during backward (the dry run says how many are at the
    /// peak; this bounds them): `4P` up to stage 1, and under stage 2 whenever earlier
    /// micro-batches accumulate locally.
    pub gradients_backward: u64,
    /// Gradients kept once reduced, while AdamW runs: `4P`, or the rank's `4P/N` shard.
    pub gradients_reduced: u64,
    /// AdamW's state on the rank: `8P` of moments, or under sharding `8P/N` of moments and
    /// `4P/N` of master shard (tl-parallel's `ShardedAdamW` keeps a 1-D copy of its shard).
    pub optimizer: u64,
    /// The sharded AdamW's copy of its shard's gradients, alive while it updates.
    pub update_copies: u64,
    /// Communication buffers alive during backward (stages 2 and 3 communicate there).
    pub buffers_backward: u64,
    /// Communication buffers of the gradient reduction after backward.
    pub buffers_reduce: u64,
    /// Communication buffers of the update's all-gather.
    pub buffers_update: u64,
}

/// The per-rank terms of `stage` for rank `rank` of `ranks`, with `accum` micro-batches
/// per step and gradient buckets of `bucket_bytes` (see the [module docs](self)).
///
/// The reduction's buffers: `DataParallel` copies a bucket into a vector (the first bucket
/// is the largest), and the ring reduce-scatters it in place through a scratch vector of
/// one shard; each collective also gathers the ranks' 40-byte headers into a vector.
/// `ShardedAdamW`'s gather uses a vector of its shard and one of a round: at most a bucket.
pub fn stage_terms(
    stage: ZeroStage,
    sizes: &ModelSizes,
    ranks: usize,
    rank: usize,
    accum: usize,
    bucket_bytes: u64,
) -> StageTerms {
    let p = sizes.parameters;
    let own = shard(p, ranks, rank);
    let (capacity, full, last) = buckets(p, bucket_bytes);
    let first_bucket = if full > 0 {
        capacity
    } else {
        last + STEP_EXTRAS
    };
    let ring = |len: u64| {
        if ranks == 1 {
            0
        } else {
            F32 * shard(len, ranks, 0) + RING_HEADER_BYTES * ranks as u64
        }
    };
    let bucket_buffers = F32 * first_bucket + ring(first_bucket);
    // `ShardedAdamW`'s gather: a copy of its shard, then rounds of at most a bucket over the
    // ranks per rank, one buffer at a time (the first round is the largest).
    let round = (bucket_bytes / F32 / ranks as u64).max(1);
    let gather_round: u64 = (0..ranks).map(|r| shard(p, ranks, r).min(round)).sum();
    let gather_buffers = F32 * own + F32 * gather_round + ring(0);
    match stage {
        ZeroStage::Ddp => StageTerms {
            weights: F32 * p,
            gradients_backward: F32 * p,
            gradients_reduced: F32 * p,
            optimizer: 2 * F32 * p,
            buffers_reduce: bucket_buffers,
            ..StageTerms::default()
        },
        ZeroStage::OptimizerStates => StageTerms {
            weights: F32 * p,
            gradients_backward: F32 * p,
            gradients_reduced: F32 * p,
            optimizer: 3 * F32 * own,
            update_copies: F32 * own,
            buffers_reduce: bucket_buffers,
            buffers_update: gather_buffers,
            ..StageTerms::default()
        },
        ZeroStage::Gradients => {
            // With one micro-batch, a bucket's full gradients wait for their reduce-scatter
            // (or a parameter's whole `.grad`, when it is larger than a bucket).
            let window = (F32 * p).min(bucket_bytes.max(F32 * sizes.largest_parameter));
            let gradients_backward = if accum > 1 {
                F32 * p
            } else {
                F32 * own + window
            };
            // The bucket, the reduce-scatter's copy of it, and the ring's scratch.
            let scatter_buffers = 2 * F32 * first_bucket + ring(first_bucket);
            StageTerms {
                weights: F32 * p,
                gradients_backward,
                gradients_reduced: F32 * own,
                optimizer: 3 * F32 * own,
                update_copies: F32 * own,
                buffers_backward: scatter_buffers,
                buffers_update: gather_buffers,
                ..StageTerms::default()
            }
        }
        ZeroStage::Parameters => {
            let own: u64 = sizes.units.iter().map(|&u| shard(u, ranks, rank)).sum();
            let unit = sizes.largest_unit();
            StageTerms {
                weights: F32 * own,
                gathered_weights: F32 * unit,
                // The accumulated shard, and one unit's full gradients before they are
                // reduce-scattered.
                gradients_backward: F32 * own + F32 * unit,
                gradients_reduced: F32 * own,
                optimizer: 3 * F32 * own,
                update_copies: F32 * own,
                // A unit's gather buffer, its gradients flattened for the reduce-scatter
                // and the reduce-scatter's copy of them, and the ring's scratch.
                buffers_backward: 3 * F32 * unit + ring(unit),
                ..StageTerms::default()
            }
        }
    }
}

/// Calls of one collective in a step, all on buffers of the same length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CollectiveCalls {
    /// What is communicated.
    pub purpose: &'static str,
    /// The collective.
    pub collective: Collective,
    /// Elements per call.
    pub elements: u64,
    /// Bytes per element: 4 (f32), or 8 for the f64 sum of the clip norm.
    pub element_bytes: u64,
    /// Calls per step.
    pub calls: u64,
}

/// The collectives of one steady-state step under `stage`, the same on every rank (see the
/// [module docs](self)), `clip` when the gradients are clipped. Stage 1's gather of the
/// weights is written as one call; `ShardedAdamW` makes it in rounds of about a bucket,
/// which the dry run follows.
pub fn stage_collectives(
    stage: ZeroStage,
    sizes: &ModelSizes,
    accum: usize,
    bucket_bytes: u64,
    clip: bool,
) -> Vec<CollectiveCalls> {
    let p = sizes.parameters;
    let (capacity, full, last) = buckets(p, bucket_bytes);
    let accum = accum as u64;
    let calls = |purpose, collective, elements, calls| CollectiveCalls {
        purpose,
        collective,
        elements,
        element_bytes: F32,
        calls,
    };
    let mut out = Vec::new();
    let bucket_calls = |out: &mut Vec<CollectiveCalls>, collective, extras| {
        if full > 0 {
            out.push(calls("gradient buckets", collective, capacity, full));
        }
        out.push(calls("last gradient bucket", collective, last + extras, 1));
    };
    let extras = calls(
        "loss, overflow flag, underflows",
        Collective::AllReduce,
        STEP_EXTRAS,
        1,
    );
    let weights = calls("updated weights", Collective::AllGather, p, 1);
    let norm = CollectiveCalls {
        purpose: "gradient norm",
        collective: Collective::AllReduce,
        elements: 1,
        element_bytes: 8,
        calls: 1,
    };
    match stage {
        ZeroStage::Ddp => bucket_calls(&mut out, Collective::AllReduce, STEP_EXTRAS),
        ZeroStage::OptimizerStates => {
            bucket_calls(&mut out, Collective::AllReduce, STEP_EXTRAS);
            out.push(weights);
        }
        ZeroStage::Gradients => {
            // The buckets as DDP lays them out, the last with room for the three scalars
            // (left at zero), reduce-scattered; then gathered back the same way.
            bucket_calls(&mut out, Collective::ReduceScatter, STEP_EXTRAS);
            out.push(extras);
            if clip {
                out.push(norm);
            }
            if full > 0 {
                out.push(calls(
                    "updated weights",
                    Collective::AllGather,
                    capacity,
                    full,
                ));
            }
            out.push(calls(
                "updated weights",
                Collective::AllGather,
                last + STEP_EXTRAS,
                1,
            ));
        }
        ZeroStage::Parameters => {
            let units = &sizes.units;
            let blocks = (units.len() - 2) as u64;
            // (unit's elements, units, what its two gathers and its reduce-scatter move)
            let groups = [
                (
                    units[0],
                    1,
                    [
                        "embedding weights, forward",
                        "embedding weights, backward",
                        "embedding gradients",
                    ],
                ),
                (
                    units[1.min(units.len() - 1)],
                    blocks,
                    [
                        "block weights, forward",
                        "block weights, backward",
                        "block gradients",
                    ],
                ),
                (
                    units[units.len() - 1],
                    1,
                    [
                        "norm + head weights, forward",
                        "norm + head weights, backward",
                        "norm + head gradients",
                    ],
                ),
            ];
            for (elements, count, [forward, backward, gradients]) in groups {
                if count > 0 {
                    let per_step = count * accum;
                    out.push(calls(forward, Collective::AllGather, elements, per_step));
                    out.push(calls(backward, Collective::AllGather, elements, per_step));
                    out.push(calls(
                        gradients,
                        Collective::ReduceScatter,
                        elements,
                        per_step,
                    ));
                }
            }
            out.push(extras);
            if clip {
                out.push(norm);
            }
        }
    }
    out
}

/// ZeRO's own arithmetic for one rank (Rajbhandari et al., 2020), and tinyllm's f32
/// counterpart of it, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PaperFigures {
    /// Mixed-precision Adam, `K = 12`: fp16 weights `2Ψ`, fp16 gradients `2Ψ`, and
    /// `KΨ` of fp32 master weights, momentum and variance; stage 0 `(2+2+K)Ψ`, stage 1
    /// `2Ψ + 2Ψ + KΨ/N`, stage 2 `2Ψ + (2+K)Ψ/N`, stage 3 `(2+2+K)Ψ/N`.
    pub model_state_k12: u64,
    /// tinyllm's `16P` in f32, weights `4P`...
    pub f32_weights: u64,
    /// ... gradients `4P`...
    pub f32_gradients: u64,
    /// ... and moments `8P`, each divided by `N` from the stage that shards it.
    pub f32_moments: u64,
    /// The paper's volume per rank in f32 bytes: `2(N−1)/N·4P` for stages 0 to 2 (an
    /// all-reduce, or a reduce-scatter and an all-gather), `3(N−1)/N·4P` per micro-batch for
    /// stage 3 (two all-gathers and a reduce-scatter).
    pub sent: u64,
}

/// [`PaperFigures`] of `stage` for `parameters` over `ranks`, `accum` micro-batches.
pub fn paper_figures(
    stage: ZeroStage,
    parameters: u64,
    ranks: usize,
    accum: usize,
) -> PaperFigures {
    let (p, n) = (parameters, ranks as u64);
    let model_state_k12 = match stage {
        ZeroStage::Ddp => 16 * p,
        ZeroStage::OptimizerStates => 4 * p + 12 * p / n,
        ZeroStage::Gradients => 2 * p + 14 * p / n,
        ZeroStage::Parameters => 16 * p / n,
    };
    let sharded = |from: ZeroStage, bytes: u64| if stage >= from { bytes / n } else { bytes };
    let volume = F32 * p * (n - 1) / n;
    PaperFigures {
        model_state_k12,
        f32_weights: sharded(ZeroStage::Parameters, 4 * p),
        f32_gradients: sharded(ZeroStage::Gradients, 4 * p),
        f32_moments: sharded(ZeroStage::OptimizerStates, 8 * p),
        sent: if stage == ZeroStage::Parameters {
            3 * volume * accum as u64
        } else {
            2 * volume
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1000 parameters in two units of 400 and 600 (as if an embedding and a head).
    fn sizes() -> ModelSizes {
        ModelSizes {
            parameters: 1000,
            units: vec![400, 600],
            largest_parameter: 600,
        }
    }

    #[test]
    fn the_papers_arithmetic_per_stage() {
        // Ψ = 1000, N = 4, K = 12: 16Ψ; 4Ψ + 12Ψ/4; 2Ψ + 14Ψ/4; 16Ψ/4.
        let k12: Vec<u64> = ZeroStage::ALL
            .iter()
            .map(|&s| paper_figures(s, 1000, 4, 1).model_state_k12)
            .collect();
        assert_eq!(k12, [16_000, 7_000, 5_500, 4_000]);
        // tinyllm's f32 split at stage 2: weights 4P, gradients 4P/N, moments 8P/N.
        let f32_split = paper_figures(ZeroStage::Gradients, 1000, 4, 1);
        assert_eq!(
            (
                f32_split.f32_weights,
                f32_split.f32_gradients,
                f32_split.f32_moments
            ),
            (4_000, 1_000, 2_000)
        );
        // Volume: 2·3/4·4000 bytes, and 3·3/4·4000 per micro-batch for stage 3.
        assert_eq!(paper_figures(ZeroStage::Ddp, 1000, 4, 2).sent, 6_000);
        assert_eq!(
            paper_figures(ZeroStage::Parameters, 1000, 4, 2).sent,
            18_000
        );
    }

    #[test]
    fn buckets_are_full_but_the_last_which_carries_the_extras() {
        // Buckets of 1600 bytes = 400 floats: 400 + 400 + 200 (+ 3 scalars).
        let calls = stage_collectives(ZeroStage::Ddp, &sizes(), 1, 1600, true);
        let shape: Vec<(u64, u64)> = calls.iter().map(|c| (c.elements, c.calls)).collect();
        assert_eq!(shape, [(400, 2), (203, 1)]);
        // ZeRO-1 adds the gather of all 1000 weights.
        let calls = stage_collectives(ZeroStage::OptimizerStates, &sizes(), 1, 1600, true);
        assert_eq!(calls.last().unwrap().elements, 1000);
        assert_eq!(calls.last().unwrap().collective, Collective::AllGather);
    }

    #[test]
    fn zero3_gathers_each_unit_twice_and_scatters_its_gradients_every_micro_batch() {
        let calls = stage_collectives(ZeroStage::Parameters, &sizes(), 3, BUCKET_BYTES, false);
        // Two units, no blocks: 3 collectives of each unit per micro-batch, then the extras.
        let per_unit: Vec<(u64, u64)> = calls.iter().map(|c| (c.elements, c.calls)).collect();
        assert_eq!(
            per_unit,
            [
                (400, 3),
                (400, 3),
                (400, 3),
                (600, 3),
                (600, 3),
                (600, 3),
                (3, 1)
            ]
        );
    }

    #[test]
    fn the_stages_shed_optimizer_gradients_then_weights() {
        let terms = |stage| stage_terms(stage, &sizes(), 4, 0, 1, BUCKET_BYTES);
        let ddp = terms(ZeroStage::Ddp);
        assert_eq!(
            (ddp.weights, ddp.gradients_reduced, ddp.optimizer),
            (4000, 4000, 8000)
        );
        // A shard of 250 elements: 8·250 of moments and 4·250 of master copy.
        let zero1 = terms(ZeroStage::OptimizerStates);
        assert_eq!((zero1.weights, zero1.optimizer), (4000, 3000));
        let zero2 = terms(ZeroStage::Gradients);
        assert_eq!((zero2.weights, zero2.gradients_reduced), (4000, 1000));
        // Unit shards of 100 and 150 elements; the head (600) is gathered whole while it runs.
        let zero3 = terms(ZeroStage::Parameters);
        assert_eq!((zero3.weights, zero3.gathered_weights), (1000, 2400));
        // With more than one micro-batch, ZeRO-2 accumulates full gradients locally.
        let accumulating = stage_terms(ZeroStage::Gradients, &sizes(), 4, 0, 2, BUCKET_BYTES);
        assert_eq!(accumulating.gradients_backward, 4000);
    }

    #[test]
    fn stages_outside_zero_to_three_are_typed_errors() {
        assert_eq!(ZeroStage::from_index(3).unwrap(), ZeroStage::Parameters);
        assert!(matches!(
            ZeroStage::from_index(4),
            Err(TrainError::InvalidArgument { name: "zero", .. })
        ));
    }
}
