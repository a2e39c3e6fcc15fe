//! [`Trainer`]: the training loop of `tinyllm train`, with evaluation, checkpoints and
//! exact resumption.

use std::cell::RefCell;
use std::fs;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use tl_collective::{Axis, Communicator, Mesh, Single};
use tl_parallel::{DataParallel, TensorParallel, ZeroStage};
use tl_precision::{
    DynamicLossScaler, Fp8State, MicroBatch, Precision, StepReport, train_step_mixed,
};
use tl_tensor::kernels::finite::array_all_finite;
use tl_tensor::nn::Module;
use tl_tensor::optim::{AdamW, Optimizer};
use tl_tensor::{Generator, no_grad};

use super::config::{AdamWConfig, TrainConfig};
use super::data::{load_corpus, run_tokenizer, token_cache_root};
use super::fp8_ranks;
use super::lock::RunLock;
use super::memory_check::check_memory;
use super::metrics::{Fp8Counts, MetricsLog, Record, read_records, rfc3339_utc};
use super::optimizer::RunOptimizer;
use super::pipeline::PipelineRank;
use super::ranks::{self, RankReport, StepBatch, StepTraffic};
use super::resume::{RunParts, resume_state};
use super::run_config::config_json;
use super::snapshot::{self, AdamWMeta, FORMAT_VERSION, RunState};
use super::summary::RunSummary;
use crate::data::{Batch, Corpus, sample_batch, sequential_batches, skip_batch};
use crate::error::{Result, TrainError};
use crate::model::Llama;
use crate::model::parallel::{Placement, placement};
use crate::store::write_atomic;

/// The run's config file in its directory.
pub(super) const CONFIG_FILE: &str = "config.json";

/// The run's copy of its tokenizer (a run of byte tokens has none).
pub const TOKENIZER_FILE: &str = "tokenizer.json";

impl MicroBatch for Batch {
    fn rows(&self) -> usize {
        self.rows
    }
}

/// Seeds of the run's independent random streams, derived from its one seed.
pub(super) const DATA_STREAM: u64 = 0xD1B5_4A32_D192_ED03;

/// What the loop reports as it goes, for a progress display.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A step or an evaluation finished.
    Metric(Record),
    /// A checkpoint was written to this directory.
    Saved(PathBuf),
}

/// How a call of [`Trainer::run`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// The requested step was reached.
    Finished,
    /// The stop flag was raised; a checkpoint of the last finished step was written.
    Interrupted,
}

/// A model being trained, with everything needed to continue it.
///
/// On several ranks (a communicator of more than one process), every rank holds a
/// `Trainer` of the same run: each trains on its share of every step's global batch, and
/// rank 0 alone writes the run directory (config, metrics, checkpoints). The others read
/// it, so it must be visible to every rank (one machine, or a shared file system).
pub struct Trainer {
    config: TrainConfig,
    run_dir: PathBuf,
    model: Llama<f32>,
    optimizer: RunOptimizer,
    scaler: Option<DynamicLossScaler>,
    /// The fp8 layers' delayed scales (fp8 runs), shared with the model's projections.
    fp8: Option<Rc<RefCell<Fp8State>>>,
    corpus: Corpus,
    validation: Vec<Batch>,
    /// The validation windows' tokens per byte of text, once the first evaluation needs it.
    validation_tokens_per_byte: Option<f64>,
    data_rng: Generator,
    step: u64,
    tokens_seen: u64,
    /// Rank 0's log of the run; `None` on the other ranks.
    metrics: Option<MetricsLog>,
    /// The data-parallel ranks of the run, which share out the batch and reduce the
    /// gradients: all of them (a world of one for a single process), or this rank's
    /// data-parallel group when the model is split over tensor-parallel groups.
    ddp: DataParallel,
    /// Every rank of the run, when `ddp` is only a group of them (tensor parallelism): what
    /// the ranks agree on between steps goes through it.
    world: Option<DataParallel>,
    /// This rank's stages and its pipeline group, when the model is cut into a pipeline.
    pipeline: Option<PipelineRank>,
    /// This rank's communication in the steps taken so far.
    traffic: StepTraffic,
    /// Held by rank 0 for the trainer's life: no other run writes this directory meanwhile.
    _lock: Option<RunLock>,
    /// The run's training time, for the records' `elapsed_s`.
    clock: RunClock,
}

/// Seconds of training since the run began, across the processes that trained it: the
/// `elapsed_s` of the last step kept in `metrics.jsonl` when this process took the run up
/// (the resumed checkpoint's step: the log is cut there), plus the time since.
///
/// The log, not the checkpoint, carries it on: it is what the figure is read from, it is
/// cut at the resumed step exactly, and older checkpoints (which do not hold it) resume
/// with their time counted. A log from before `elapsed_s` was written starts again at 0.
#[derive(Clone, Copy, Debug)]
struct RunClock {
    before: f64,
    since: Instant,
}

impl RunClock {
    fn elapsed_s(&self) -> f64 {
        self.before + self.since.elapsed().as_secs_f64()
    }
}

/// Choices of [`Trainer::resume`] that are not part of the run's config.
#[derive(Clone, Copy, Debug, Default)]
pub struct ResumeOptions {
    /// Continue even though the training file is not the one the run started on (its new
    /// fingerprint becomes the run's).
    pub data_changed_ok: bool,
    /// Continue at this ZeRO stage instead of the run's (a checkpoint holds whole tensors
    /// whatever the stage that wrote it).
    pub zero: Option<u8>,
    /// Continue with buckets of this many bytes.
    pub bucket_bytes: Option<usize>,
    /// Continue with the reduction overlapping backward or not.
    pub overlap: Option<bool>,
    /// Continue with the layers split over tensor-parallel groups of this many ranks
    /// instead of the run's (a checkpoint holds whole tensors whatever the split).
    pub tensor: Option<usize>,
    /// Continue with sequence parallelism on or off instead of as the run had it (a run
    /// continued at tp 1 has it off, and asking for it there is an error: there is no
    /// group to split the tokens over).
    pub sequence_parallel: Option<bool>,
    /// Continue with the model cut into a pipeline over this many ranks instead of the
    /// run's (a checkpoint holds whole tensors whatever the cut); its split is then
    /// balanced again.
    pub pipeline: Option<usize>,
    /// Continue with this pipeline schedule.
    pub schedule: Option<tl_parallel::pipeline::ScheduleKind>,
    /// Continue with this many pipeline stages a rank (the interleaved schedule).
    pub stages_per_rank: Option<usize>,
}

