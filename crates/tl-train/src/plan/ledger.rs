//! The plan's figures from the memory meter's tagged timeline of the trainer's own step,
//! run on meta tensors (see `tl_tensor::meta`): the peak, when it comes and what it holds,
//! what a micro-batch saves for backward, and what the update allocates.
//!
//! Every allocation of the step carries a tag (`tl_tensor::memory::Tag`): its kind, the
//! model's unit that owns it, the label of what made it, the stage and micro-batch of the
//! step that made it. [`TensorKind::of`] and [`Layer::of_unit`] read the plan's terms
//! from them, and the ledger adds them up event by event.

use std::collections::BTreeMap;

use serde::Serialize;

use tl_precision::{COPY_LABEL, LOSS_LABEL, WEIGHT_COPY_LABEL};
use tl_tensor::memory::{self, Event, EventKind, Kind, Stage as MeterStage, Tag};
use tl_tensor::nn::DROPOUT_MASK_LABEL;

use tl_collective::{Communicator, Phantom};
use tl_parallel::labels;

use super::kind::{Layer, Phase, Stage, TensorKind};
use super::recipe::Recipe;
use super::recorder::{Call, Calls, Recorder};
use super::zero::CollectiveCalls;
use crate::error::Result;
use crate::model::Checkpointing;
use crate::model::causal_attention::ATTENTION;
use crate::model::roles;
use crate::train::{TrainConfig, Trainer};

/// The plan's account of one recipe's step: peaks, where they fall, what they hold, and what
/// the forward pass of one micro-batch leaves saved for backward.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepPrediction {
    /// How the blocks kept their activations.
    pub checkpointing: Checkpointing,
    /// Peak live bytes of a steady-state step (step 2 on: AdamW's moments exist), counted
    /// like `tl_tensor::memory::peak_bytes` after a `reset_peak` between steps.
    pub peak_bytes: u64,
    /// When that peak is reached.
    pub peak_at: Phase,
    /// What is alive at that peak, by kind (kinds with no bytes left out).
    pub peak_by_kind: Vec<(TensorKind, u64)>,
    /// Peak live bytes of the very first step of a fresh model (no moments before its
    /// update; they are allocated at its end).
    pub first_step_peak_bytes: u64,
    /// Live bytes between steps: weights and moments (the trainer drops the gradients after
    /// each update).
    pub between_steps_bytes: u64,
    /// What the steady-state update allocates above the live bytes it starts from (weights,
    /// gradients, moments): AdamW's temporaries, or ZeRO's copies and gather buffers.
    pub update_extra_bytes: u64,
    /// Bytes saved for backward at the end of one micro-batch's forward pass, by layer and
    /// kind (the model state left out).
    pub saved: Vec<SavedBytes>,
    /// The collectives of the steady-state step, in the order of their first call (none
    /// without data parallelism).
    pub collectives: Vec<CollectiveCalls>,
}

/// Bytes of one kind that one layer holds for backward at the end of the forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SavedBytes {
    /// The layer that saved them.
    pub layer: Layer,
    /// What they are.
    pub kind: TensorKind,
    /// How many.
    pub bytes: u64,
}

impl StepPrediction {
    /// All bytes saved for backward by one micro-batch's forward pass.
    pub fn saved_total(&self) -> u64 {
        self.saved.iter().map(|s| s.bytes).sum()
    }
}

