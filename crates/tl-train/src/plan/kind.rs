//! What the plan counts bytes *of*: the kind of each tensor, the layer it belongs to, and the
//! moment of the step a figure refers to.

use std::fmt;

use serde::Serialize;

/// What a tensor is, for the plan's tables and the anatomy of a peak.
///
/// The first five kinds are the model state every step carries; the others are activations,
/// either saved for backward or alive only for a moment of the forward pass. Under autocast
/// a product saves rounded operands: the model's norm outputs and SwiGLU gate are rounded
/// as they are written (so their bytes stay [`NormOutputs`](Self::NormOutputs) and
/// [`MlpHidden`](Self::MlpHidden)), the attention's result is rounded already, and any other
/// activation would be saved as a [`RoundedCopies`](Self::RoundedCopies) copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    /// The f32 parameters (4 bytes each).
    Weights,
    /// Gradients accumulated into the parameters' `.grad` (4 bytes each).
    Gradients,
    /// AdamW's first and second moments (8 bytes per parameter), made by the first step.
    AdamMoments,
    /// ZeRO's master copy of this rank's shard of the weights, which the sharded AdamW
    /// updates before the weights are all-gathered (4 bytes per element of the shard).
    MasterShard,
    /// Gradients flowing through backward, not yet added into a parameter or consumed.
    GradientsInFlight,
    /// The residual stream: block inputs and the sum after attention (what the norms save).
    ResidualStream,
    /// RMSNorm outputs, saved by the projections that read them (under autocast, rounded in
    /// place first).
    NormOutputs,
    /// Outputs of the projections and of the fused attention; the attention's output is
    /// saved by the output projection, the others are short-lived.
    LinearOutputs,
    /// The attention's queries, keys and values: the rotated `q` and `k` and `v`, saved by
    /// the fused attention, and the projections they come from, alive for a moment.
    Heads,
    /// The SwiGLU hidden tensors: gate pre-activation, up projection, their gated product.
    MlpHidden,
    /// Dropout's masks, one per residual branch.
    DropoutMasks,
    /// The logits and their `[B·T, V]` copy that cross-entropy saves.
    Logits,
    /// Autocast's rounded copies of activation operands, saved by the products.
    RoundedCopies,
    /// Autocast's rounded copies of weight matrices, saved by the products.
    WeightCopies,
    /// The loss and its weighted copy (one element each).
    Loss,
    /// tl-parallel's communication buffers, which it counts on the meter: a gradient
    /// bucket, a shard or a gathered unit while a collective runs.
    CommBuffers,
}

impl TensorKind {
    /// Every kind, model state first, in table order.
    pub const ALL: [TensorKind; 16] = [
        TensorKind::Weights,
        TensorKind::Gradients,
        TensorKind::AdamMoments,
        TensorKind::MasterShard,
        TensorKind::GradientsInFlight,
        TensorKind::ResidualStream,
        TensorKind::NormOutputs,
        TensorKind::LinearOutputs,
        TensorKind::Heads,
        TensorKind::MlpHidden,
        TensorKind::DropoutMasks,
        TensorKind::Logits,
        TensorKind::RoundedCopies,
        TensorKind::WeightCopies,
        TensorKind::Loss,
        TensorKind::CommBuffers,
    ];

    /// The position of this kind in [`TensorKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Whether this kind belongs to the model state (weights, gradients, moments, a ZeRO
    /// master shard), which does not scale with the micro-batch.
    pub fn is_model_state(self) -> bool {
        matches!(
            self,
            TensorKind::Weights
                | TensorKind::Gradients
                | TensorKind::AdamMoments
                | TensorKind::MasterShard
        )
    }

    /// Whether this kind is an activation or a value derived from one (everything but the
    /// model state, the gradients in flight and the communication buffers).
    pub fn is_activation(self) -> bool {
        !self.is_model_state()
            && !matches!(
                self,
                TensorKind::GradientsInFlight | TensorKind::CommBuffers
            )
    }

    /// A short label for tables.
    pub fn label(self) -> &'static str {
        match self {
            TensorKind::Weights => "weights",
            TensorKind::Gradients => "gradients",
            TensorKind::AdamMoments => "AdamW moments",
            TensorKind::MasterShard => "ZeRO master shard",
            TensorKind::GradientsInFlight => "gradients in flight",
            TensorKind::ResidualStream => "residual stream (norm inputs)",
            TensorKind::NormOutputs => "norm outputs",
            TensorKind::LinearOutputs => "projection / attention outputs",
            TensorKind::Heads => "q, k, v",
            TensorKind::MlpHidden => "SwiGLU hidden",
            TensorKind::DropoutMasks => "dropout masks",
            TensorKind::Logits => "logits",
            TensorKind::RoundedCopies => "rounded operand copies",
            TensorKind::WeightCopies => "rounded weight copies",
            TensorKind::Loss => "loss",
            TensorKind::CommBuffers => "communication buffers",
        }
    }
}

impl fmt::Display for TensorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// The part of the model a tensor belongs to: the layer that owns a parameter, or the layer
/// that saves (or computes) an activation. A block's input is counted in the block that
/// reads it, so every block carries the same activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Layer {
    /// The token embedding.
    Embedding,
    /// Transformer block `i`, counted from the input.
    Block(usize),
    /// The final RMSNorm, the output head and the cross-entropy.
    Head,
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Layer::Embedding => f.write_str("embedding"),
            Layer::Block(i) => write!(f, "block {i}"),
            Layer::Head => f.write_str("norm + head"),
        }
    }
}

/// What a training step is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Dropping the previous step's gradients.
    StepStart,
    /// The forward pass.
    Forward,
    /// The backward pass.
    Backward,
    /// A checkpointed segment rerunning its forward pass during backward.
    Recompute,
    /// Data parallelism's gradient reduction after the last backward (and, under ZeRO-2,
    /// the buckets left to reduce), before the update.
    Reduction,
    /// The AdamW update.
    Optimizer,
    /// The all-gather of the updated weights (ZeRO-1 and 2).
    Gather,
}

/// A moment of a training step: which step, which micro-batch, what stage, which layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Phase {
    /// The optimizer step, from 1.
    pub step: u32,
    /// The micro-batch, from 1 (0 outside the micro-batch loop).
    pub micro_batch: usize,
    /// The micro-batches of a step.
    pub accum: usize,
    /// What the step is doing.
    pub stage: Stage,
    /// Where in the model.
    pub layer: Layer,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let where_ = match self.stage {
            Stage::StepStart => "start".to_string(),
            Stage::Reduction => "gradient reduction".to_string(),
            Stage::Optimizer => "AdamW update".to_string(),
            Stage::Gather => "all-gather of the weights".to_string(),
            Stage::Forward => format!("forward, {}", self.layer),
            Stage::Backward => format!("backward, {}", self.layer),
            Stage::Recompute => format!("recompute, {}", self.layer),
        };
        if self.micro_batch == 0 {
            write!(f, "step {}, {where_}", self.step)
        } else {
            write!(
                f,
                "step {}, micro-batch {}/{}, {where_}",
                self.step, self.micro_batch, self.accum
            )
        }
    }
}