impl Trainer {
    /// A new run of `config` in `run_dir`, which must not hold a run already.
    ///
    /// Everything that can be wrong with the inputs (options, data file, the memory the
    /// step needs) is checked before the directory is created or written.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`]/[`TrainError::InvalidConfig`] for the config,
    /// [`TrainError::Data`] for the data, [`TrainError::Checkpoint`] when `run_dir` already
    /// holds a run, [`TrainError::Locked`] when another process is using it,
    /// [`TrainError::Io`] when it cannot be written.
    pub fn new(config: TrainConfig, run_dir: &Path) -> Result<Self> {
        Self::new_on(config, run_dir, Box::new(Single::new()))
    }

    /// [`Trainer::new`] on the ranks of `comm`: every rank calls it with the same config
    /// (`config.parallel.ranks` is set to the communicator's world size). Rank 0 creates the
    /// run directory; the weights are rank 0's, broadcast. When a rank cannot start, every
    /// rank returns an error (its own, or one naming the ranks that failed).
    ///
    /// # Errors
    /// Those of [`Trainer::new`]; [`TrainError::Ranks`] when another rank failed or was
    /// started with another config; [`TrainError::Parallel`] when a collective failed.
    pub fn new_on(
        config: TrainConfig,
        run_dir: &Path,
        comm: Box<dyn Communicator>,
    ) -> Result<Self> {
        Self::new_with(config, run_dir, DataParallel::new(comm))
    }

    /// [`Trainer::new_on`] with the ranks' communicator already wrapped, as a previous
    /// trainer handed it back ([`Trainer::into_parallel`]): several runs one after the other
    /// on the same ranks (`tinyllm compare`).
    ///
    /// # Errors
    /// As [`Trainer::new_on`].
    pub fn new_with(
        mut config: TrainConfig,
        run_dir: &Path,
        mut ddp: DataParallel,
    ) -> Result<Self> {
        config.parallel.ranks = ddp.world_size();
        let leader = ddp.rank() == 0;
        let prepared = (|| {
            config.validate()?;
            check_memory(&config, ddp.rank())?;
            let model = Llama::new(&config.model, config.seed)?;
            if let Some(dir) = &config.init_from {
                // Before the run directory is made: a checkpoint that does not fit writes
                // nothing.
                crate::import::load_hf_weights(&model, dir)?;
            }
            let corpus = load_corpus(&config, &token_cache_root(Some(run_dir)), None)?;
            config.data_file = corpus.fingerprint.clone();
            if !leader {
                return Ok((corpus, model, None));
            }
            fs::create_dir_all(run_dir).map_err(|source| TrainError::io(run_dir, source))?;
            let lock = RunLock::acquire(run_dir)?;
            if run_dir.join("LATEST").exists() || run_dir.join(CONFIG_FILE).exists() {
                return Err(TrainError::InvalidArgument {
                    name: "out",
                    value: run_dir.display().to_string(),
                    reason: "already holds a run: resume it with --resume, or choose another \
                             --out"
                        .into(),
                });
            }
            snapshot::clean(run_dir)?;
            if let Some(tokenizer) = &config.tokenizer {
                // The run's own copy, which `sample` reads and an export ships.
                let bytes = fs::read(&tokenizer.path)
                    .map_err(|source| TrainError::io(&tokenizer.path, source))?;
                write_atomic(&run_dir.join(TOKENIZER_FILE), &bytes)?;
            }
            write_atomic(&run_dir.join(CONFIG_FILE), &config_json(&config))?;
            Ok((corpus, model, Some(lock)))
        })();
        let (corpus, model, lock) =
            ranks::agree(&mut ddp, prepared, Some((&config, 0)), "start the run")?;
        if ddp.world_size() > 1 {
            ddp.broadcast_parameters(&model.parameters())?;
        }
        let optimizer = new_optimizer(&model, &config)?;
        let parts = RunParts::fresh(config, lock, corpus, model, optimizer);
        Self::assemble(run_dir, parts, ddp)
    }