impl TensorKind {
    /// The plan's term for storage tagged `tag`; `None` for an activation whose label the
    /// plan does not know (which its tests rule out).
    pub fn of(tag: &Tag) -> Option<TensorKind> {
        Some(match tag.kind {
            Kind::Weights => TensorKind::Weights,
            Kind::Gradients => TensorKind::Gradients,
            Kind::GradientsInFlight => TensorKind::GradientsInFlight,
            Kind::OptimizerState if tag.label == labels::MASTER_SHARD => TensorKind::MasterShard,
            Kind::OptimizerState => TensorKind::AdamMoments,
            Kind::Communication => TensorKind::CommBuffers,
            Kind::Activations | Kind::Temporaries => match tag.label {
                roles::EMBEDDING
                | roles::RESIDUAL
                | roles::BLOCK_OUTPUT
                | labels::PIPELINE_ACTIVATION
                | labels::PIPELINE_GRADIENT => TensorKind::ResidualStream,
                roles::NORM => TensorKind::NormOutputs,
                "wq" | "wk" | "wv" | roles::ROPE => TensorKind::Heads,
                "wo" | "w2" | ATTENTION | roles::DROPOUT => TensorKind::LinearOutputs,
                "w1" | "w3" | roles::SWIGLU => TensorKind::MlpHidden,
                DROPOUT_MASK_LABEL => TensorKind::DropoutMasks,
                roles::LOGITS | labels::OUTPUT_GATHERED => TensorKind::Logits,
                // Tensor parallelism's own results: a row-parallel layer's output summed
                // over the group (or its rows of the sum), the norm's output gathered whole.
                labels::TENSOR_PARALLEL_SUM | labels::SEQUENCE_SCATTERED => {
                    TensorKind::LinearOutputs
                }
                labels::SEQUENCE_GATHERED => TensorKind::NormOutputs,
                labels::VOCABULARY_STATISTICS => TensorKind::Loss,
                COPY_LABEL => TensorKind::RoundedCopies,
                WEIGHT_COPY_LABEL => TensorKind::WeightCopies,
                roles::LOSS | LOSS_LABEL => TensorKind::Loss,
                _ => return None,
            },
        })
    }
}

impl Layer {
    /// The layer storage tagged `tag` is counted with: its owner's, except that a unit's
    /// output (the embedding's rows, a block's output) is counted with the unit that reads
    /// it, which saves it for backward or keeps it as a checkpoint's input.
    pub fn of_tag(tag: &Tag, n_layers: usize) -> Layer {
        let output = tag.kind == Kind::Activations
            && matches!(tag.label, roles::EMBEDDING | roles::BLOCK_OUTPUT);
        let unit = if output {
            tag.owner.map(|unit| unit + 1)
        } else {
            tag.owner
        };
        Layer::of_unit(unit, n_layers)
    }

    /// The layer of the model's unit `unit` of a model of `n_layers` blocks (the unit hook's
    /// numbering: the embedding, each block, the final norm with the head); storage no
    /// unit owns (the weighted loss) goes with the head.
    pub fn of_unit(unit: Option<usize>, n_layers: usize) -> Layer {
        match unit {
            Some(0) => Layer::Embedding,
            Some(u) if u <= n_layers => Layer::Block(u - 1),
            _ => Layer::Head,
        }
    }
}

/// Live bytes by layer and term (in that order, the order the plan lists them).
type Live = BTreeMap<(Layer, TensorKind), u64>;

/// The figures of one recorded step.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct StepLedger {
    /// The highest live bytes (counted from the start of the live bytes given).
    pub peak_bytes: u64,
    /// The allocation that reached the peak, as a phase of the step.
    pub peak_at: Phase,
    /// Live bytes at the peak, by term and layer.
    pub peak_live: Live,
    /// Live bytes when the first micro-batch's forward pass ended, by term and layer.
    pub after_first_forward: Live,
    /// The most the update allocated above the live bytes when it began.
    pub update_extra_bytes: u64,
    /// Live bytes when the step ended.
    pub end_bytes: u64,
}

/// Adds up tagged events.
struct Tally {
    n_layers: usize,
    live: Live,
    total: u64,
}

impl Tally {
    fn key(&self, tag: &Tag) -> (Layer, TensorKind) {
        let kind = TensorKind::of(tag).unwrap_or_else(|| {
            panic!(
                "the plan has no term for {:?} storage labelled {:?} ({tag:?})",
                tag.kind, tag.label
            )
        });
        (Layer::of_tag(tag, self.n_layers), kind)
    }

