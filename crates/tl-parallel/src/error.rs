//! What can go wrong in data-parallel training, as a typed error.

use thiserror::Error;
use tl_collective::CollectiveError;
use tl_precision::PrecisionError;
use tl_tensor::TensorError;

/// Errors of tl-parallel.
#[derive(Debug, Error)]
pub enum ParallelError {
    /// A collective failed (a peer exited, a timeout, ranks that disagree). The communicator
    /// is closed afterwards: the run must stop.
    #[error("rank {rank}: {source}")]
    Collective {
        /// The rank that saw the failure.
        rank: usize,
        /// What the communicator reported.
        source: CollectiveError,
    },
    /// The training step itself refused (a non-finite loss without a scaler, an empty
    /// micro-batch, a scale stuck at its floor).
    #[error(transparent)]
    Precision(#[from] PrecisionError),
    /// An optimizer hyperparameter that tl-tensor refused.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// An optimizer that has already stepped cannot be sharded: its moments are whole.
    #[error("cannot shard an optimizer that has already stepped; shard a fresh one")]
    OptimizerHasState,
    /// A rank's rows that are not a share of the step's global batch.
    #[error(
        "rank {rank}: {local_rows} rows are not a share of a global batch of {global_rows} rows"
    )]
    RowsOutsideBatch {
        /// The rank.
        rank: usize,
        /// Rows of this rank's micro-batches.
        local_rows: usize,
        /// Rows of the global batch.
        global_rows: usize,
    },
    /// A ZeRO stage number that is not one (see [`ZeroStage`](crate::ZeroStage)).
    #[error("unknown ZeRO stage {index}: a stage is 0 (plain DDP), 1, 2 or 3")]
    UnknownStage {
        /// The number given.
        index: usize,
    },
    /// A global batch that cannot be shared out as asked.
    #[error(
        "cannot share a global batch of {global_rows} rows into micro-batches of {micro_batch_rows} over {world_size} ranks (rank {rank}): {reason}"
    )]
    InvalidBatch {
        /// Rows of the global batch.
        global_rows: usize,
        /// Largest micro-batch asked for.
        micro_batch_rows: usize,
        /// Number of ranks.
        world_size: usize,
        /// The rank asked about.
        rank: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// A size that tensor parallelism splits evenly over the group's ranks (a layer's
    /// features, the vocabulary, the sequence) and that the group's size does not divide.
    #[error("{what} of {size} does not split evenly over {tensor_parallel} tensor-parallel ranks")]
    Indivisible {
        /// What was to be split (`"output features"`, `"sequence length"`, …).
        what: &'static str,
        /// Its size.
        size: usize,
        /// Ranks of the tensor-parallel group.
        tensor_parallel: usize,
    },
    /// A pipeline schedule the executor cannot run on this pipeline group.
    #[error("pipeline rank {rank}: {reason}")]
    Pipeline {
        /// The rank of the pipeline group.
        rank: usize,
        /// Why.
        reason: String,
    },
}

/// `Result` with a [`ParallelError`].
pub type Result<T, E = ParallelError> = std::result::Result<T, E>;
