//! The capstone of tinyllm: a Llama-style decoder, the built-in corpus, and the trainer
//! behind the `tinyllm` command.

// First, so that its `say!` is in scope in every module after it.
#[macro_use]
pub mod output;
pub mod bench;
pub mod build_info;
pub mod chart;
pub mod cli;
pub mod compare;
pub mod data;
mod error;
pub mod export;
pub mod gradients;
pub mod import;
pub mod model;
pub mod plan;
pub mod process_memory;
pub mod profile;
pub mod store;
pub mod train;

pub use error::{Result, TrainError};

/// The guide to the trainer (`docs/training.md`); its examples run as doctests.
#[doc = include_str!("../../../docs/training.md")]
pub mod guide {}

/// Training on your files: tokenizers, corpus formats, the token cache (`docs/data.md`); its
/// examples run as doctests.
#[doc = include_str!("../../../docs/data.md")]
pub mod data_guide {}

/// The companion's two experiments worked on `small` (`docs/experiments.md`); its examples
/// run as doctests.
#[doc = include_str!("../../../docs/experiments.md")]
pub mod experiments_guide {}
