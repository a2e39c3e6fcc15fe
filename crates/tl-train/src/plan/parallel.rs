//! [`ParallelPlan`]: what each rank of a data-parallel run holds at its peak and sends per
//! step, for a recipe (the rank's own micro-batches), a number of ranks and a ZeRO stage.
//!
//! # How each figure is made
//!
//! - **The metered peak** is the trainer's own step, run on meta tensors as rank `r` of a
//!   phantom world of `N` (tl-collective's `Phantom`): the recipe's micro-batches through
//!   tl-parallel's real DDP, `ShardedAdamW`, `Zero2AdamW` or `Zero3` — their buckets,
//!   shards, gathers, hooks and copies — counted by the memory meter as a real rank counts
//!   them. So the peak is exact, rank by rank, at every stage, for the first step and a
//!   steady one; tests check it against ranks training for real over the ring, event for
//!   event.
//! - **The terms** split that peak by the tags of what is live at it: weights, gradients,
//!   optimizer (moments and master shards), communication buffers (tl-parallel's), and
//!   activations (everything else: saved activations, their gradients in flight,
//!   autocast's copies). The ring's scratch vector (a shard of a bucket) and its headers are
//!   the only buffers the meter does not see; they are left out.
//! - **Bytes sent** are what the phantom counted for the collectives the step called, which
//!   follow the ring to the byte, headers included ([`ring_bytes_sent`]), named by what the
//!   meter's tags said when each was called (a bucket of gradients, a unit's weights
//!   before its forward or backward pass, the clip norm's f64 sum).
//!
//! A 7B shape at context 4096 plans in milliseconds and a few megabytes: the meta run makes
//! every allocation of the step and no arithmetic. Rajbhandari et al.'s closed forms are
//! printed beside the figures ([`paper_figures`]).
//!
//! [`ring_bytes_sent`]: super::ring_bytes_sent
//! [`paper_figures`]: super::paper_figures

use serde::Serialize;

use super::kind::{Layer, Stage, TensorKind};
use super::ledger::StepPrediction;
use super::ledger::predict_rank;
use super::recipe::Recipe;
use super::recorder::by_purpose;
use super::zero::{
    BUCKET_BYTES, CollectiveCalls, MAX_RANKS, ModelSizes, PaperFigures, ZeroStage, paper_figures,
};
use crate::error::{Result, TrainError};
use crate::train::TrainConfig;

/// Ranks whose plans are all listed; above it only rank 0's (the largest shards, since the
/// first `len mod N` shards are one element longer) is computed.
pub const LISTED_RANKS: usize = 16;

/// How the training is spread: ranks, ZeRO stage and gradient bucket size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct DataParallelism {
    /// Number of ranks, `N`.
    pub ranks: usize,
    /// ZeRO stage, 0 for plain DDP (its number in JSON).
    #[serde(serialize_with = "stage_number")]
    pub stage: ZeroStage,
    /// Bytes per gradient bucket.
    pub bucket_bytes: u64,
    /// Ranks each layer is split over (tensor parallelism); `ranks / tensor` data-parallel
    /// replicas share the batch. 1 (not written in JSON) splits nothing.
    #[serde(skip_serializing_if = "is_one")]
    pub tensor: usize,
    /// Sequence parallelism over the tensor-parallel groups (as `tinyllm train
    /// --sequence-parallel`); `false` is not written in JSON.
    #[serde(skip_serializing_if = "is_false")]
    pub sequence_parallel: bool,
    /// Ranks of each pipeline (`tinyllm train --pp`); the schedule, the stages a rank and
    /// the cut are the recipe's. 1 (not written in JSON) cuts nothing.
    #[serde(skip_serializing_if = "is_one")]
    pub pipeline: usize,
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

fn is_false(on: &bool) -> bool {
    !on
}

/// A ZeRO stage as its number.
fn stage_number<S: serde::Serializer>(
    stage: &ZeroStage,
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    serializer.serialize_u64(stage.index() as u64)
}

