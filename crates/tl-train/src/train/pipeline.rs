//! The trainer's pipeline parallelism: this rank's stages of the model, the schedule that
//! streams a step's micro-batches through them (tl-parallel's executor), what the stages
//! agree on (the batch's loss, the overflow, the clip norm), and the whole tensors a
//! checkpoint needs, assembled from the stages.
//!
//! A step on a pipeline is one process's step to the bit where nothing is summed across
//! stages: every stage's backwards run in micro-batch order, so its parameters' gradients
//! add up in one process's order, and each micro-batch's loss is weighted as tl-precision
//! weights it. Each stage draws one process's dropout masks (it starts from the
//! micro-batch's stream and skips the blocks before it, see `Llama::stage_forward`), and
//! fp8's amaxes need no more than the trainer's reduction over every rank (the stages that
//! do not hold a layer add nothing to it). The clip norm is the one exception: each stage
//! sums its squares, and the stages' sums are added over the pipeline, an order one
//! process does not use.

use std::cell::{Cell, RefCell};
use std::ops::Range;
use std::time::{Duration, Instant};

use tl_collective::{Communicator, ReduceOp, SliceMut};
use tl_parallel::pipeline::{Executed, Schedule, StageModel, execute};
use tl_parallel::{DataParallel, ParallelError};
use tl_precision::{
    DynamicLossScaler, LOSS_LABEL, StepObserver, StepReport, finish_step_observed, start_step,
};
use tl_tensor::memory::{self, Stage as MeterStage};
use tl_tensor::optim::{AdamW, AdamWParamState, AdamWState};
use tl_tensor::{Element, Tensor, no_grad};

use super::config::TrainConfig;
use super::optimizer::RunOptimizer;
use super::ranks::StepBatch;
use crate::data::Batch;
use crate::error::{Result, TrainError};
use crate::model::Llama;
use crate::model::pipeline::{rank_stages, stage_blocks};

/// The file in a run's directory that holds the pipeline's last step as it ran.
pub const PIPELINE_TIMELINE_FILE: &str = "pipeline-timeline.json";

/// A pipeline's last step as it ran, rank by rank: what `tinyllm schedule --from RUN`
/// draws and times against the simulator.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PipelineTimeline {
    /// The step.
    pub step: u64,
    /// For each rank, its actions up to the gradient reduction: each one's place in the
    /// rank's list, its name (`0F1`: stage 0's forward of micro-batch 1) and when it began
    /// and ended, in seconds since the rank's step began on its own clock (the ranks begin a
    /// step within a collective of each other).
    pub ranks: Vec<Vec<TimedAction>>,
}

/// One action of a [`PipelineTimeline`].
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TimedAction {
    /// Its place in the rank's list of the schedule.
    pub index: usize,
    /// Its name, as the schedule prints it.
    pub action: String,
    /// When it began, seconds.
    pub start_s: f64,
    /// When it ended, seconds.
    pub end_s: f64,
}

/// This rank's place in the pipeline.
pub(super) struct PipelineRank {
    /// The pipeline group: stage `s` is held by its rank `s mod p`.
    comm: RefCell<Box<dyn Communicator>>,
    schedule: Schedule,
    /// Every stage's blocks.
    blocks: Vec<Range<usize>>,
    /// Every parameter of the whole model, in order: its name, shape and the stage that
    /// holds it.
    whole: Vec<(String, Vec<usize>, usize)>,
    /// The last step's timeline on this rank.
    last_step: RefCell<Option<Executed>>,
    /// Wall-clock time spent sending, receiving (waits included) and in the pipeline's
    /// collectives.
    busy: Cell<Duration>,
}

