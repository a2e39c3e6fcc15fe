//! What a user of the trainer can get wrong, as one typed error.

use std::path::PathBuf;

use thiserror::Error;
use tl_precision::PrecisionError;
use tl_recompute::RecomputeError;
use tl_tensor::TensorError;

/// Errors of tl-train and the `tinyllm` command.
///
/// Every variant is raised before the run directory is touched, or, for the ones met while
/// saving, before the last good checkpoint is replaced.
#[derive(Debug, Error)]
pub enum TrainError {
    /// A `--preset` that does not exist.
    #[error("unknown preset `{input}`: expected one of tiny, small, capstone")]
    UnknownPreset {
        /// The name given.
        input: String,
    },
    /// Model sizes that do not fit together.
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    /// A training option outside its valid range.
    #[error("invalid {name}: {value} ({reason})")]
    InvalidArgument {
        /// Which option.
        name: &'static str,
        /// The value given, as text.
        value: String,
        /// What was expected.
        reason: String,
    },
    /// A data file that cannot be used.
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    /// A file that could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// A checkpoint that is missing a file, corrupt, or does not fit this model.
    #[error("checkpoint {}: {reason}", path.display())]
    Checkpoint {
        /// The checkpoint directory or file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A chart that could not be drawn.
    #[error(transparent)]
    Chart(#[from] crate::chart::ChartError),
    /// Mixed precision refused a step (a non-finite loss without a scaler, a scale stuck at
    /// its floor, ...).
    #[error(transparent)]
    Precision(#[from] PrecisionError),
    /// A checkpointing schedule that cannot be built.
    #[error(transparent)]
    Recompute(#[from] RecomputeError),
    /// A collective or a launched rank failed.
    #[error(transparent)]
    Collective(#[from] tl_collective::CollectiveError),
    /// An optimizer argument or state the tensor library rejected.
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

impl TrainError {
    /// An [`TrainError::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TrainError::Io {
            path: path.into(),
            source,
        }
    }

    /// A [`TrainError::Checkpoint`] for `path`.
    pub fn checkpoint(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        TrainError::Checkpoint {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

/// The result of tl-train's fallible functions.
pub type Result<T> = std::result::Result<T, TrainError>;
