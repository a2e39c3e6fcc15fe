//! The capstone model: a Llama-style decoder built from tl-tensor's layers.
//!
//! - [`config`]: sizes and the named presets.
//! - [`rope`]: rotary position embedding.
//! - [`attention`]: causal multi-head self-attention.
//! - [`causal_attention`]: its core, `softmax(q·kᵀ/√hd + M)·v` for all heads, as one fused op.
//! - [`block`]: the pre-norm block with its SwiGLU MLP.
//! - [`fp8`]: the blocks' projections, named for keep policies, in fp8 with delayed scaling.
//! - [`llama`]: the whole model, with optional activation checkpointing and sampling.
//! - [`parallel`]: how the model splits over a tensor-parallel group.
//! - [`pipeline`]: how it is cut into pipeline stages.

pub mod attention;
pub mod block;
pub mod causal_attention;
pub mod config;
pub mod fp8;
pub mod head_loss;
pub mod llama;
pub mod parallel;
pub mod pipeline;
pub mod roles;
pub mod rope;

pub use config::{ModelConfig, Preset};
pub use llama::{Checkpointing, Llama, Stage, UnitHook};