impl DataParallelism {
    /// `ranks` ranks under ZeRO stage `stage`, with tl-parallel's 25 MiB buckets.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`] (`ranks`) for 0 or more than [`MAX_RANKS`] ranks,
    /// (`zero`) for a stage above 3.
    pub fn new(ranks: usize, stage: usize) -> Result<Self> {
        if !(1..=MAX_RANKS).contains(&ranks) {
            return Err(TrainError::InvalidArgument {
                name: "ranks",
                value: ranks.to_string(),
                reason: format!("must be in 1..={MAX_RANKS}"),
            });
        }
        Ok(Self {
            ranks,
            stage: ZeroStage::from_index(stage).map_err(|_| TrainError::InvalidArgument {
                name: "zero",
                value: stage.to_string(),
                reason: "a ZeRO stage is 0 (plain DDP), 1, 2 or 3".into(),
            })?,
            bucket_bytes: BUCKET_BYTES,
            tensor: 1,
            sequence_parallel: false,
            pipeline: 1,
        })
    }

    /// The same with the model cut into pipelines of `pipeline` ranks.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`] (`pp`) when `pipeline` does not divide the ranks.
    pub fn with_pipeline(self, pipeline: usize) -> Result<Self> {
        if pipeline == 0 || !self.ranks.is_multiple_of(pipeline * self.tensor) {
            return Err(TrainError::InvalidArgument {
                name: "pp",
                value: pipeline.to_string(),
                reason: format!(
                    "{} ranks cannot form pipelines of {pipeline} (times --tp {})",
                    self.ranks, self.tensor
                ),
            });
        }
        Ok(Self { pipeline, ..self })
    }

    /// The same with each layer split over tensor-parallel groups of `tensor` ranks.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`] (`tp`) when `tensor` does not divide the ranks.
    pub fn with_tensor(self, tensor: usize) -> Result<Self> {
        if tensor == 0 || !self.ranks.is_multiple_of(tensor) {
            return Err(TrainError::InvalidArgument {
                name: "tp",
                value: tensor.to_string(),
                reason: format!(
                    "{} ranks cannot form tensor-parallel groups of {tensor}",
                    self.ranks
                ),
            });
        }
        Ok(Self { tensor, ..self })
    }

    /// The same with the tensor-parallel groups' residual stream split over them too
    /// (sequence parallelism) when `on`.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`] (`sequence-parallel`) when `on` without tensor
    /// parallelism.
    pub fn with_sequence_parallel(self, on: bool) -> Result<Self> {
        if on && self.tensor <= 1 {
            return Err(TrainError::InvalidArgument {
                name: "sequence-parallel",
                value: "on".into(),
                reason: "splits the residual stream over the tensor-parallel group, so it \
                         requires --tp > 1"
                    .into(),
            });
        }
        Ok(Self {
            sequence_parallel: on,
            ..self
        })
    }
}

/// Which term of a rank's memory is the largest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Term {
    /// Weights (with a gathered unit under stage 3).
    Weights,
    /// Gradients.
    Gradients,
    /// AdamW's moments and master shard.
    Optimizer,
    /// Activations, their gradients and autocast's copies.
    Activations,
    /// Communication buffers.
    CommBuffers,
}

impl Term {
    /// A short label for tables.
    pub fn label(self) -> &'static str {
        match self {
            Term::Weights => "weights",
            Term::Gradients => "gradients",
            Term::Optimizer => "optimizer",
            Term::Activations => "activations",
            Term::CommBuffers => "comm buffers",
        }
    }
}

/// Bytes one rank sends for one kind of collective in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SentBytes {
    /// The calls.
    #[serde(flatten)]
    pub calls: CollectiveCalls,
    /// Bytes this rank sends over all of them, headers included.
    pub bytes: u64,
}

/// One rank's memory at its peak and its traffic per steady-state step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankPlan {
    /// The rank.
    pub rank: usize,
    /// Weights alive at the rank's worst moment ([`phase`](Self::phase)).
    pub weights_bytes: u64,
    /// Gradients alive then.
    pub gradients_bytes: u64,
    /// AdamW's state alive then.
    pub optimizer_bytes: u64,
    /// Everything else alive then that the meter counts: activations, their gradients in
    /// flight, autocast's copies.
    pub activations_bytes: u64,
    /// tl-parallel's communication buffers alive then (it counts them on the meter).
    pub comm_buffer_bytes: u64,
    /// The most bytes alive at once, the five terms above together: the metered peak.
    pub total_bytes: u64,
    /// When that is.
    pub phase: PeakPhase,
    /// The largest of the five terms then.
    pub limiting: Term,
    /// The metered peak of a steady-state step, as `tl_tensor::memory::peak_bytes` counts
    /// it on the rank's thread after a `reset_peak` between steps (tensors and
    /// tl-parallel's buffers).
    pub peak_bytes: u64,
    /// The first step's metered peak (no moments before its update).
    pub first_step_peak_bytes: Option<u64>,
    /// Bytes sent per step, per kind of collective.
    pub sent: Vec<SentBytes>,
    /// Bytes sent per step in all.
    pub sent_bytes: u64,
    /// Bytes the block that keeps the most keeps for backward at the end of one
    /// micro-batch's forward pass (saved activations, a checkpoint's input): the figure
    /// Korthikanti et al.'s per-layer formula stands for
    /// ([`ParallelPlan::paper_block_activations`]).
    pub block_activations_bytes: u64,
}

