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
    #[error("invalid model config: {field} = {value}: {reason}")]
    InvalidConfig {
        /// The field of [`ModelConfig`](crate::model::ModelConfig).
        field: &'static str,
        /// Its value, as text.
        value: String,
        /// What it must be.
        reason: String,
    },
    /// A config file (`--config`) that is not a config: malformed, a key the schema does not
    /// have, or a value of the wrong type.
    #[error("{}: {key}: {reason}", path.display())]
    ConfigFile {
        /// The file.
        path: std::path::PathBuf,
        /// Where in it, as a path of keys (`model.d_model`).
        key: String,
        /// What is wrong.
        reason: String,
    },
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
    /// A file given on the command line (or a run's own small file) longer than the bound
    /// for its kind: refused without reading past the bound, so a device that never ends
    /// (`/dev/zero`) is refused too.
    #[error("{}: larger than the {} bytes allowed for {name}", path.display(), limit)]
    FileTooLarge {
        /// The flag or file kind (`--config`, `--prompt-file`, `config.json`).
        name: &'static str,
        /// The file.
        path: PathBuf,
        /// The most bytes allowed.
        limit: u64,
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
    /// A line of a run's `metrics.jsonl` that is not a record (a torn last line, as a crash
    /// leaves, is not an error).
    #[error("{}, line {line}: {reason}", path.display())]
    Metrics {
        /// The metrics file.
        path: PathBuf,
        /// The line, counting from 1.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// Another process holds the run directory's lock.
    #[error("{} is in use by another tinyllm ({holder}); wait for it to finish or stop it", path.display())]
    Locked {
        /// The run directory.
        path: PathBuf,
        /// The holder, as its lock file names it (process id and command).
        holder: String,
    },
    /// The run diverged: training stopped and the last checkpoint was left as it was.
    #[error("diverged at step {step}: {what}; the last good checkpoint is {}", checkpoint.as_ref().map_or("none (no checkpoint was written yet)".to_string(), |c| c.display().to_string()))]
    Diverged {
        /// The step whose result was refused (the first step not taken).
        step: u64,
        /// What was seen, naming the parameter where there is one.
        what: String,
        /// The checkpoint a resume would continue from.
        checkpoint: Option<PathBuf>,
    },
    /// The training file is not the one the run started on.
    #[error("{} changed since the run began (was {expected}, now {found}); resume with --data-changed-ok to continue on it anyway", path.display())]
    DataChanged {
        /// The data file.
        path: PathBuf,
        /// Its size and SHA-256 when the run began.
        expected: String,
        /// Its size and SHA-256 now.
        found: String,
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
    /// A collective of data-parallel training failed (the error names the rank that saw
    /// it), or the step refused on every rank.
    #[error(transparent)]
    Parallel(#[from] tl_parallel::ParallelError),
    /// A pipeline schedule that cannot be made, or that breaks a rule of the step.
    #[error(transparent)]
    Schedule(#[from] tl_parallel::pipeline::ScheduleError),
    /// Other ranks of the run failed, or disagree with this one.
    #[error("rank{} {} {what}", if ranks.len() == 1 { "" } else { "s" }, ranks.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "))]
    Ranks {
        /// The ranks concerned.
        ranks: Vec<usize>,
        /// What they did.
        what: String,
    },
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

/// What a conversion that cannot fail "fails" with: lets a function take either a typed
/// value or one to convert (a [`ZeroStage`](tl_parallel::ZeroStage) or a config's stage
/// number, in [`RunOptimizer::at_stage`](crate::train::RunOptimizer::at_stage)).
impl From<std::convert::Infallible> for TrainError {
    fn from(never: std::convert::Infallible) -> Self {
        match never {}
    }
}

/// The result of tl-train's fallible functions.
pub type Result<T> = std::result::Result<T, TrainError>;