    fn apply(&mut self, event: &Event) {
        let bytes = event.bytes as u64;
        match event.kind {
            EventKind::Alloc => {
                *self.live.entry(self.key(&event.tag)).or_default() += bytes;
                self.total += bytes;
            }
            EventKind::Free => {
                let key = self.key(&event.tag);
                let entry = self.live.entry(key).or_default();
                *entry = entry
                    .checked_sub(bytes)
                    .unwrap_or_else(|| panic!("{key:?}: freed more than was allocated"));
                self.total -= bytes;
            }
            EventKind::Retag => {
                let previous = self.key(&event.previous.expect("a retag names its old tag"));
                *self.live.entry(previous).or_default() -= bytes;
                *self.live.entry(self.key(&event.tag)).or_default() += bytes;
            }
        }
    }

    fn snapshot(&self) -> Live {
        self.live
            .iter()
            .filter(|&(_, &bytes)| bytes > 0)
            .map(|(&key, &bytes)| (key, bytes))
            .collect()
    }
}

/// Runs `step` (the `step`-th, from 1, of `accum` micro-batches, for a model of `n_layers`
/// blocks) with the meter recording, on top of `live` (what was live before it, by term),
/// and returns its figures and what is live after it.
pub(crate) fn record_step<T>(
    n_layers: usize,
    step_number: u32,
    accum: usize,
    live: Live,
    step: impl FnOnce() -> T,
) -> (T, StepLedger, Live) {
    let (out, events) = memory::record(step);
    let mut tally = Tally {
        n_layers,
        total: live.values().sum(),
        live,
    };
    let mut peak = (tally.total, None::<Tag>, tally.snapshot());
    let mut after_first_forward = None;
    let mut update = None::<(u64, u64)>;
    for event in &events {
        let tag = event.tag;
        let first_backward = tag.micro_batch == Some(0)
            && event.kind == EventKind::Alloc
            && tag.stage != MeterStage::Forward;
        if after_first_forward.is_none() && first_backward {
            after_first_forward = Some(tally.snapshot());
        }
        tally.apply(event);
        if event.kind == EventKind::Alloc && tally.total > peak.0 {
            peak = (tally.total, Some(tag), tally.snapshot());
        }
        if tag.stage == MeterStage::Update && event.kind == EventKind::Alloc {
            let before = update.map_or(tally.total - event.bytes as u64, |(b, _)| b);
            let high = update.map_or(0, |(_, h)| h).max(tally.total);
            update = Some((before, high));
        }
    }
    let (peak_bytes, peak_tag, peak_live) = peak;
    let ledger = StepLedger {
        peak_bytes,
        peak_at: phase_of(peak_tag.unwrap_or_default(), step_number, accum, n_layers),
        peak_live,
        after_first_forward: after_first_forward.unwrap_or_default(),
        update_extra_bytes: update.map_or(0, |(before, high)| high - before),
        end_bytes: tally.total,
    };
    (out, ledger, tally.snapshot())
}

/// The plan's phase of an allocation tagged `tag`.
fn phase_of(tag: Tag, step: u32, accum: usize, n_layers: usize) -> Phase {
    let stage = match tag.stage {
        MeterStage::Other => Stage::StepStart,
        MeterStage::Forward => Stage::Forward,
        MeterStage::Backward => Stage::Backward,
        MeterStage::Recompute => Stage::Recompute,
        MeterStage::Reduction => Stage::Reduction,
        MeterStage::Update => Stage::Optimizer,
        MeterStage::Gather => Stage::Gather,
    };
    Phase {
        step,
        micro_batch: tag.micro_batch.map_or(0, |m| m + 1),
        accum,
        stage,
        layer: Layer::of_unit(tag.owner, n_layers),
    }
}