/// Everything `tinyllm plan --ranks N --zero S` reports.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ParallelPlan {
    /// One rank's recipe: its micro-batches, precision and checkpointing.
    pub recipe: Recipe,
    /// Ranks, stage and buckets.
    pub parallelism: DataParallelism,
    /// The model's sizes.
    pub sizes: ModelSizes,
    /// The paper's arithmetic and tinyllm's f32 counterpart.
    pub paper: PaperFigures,
    /// Rank by rank, or rank 0 alone above [`LISTED_RANKS`] ranks.
    pub ranks: Vec<RankPlan>,
    /// Korthikanti et al.'s activations of one block for one micro-batch
    /// ([`korthikanti_block_bytes`]), beside the plan's exact
    /// [`RankPlan::block_activations_bytes`].
    pub paper_block_activations: u64,
    /// The pipeline's schedule and its bubble, with `--pp` > 1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelinePlan>,
    /// Each rank's step time on a link, when one is given (`tinyllm plan --link`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_time: Option<super::step_time::StepTimePlan>,
}

/// A pipeline's schedule as the plan sees it: the simulator's bubble and activations in
/// flight beside Narayanan et al.'s formula.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PipelinePlan {
    /// The schedule's name.
    pub schedule: &'static str,
    /// Micro-batches a step (`m`).
    pub micro_batches: usize,
    /// Stages a rank (`v`).
    pub stages_per_rank: usize,
    /// Each stage's blocks, `[first, end)`.
    pub stage_blocks: Vec<[usize; 2]>,
    /// Each rank's bubble, idle time over compute time, simulated with equal stages and a
    /// backward twice a forward (the papers' assumption).
    pub bubble: Vec<f64>,
    /// The papers' bubble for equal stages ([`ScheduleKind::paper_bubble`]): Narayanan et
    /// al. (2021) for GPipe, 1F1B and interleaved, Qi et al. (2023) for ZB-H1.
    ///
    /// [`ScheduleKind::paper_bubble`]: tl_parallel::pipeline::ScheduleKind::paper_bubble
    pub bubble_formula: f64,
    /// Where [`bubble_formula`](Self::bubble_formula) comes from, and the formula.
    pub bubble_source: String,
    /// The most micro-batches whose activations each rank holds at once (the simulator's
    /// count, which the executor's run matches).
    pub activations_in_flight: Vec<usize>,
}

impl PipelinePlan {
    /// The pipeline of `config` (with `pipeline` > 1), simulated.
    ///
    /// # Errors
    /// The config's errors of the schedule and the cut.
    pub fn of(config: &TrainConfig) -> Result<Self> {
        use tl_parallel::pipeline::{Costs, simulate};
        let parallel = &config.parallel;
        let schedule = config.pipeline_schedule()?;
        let run = simulate(&schedule, Costs::UNIT).expect("a generated schedule runs");
        let blocks = crate::model::pipeline::stage_blocks(
            &config.model,
            parallel.stages(),
            parallel.pipeline_split.as_deref(),
        )?;
        let (p, m, v) = (parallel.pipeline, config.accum, parallel.stages_per_rank);
        let (bubble_formula, bubble_source) = parallel.schedule.paper_bubble(p, m, v);
        Ok(Self {
            schedule: parallel.schedule.name(),
            micro_batches: m,
            stages_per_rank: v,
            stage_blocks: blocks.iter().map(|b| [b.start, b.end]).collect(),
            bubble: run.ranks.iter().map(|r| r.bubble_ratio()).collect(),
            bubble_formula,
            bubble_source: bubble_source.to_owned(),
            activations_in_flight: run.ranks.iter().map(|r| r.peak_activations).collect(),
        })
    }
}

