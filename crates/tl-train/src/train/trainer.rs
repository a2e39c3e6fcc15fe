//! [`Trainer`]: the training loop of `tinyllm train`, with evaluation, checkpoints and
//! exact resumption.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use tl_precision::{DynamicLossScaler, MicroBatch, Precision, StepReport, train_step_mixed};
use tl_tensor::nn::Module;
use tl_tensor::optim::{AdamW, Optimizer};
use tl_tensor::{Generator, no_grad};

use super::config::{DataSource, TrainConfig};
use super::metrics::{MetricsLog, Record, read_records};
use super::snapshot::{self, AdamWMeta, FORMAT_VERSION, RunState};
use super::summary::RunSummary;
use crate::data::{Batch, Corpus, sample_batch, sequential_batches};
use crate::error::{Result, TrainError};
use crate::model::Llama;
use crate::store::{NamedTensor, write_atomic};

impl MicroBatch for Batch {
    fn rows(&self) -> usize {
        self.rows
    }
}

/// Seeds of the run's independent random streams, derived from its one seed.
const DATA_STREAM: u64 = 0xD1B5_4A32_D192_ED03;

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
pub struct Trainer {
    config: TrainConfig,
    run_dir: PathBuf,
    model: Llama<f32>,
    optimizer: AdamW<f32>,
    scaler: Option<DynamicLossScaler>,
    corpus: Corpus,
    validation: Vec<Batch>,
    data_rng: Generator,
    step: u64,
    tokens_seen: u64,
    metrics: MetricsLog,
}

/// Loads the corpus a config names.
pub(crate) fn load_corpus(config: &TrainConfig) -> Result<Corpus> {
    Ok(match &config.data {
        DataSource::Builtin { seed, bytes } => Corpus::builtin(*seed, *bytes),
        DataSource::File { path } => Corpus::from_file(path, config.model.context)?,
    })
}

impl Trainer {
    /// A new run of `config` in `run_dir`, which must not hold a checkpoint already.
    ///
    /// Everything that can be wrong with the inputs (options, data file) is checked before
    /// the directory is created or written.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`]/[`TrainError::InvalidConfig`] for the config,
    /// [`TrainError::Data`] for the data, [`TrainError::Checkpoint`] when `run_dir` already
    /// holds a run, [`TrainError::Io`] when it cannot be written.
    pub fn new(config: TrainConfig, run_dir: &Path) -> Result<Self> {
        config.validate()?;
        let corpus = load_corpus(&config)?;
        if run_dir.join("LATEST").exists() || run_dir.join("config.json").exists() {
            return Err(TrainError::checkpoint(
                run_dir,
                "already holds a run: resume it with --resume, or choose another --out",
            ));
        }
        let model = Llama::new(&config.model, config.seed)?;
        let optimizer = new_optimizer(&model, &config)?;
        fs::create_dir_all(run_dir).map_err(|source| TrainError::io(run_dir, source))?;
        let json = serde_json::to_vec_pretty(&config).expect("the config serializes");
        write_atomic(&run_dir.join("config.json"), &json)?;
        let trainer = Self {
            scaler: new_scaler(&config),
            validation: validation_batches(&corpus, &config),
            data_rng: Generator::new(config.seed ^ DATA_STREAM),
            metrics: MetricsLog::open(run_dir, 0)?,
            run_dir: run_dir.to_path_buf(),
            config,
            model,
            optimizer,
            corpus,
            step: 0,
            tokens_seen: 0,
        };
        trainer
            .model
            .set_checkpointing(trainer.config.checkpointing);
        Ok(trainer)
    }