    /// A trainer of `config` whose tensors are [meta](tl_tensor::meta) — shapes, no values —
    /// as rank `comm.rank()` of `comm`'s ranks: what `tinyllm plan` and the pre-flight memory
    /// check run, under [`tl_tensor::meta_mode`], with a phantom communicator for a world of
    /// many ranks. Its [`train_step`](Self::train_step) is the real step, allocating and
    /// freeing what a real one does, with no arithmetic, at any ZeRO stage: tl-parallel's
    /// buffers are counted and its collectives called on shapes, so a
    /// [`Phantom`](tl_collective::Phantom) counts what rank `r` of a ring would send. The
    /// weights are broadcast as on a real rank; the ranks' agreement on the config is not
    /// made (a phantom has no other ranks to agree with). Nothing is read or written on disk
    /// (no run directory, no metrics), the data is a stand-in of the right length, and the
    /// memory check is not made (this is what it runs).
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`]/[`TrainError::InvalidConfig`] for the config, and what
    /// [`Trainer::new_on`] reports of the parallel setup.
    pub fn meta_on(mut config: TrainConfig, comm: Box<dyn Communicator>) -> Result<Self> {
        let _meta = tl_tensor::meta_mode();
        let mut ddp = DataParallel::new(comm);
        config.parallel.ranks = ddp.world_size();
        config.validate()?;
        let corpus = Corpus::stand_in(config.model.context);
        let model = Llama::new(&config.model, config.seed)?;
        if ddp.world_size() > 1 {
            // As a real rank takes rank 0's weights: the same buffers, the same collectives.
            ddp.broadcast_parameters(&model.parameters())?;
        }
        let optimizer = new_optimizer(&model, &config)?;
        let parts = RunParts::fresh(config, None, corpus, model, optimizer);
        Self::assemble(Path::new(""), parts, ddp)
    }

    /// The trainer of `parts` in `run_dir` (locked by rank 0), on `ddp`'s ranks; with
    /// `config.parallel.tensor` > 1 their mesh is split into data- and tensor-parallel
    /// groups, and the whole model and optimizer of `parts` into this rank's part.
    fn assemble(run_dir: &Path, parts: RunParts, ddp: DataParallel) -> Result<Self> {
        let RunParts {
            config,
            lock,
            corpus,
            model,
            optimizer,
            scaler,
            fp8,
            data_rng,
            step,
            tokens_seen,
        } = parts;
        let (ddp, world, model, optimizer, pipeline) = split_mesh(ddp, model, optimizer, &config)?;
        let mut ddp = ddp
            .with_bucket_bytes(config.parallel.bucket_bytes)
            .with_overlap(config.parallel.overlap);
        model.set_checkpointing(config.checkpointing);
        model.set_chunked_loss(config.chunked_loss.resolve(&config.model));
        let fp8 = fp8.map(|state| Rc::new(RefCell::new(state)));
        model.set_fp8(fp8.clone())?;
        let stage = ZeroStage::try_from(config.parallel.zero)?;
        let optimizer = RunOptimizer::at_stage(optimizer, stage, &mut ddp, &model)?;
        let metrics = lock
            .is_some()
            .then(|| MetricsLog::open(run_dir, step))
            .transpose()?;
        let clock = RunClock {
            before: metrics.as_ref().map_or(0.0, MetricsLog::elapsed_s_at_open),
            since: Instant::now(),
        };
        Ok(Self {
            scaler,
            fp8,
            validation: validation_batches(&corpus, &config),
            validation_tokens_per_byte: None,
            data_rng,
            metrics,
            clock,
            run_dir: run_dir.to_path_buf(),
            step,
            tokens_seen,
            config,
            model,
            optimizer,
            corpus,
            ddp,
            world,
            pipeline,
            traffic: StepTraffic::default(),
            _lock: lock,
        })
    }

    /// Continues the run in `run_dir` from its latest checkpoint: weights, optimizer
    /// moments, loss scale, the batch stream and dropout's stream are all restored, so the
    /// continued run is bit for bit the uninterrupted one. A run that stopped before its
    /// first checkpoint starts again from step 0 of its `config.json`.
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] when the checkpoint is damaged or does not fit the run's
    /// config; [`TrainError::Data`] when the data file can no longer be read, and
    /// [`TrainError::DataChanged`] when it changed (unless `options` allow it);
    /// [`TrainError::Locked`] when another process is using the run.
    pub fn resume(run_dir: &Path, options: ResumeOptions) -> Result<Self> {
        Self::resume_on(run_dir, options, Box::new(Single::new()))
    }

    /// [`Trainer::resume`] on the ranks of `comm`, whatever the world size that wrote the
    /// checkpoint: a checkpoint holds whole tensors, and `accum` is rescaled so that the
    /// global batch stays the run's ([`TrainConfig::at_ranks`]). Every rank reads the
    /// checkpoint; rank 0 locks the run and rewrites its `config.json` when the world size
    /// changed.
    ///
    /// # Errors
    /// Those of [`Trainer::resume`]; [`TrainError::InvalidArgument`] when the global batch
    /// cannot be shared over this many ranks; [`TrainError::Ranks`] when another rank failed
    /// or read another checkpoint.
    pub fn resume_on(
        run_dir: &Path,
        options: ResumeOptions,
        comm: Box<dyn Communicator>,
    ) -> Result<Self> {
        let mut ddp = DataParallel::new(comm);
        let prepared = resume_state(run_dir, options, ddp.rank(), ddp.world_size());
        let fingerprint = prepared.as_ref().ok().map(|r| (r.config.clone(), r.step));
        let fingerprint = fingerprint.as_ref().map(|(config, step)| (config, *step));
        let parts = ranks::agree(&mut ddp, prepared, fingerprint, "resume the run")?;
        Self::assemble(run_dir, parts, ddp)
    }

    /// Ends the trainer (releasing the run's lock), handing back the ranks' communicator
    /// (all of them: the world's, when the model was split).
    pub fn into_parallel(self) -> DataParallel {
        self.world.unwrap_or(self.ddp)
    }

    /// Every rank of the run, for what they agree on between steps.
    fn world(&mut self) -> &mut DataParallel {
        self.world.as_mut().unwrap_or(&mut self.ddp)
    }

    /// Bytes this rank has sent, over every group it belongs to (and over the whole world,
    /// when its data-parallel group is not: fp8's amaxes).
    fn bytes_sent(&self) -> u64 {
        let split = self.model.tensor_split();
        let world = self
            .world
            .as_ref()
            .map_or(0, |world| world.stats().bytes_sent);
        let pipeline = self.pipeline.as_ref().map_or(0, PipelineRank::bytes_sent);
        self.ddp.stats().bytes_sent
            + split.map_or(0, |s| s.group().stats().bytes_sent)
            + world
            + pipeline
    }

    /// Time this rank has spent inside collectives, over every group it belongs to: the
    /// data-parallel group's and the tensor-parallel group's (their calls never overlap).
    fn communication_time(&self) -> Duration {
        let split = self.model.tensor_split();
        let tensor = split.map_or(Duration::ZERO, |s| s.group().communication_time());
        let pipeline = (self.pipeline.as_ref()).map_or(Duration::ZERO, |p| p.communication_time());
        self.ddp.communication_time() + tensor + pipeline
    }

    /// Whether the run has done all the steps of its config.
    pub fn is_finished(&self) -> bool {
        self.step >= self.config.steps
    }

    /// The run's config.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// The model.
    pub fn model(&self) -> &Llama<f32> {
        &self.model
    }

    /// The data being trained on.
    pub fn corpus(&self) -> &Corpus {
        &self.corpus
    }

    /// Optimizer steps taken so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The run directory.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// The run's figures so far, from its `metrics.jsonl`, with the given meter readings.
    ///
    /// # Errors
    /// [`TrainError::Io`] if the metrics cannot be read.
    pub fn summary(&self, peak_live_bytes: u64, peak_rss_bytes: Option<u64>) -> Result<RunSummary> {
        let records = read_records(&self.run_dir.join("metrics.jsonl"))?;
        Ok(RunSummary::from_records(
            &records,
            self.corpus.entropy_nats_per_byte,
            peak_live_bytes,
            peak_rss_bytes,
        ))
    }

    /// One optimizer step on `accum` fresh micro-batches: returns its record.
    ///
    /// # Errors
    /// [`TrainError::Diverged`] when the step is refused (a non-finite loss or gradient in
    /// fp32/bf16, a loss scale stuck at its floor in fp16: the weights are then unchanged)
    /// or its result is (a loss above the config's limit, a weight no longer finite: the
    /// step is not counted and nothing is saved).
    pub fn train_step(&mut self) -> Result<Record> {
        let lr = self.config.lr.at(self.step);
        self.optimizer.set_learning_rate(lr);
        let micro_batches = self.draw_micro_batches();
        let config = &self.config;
        // Each micro-batch's dropout masks come from a stream keyed by its place in the
        // global batch, so they are the same whichever rank runs it.
        let loss = |model: &Llama<f32>, micro_batch: &StepBatch| {
            model.dropout_generator().set_state(&micro_batch.dropout);
            batch_loss(model, &micro_batch.batch)
        };
        let started = Instant::now();
        let (sent_before, busy_before) = (self.bytes_sent(), self.communication_time());
        let overlapped_before = self.ddp.overlapped_communication_time();
        // The run's hardware: the step turns on its precision inside and keeps the model.
        let hardware = config.autocast();
        let stepped = match &self.pipeline {
            Some(pipeline) => pipeline.train_step(
                &self.model,
                &mut self.optimizer,
                &mut self.ddp,
                &micro_batches,
                config,
                self.scaler.as_mut(),
            ),
            None => self.optimizer.train_step(
                &mut self.ddp,
                &self.model,
                &micro_batches,
                config.sequences_per_step(),
                loss,
                config.precision,
                self.scaler.as_mut(),
                config.clip,
            ),
        };
        drop(hardware);
        // The step is over for the fp8 scales, taken or skipped: its amaxes, made global
        // over the ranks, join the histories and the next step's scales are set. A refused
        // step ends the run instead, and is not made global: a rank that failed in a
        // collective would not be there to take part.
        let made_global = match (self.fp8.clone(), &stepped) {
            (Some(state), Ok(_)) => self.fp8_made_global(&state),
            _ => Ok(()),
        };
        let fp8 = self.fp8.as_ref().map(|state| {
            let per_layer = state.borrow_mut().update();
            Fp8Counts::from_layers(&self.model.fp8_layer_names(), &per_layer)
        });
        let report = stepped.map_err(|error| self.diverged_from(error))?;
        made_global?;
        // Nothing reads the gradients after the update (the next step drops them first):
        // dropped now, they do not sit under the evaluation or the checkpoint's write.
        self.optimizer.zero_grad();
        // The check for a damaged weight is the step's last collective, when it has one.
        self.check_divergence(&report)?;
        let step_s = started.elapsed().as_secs_f64();
        self.traffic.bytes_sent += self.bytes_sent() - sent_before;
        self.traffic.comm_s += (self.communication_time() - busy_before).as_secs_f64();
        self.traffic.overlapped_s +=
            (self.ddp.overlapped_communication_time() - overlapped_before).as_secs_f64();
        self.traffic.step_s += step_s;
        self.traffic.steps += 1;
        self.step += 1;
        let tokens = self.config.tokens_per_step();
        self.tokens_seen += tokens as u64;
        let record = Record::Train {
            step: self.step,
            loss: report.loss,
            lr,
            grad_norm: report.grad_norm,
            scale: report.scale,
            skipped: report.skipped,
            underflows: report.underflows,
            tokens_per_s: tokens as f64 / step_s,
            step_s,
            time: Some(rfc3339_utc(SystemTime::now())),
            elapsed_s: Some(self.clock.elapsed_s()),
            tokens: Some(self.tokens_seen),
            fp8,
        };
        self.log(&record)?;
        Ok(record)
    }

    /// The step's fp8 amaxes and range counts in `state`, made those of every rank of the
    /// run (see [`fp8_ranks`](super::fp8_ranks)).
    fn fp8_made_global(&mut self, state: &RefCell<Fp8State>) -> Result<()> {
        let names = self.model.fp8_layer_names();
        let tensor_rank = self.model.tensor_split().map_or(0, |s| s.group().rank());
        fp8_ranks::make_global(self.world(), &mut state.borrow_mut(), &names, tensor_rank)
    }

    /// This rank's micro-batches of the next step. Every rank draws the whole global batch
    /// from the one data stream, micro-batch by micro-batch, and keeps its own: the union of
    /// the ranks' micro-batches is the batch one process would draw, and the stream's
    /// position after a step does not depend on the world size.
    fn draw_micro_batches(&self) -> Vec<StepBatch> {
        let (train, rows, context) = (
            &self.corpus.train,
            self.config.micro_batch,
            self.config.model.context,
        );
        let per_rank = self.config.accum;
        let rank = self.ddp.rank();
        (0..per_rank * self.ddp.world_size())
            .filter_map(|index| {
                if index / per_rank == rank {
                    let batch = sample_batch(train, rows, context, &self.data_rng);
                    let dropout = ranks::dropout_state(self.config.seed, self.step, index);
                    Some(StepBatch {
                        index,
                        batch,
                        dropout,
                    })
                } else {
                    skip_batch(train, rows, context, &self.data_rng);
                    None
                }
            })
            .collect()
    }

    /// Appends `record` to the run's metrics (rank 0; the other ranks keep none).
    fn log(&mut self, record: &Record) -> Result<()> {
        match &mut self.metrics {
            Some(metrics) => metrics.append(record),
            None => Ok(()),
        }
    }

    /// This process's rank in the run (0 for a single process).
    pub fn rank(&self) -> usize {
        self.world.as_ref().unwrap_or(&self.ddp).rank()
    }

    /// The number of ranks training the run.
    pub fn world_size(&self) -> usize {
        self.world.as_ref().unwrap_or(&self.ddp).world_size()
    }

    /// Every rank's peak live tensor bytes, peak process memory and communication per step,
    /// in rank order: a collective every rank must call.
    ///
    /// # Errors
    /// [`TrainError::Parallel`] if the collective fails.
    pub fn rank_reports(
        &mut self,
        peak_live_bytes: u64,
        peak_rss_bytes: Option<u64>,
    ) -> Result<Vec<RankReport>> {
        let traffic = self.traffic;
        ranks::gather_reports(self.world(), peak_live_bytes, peak_rss_bytes, traffic)
    }

    /// The last step's actions on this rank as they ran, when the model is cut into a
    /// pipeline: each forward, backward and message with its start and end.
    pub fn pipeline_timeline(&self) -> Option<tl_parallel::pipeline::Executed> {
        self.pipeline.as_ref().and_then(PipelineRank::last_step)
    }

    /// Every pipeline rank's last step as it ran, when the model is cut into a pipeline and
    /// has taken a step: a collective every rank of the pipeline calls.
    ///
    /// # Errors
    /// [`TrainError::Parallel`] when the collective fails.
    pub fn pipeline_timelines(&mut self) -> Result<Option<super::PipelineTimeline>> {
        match &self.pipeline {
            Some(pipeline) => pipeline.gather_timelines(self.step),
            None => Ok(None),
        }
    }

    /// This rank's communication during the steps this trainer took.
    pub fn traffic(&self) -> StepTraffic {
        self.traffic
    }

    /// The name of the parameter at `index` in the optimizer's list.
    fn parameter_name(&self, index: usize) -> String {
        self.model
            .named_parameters()
            .into_iter()
            .nth(index)
            .map_or_else(|| format!("#{index}"), |(name, _)| name)
    }

    /// [`TrainError::Diverged`] at the step being taken.
    fn diverged(&self, what: String) -> TrainError {
        let checkpoint = snapshot::latest_step(&self.run_dir)
            .ok()
            .flatten()
            .map(|step| self.run_dir.join(format!("checkpoint-{step:06}")));
        TrainError::Diverged {
            step: self.step + 1,
            what,
            checkpoint,
        }
    }

    /// The refusals of a mixed-precision step, as divergence of this run.
    fn diverged_from(&self, error: TrainError) -> TrainError {
        use tl_precision::PrecisionError as P;
        let error = match error {
            TrainError::Parallel(tl_parallel::ParallelError::Precision(error)) => {
                TrainError::Precision(error)
            }
            other => other,
        };
        match error {
            TrainError::Precision(P::NonFiniteLoss { loss }) => {
                self.diverged(format!("the loss is {loss}"))
            }
            TrainError::Precision(P::NonFiniteGradient { index }) => self.diverged(match index {
                Some(index) if let RunOptimizer::Zero3(zero3) = &self.optimizer => format!(
                    "the gradient of {} is not finite in rank {}'s shard",
                    self.parameter_name(zero3.parameter_of_piece(index)),
                    self.ddp.rank()
                ),
                Some(_) if matches!(self.optimizer, RunOptimizer::Zero2(_)) => format!(
                    "a gradient in rank {}'s shard is not finite",
                    self.ddp.rank()
                ),
                Some(index) => format!(
                    "the gradient of {} is not finite",
                    self.parameter_name(index)
                ),
                None => "a gradient is not finite on another rank".to_string(),
            }),
            TrainError::Precision(P::ScaleStuckAtFloor { scale, skips }) => self.diverged(format!(
                "{skips} consecutive fp16 steps overflowed with the loss scale at its floor {scale}"
            )),
            other => other,
        }
    }

    /// Refuses a step whose loss exploded or whose update left a weight that is not finite.
    fn check_divergence(&mut self, report: &StepReport) -> Result<()> {
        let limit = self.config.max_loss();
        let within = report.loss.is_finite() && report.loss <= limit;
        if !report.skipped && !within {
            return Err(self.diverged(format!(
                "the loss is {:.4}, above the limit {limit:.4} (--max-loss)",
                report.loss
            )));
        }
        if let RunOptimizer::Zero3(zero3) = &self.optimizer {
            // Each rank holds a shard (of its stages', on a pipeline): the ranks learn
            // together whether any is damaged.
            let local = zero3.nonfinite_parameter();
            let ranks = match self.pipeline {
                Some(_) => self.world(),
                None => &mut self.ddp,
            };
            if ranks::any(ranks, local.is_some())? {
                return Err(self.diverged(match local {
                    Some(index) => format!(
                        "weight {} holds a value that is not finite",
                        self.parameter_name(index)
                    ),
                    None => "a weight in another rank's shard is not finite".to_string(),
                }));
            }
            return Ok(());
        }
        let damaged = self
            .model
            .named_parameters()
            .into_iter()
            .find_map(|(name, tensor)| {
                let value = tensor.value();
                // One vectorised pass on the pool; the bad value is looked for only if any.
                let finite = array_all_finite(&value);
                let bad = (!finite).then(|| value.iter().find(|v| !v.is_finite()));
                bad.flatten()
                    .map(|bad| format!("weight {name} holds {bad}"))
            });
        if self.pipeline.is_some() {
            // Each rank holds its stages: the ranks learn together whether any is damaged.
            if ranks::any(self.world(), damaged.is_some())? {
                let what = damaged.unwrap_or_else(|| {
                    "a weight of another pipeline stage is not finite".to_string()
                });
                return Err(self.diverged(what));
            }
            return Ok(());
        }
        match damaged {
            Some(what) => Err(self.diverged(what)),
            None => Ok(()),
        }
    }

    /// The mean loss over the fixed validation windows, without dropout, under the run's
    /// precision.
    ///
    /// # Errors
    /// [`TrainError::Io`] if the record cannot be logged.
    pub fn evaluate(&mut self) -> Result<Record> {
        let val_loss = self.validation_loss()?;
        let tokens_per_byte = match self.validation_tokens_per_byte {
            Some(ratio) => ratio,
            None => {
                let ratio = tokens_per_byte(&self.validation, &run_tokenizer(&self.config)?)?;
                *self.validation_tokens_per_byte.insert(ratio)
            }
        };
        let record = Record::Eval {
            step: self.step,
            val_loss,
            val_bpb: Some(val_loss * tokens_per_byte / std::f64::consts::LN_2),
            time: Some(rfc3339_utc(SystemTime::now())),
        };
        self.log(&record)?;
        Ok(record)
    }

    /// The mean validation loss, nats per token, weighting each batch by its rows.
    ///
    /// # Errors
    /// On a pipeline, [`TrainError::Parallel`] if a message between the stages fails.
    pub fn validation_loss(&self) -> Result<f64> {
        let _no_graph = no_grad();
        let _autocast = self.config.autocast();
        self.model.set_training(false);
        // Evaluation is not a step the fp8 scales should learn from.
        let fp8_observing = |on: bool| {
            if let Some(state) = &self.fp8 {
                state.borrow_mut().observing = on;
            }
        };
        fp8_observing(false);
        let loss = match &self.pipeline {
            Some(pipeline) => pipeline.validation_loss(&self.model, &self.validation),
            None => {
                let (mut total, mut rows) = (0.0, 0);
                for batch in &self.validation {
                    let loss = self
                        .model
                        .loss(&batch.inputs, &batch.targets, batch.rows, batch.context)
                        .expect("no schedule is built without a graph");
                    total += f64::from(loss.item()) * batch.rows as f64;
                    rows += batch.rows;
                }
                Ok(total / rows as f64)
            }
        };
        fp8_observing(true);
        self.model.set_training(true);
        loss
    }

    /// Writes a checkpoint of the current step.
    ///
    /// # Errors
    /// [`TrainError::Io`]; the previous checkpoint then remains the latest.
    pub fn save(&mut self) -> Result<PathBuf> {
        // Whole tensors whatever the stage: sharded moments are gathered (every rank takes
        // part), and rank 0 writes them.
        let mut gathered = self.optimizer.gathered_state()?;
        let leader = self.metrics.is_some();
        let mut weights = self.optimizer.named_weights(&self.model, true)?;
        if let Some(split) = self.model.tensor_split() {
            // The slices of the tensor-parallel group assembled whole, on every rank of it:
            // a checkpoint does not depend on the layout that wrote it.
            let names: Vec<String> = weights.iter().map(|(name, _)| name.clone()).collect();
            let state = match gathered.take() {
                Some(state) => state,
                None => self.optimizer.whole_state(),
            };
            gathered = Some(split.gather_state(state, &names)?);
            weights = (weights.into_iter())
                .map(|(name, local)| {
                    let whole = split.gather_whole(&local, placement(&name))?;
                    Ok((name, whole))
                })
                .collect::<Result<_>>()?;
        }
        if let Some(pipeline) = &self.pipeline {
            // Every stage's tensors, broadcast from the rank that holds them.
            let names: Vec<String> = weights.iter().map(|(name, _)| name.clone()).collect();
            let state = match gathered.take() {
                Some(state) => state,
                None => self.optimizer.whole_state(),
            };
            gathered = Some(pipeline.gather_state(state, &names, leader)?);
            weights = pipeline.gather_weights(&weights, leader)?;
        }
        if !leader {
            weights.clear();
        }
        if !leader {
            return Ok(self.run_dir.join(format!("checkpoint-{:06}", self.step)));
        }
        let (adamw, moments) = match (&gathered, &self.optimizer) {
            (Some(state), _) => (
                AdamWMeta::of_state(state),
                snapshot::gathered_moments(state),
            ),
            (None, RunOptimizer::Whole(adamw)) => {
                (AdamWMeta::of_adamw(adamw), snapshot::live_moments(adamw))
            }
            (None, _) => unreachable!("only a whole optimizer has no state to gather"),
        };
        let state = RunState {
            format: FORMAT_VERSION,
            step: self.step,
            tokens_seen: self.tokens_seen,
            config: self.config.clone(),
            adamw,
            scaler: self.scaler.as_ref().map(DynamicLossScaler::state_dict),
            data_rng: self.data_rng.state(),
            dropout_rng: self.model.dropout_generator().state(),
            fp8: self.fp8.as_ref().map(|state| state.borrow().clone()),
        };
        snapshot::save(
            &self.run_dir,
            state,
            &weights,
            moments,
            self.config.keep_checkpoints,
        )
    }

    /// Checks that every rank was asked to stop after the same step (`until`, at most the
    /// run's steps): a collective every rank calls before it trains, or before it finds
    /// there is nothing to do. [`Trainer::run`] checks it too.
    ///
    /// # Errors
    /// [`TrainError::Ranks`] naming the ranks whose `--until-step` differs from rank 0's;
    /// [`TrainError::Parallel`] when the collective fails.
    pub fn agree_on_until(&mut self, until: u64) -> Result<()> {
        let until = until.min(self.config.steps);
        ranks::same_value(self.world(), until, "--until-step")
    }

    /// The largest of `value` over the run's ranks (`value` itself alone): a collective
    /// that every rank calls, as after [`Trainer::run`] stops them all for a signal that
    /// only some of them received.
    ///
    /// # Errors
    /// [`TrainError::Parallel`] when the collective fails.
    pub fn max_over_ranks(&mut self, value: u32) -> Result<u32> {
        ranks::max(self.world(), value)
    }

    /// Trains until `until` steps are done (at most the config's `steps`), evaluating and
    /// saving on the config's intervals, and always saving when it stops. When `stop` is
    /// raised (Ctrl-C), the step in progress finishes, a checkpoint is written and the run
    /// returns [`Stop::Interrupted`].
    ///
    /// # Errors
    /// Those of [`Trainer::train_step`], [`Trainer::evaluate`] and [`Trainer::save`]; the
    /// last checkpoint written stays valid.
    pub fn run(
        &mut self,
        until: u64,
        stop: &AtomicBool,
        on_event: &mut dyn FnMut(&Event),
    ) -> Result<Stop> {
        self.agree_on_until(until)?;
        let until = until.min(self.config.steps);
        while self.step < until {
            let record = self.train_step()?;
            on_event(&Event::Metric(record));
            let last = self.step == self.config.steps;
            if self.step.is_multiple_of(self.config.eval_interval) || last {
                let record = self.evaluate()?;
                on_event(&Event::Metric(record));
            }
            // The last step of this call is always saved, so stopping loses nothing. The
            // ranks stop together, after the same step, when any of them was asked to.
            let interrupted = ranks::any(self.world(), stop.load(Ordering::SeqCst))?;
            if self.step.is_multiple_of(self.config.save_interval)
                || self.step == until
                || interrupted
            {
                on_event(&Event::Saved(self.save()?));
            }
            if interrupted {
                return Ok(Stop::Interrupted);
            }
        }
        let leader = self.metrics.is_some();
        let unsaved = leader && !self.run_dir.join("LATEST").exists();
        if ranks::any(self.world(), unsaved)? {
            // Asked for no steps at all: still leave a checkpoint to resume from.
            on_event(&Event::Saved(self.save()?));
        }
        Ok(Stop::Finished)
    }
}

/// A rank's share of a run laid out on a mesh: its data-parallel group, the world when
/// that is only a group of it, its part of the model and that part's optimizer.
type MeshShare = (
    DataParallel,
    Option<DataParallel>,
    Llama<f32>,
    AdamW<f32>,
    Option<PipelineRank>,
);

/// The ranks of `world` as a mesh of data-parallel replicas of `config.parallel.tensor`
/// consecutive ranks each, and `model` and `optimizer` (whole, the same on every rank) cut
/// into this rank's part, the residual stream split too under
/// `config.parallel.sequence_parallel` (the step then sums the norms' gains' gradients
/// over the tensor-parallel group). Without tensor parallelism, everything as it was.
fn split_mesh(
    mut world: DataParallel,
    model: Llama<f32>,
    optimizer: AdamW<f32>,
    config: &TrainConfig,
) -> Result<MeshShare> {
    let (tensor, pipeline) = (config.parallel.tensor, config.parallel.pipeline);
    if tensor <= 1 && pipeline <= 1 {
        return Ok((world, None, model, optimizer, None));
    }
    let mesh = Mesh::for_world(world.world_size(), tensor, pipeline).map_err(|source| {
        tl_parallel::ParallelError::Collective {
            rank: world.rank(),
            source,
        }
    })?;
    let rank = world.rank();
    // The same splits in the same order on every rank: each is a collective of the world.
    let mut group = |axis| world.with_communicator(|comm| comm.split(&mesh.members(axis, rank)));
    let tp = (tensor > 1).then(|| group(Axis::Tensor)).transpose()?;
    let pp = (pipeline > 1).then(|| group(Axis::Pipeline)).transpose()?;
    let dp = group(Axis::Data)?;
    // The whole model's names and shapes, which checkpoints hold whatever the cut.
    let whole: Vec<(String, Vec<usize>)> = (model.named_parameters().into_iter())
        .map(|(name, tensor)| (name, tensor.shape()))
        .collect();
    let (part, adamw) = match tp {
        Some(tp) => {
            let tp = TensorParallel::new(tp);
            let part = model.tensor_parallel_with(tp, config.parallel.sequence_parallel)?;
            let names: Vec<String> = whole.iter().map(|(n, _)| n.clone()).collect();
            let split = part.tensor_split().expect("a split model");
            let state = split.slice_state(optimizer.state_dict(), &names)?;
            let mut adamw = optimizer_like(&optimizer, &part)?;
            adamw.load_state_dict(state)?;
            (part, adamw)
        }
        None => (model, optimizer),
    };
    let (part, adamw, stages) = match pp {
        Some(pp) => {
            let (stages, part, adamw) = PipelineRank::cut(pp, part, adamw, config, &whole)?;
            (part, adamw, Some(stages))
        }
        None => (part, adamw, None),
    };
    let mut ddp = DataParallel::new(dp);
    if let Some(split) = part.tensor_split() {
        let replicated = (part.named_parameters().iter())
            .map(|(name, _)| placement(name) == Placement::Replicated)
            .collect();
        ddp = ddp.with_tensor_parallel(split.group().clone(), replicated);
        let shares = part.sequence_parallel_parameters();
        if !shares.is_empty() {
            let flags = (part.parameters().iter())
                .map(|param| shares.iter().any(|share| share.same(param)))
                .collect();
            ddp = ddp.with_sequence_parallel(flags);
        }
    }
    Ok((ddp, Some(world), part, adamw, stages))
}

/// A fresh AdamW over `model`'s parameters with `like`'s hyperparameters.
pub(super) fn optimizer_like(like: &AdamW<f32>, model: &Llama<f32>) -> Result<AdamW<f32>> {
    Ok(AdamW::new(model.parameters(), like.learning_rate())?
        .with_betas(like.betas().0, like.betas().1)?
        .with_eps(like.eps())?
        .with_weight_decay(like.weight_decay())?)
}

/// The mean loss of `model` on one batch, with the graph recorded: the loss function of
/// every training step.
///
/// # Panics
/// If the model's checkpointing budget admits no schedule, which a validated
/// [`TrainConfig`] rules out.
pub fn batch_loss(model: &Llama<f32>, batch: &Batch) -> tl_tensor::Tensor<f32> {
    model
        .loss(&batch.inputs, &batch.targets, batch.rows, batch.context)
        .expect("the checkpointing schedule was validated with the config")
}

/// One optimizer step of `config`'s recipe (precision, loss scaling, clipping) on
/// `micro_batches`: tl-precision's `train_step_mixed` with the model's loss.
///
/// # Errors
/// Those of [`train_step_mixed`]; the weights are then unchanged.
pub(crate) fn mixed_step(
    model: &Llama<f32>,
    micro_batches: &[Batch],
    optimizer: &mut AdamW<f32>,
    scaler: Option<&mut DynamicLossScaler>,
    config: &TrainConfig,
) -> Result<StepReport> {
    let _hardware = config.autocast();
    Ok(train_step_mixed(
        model,
        micro_batches,
        batch_loss,
        optimizer,
        config.precision,
        scaler,
        config.clip,
    )?)
}

/// AdamW on `model`'s parameters with the config's peak learning rate, weight decay, betas
/// and epsilon.
pub(crate) fn new_optimizer(model: &Llama<f32>, config: &TrainConfig) -> Result<AdamW<f32>> {
    let AdamWConfig { beta1, beta2, eps } = config.adamw;
    Ok(AdamW::new(model.parameters(), config.lr.peak)?
        .with_weight_decay(config.weight_decay)?
        .with_betas(beta1, beta2)?
        .with_eps(eps)?)
}

/// The dynamic loss scaler an fp16 run needs, and none otherwise.
///
/// Its scale never falls below 1: below that the gradients are no longer lifted but
/// shrunk, and a scale that keeps halving only hides divergence (a run whose every step
/// overflows). `max_skipped` overflows in a row at the floor stop the run.
pub(crate) fn new_scaler(config: &TrainConfig) -> Option<DynamicLossScaler> {
    (config.precision == Precision::Fp16).then(|| {
        DynamicLossScaler::default()
            .with_floor(1.0, config.divergence.max_skipped)
            .expect("a floor of 1 below the initial scale is valid")
    })
}

/// The validation windows' predicted tokens (their targets) over the bytes of text they
/// stand for, to turn nats per token into bits per byte.
///
/// # Errors
/// [`TrainError::Data`] if the tokenizer cannot decode the ids.
fn tokens_per_byte(batches: &[Batch], tokenizer: &crate::data::Tokenizer) -> Result<f64> {
    let (mut tokens, mut bytes) = (0usize, 0usize);
    for batch in batches {
        for row in batch.targets.chunks(batch.context) {
            let ids: Vec<u32> = row.iter().map(|&id| id as u32).collect();
            tokens += ids.len();
            bytes += tokenizer.text_bytes(&ids)?;
        }
    }
    Ok(tokens as f64 / bytes.max(1) as f64)
}

fn validation_batches(corpus: &Corpus, config: &TrainConfig) -> Vec<Batch> {
    let mut batches =
        sequential_batches(&corpus.validation, config.micro_batch, config.model.context);
    batches.truncate(config.eval_batches);
    batches
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{Tokenizer, train_bpe};

    /// Bits per byte count the text the predicted tokens stand for: a byte a token for
    /// bytes; for a BPE, the decoded text's bytes, its end-of-text tokens counting none.
    #[test]
    fn tokens_per_byte_counts_the_text_the_targets_stand_for() {
        let batch = |targets: Vec<usize>, context| Batch {
            inputs: vec![0; targets.len()],
            rows: targets.len() / context,
            targets,
            context,
        };
        let bytes: Vec<usize> = b"hello world!".iter().map(|&b| usize::from(b)).collect();
        let ratio = tokens_per_byte(&[batch(bytes, 4)], &Tokenizer::Bytes).unwrap();
        assert_eq!(ratio, 1.0);

        let text = "the cat sat on the mat. the cat ate. ".repeat(20);
        let json = train_bpe([text].into_iter(), 270).unwrap();
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), &json).unwrap();
        let bpe = Tokenizer::load(file.path()).unwrap();
        let mut ids = bpe.encode("the cat sat on the mat.").unwrap();
        let (end, _) = bpe.end_of_text_token().expect("an end-of-text token");
        ids.push(end);
        let tokens = ids.len();
        let targets: Vec<usize> = ids.iter().map(|&id| id as usize).collect();
        let ratio = tokens_per_byte(&[batch(targets, tokens)], &bpe).unwrap();
        assert_eq!(
            ratio,
            tokens as f64 / "the cat sat on the mat.".len() as f64
        );
        assert!(ratio < 0.5, "{ratio}");
    }
}