/// Bytes of activations one transformer layer keeps for backward, by Korthikanti et al.,
/// "Reducing Activation Recomputation in Large Transformer Models" (2022), Table 2, for
/// their GPT layer with 16-bit activations and 1-byte dropout masks: `sbh(34 + 5as/h)`
/// alone, `sbh(10 + 24/t + 5as/(ht))` with tensor parallelism over `t`, and
/// `(sbh/t)(34 + 5as/h)` with sequence parallelism too (`s` the sequence length, `b` the
/// micro-batch, `h` the width, `a` the heads).
///
/// ```
/// use tl_train::plan::korthikanti_block_bytes;
/// // GPT-3 175B's layer (h 12288, a 96) at s 2048, b 1: 34·sbh + 5·a·s²·b = 2.87 GB.
/// assert_eq!(korthikanti_block_bytes(2048, 1, 12288, 96, 1, false), 2_868_903_936);
/// // Over t = 8: 10·sbh stays whole (the norms' inputs and outputs, dropout masks)...
/// assert_eq!(korthikanti_block_bytes(2048, 1, 12288, 96, 8, false), 578_813_952);
/// // ... and with sequence parallelism everything is divided by 8.
/// assert_eq!(korthikanti_block_bytes(2048, 1, 12288, 96, 8, true), 2_868_903_936 / 8);
/// ```
pub fn korthikanti_block_bytes(
    s: usize,
    b: usize,
    h: usize,
    a: usize,
    t: usize,
    sequence_parallel: bool,
) -> u64 {
    let (s, b, h, a, t) = (s as u128, b as u128, h as u128, a as u128, t.max(1) as u128);
    let sbh = s * b * h;
    // The attention's scores and softmax: 5as²b, exact in whole bytes.
    let scores = 5 * a * s * s * b;
    let bytes = if sequence_parallel || t == 1 {
        (34 * sbh + scores) / t
    } else {
        10 * sbh + 24 * sbh / t + scores / t
    };
    bytes as u64
}

impl ParallelPlan {
    /// Rank 0's plan (the one with the largest shards).
    pub fn rank0(&self) -> &RankPlan {
        &self.ranks[0]
    }
}

/// Plans `recipe` on every rank of `parallelism` (see the [module docs](self)).
///
/// ```
/// use tl_train::model::Preset;
/// use tl_train::plan::{DataParallelism, ParallelPlan, Recipe, plan_ranks};
/// use tl_train::train::TrainConfig;
///
/// let mut config = TrainConfig::for_preset(Preset::Tiny);
/// config.micro_batch = 2;
/// let recipe = Recipe::from(&config);
/// let ddp = plan_ranks(&recipe, &DataParallelism::new(2, 0)?)?;
/// let zero1 = plan_ranks(&recipe, &DataParallelism::new(2, 1)?)?;
/// // ZeRO-1 keeps 12 of DDP's 16 bytes per parameter... on half the parameters.
/// let p = 133_440;
/// assert_eq!(ddp.rank0().peak_bytes - zero1.rank0().peak_bytes, 8 * p - 12 * p / 2);
/// assert!(zero1.rank0().sent_bytes > ddp.rank0().sent_bytes); // plus the weights' gather
/// # Ok::<(), tl_train::TrainError>(())
/// ```
///
/// # Errors
/// As [`Recipe::validate`].
pub fn plan_ranks(recipe: &Recipe, parallelism: &DataParallelism) -> Result<ParallelPlan> {
    let sizes = ModelSizes::of(&recipe.model);
    let DataParallelism {
        ranks: world_size,
        stage,
        ..
    } = *parallelism;
    let listed = if world_size <= LISTED_RANKS {
        world_size
    } else {
        1
    };
    let ranks = (0..listed)
        .map(|rank| plan_rank(recipe, parallelism, rank))
        .collect::<Result<Vec<_>>>()?;
    Ok(ParallelPlan {
        recipe: recipe.clone(),
        parallelism: *parallelism,
        // The paper's data-parallel arithmetic on each rank's slice of the model (the
        // replicated norms, a few thousand parameters, counted as split).
        // (A pipeline's stages as shares of the model too, equal ones.)
        paper: paper_figures(
            stage,
            sizes.parameters / (parallelism.tensor * parallelism.pipeline) as u64,
            world_size / (parallelism.tensor * parallelism.pipeline),
            recipe.accum,
        ),
        paper_block_activations: korthikanti_block_bytes(
            recipe.model.context,
            recipe.micro_batch,
            recipe.model.d_model,
            recipe.model.n_heads,
            parallelism.tensor,
            parallelism.sequence_parallel,
        ),
        sizes,
        ranks,
        pipeline: (parallelism.pipeline > 1)
            .then(|| PipelinePlan::of(&pipeline_config(recipe, parallelism)))
            .transpose()?,
        step_time: None,
    })
}

