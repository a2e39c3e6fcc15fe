//! Shared helpers of the course tests (see `l11_1/`), and the guides in `docs/`, whose
//! examples run as doctests here: `cargo test -p tl-course --doc` keeps every example of the
//! guides compiling and true against the real API.

#[doc = include_str!("../docs/mixed-precision.md")]
pub mod mixed_precision_guide {}

#[doc = include_str!("../docs/loss-scaling.md")]
pub mod loss_scaling_guide {}

#[doc = include_str!("../docs/gradient-accumulation.md")]
pub mod gradient_accumulation_guide {}

#[doc = include_str!("../docs/activation-checkpointing.md")]
pub mod activation_checkpointing_guide {}

#[doc = include_str!("../README.md")]
pub mod readme {}