impl PipelineRank {
    /// Rank `comm.rank()` of the pipeline of `config`, cutting `model` and its `optimizer`
    /// (the same on every rank of the pipeline: whole, or a tensor-parallel rank's part of
    /// the whole) into this rank's stages. `whole` is the whole model's parameters' names
    /// and shapes, in order: what a checkpoint holds.
    ///
    /// # Errors
    /// The config's errors of the schedule and the cut; an optimizer state that does not
    /// fit.
    pub(super) fn cut(
        comm: Box<dyn Communicator>,
        model: Llama<f32>,
        optimizer: AdamW<f32>,
        config: &TrainConfig,
        whole: &[(String, Vec<usize>)],
    ) -> Result<(Self, Llama<f32>, AdamW<f32>)> {
        let parallel = &config.parallel;
        let schedule = config.pipeline_schedule()?;
        let blocks = stage_blocks(
            &config.model,
            parallel.stages(),
            parallel.pipeline_split.as_deref(),
        )?;
        let stage_of = |name: &str| -> usize {
            match name.strip_prefix("blocks.") {
                Some(rest) => {
                    let block: usize = rest
                        .split('.')
                        .next()
                        .and_then(|i| i.parse().ok())
                        .expect("a block's parameter names its block");
                    (blocks.iter())
                        .position(|b| b.contains(&block))
                        .expect("every block is in a stage")
                }
                None if name == "emb.weight" => 0,
                None => blocks.len() - 1,
            }
        };
        let whole: Vec<(String, Vec<usize>, usize)> = (whole.iter())
            .map(|(name, shape)| (name.clone(), shape.clone(), stage_of(name)))
            .collect();
        let state = optimizer.state_dict();
        let part = model.into_pipeline_part(rank_stages(comm.rank(), schedule.ranks(), &blocks));
        let kept: Vec<String> = (part.named_parameters().into_iter())
            .map(|(name, _)| name)
            .collect();
        let mut adamw = super::trainer::optimizer_like(&optimizer, &part)?;
        adamw.load_state_dict(select_state(state, &whole, &kept))?;
        let rank = Self {
            comm: RefCell::new(comm),
            schedule,
            blocks,
            whole,
            last_step: RefCell::new(None),
            busy: Cell::new(Duration::ZERO),
        };
        Ok((rank, part, adamw))
    }

    fn rank(&self) -> usize {
        self.comm.borrow().rank()
    }

    /// Runs `collective` on the pipeline group.
    fn call<T>(
        &self,
        collective: impl FnOnce(&mut dyn Communicator) -> tl_collective::Result<T>,
    ) -> Result<T> {
        let rank = self.rank();
        let started = Instant::now();
        let done = collective(self.comm.borrow_mut().as_mut());
        self.busy.set(self.busy.get() + started.elapsed());
        done.map_err(|source| ParallelError::Collective { rank, source }.into())
    }

    /// Wall-clock time this rank has spent on the pipeline's messages (a receive's wait
    /// for its sender included) and its collectives.
    pub(super) fn communication_time(&self) -> Duration {
        self.busy.get()
    }

    /// The sum of `x` over the pipeline's ranks.
    fn sum(&self, x: f64) -> Result<f64> {
        self.call(|comm| comm.all_reduce_sum_f64(x))
    }

    /// Bytes this rank sent over the pipeline group.
    pub(super) fn bytes_sent(&self) -> u64 {
        self.comm.borrow().stats().bytes_sent
    }

    /// The last step's timeline on this rank.
    pub(super) fn last_step(&self) -> Option<Executed> {
        self.last_step.borrow().clone()
    }