    /// Continues the run in `run_dir` from its latest checkpoint: weights, optimizer
    /// moments, loss scale, the batch stream and dropout's stream are all restored, so the
    /// continued run is bit for bit the uninterrupted one.
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] when there is no checkpoint or it is damaged or does not
    /// fit its config; [`TrainError::Data`] when the data file can no longer be read.
    pub fn resume(run_dir: &Path) -> Result<Self> {
        let snapshot = snapshot::load(run_dir)?;
        let state = &snapshot.state;
        let config = state.config.clone();
        config.validate()?;
        let corpus = load_corpus(&config)?;
        let model = restore_model(&snapshot)?;
        let named = model.named_parameters();
        let names: Vec<String> = named.iter().map(|(name, _)| name.clone()).collect();
        let shapes: Vec<Vec<usize>> = named.iter().map(|(_, tensor)| tensor.shape()).collect();
        let mut optimizer = new_optimizer(&model, &config)?;
        optimizer
            .load_state_dict(snapshot.adamw_state(&names, &shapes)?)
            .map_err(|error| TrainError::checkpoint(&snapshot.dir, error.to_string()))?;
        let mut scaler = new_scaler(&config);
        match (&mut scaler, &state.scaler) {
            (Some(scaler), Some(saved)) => scaler
                .load_state_dict(saved)
                .map_err(|error| TrainError::checkpoint(&snapshot.dir, error.to_string()))?,
            (None, None) => {}
            _ => {
                return Err(TrainError::checkpoint(
                    &snapshot.dir,
                    "the loss-scaler state does not match the precision",
                ));
            }
        }
        let data_rng = Generator::new(0);
        data_rng.set_state(&state.data_rng);
        model.dropout_generator().set_state(&state.dropout_rng);
        model.set_checkpointing(config.checkpointing);
        Ok(Self {
            scaler,
            validation: validation_batches(&corpus, &config),
            data_rng,
            metrics: MetricsLog::open(run_dir, state.step)?,
            run_dir: run_dir.to_path_buf(),
            step: state.step,
            tokens_seen: state.tokens_seen,
            config,
            model,
            optimizer,
            corpus,
        })
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
    /// Those of [`train_step_mixed`]: a non-finite loss or gradient in fp32/bf16, or a loss
    /// scale stuck at its floor in fp16. The weights are then unchanged.
    pub fn train_step(&mut self) -> Result<Record> {
        let lr = self.config.lr.at(self.step);
        self.optimizer.set_learning_rate(lr);
        let (train, rows, context) = (
            &self.corpus.train,
            self.config.micro_batch,
            self.config.model.context,
        );
        let micro_batches: Vec<Batch> = (0..self.config.accum)
            .map(|_| sample_batch(train, rows, context, &self.data_rng))
            .collect();
        let started = Instant::now();
        let report = mixed_step(
            &self.model,
            &micro_batches,
            &mut self.optimizer,
            self.scaler.as_mut(),
            &self.config,
        )?;
        let step_s = started.elapsed().as_secs_f64();
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
        };
        self.metrics.append(&record)?;
        Ok(record)
    }

    /// The mean loss over the fixed validation windows, without dropout, under the run's
    /// precision.
    ///
    /// # Errors
    /// [`TrainError::Io`] if the record cannot be logged.
    pub fn evaluate(&mut self) -> Result<Record> {
        let val_loss = self.validation_loss();
        let record = Record::Eval {
            step: self.step,
            val_loss,
        };
        self.metrics.append(&record)?;
        Ok(record)
    }

    /// The mean validation loss, nats per token, weighting each batch by its rows.
    pub fn validation_loss(&self) -> f64 {
        let _no_graph = no_grad();
        let _autocast = self.config.precision.autocast();
        self.model.set_training(false);
        let (mut total, mut rows) = (0.0, 0);
        for batch in &self.validation {
            let loss = self
                .model
                .loss(&batch.inputs, &batch.targets, batch.rows, batch.context)
                .expect("no schedule is built without a graph");
            total += f64::from(loss.item()) * batch.rows as f64;
            rows += batch.rows;
        }
        self.model.set_training(true);
        total / rows as f64
    }

    /// Writes a checkpoint of the current step.
    ///
    /// # Errors
    /// [`TrainError::Io`]; the previous checkpoint then remains the latest.
    pub fn save(&self) -> Result<PathBuf> {
        let named = self.model.named_parameters();
        let weights: Vec<NamedTensor> = named
            .iter()
            .map(|(name, tensor)| (name.clone(), tensor.shape(), tensor.to_vec()))
            .collect();
        let adamw = self.optimizer.state_dict();
        let state = RunState {
            format: FORMAT_VERSION,
            step: self.step,
            tokens_seen: self.tokens_seen,
            config: self.config.clone(),
            adamw: AdamWMeta {
                lr: adamw.lr,
                betas: adamw.betas,
                eps: adamw.eps,
                weight_decay: adamw.weight_decay,
                steps: adamw
                    .params
                    .iter()
                    .map(|p| p.as_ref().map_or(0, |p| p.step))
                    .collect(),
            },
            scaler: self.scaler.as_ref().map(DynamicLossScaler::state_dict),
            data_rng: self.data_rng.state(),
            dropout_rng: self.model.dropout_generator().state(),
            files: Default::default(),
        };
        snapshot::save(&self.run_dir, state, &weights, &adamw)
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
        let until = until.min(self.config.steps);
        while self.step < until {
            let record = self.train_step()?;
            on_event(&Event::Metric(record));
            let last = self.step == self.config.steps;
            if self.step.is_multiple_of(self.config.eval_interval) || last {
                let record = self.evaluate()?;
                on_event(&Event::Metric(record));
            }
            // The last step of this call is always saved, so stopping loses nothing.
            let interrupted = stop.load(Ordering::SeqCst);
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
        if !self.run_dir.join("LATEST").exists() {
            // Asked for no steps at all: still leave a checkpoint to resume from.
            on_event(&Event::Saved(self.save()?));
        }
        Ok(Stop::Finished)
    }
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

/// The model of the latest checkpoint in `run_dir`, for inference (no data, optimizer or
/// metrics are touched).
///
/// # Errors
/// [`TrainError::Checkpoint`] when there is no checkpoint or it is damaged.
pub fn load_model(run_dir: &Path) -> Result<(TrainConfig, Llama<f32>)> {
    let snapshot = snapshot::load(run_dir)?;
    let model = restore_model(&snapshot)?;
    Ok((snapshot.state.config, model))
}

/// A model of the snapshot's config holding the snapshot's weights.
fn restore_model(snapshot: &snapshot::Snapshot) -> Result<Llama<f32>> {
    let config = &snapshot.state.config;
    let model = Llama::new(&config.model, config.seed)
        .map_err(|error| TrainError::checkpoint(&snapshot.dir, error.to_string()))?;
    for (name, tensor) in model.named_parameters() {
        let values = snapshot.weight(&name, &tensor.shape())?;
        tensor.update_value(|array| {
            array
                .iter_mut()
                .zip(values)
                .for_each(|(slot, &value)| *slot = value);
        });
    }
    Ok(model)
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

/// AdamW on `model`'s parameters with the config's peak learning rate and weight decay.
pub(crate) fn new_optimizer(model: &Llama<f32>, config: &TrainConfig) -> Result<AdamW<f32>> {
    Ok(AdamW::new(model.parameters(), config.lr.peak)?.with_weight_decay(config.weight_decay)?)
}

/// The dynamic loss scaler an fp16 run needs, and none otherwise.
pub(crate) fn new_scaler(config: &TrainConfig) -> Option<DynamicLossScaler> {
    (config.precision == Precision::Fp16).then(DynamicLossScaler::default)
}

fn validation_batches(corpus: &Corpus, config: &TrainConfig) -> Vec<Batch> {
    let mut batches =
        sequential_batches(&corpus.validation, config.micro_batch, config.model.context);
    batches.truncate(config.eval_batches);
    batches
}
