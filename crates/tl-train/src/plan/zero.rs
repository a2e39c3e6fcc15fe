//! ZeRO as sizes: the model's units and parameters, the calls of a step's collectives, and
//! the paper's arithmetic ([`paper_figures`]) that the parallel plan prints beside the
//! figures it measures on the trainer's own step.
//!
//! What each stage keeps and sends is not written here: the plan runs tl-parallel's real
//! step on meta tensors, as one rank of a phantom world (see the parallel plan). Only
//! Rajbhandari et al.'s closed forms stay, as the `paper` column.

use serde::Serialize;

use super::collectives::Collective;
use crate::model::ModelConfig;

pub use tl_parallel::ZeroStage;

/// Bytes per bucket of tl-parallel's gradient reduction: its `DEFAULT_BUCKET_BYTES`
/// (PyTorch DDP's 25 MiB).
pub const BUCKET_BYTES: u64 = tl_parallel::DEFAULT_BUCKET_BYTES as u64;

/// The scalars tl-parallel adds up at the end of a step (the loss, the non-finite flag and
/// the underflow count): its `STEP_EXTRAS`.
pub const STEP_EXTRAS: u64 = tl_parallel::STEP_EXTRAS as u64;

/// The most ranks a plan takes: far past any run of this design, and small enough that
/// every per-rank figure stays exact in 64 bits.
pub const MAX_RANKS: usize = 1 << 16;

/// Bytes of an f32.
const F32: u64 = 4;

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

/// Calls of one collective in a step, all on buffers of the same length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CollectiveCalls {
    /// What is communicated.
    pub purpose: &'static str,
    /// The collective.
    pub collective: Collective,
    /// Elements per call.
    pub elements: u64,
    /// Bytes per element: 4 (f32), or 8 for the f64 sums and maxima (the clip norm, the
    /// non-finite weight check, fp8's amaxes and counts).
    pub element_bytes: u64,
    /// Calls per step.
    pub calls: u64,
    /// Ranks of the group the calls run over (the world, or a tensor-, pipeline- or
    /// data-parallel group): the ring's length, which sets its number of hops.
    #[serde(skip)]
    pub group_ranks: usize,
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
        ZeroStage::Optimizer => 4 * p + 12 * p / n,
        ZeroStage::Gradients => 2 * p + 14 * p / n,
        ZeroStage::Parameters => 16 * p / n,
    };
    let sharded = |from: ZeroStage, bytes: u64| if stage >= from { bytes / n } else { bytes };
    let volume = F32 * p * (n - 1) / n;
    PaperFigures {
        model_state_k12,
        f32_weights: sharded(ZeroStage::Parameters, 4 * p),
        f32_gradients: sharded(ZeroStage::Gradients, 4 * p),
        f32_moments: sharded(ZeroStage::Optimizer, 8 * p),
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
}