    /// One optimizer step of `model` (this rank's stages) on the step's `micro_batches`,
    /// streamed through the pipeline by the schedule, then the update with the overflow
    /// and the clip norm decided over every stage.
    ///
    /// # Errors
    /// As the trainer's step: a refused update (the weights unchanged), a failed message
    /// or collective.
    ///
    /// `ddp` is the rank's data-parallel group (with the tensor-parallel axis of a split
    /// model): when it spans more than this rank, the step ends with its reduction and its
    /// decisions, made over the pipeline too.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn train_step(
        &self,
        model: &Llama<f32>,
        optimizer: &mut RunOptimizer,
        ddp: &mut DataParallel,
        micro_batches: &[StepBatch],
        config: &TrainConfig,
        scaler: Option<&mut DynamicLossScaler>,
    ) -> Result<StepReport> {
        start_step(model, optimizer);
        let local_rows: usize = micro_batches.iter().map(|m| m.batch.rows).sum();
        let global_rows = config.sequences_per_step();
        // ZeRO-3 reduce-scatters each unit in every micro-batch's backward, weighted by this
        // replica's share: its step begins before the schedule, and ends with its observer.
        let zero3 = match &mut *optimizer {
            RunOptimizer::Zero3(zero3) => {
                zero3.begin_step(local_rows, global_rows)?;
                true
            }
            _ => false,
        };
        let replicated = !zero3 && (ddp.world_size() > 1 || ddp.spans_tensor());
        if replicated {
            ddp.begin_step(local_rows, global_rows)?;
        }
        let stages = Stages {
            model,
            micro_batches,
            total_rows: local_rows,
            global_rows,
            loss_scale: scaler.as_deref().map_or(1.0, DynamicLossScaler::loss_scale),
            last: self.blocks.len() - 1,
            batch_loss: Cell::new(0.0),
        };
        let executed = {
            let _autocast = config.precision.autocast();
            let mut comm = self.comm.borrow_mut();
            execute(&self.schedule, comm.as_mut(), &stages)?
        };
        // Its messages, and the waits in its receives: what is not compute in its timeline.
        let messages: Duration = (executed.timeline.iter())
            .filter(|t| !t.action.computes())
            .map(|t| t.end - t.start)
            .sum();
        self.busy.set(self.busy.get() + messages);
        *self.last_step.borrow_mut() = Some(executed);
        // The last stage's loss (this replica's share of the batch's), every stage's.
        let loss = self.sum(stages.batch_loss.get())?;
        if let RunOptimizer::Zero3(zero3) = &mut *optimizer {
            zero3.record_loss(loss);
            let mut inner = zero3.observer();
            let report = self.finish(optimizer, loss, scaler, config, Some(&mut inner))?;
            if let Some(error) = inner.take_error() {
                return Err(error.into());
            }
            return Ok(inner.global_report(report?));
        }
        let inner = replicated.then(|| {
            ddp.record_loss(loss);
            &mut *ddp
        });
        let report = self.finish(optimizer, loss, scaler, config, inner)?;
        if replicated && let Some(error) = ddp.take_error() {
            return Err(error.into());
        }
        Ok(if replicated {
            ddp.global_report(report?)
        } else {
            report?
        })
    }

    /// tl-precision's end of the step, with the update's decisions made over the pipeline
    /// after those of `inner`, the rank's data-parallel (and tensor-parallel) observer.
    ///
    /// # Errors
    /// A collective of the pipeline that failed (the step then changed nothing); the
    /// step's own refusal is the inner result.
    fn finish<O: StepObserver<f32>>(
        &self,
        optimizer: &mut RunOptimizer,
        loss: f64,
        scaler: Option<&mut DynamicLossScaler>,
        config: &TrainConfig,
        inner: Option<&mut O>,
    ) -> Result<tl_precision::Result<StepReport>> {
        let mut observer = Agreement {
            rank: self,
            inner,
            error: None,
        };
        let report = finish_step_observed(optimizer, loss, scaler, config.clip, &mut observer);
        match observer.error {
            Some(error) => Err(error),
            None => Ok(report),
        }
    }

    /// Every rank's last step (see [`PipelineTimeline`]), on every rank: a collective of
    /// the pipeline. `None` before the first step.
    ///
    /// # Errors
    /// A failed broadcast.
    pub(super) fn gather_timelines(&self, step: u64) -> Result<Option<PipelineTimeline>> {
        let own: Vec<f64> = self.last_step().map_or_else(Vec::new, |executed| {
            (executed.timeline.iter().enumerate())
                .flat_map(|(i, t)| [i as f64, t.start.as_secs_f64(), t.end.as_secs_f64()])
                .collect()
        });
        let mut ranks = Vec::with_capacity(self.schedule.ranks());
        for root in 0..self.schedule.ranks() {
            let mut len = [own.len() as f64];
            self.call(|comm| comm.broadcast(SliceMut::F64(&mut len), root))?;
            let mut values = if root == self.rank() {
                own.clone()
            } else {
                vec![0.0; len[0] as usize]
            };
            self.call(|comm| comm.broadcast((&mut values[..]).into(), root))?;
            let actions = self.schedule.actions(root);
            ranks.push(
                (values.chunks_exact(3))
                    .map(|t| TimedAction {
                        index: t[0] as usize,
                        action: actions[t[0] as usize].to_string(),
                        start_s: t[1],
                        end_s: t[2],
                    })
                    .collect::<Vec<_>>(),
            );
        }
        Ok((!own.is_empty()).then_some(PipelineTimeline { step, ranks }))
    }

    /// The mean loss of `batches` through the stages, without a graph: every rank returns
    /// the same.
    ///
    /// # Errors
    /// A failed message or collective.
    pub(super) fn validation_loss(&self, model: &Llama<f32>, batches: &[Batch]) -> Result<f64> {
        let _no_graph = no_grad();
        let (rank, p, last) = (self.rank(), self.schedule.ranks(), self.blocks.len() - 1);
        let (mut total, mut rows) = (0.0, 0);
        for batch in batches {
            let mut input: Option<Tensor<f32>> = None;
            for stage in (rank..=last).step_by(p) {
                if stage > 0 {
                    let shape = model.stream_shape(batch.rows, batch.context)?;
                    let mut values = vec![0.0f32; shape.iter().product()];
                    let from = self.schedule.rank_of(stage - 1);
                    self.call(|comm| comm.recv((&mut values[..]).into(), from, stage as u32))?;
                    input = Some(Tensor::from_vec(values, &shape)?);
                }
                let output = model.stage_forward(
                    stage,
                    input.as_ref(),
                    (&batch.inputs, &batch.targets),
                    batch.rows,
                    batch.context,
                )?;
                if stage == last {
                    total += f64::from(output.item()) * batch.rows as f64;
                } else {
                    let values = output.to_vec();
                    let to = self.schedule.rank_of(stage + 1);
                    self.call(|comm| comm.send((&values[..]).into(), to, stage as u32 + 1))?;
                }
            }
            rows += batch.rows;
        }
        self.call(|comm| comm.flush())?;
        Ok(self.sum(total)? / rows as f64)
    }

    /// Every parameter of the whole model, each broadcast from the rank holding it: a
    /// collective of the pipeline. `local` are this rank's (name, tensor) pairs. Only a rank
    /// that `keep`s them (the one that writes the checkpoint) holds them all; the others
    /// hold one at a time, and return none.
    ///
    /// # Errors
    /// A failed broadcast.
    pub(super) fn gather_weights(
        &self,
        local: &[(String, Tensor<f32>)],
        keep: bool,
    ) -> Result<Vec<(String, Tensor<f32>)>> {
        let mut whole = Vec::with_capacity(self.whole.len());
        for (name, shape, stage) in &self.whole {
            let owner = self.schedule.rank_of(*stage);
            let mut values = match local.iter().find(|(n, _)| n == name) {
                Some((_, tensor)) => tensor.to_vec(),
                None => vec![0.0f32; shape.iter().product()],
            };
            self.call(|comm| comm.broadcast((&mut values[..]).into(), owner))?;
            if keep {
                whole.push((name.clone(), Tensor::from_vec(values, shape)?));
            }
        }
        Ok(whole)
    }

    /// The whole optimizer state from every rank's `state` (of its parameters, in their
    /// order), each parameter's moments broadcast from the rank holding it: a collective of
    /// the pipeline. Only a rank that `keep`s it holds it whole; the others return their
    /// own `state`.
    ///
    /// # Errors
    /// A failed broadcast.
    pub(super) fn gather_state(
        &self,
        state: AdamWState,
        local: &[String],
        keep: bool,
    ) -> Result<AdamWState> {
        let mut whole = AdamWState {
            shapes: Vec::with_capacity(self.whole.len()),
            params: Vec::with_capacity(self.whole.len()),
            ..state.clone()
        };
        for (name, shape, stage) in &self.whole {
            let owner = self.schedule.rank_of(*stage);
            let mine = local.iter().position(|n| n == name);
            let held = mine.and_then(|i| state.params[i].as_ref());
            // Whether it has stepped, and how often: every rank learns it first.
            let mut head = [held.map_or(-1.0, |s| s.step as f64)];
            self.call(|comm| comm.broadcast(SliceMut::F64(&mut head), owner))?;
            let moments = if head[0] < 0.0 {
                None
            } else {
                let numel = shape.iter().product();
                let mut both = match held {
                    Some(s) => [s.exp_avg.clone(), s.exp_avg_sq.clone()].concat(),
                    None => vec![0.0f64; 2 * numel],
                };
                self.call(|comm| comm.broadcast((&mut both[..]).into(), owner))?;
                let exp_avg_sq = both.split_off(numel);
                Some(AdamWParamState {
                    step: head[0] as u64,
                    exp_avg: both,
                    exp_avg_sq,
                })
            };
            if keep {
                whole.shapes.push(shape.clone());
                whole.params.push(moments);
            }
        }
        Ok(if keep { whole } else { state })
    }
}

