//! Memory profiles of a training step: live tensor bytes at every allocation and free,
//! phase by phase, for a plain run and a checkpointed one.
//!
//! What the timeline shows. Between steps, a model trained with AdamW holds 16 bytes per
//! parameter in f32: the weights, their gradients and the two moments. Zeroing the
//! gradients drops 4 of them. Each micro-batch's forward pass then piles up the
//! activations its backward pass will read, and the backward pass gives them back as it
//! consumes them while it makes the gradients again; the optimizer updates in place. So
//! live memory rises and falls once per micro-batch — a sawtooth on top of the constant
//! weights and moments — and the step peaks where the activations are all still held: at
//! the end of the forward pass, while the loss adds its own temporaries, or early in the
//! backward pass. From the second micro-batch on, the tooth stands on
//! the gradients of the first, 4 bytes per parameter higher. Checkpointing keeps only each
//! block's input through the forward pass and rebuilds the block's activations during
//! backward, one block at a time, so its teeth are a fraction of the height, at the cost of
//! the extra allocations of the rerun.
//!
//! How it is measured. A run builds its model and optimizer as the trainer does, takes one
//! unrecorded step so that AdamW's moments exist, then runs each recorded step from its
//! parts with `tl_tensor::memory::record` around each phase. Plain and checkpointed runs
//! share the seed, hence the weights, the batches and — to the bit — the loss.
//!
//! - `timeline`: a run's events and phases, its peaks ([`Timeline`]).
//! - `session` and `step`: the model, optimizer and data of a run, set up as the trainer
//!   sets them up, and one step run from its parts with each phase recorded.
//! - `run`: [`record_run`], [`compare`] and the [`Profile`] they make.
//! - `layout`: one x axis for runs with different numbers of events ([`align`]).
//! - `chart` and `report`: the SVG chart ([`render_chart`]), the JSON beside it
//!   ([`write_profile`]), the summary [`table`].
//!
//! ```
//! use tl_train::model::{Checkpointing, Preset};
//! use tl_train::profile::{ProfileConfig, compare, table, write_profile};
//! use tl_train::train::{DataSource, TrainConfig};
//!
//! let mut train = TrainConfig::for_preset(Preset::Tiny);
//! train.data = DataSource::Builtin { seed: 0, bytes: 20_000 };
//! (train.micro_batch, train.accum, train.checkpointing) = (2, 2, Checkpointing::PerBlock);
//! let profile = compare(&ProfileConfig { train, steps: 1 })?;
//! let dir = tempfile::tempdir().unwrap();
//! let json = write_profile(&profile, &dir.path().join("memory.svg"))?;
//! assert!(json.exists());
//! println!("{}", table(&profile));
//! # Ok::<(), tl_train::TrainError>(())
//! ```

mod chart;
mod layout;
mod report;
mod run;
mod session;
mod step;
mod timeline;

pub use chart::{X_AXIS, format_mib, render_chart};
pub use layout::{Layout, align};
pub use report::{policy_table, read_profile, table, timeline_path, write_profile};
pub use run::{Profile, ProfileConfig, compare, record_run, run_label};
pub use timeline::{EventKind, MemoryEvent, Peak, Phase, Span, Timeline};