/// The memory of one training step of `recipe`, for one process: the trainer's own steps
/// on meta tensors (a fresh meta trainer, its first step, then a steady-state second one),
/// each recorded by the tagged memory meter and added up term by term.
///
/// ```
/// use tl_train::model::Preset;
/// use tl_train::plan::{Recipe, predict_step};
/// use tl_train::train::TrainConfig;
///
/// let mut config = TrainConfig::for_preset(Preset::Tiny);
/// config.micro_batch = 2;
/// let prediction = predict_step(&Recipe::from(&config))?;
/// // Between steps: weights and moments, 12 bytes per parameter (the trainer drops the
/// // gradients after the update).
/// assert_eq!(prediction.between_steps_bytes, 12 * 133_440);
/// assert!(prediction.peak_bytes > prediction.between_steps_bytes + prediction.saved_total());
/// # Ok::<(), tl_train::TrainError>(())
/// ```
///
/// # Errors
/// Those of [`Trainer::meta_on`] (an invalid config) and [`Trainer::train_step`].
pub fn predict_step(recipe: &Recipe) -> Result<StepPrediction> {
    Ok(predict_rank(recipe.config(), 0, 1)?.0)
}

/// [`predict_step`] of rank `rank` of a world of `world_size` ranks (the config's ZeRO
/// stage and buckets, on a phantom communicator), with the collectives the rank
/// called during the steady-state step.
///
/// The meta run has a thread of its own, so its meter, its tags and its modes are its own:
/// the caller's meter (a real run checking its memory before it starts, a profile) sees
/// none of its allocations, nor its peak.
pub(crate) fn predict_rank(
    config: &TrainConfig,
    rank: usize,
    world_size: usize,
) -> Result<(StepPrediction, Vec<Call>)> {
    std::thread::scope(|scope| {
        let run = scope.spawn(|| {
            let (recorder, calls) = Recorder::new(Box::new(Phantom::new(rank, world_size)?));
            let prediction = predict_here(config, Box::new(recorder), &calls)?;
            let calls = calls.lock().expect("the plan's log").clone();
            Ok((prediction, calls))
        });
        run.join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// [`predict_rank`] on this thread, on `comm`; `calls` is where a recorder around it notes
/// its collectives, left holding the steady-state step's.
fn predict_here(
    config: &TrainConfig,
    comm: Box<dyn Communicator>,
    calls: &Calls,
) -> Result<StepPrediction> {
    let _meta = tl_tensor::meta_mode();
    let (n, accum) = (config.model.n_layers, config.accum);
    let (trainer, _, live) = record_step(n, 0, accum, Live::new(), || {
        Trainer::meta_on(config.clone(), comm)
    });
    let mut trainer = trainer?;
    let (stepped, first, live) = record_step(n, 1, accum, live, || trainer.train_step());
    stepped?;
    calls.lock().expect("the plan's log").clear();
    let (stepped, second, _) = record_step(n, 2, accum, live, || trainer.train_step());
    stepped?;
    let mut by_kind = BTreeMap::new();
    for (&(_, kind), &bytes) in &second.peak_live {
        *by_kind.entry(kind).or_insert(0) += bytes;
    }
    let peak_by_kind = TensorKind::ALL
        .into_iter()
        .filter_map(|kind| by_kind.get(&kind).map(|&bytes| (kind, bytes)))
        .collect();
    let saved = second
        .after_first_forward
        .iter()
        .filter(|((_, kind), _)| kind.is_activation())
        .map(|(&(layer, kind), &bytes)| SavedBytes { layer, kind, bytes })
        .collect();
    Ok(StepPrediction {
        checkpointing: config.checkpointing,
        peak_bytes: second.peak_bytes,
        peak_at: second.peak_at,
        peak_by_kind,
        first_step_peak_bytes: first.peak_bytes,
        between_steps_bytes: first.end_bytes,
        update_extra_bytes: second.update_extra_bytes,
        saved,
        collectives: Vec::new(),
    })
}