/// The whole model's optimizer `state` cut down to the parameters `kept`, in their order.
fn select_state(
    state: AdamWState,
    whole: &[(String, Vec<usize>, usize)],
    kept: &[String],
) -> AdamWState {
    let mut by_name: Vec<Option<(Vec<usize>, Option<AdamWParamState>)>> = (state.shapes)
        .into_iter()
        .zip(state.params)
        .map(Some)
        .collect();
    let (shapes, params) = kept
        .iter()
        .map(|name| {
            let at = (whole.iter())
                .position(|(n, _, _)| n == name)
                .expect("a part's parameter is the whole model's");
            by_name[at].take().expect("each parameter once")
        })
        .unzip();
    AdamWState {
        shapes,
        params,
        ..state
    }
}

/// This rank's stages as the executor runs them: each micro-batch's forward on a stage,
/// and on the last stage its loss weighted by its share of the step's rows and scaled, as
/// tl-precision's accumulation weights it.
struct Stages<'a> {
    model: &'a Llama<f32>,
    micro_batches: &'a [StepBatch],
    /// Rows of this rank's micro-batches (its data-parallel replica's), which weight each
    /// micro-batch's gradient, as tl-precision's accumulation weights it.
    total_rows: usize,
    /// Rows of the step's whole batch, which weight each micro-batch's loss in the batch's.
    global_rows: usize,
    loss_scale: f64,
    last: usize,
    /// The batch's loss so far: the weighted losses of the micro-batches, on the last
    /// stage.
    batch_loss: Cell<f64>,
}

