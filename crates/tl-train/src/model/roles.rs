//! The labels the model gives its activations on the memory meter (tl-tensor's
//! `memory::label_scope`): what made each tensor, so that a timeline of the meter — the
//! plan's tables — can say which bytes are norm outputs and which are queries. A
//! projection's output is labelled with the projection's name ([`LAYER_NAMES`]), the fused
//! attention's with [`ATTENTION`].
//!
//! [`LAYER_NAMES`]: super::fp8::LAYER_NAMES
//! [`ATTENTION`]: super::causal_attention::ATTENTION

/// The embedding's rows: the residual stream's start.
pub const EMBEDDING: &str = "embedding";
/// A residual sum inside a block, `x + attention(x)`.
pub const RESIDUAL: &str = "residual";
/// A block's output, `x + mlp(x)`: the next unit's input.
pub const BLOCK_OUTPUT: &str = "block output";
/// An RMSNorm's output.
pub const NORM: &str = "norm";
/// Rotary embedding's rotated queries and keys.
pub const ROPE: &str = "rope";
/// The SwiGLU gate's product `silu(x·W1) ⊙ x·W3`.
pub const SWIGLU: &str = "swiglu";
/// A branch's output after dropout.
pub const DROPOUT: &str = "dropout";
/// The head's logits.
pub const LOGITS: &str = "logits";
/// The cross-entropy of the logits.
pub const LOSS: &str = "loss";
