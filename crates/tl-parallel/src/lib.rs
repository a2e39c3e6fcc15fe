//! Data-parallel training for tinyllm (L11.3): every rank holds a replica of the model,
//! trains on its own share of the global batch, and the ranks' gradients are summed over a
//! [`tl_collective::Communicator`] before the update.
//!
//! - [`batch_share`] says which rows of a step's global batch a rank trains on, and with
//!   which weight its gradient enters the sum.
//! - [`DataParallel`] is the [`StepObserver`](tl_precision::StepObserver) that does the
//!   reduction inside tl-precision's one training step, in buckets, and makes the loss
//!   scaler's overflow decision and the clip norm global; [`DataParallel::train_step`] is
//!   that step, with the global loss in its report.
//! - [`ShardedAdamW`] is ZeRO stage 1: AdamW's moments and update partitioned over the
//!   ranks, the updated weights all-gathered; bit for bit DDP's AdamW.
//! - [`Zero2AdamW`] is ZeRO stage 2: the gradients too, reduce-scattered bucket by bucket
//!   while the last micro-batch's backward runs, each rank keeping only its shard; bit for
//!   bit DDP's AdamW as well (without clipping).
//! - [`Zero3`] is ZeRO stage 3: the parameters sharded as well, by *units* the caller
//!   names, gathered around each unit's forward and backward by [`UnitRunner::run_unit`]
//!   and released after; its own [`Zero3::train_step`].
//! - All three save and load the whole AdamW state at any world size (`full_state`,
//!   `load_full_state`).
//! - [`ZeroStage`] names the stages, 0 (plain DDP) to 3.
//! - [`tensor_parallel`]: Megatron's tensor parallelism — [`TensorParallel`] (a group and
//!   its conjugate ops), [`ColumnParallelLinear`], [`RowParallelLinear`],
//!   [`VocabParallelEmbedding`] and a vocabulary-parallel cross-entropy — each layer's
//!   weights split over the ranks of a group that trains on the same batch; under autocast
//!   the ranks' partial results are added in its 16-bit format, as a GPU's all-reduce adds
//!   them, or in f32 ([`ReduceIn`]).
//! - [`pipeline`]: pipeline parallelism's schedules as data — each rank's list of actions
//!   for GPipe, 1F1B, interleaved 1F1B and ZB-H1 — and a simulator that checks a schedule
//!   cannot deadlock and times its bubble.
//! - Every stage runs on [meta](tl_tensor::meta) tensors as well: its buffers are counted
//!   on the memory meter as the real ones, with their tags, and hold no values, and its
//!   collectives get shape-only slices. Over a [`Phantom`](tl_collective::Phantom), one
//!   process thus takes the step of any rank of any world, allocation for allocation and
//!   byte sent for byte sent.
//!
//! The same code runs on one process with [`tl_collective::Single`], or on the ranks
//! `tinyllm launch` starts with [`tl_collective::from_env`]:
//!
//! ```
//! use tl_collective::Single;
//! use tl_parallel::{DataParallel, batch_share};
//! use tl_precision::Precision;
//! use tl_tensor::losses::mse;
//! use tl_tensor::nn::{Linear, Module};
//! use tl_tensor::optim::AdamW;
//! use tl_tensor::{Generator, Tensor};
//!
//! let mut ddp = DataParallel::new(Box::new(Single::new()));
//! let model = Linear::<f32>::new(3, 1, true, &Generator::new(0));
//! ddp.broadcast_parameters(&model.parameters())?; // rank 0's initial weights everywhere
//! let mut opt = AdamW::new(model.parameters(), 1e-2)?;
//!
//! let x = Tensor::from_vec((0..24).map(|i| i as f32 / 24.0).collect(), &[8, 3])?;
//! let target = Tensor::ones(&[8, 1]);
//! let share = batch_share(8, 2, ddp.world_size(), ddp.rank())?;
//! let micro_batches: Vec<_> = share
//!     .micro_batches
//!     .iter()
//!     .map(|rows| (x.narrow(0, rows.start, rows.len()), target.narrow(0, rows.start, rows.len())))
//!     .collect();
//! let loss_fn = |m: &Linear<f32>, (x, t): &(Tensor<f32>, Tensor<f32>)| mse(&m.forward(x), t);
//! let before = ddp.stats().collectives;
//! let report = ddp.train_step(&model, &micro_batches, 8, loss_fn, &mut opt, Precision::Bf16, None, Some(1.0))?;
//! assert!(report.loss.is_finite() && !report.skipped);
//! assert_eq!(ddp.stats().collectives - before, 1); // one bucket, loss and flag folded in
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod batch;
mod bucket;
mod ddp;
mod decide;
mod error;
mod link;
mod metered;
pub mod overlap;
pub mod pipeline;
mod runs;
mod shard_step;
mod stage;
pub mod tensor_parallel;
mod zero;
mod zero2;
mod zero3;

pub use batch::{BatchShare, batch_share};
pub use bucket::{
    DEFAULT_BUCKET_BYTES, STEP_EXTRAS, Segment as BucketSegment, plan as bucket_plan,
};
pub use ddp::{DataParallel, GradElement, StepSummary};
pub use error::{ParallelError, Result};
pub use metered::labels;
pub use overlap::MAX_IN_FLIGHT;
pub use stage::ZeroStage;
pub use tensor_parallel::{
    ColumnParallelLinear, ReduceIn, RowParallelLinear, TensorParallel, VocabParallelEmbedding,
};
pub use zero::ShardedAdamW;
pub use zero2::Zero2AdamW;
pub use zero3::{UnitRunner, Zero3, Zero3Observer};

/// The user guide `docs/data-parallel.md`, compiled as a doctest so its examples stay true.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/data-parallel.md")]
pub struct DataParallelGuide;

/// The user guide `docs/pipeline-parallel.md`, compiled as a doctest so its examples stay
/// true.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/pipeline-parallel.md")]
pub struct PipelineGuide;