impl StageModel<f32> for Stages<'_> {
    type Error = TrainError;

    fn input_shape(&self, _stage: usize, micro_batch: usize) -> Vec<usize> {
        let batch = &self.micro_batches[micro_batch].batch;
        self.model
            .stream_shape(batch.rows, batch.context)
            .expect("a pipeline has no sequence parallelism")
    }

    fn forward(
        &self,
        stage: usize,
        micro_batch: usize,
        input: Option<&Tensor<f32>>,
    ) -> Result<Tensor<f32>> {
        let _micro_batch = memory::micro_batch_scope(Some(micro_batch));
        let _forward = memory::stage_scope(MeterStage::Forward);
        let StepBatch { batch, dropout, .. } = &self.micro_batches[micro_batch];
        // Every stage starts from the micro-batch's stream and skips to its blocks' masks.
        self.model.dropout_generator().set_state(dropout);
        let output = self.model.stage_forward(
            stage,
            input,
            (&batch.inputs, &batch.targets),
            batch.rows,
            batch.context,
        )?;
        if stage != self.last {
            return Ok(output);
        }
        let weight = batch.rows as f64 / self.total_rows as f64;
        let loss = Element::to_f64(output.item());
        let share = batch.rows as f64 / self.global_rows as f64;
        self.batch_loss.set(self.batch_loss.get() + share * loss);
        let _label = memory::label_scope(LOSS_LABEL);
        Ok(output.mul_scalar(<f32 as Element>::from_f64(weight * self.loss_scale)))
    }
}

/// The update's decisions made over the pipeline: any stage's overflow is every stage's,
/// and the clip norm is the whole model's.
struct Agreement<'a, O> {
    rank: &'a PipelineRank,
    /// The data-parallel group's own observer (and the tensor-parallel group's), when the
    /// rank has replicas, or ZeRO-3's: it reduces the gradients and makes its decisions
    /// first.
    inner: Option<&'a mut O>,
    /// The first collective that failed (the decisions then err on the safe side).
    error: Option<TrainError>,
}

impl<O: StepObserver<f32>> StepObserver<f32> for Agreement<'_, O> {
    fn gradients_ready(&mut self, params: &[Tensor<f32>]) {
        if let Some(inner) = self.inner.as_deref_mut() {
            inner.gradients_ready(params);
        }
    }

    fn all_finite(&mut self, local: bool) -> bool {
        let local = match self.inner.as_deref_mut() {
            Some(inner) => inner.all_finite(local),
            None => local,
        };
        let flag = if local { 0.0 } else { 1.0 };
        let mut buf = [flag];
        let agreed = self
            .rank
            .call(|comm| comm.all_reduce(SliceMut::F32(&mut buf), ReduceOp::Max));
        match agreed {
            Ok(()) => buf[0] == 0.0,
            Err(error) => {
                self.error.get_or_insert(error);
                false
            }
        }
    }

    fn total_sum_squares(&mut self, local: f64) -> f64 {
        let local = match self.inner.as_deref_mut() {
            Some(inner) => inner.total_sum_squares(local),
            None => local,
        };
        match self.rank.sum(local) {
            Ok(total) => total,
            Err(error) => {
                self.error.get_or_insert(error);
                f64::NAN
            }
        }
    }
}