/// For each block, how many micro-batches' forwards its stage on world rank `rank` runs
/// before the rank's first backward (1 without a pipeline).
fn pipeline_forwards_before_backward(
    config: &TrainConfig,
    rank: usize,
    parallelism: &DataParallelism,
) -> Result<impl Fn(usize) -> usize> {
    use tl_parallel::pipeline::Action;
    let mut counts: Vec<usize> = Vec::new();
    let mut stage_of_block: Vec<usize> = Vec::new();
    if parallelism.pipeline > 1 {
        let mut config = config.clone();
        config.parallel.ranks = parallelism.ranks;
        let schedule = config.pipeline_schedule()?;
        let blocks = crate::model::pipeline::stage_blocks(
            &config.model,
            config.parallel.stages(),
            config.parallel.pipeline_split.as_deref(),
        )?;
        // The mesh's layout: rank = (pp·DP + dp)·TP + tp.
        let replicas = parallelism.ranks / (parallelism.tensor * parallelism.pipeline);
        let pp_rank = rank / (parallelism.tensor * replicas);
        counts = vec![0; blocks.len()];
        for action in schedule.actions(pp_rank) {
            match *action {
                Action::Backward { .. } | Action::BackwardInput { .. } => break,
                Action::Forward { stage, .. } => counts[stage] += 1,
                _ => {}
            }
        }
        stage_of_block = (0..config.model.n_layers)
            .map(|b| blocks.iter().position(|r| r.contains(&b)).unwrap_or(0))
            .collect();
    }
    Ok(move |block: usize| match stage_of_block.get(block) {
        Some(&stage) => counts[stage],
        None => 1,
    })
}

/// The recipe's config on `parallelism`'s pipeline.
fn pipeline_config(recipe: &Recipe, parallelism: &DataParallelism) -> TrainConfig {
    let mut config = recipe.config().clone();
    config.parallel.ranks = parallelism.ranks;
    config.parallel.pipeline = parallelism.pipeline;
    config
}

/// Rank `rank` of `parallelism`, planned by running the trainer's own data-parallel step on
/// meta tensors, as that rank of a phantom world (see the [module docs](self)).
fn plan_rank(recipe: &Recipe, parallelism: &DataParallelism, rank: usize) -> Result<RankPlan> {
    let mut config = recipe.config().clone();
    config.parallel.zero = parallelism.stage.index() as u8;
    config.parallel.bucket_bytes = parallelism.bucket_bytes as usize;
    config.parallel.tensor = parallelism.tensor;
    config.parallel.sequence_parallel = parallelism.sequence_parallel;
    config.parallel.pipeline = parallelism.pipeline;
    let (prediction, calls) = predict_rank(&config, rank, parallelism.ranks)?;
    let sent = by_purpose(&calls, parallelism.stage, &config)
        .into_iter()
        .map(|(calls, bytes)| SentBytes { calls, bytes })
        .collect();
    let mut by_block = std::collections::BTreeMap::<usize, u64>::new();
    for saved in &prediction.saved {
        if let Layer::Block(i) = saved.layer {
            *by_block.entry(i).or_default() += saved.bytes;
        }
    }
    // On a pipeline the first backward comes after the forwards of several micro-batches:
    // a block's saved bytes are those of each micro-batch its stage ran until then.
    let in_flight = pipeline_forwards_before_backward(&config, rank, parallelism)?;
    let block_activations = (by_block.into_iter())
        .map(|(block, bytes)| bytes / in_flight(block).max(1) as u64)
        .max()
        .unwrap_or(0);
    let mut plan = from_prediction(&prediction).into_rank_plan(rank, sent);
    plan.block_activations_bytes = block_activations;
    Ok(plan)
}

