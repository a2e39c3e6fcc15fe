//! `tinyllm plan`: the memory of a training step, predicted before it runs.
//!
//! # What a step holds
//!
//! With `P` parameters, training with AdamW in f32 keeps `4P` bytes of weights, `4P` of
//! gradients and `8P` of moments: a floor of **16 bytes per parameter** that no batch size
//! changes ([`FLOOR_BYTES_PER_PARAMETER`]). On top come the activations, which grow with the
//! micro-batch: for `N = B·T` tokens of width `d`, SwiGLU width `h`, `H` heads and vocabulary
//! `V`, one block of our engine saves, in f32 elements,
//!
//! ```text
//! residual stream   2·N·d        the two norms' inputs (block input, x + attention)
//! norm outputs      2·N·d        read and saved by the projections (q, k, v share one)
//! q, k, v           3·N·d        rotated q and k and v, saved by the fused attention
//! attention output  N·d          saved by the output projection
//! SwiGLU hidden     3·N·h        gate pre-activation and up (the fused gate), their product (w2)
//! -------------------------------------------------------------------------------------------
//! per block          8·N·d + 3·N·h                  head: 2·N·d + N·V (+ the loss)
//! ```
//!
//! No `T×T` attention matrix is saved: the fused attention keeps two numbers per query row
//! and recomputes its probabilities in the backward pass.
//!
//! Under bf16/fp16 autocast a product reads 16-bit values, and saves what it read. The
//! activations the projections read are rounded where they are made, not copied: the norms
//! and the SwiGLU gate round their results as they write them (`round_for_products`), and the
//! fused attention's result is rounded already, so the projections save those tensors
//! themselves and an activation costs what it costs in fp32. What a product still copies is
//! each weight matrix, rounded once per product and held until its backward (`4d² + 3dh`
//! per block, `dV` for the head); a product's own result is rounded in place. The storage
//! stays f32, so emulated mixed precision *adds* the weight copies here, where real hardware
//! would halve the activations. Dropout adds one `N·d` mask per branch. With checkpointing, a
//! checkpointed block keeps only its input and its attention output (`2·N·d`: the rerun takes
//! the fused attention's result back rather than recomputing it); the last segment of a
//! schedule is never checkpointed.
//!
//! # When the peak comes
//!
//! The sum of these terms is not the peak: the timeline decides which of them coexist. A
//! steady-state step (step 2 on, moments allocated) starts at 16P, drops the old gradients
//! (12P), and from its second micro-batch on carries a full set of gradients (16P again)
//! while activations grow through the forward pass and shrink through the backward pass.
//! Three things sit on top of the saved activations at the worst moment:
//!
//! - **forward transients**: a projection's output before it is rotated, an MLP's hidden
//!   tensors before the gate combines them, and under autocast each product's unrounded
//!   result, for a moment;
//! - **gradients in flight**: tl-tensor sweeps nodes in reverse depth-first post-order, which
//!   reaches the weights of `wv`, `wo`, `w2`, `w3` and the norm gains only at the very end, so
//!   their gradients wait in flight through the whole backward pass;
//! - **recomputation**: a checkpointed block reruns its forward pass with the graph on (its
//!   full activations) while the gradient flowing into it is counted twice.
//!
//! # How the prediction is made and checked
//!
//! Rather than a formula per case, the plan runs the trainer's own step — the same
//! [`Trainer::train_step`](crate::train::Trainer::train_step), model, autocast,
//! checkpointing and optimizer a run uses — on meta tensors (`tl_tensor::meta`): tensors
//! with shapes and no values, counted by the memory meter exactly as real ones. Every
//! allocation carries a tag (its kind, the model's unit that owns it, the label of what made
//! it, the stage and micro-batch of the step), and the ledger (`ledger.rs`) adds the tags
//! of a fresh trainer's first and second steps into the terms, the peaks and their moment.
//! The closed forms above are what it finds, and unit tests check them by hand. A step of
//! a 7B model runs this way in milliseconds, in a few megabytes. Against
//! `tl_tensor::memory` the plan is exact by construction — the meta run's allocations and
//! frees are the real step's, event for event and tag for tag (tested), and
//! [`measure_steps`] reads the meter around real [`Trainer`](crate::train::Trainer) steps
//! for `tinyllm plan --measure`. Like the meter, the plan counts tensor storage only; the
//! process's resident memory also holds the allocator's slack, kernel workspaces and the
//! data.
//!
//! ```
//! use tl_train::model::{Checkpointing, Preset};
//! use tl_train::plan::{MemoryPlan, Recipe, render};
//! use tl_train::train::TrainConfig;
//!
//! let mut config = TrainConfig::for_preset(Preset::Tiny);
//! config.micro_batch = 2;
//! config.checkpointing = Checkpointing::PerBlock;
//! let plan = MemoryPlan::new(&Recipe::from(&config))?;
//! assert!(plan.chosen().peak_bytes < plan.plain.peak_bytes);
//! assert!(render(&plan).contains("16 B/parameter"));
//! # Ok::<(), tl_train::TrainError>(())
//! ```

mod collectives;
mod flops;
mod kind;
mod ledger;
mod measure;
mod parallel;
mod parallel_table;
mod recipe;
mod recorder;
mod report;
mod shapes;
mod step_time;
mod step_time_table;
mod table;
mod zero;

pub use collectives::{Collective, RING_HEADER_BYTES, ring_bytes_sent};
pub use flops::{StepFlops, attention_pairs, step_flops};
pub use kind::{Layer, Phase, Stage, TensorKind};
pub(crate) use ledger::predict_rank;
pub use ledger::{SavedBytes, StepPrediction, predict_step};
pub use measure::{
    Measurement, RankMeasurement, measure_meta_rank, measure_meta_steps, measure_meta_steps_on,
    measure_rank, measure_steps, relative_error,
};
pub use parallel::{
    DataParallelism, LISTED_RANKS, ParallelPlan, PeakPhase, PipelinePlan, RankPlan, SentBytes,
    Term, korthikanti_block_bytes, plan_ranks,
};
pub use parallel_table::{render_parallel, render_sweep};
pub use recipe::Recipe;
pub use report::{FLOOR_BYTES_PER_PARAMETER, KindBytes, LayerBytes, MemoryPlan, PolicyPlan};
pub use shapes::PlanShape;
pub use step_time::{
    ComputeRate, Link, RankStepTime, RateSource, SOFTWARE_US_PER_MESSAGE, StepTimePlan,
    communication_s, overlapped_s, predict_step_time, ring_messages,
};
pub use step_time_table::{render_step_time, render_step_time_sweep};
pub use table::{render, render_measurement, schedule_label, thousands};
pub use zero::{
    BUCKET_BYTES, CollectiveCalls, MAX_RANKS, ModelSizes, PaperFigures, STEP_EXTRAS, ZeroStage,
    paper_figures,
};

#[cfg(test)]
mod tests;