/// When a rank's metered bytes are highest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PeakPhase {
    /// The forward and backward passes (with stage 2's and 3's communication in them).
    Backward,
    /// AdamW's update.
    Update,
    /// After backward: stage 0's and 1's gradient reduction, bucket by bucket (stage 2's
    /// buckets that backward left).
    Reduction,
    /// After the update: the all-gather of the updated weights.
    Gather,
}

impl PeakPhase {
    /// A short label for tables.
    pub fn label(self) -> &'static str {
        match self {
            PeakPhase::Backward => "backward",
            PeakPhase::Update => "update",
            PeakPhase::Reduction => "reduction",
            PeakPhase::Gather => "gather",
        }
    }
}

/// What a rank holds at one moment, by term.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Moment {
    phase: PeakPhase,
    weights: u64,
    gradients: u64,
    optimizer: u64,
    activations: u64,
    buffers: u64,
}

impl Moment {
    fn total(&self) -> u64 {
        self.weights + self.gradients + self.optimizer + self.activations + self.buffers
    }
}

/// A rank's memory figures before the traffic is added: the metered peak and what is alive
/// then, by term.
struct Memory {
    peak: u64,
    first_step_peak: Option<u64>,
    worst: Moment,
}

impl Memory {
    fn new(peak: u64, first_step_peak: Option<u64>, worst: Moment) -> Self {
        Self {
            peak,
            first_step_peak,
            worst,
        }
    }

    fn into_rank_plan(self, rank: usize, sent: Vec<SentBytes>) -> RankPlan {
        let w = self.worst;
        let candidates = [
            (Term::Weights, w.weights),
            (Term::Gradients, w.gradients),
            (Term::Optimizer, w.optimizer),
            (Term::Activations, w.activations),
            (Term::CommBuffers, w.buffers),
        ];
        let limiting = candidates
            .iter()
            .fold(
                candidates[0],
                |best, &c| if c.1 > best.1 { c } else { best },
            )
            .0;
        RankPlan {
            rank,
            weights_bytes: w.weights,
            gradients_bytes: w.gradients,
            optimizer_bytes: w.optimizer,
            activations_bytes: w.activations,
            comm_buffer_bytes: w.buffers,
            total_bytes: w.total(),
            phase: w.phase,
            limiting,
            peak_bytes: self.peak,
            first_step_peak_bytes: self.first_step_peak,
            sent_bytes: sent.iter().map(|s| s.bytes).sum(),
            sent,
            block_activations_bytes: 0,
        }
    }
}

/// Bytes of `kind` alive at the step's peak.
fn at_peak(prediction: &StepPrediction, kinds: &[TensorKind]) -> u64 {
    prediction
        .peak_by_kind
        .iter()
        .filter(|(kind, _)| kinds.contains(kind))
        .map(|(_, bytes)| bytes)
        .sum()
}

/// The step's peak, split by kind: the communication buffers tl-parallel puts on the
/// meter are the buffer term, and everything outside the model state and the buffers the
/// activation term.
fn from_prediction(prediction: &StepPrediction) -> Memory {
    let weights = at_peak(prediction, &[TensorKind::Weights]);
    let gradients = at_peak(prediction, &[TensorKind::Gradients]);
    let optimizer = at_peak(
        prediction,
        &[TensorKind::AdamMoments, TensorKind::MasterShard],
    );
    let buffers = at_peak(prediction, &[TensorKind::CommBuffers]);
    let peak = prediction.peak_bytes;
    let metered = Moment {
        // A gather or a reduction inside a micro-batch (ZeRO-3's units, ZeRO-2's buckets)
        // is part of its forward or backward pass.
        phase: match prediction.peak_at.stage {
            Stage::Forward | Stage::Backward | Stage::Recompute => PeakPhase::Backward,
            Stage::Reduction | Stage::Gather if prediction.peak_at.micro_batch > 0 => {
                PeakPhase::Backward
            }
            Stage::Reduction => PeakPhase::Reduction,
            Stage::StepStart | Stage::Optimizer => PeakPhase::Update,
            Stage::Gather => PeakPhase::Gather,
        },
        weights,
        gradients,
        optimizer,
        activations: peak - weights - gradients - optimizer - buffers,
        buffers,
    };
    Memory::new(peak, Some(prediction.first_step_peak_bytes), metered)
}
