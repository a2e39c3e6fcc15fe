//! [`TrainConfig`]: everything that determines a training run.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tl_precision::{Accumulation, AutocastGuard, Fp8Recipe, Precision, autocast_with};
use tl_recompute::checkpoint_schedule;

use tl_parallel::pipeline::{Schedule, ScheduleKind};

use super::schedule::LrSchedule;
use crate::error::{Result, TrainError};
use crate::model::head_loss::ChunkedLoss;
use crate::model::{Checkpointing, ModelConfig, Preset};

/// Where the training text comes from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum DataSource {
    /// The built-in grammar corpus: `bytes` bytes generated from `seed`.
    Builtin {
        /// Seed of the generator.
        seed: u64,
        /// Length of the generated text.
        bytes: usize,
    },
    /// Documents from files, tokenized by the run's tokenizer into the token cache: a UTF-8
    /// text file, a directory of `.txt` files, or a `.jsonl` file of `{"text": ...}` lines.
    File {
        /// The file or directory.
        path: PathBuf,
    },
}

/// The `tokenizer.json` a run's ids come from, and its SHA-256 when the run began.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerFile {
    /// The file, absolute.
    pub path: PathBuf,
    /// Its SHA-256, as `sha256sum` prints it.
    pub sha256: String,
}

/// Everything that determines a run: with the same config, two runs produce the same bits.
///
/// The checkpoint saves it; resuming refuses a checkpoint whose config differs from the one
/// asked for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// The preset the model came from, if any (informational: `model` is what counts).
    pub preset: Option<Preset>,
    /// The model's sizes.
    pub model: ModelConfig,
    /// The training text.
    pub data: DataSource,
    /// fp32, or bf16/fp16 autocast (fp16 with a dynamic loss scaler).
    pub precision: Precision,
    /// How autocast's products add up: in f32, or as a GPU's tensor cores do (absent from
    /// a config file: f32).
    #[serde(default, skip_serializing_if = "is_f32_accumulation")]
    pub accumulation: Accumulation,
    /// The blocks' linear layers in fp8 with delayed scaling (Transformer Engine's HYBRID
    /// recipe), on top of `precision` for every other product; absent: no fp8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<Fp8Recipe>,
    /// Rows (sequences of `model.context` tokens) per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches accumulated per optimizer step.
    pub accum: usize,
    /// How blocks keep activations for backward.
    pub checkpointing: Checkpointing,
    /// Whether the loss keeps the head's logits for backward or recomputes them block by
    /// block (the same bits either way); `auto` (the default, and what older runs read) by
    /// the vocabulary's size, see [`ChunkedLoss::resolve`].
    #[serde(default)]
    pub chunked_loss: ChunkedLoss,
    /// Optimizer steps of the whole run.
    pub steps: u64,
    /// Peak learning rate, warmup and floor.
    pub lr: LrSchedule,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// AdamW's moment decay rates and the constant added to its denominator.
    #[serde(default)]
    pub adamw: AdamWConfig,
    /// Clip the gradient's total norm to this, if set.
    pub clip: Option<f64>,
    /// Seed of the weights, the batches and dropout.
    pub seed: u64,
    /// Steps between validation losses (and the last step always).
    pub eval_interval: u64,
    /// Validation batches per evaluation (of `micro_batch` rows each).
    pub eval_batches: usize,
    /// Steps between checkpoints (and the last step always).
    pub save_interval: u64,
    /// How many of the newest checkpoints a run keeps (at least 1). More than one keeps an
    /// older state to go back to when a run diverges after its last save.
    #[serde(default = "default_keep_checkpoints")]
    pub keep_checkpoints: usize,
    /// What counts as divergence.
    #[serde(default)]
    pub divergence: Divergence,
    /// The training data's size and SHA-256 when the run began (`data` is files: see
    /// [`Inputs::fingerprint`](crate::data::Inputs::fingerprint)), so that a resume notices a
    /// file that changed under the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_file: Option<FileFingerprint>,
    /// The tokenizer, when it is not bytes (`model.vocab` is then its vocabulary, or more
    /// for an imported model whose table is padded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerFile>,
    /// The Hugging Face Llama directory the run's weights started from (`--init-from`),
    /// instead of a random initialisation; the model's sizes are its `config.json`'s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
    /// How many processes train the run, and what each keeps (data parallelism).
    #[serde(default)]
    pub parallel: Parallel,
}

/// How a run is spread over ranks (processes), each training on `micro_batch × accum`
/// sequences of every step: the global batch is `micro_batch × accum × ranks` sequences.
///
/// The run's recipe is its global batch; the ranks are where it runs. A checkpoint holds
/// whole tensors whatever the ranks and the stage, so it resumes at another world size (with
/// `accum` rescaled so the global batch stays the same) or another ZeRO stage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Parallel {
    /// Ranks that train the run.
    pub ranks: usize,
    /// The ZeRO stage: 0 (DDP: every rank keeps everything), 1 (AdamW's moments and update
    /// partitioned over the ranks), 2 (the gradients too), 3 (the parameters too).
    pub zero: u8,
    /// Bytes of gradients per collective of the reduction (PyTorch DDP's
    /// `bucket_cap_mb`): fewer, larger messages, or gradients freed sooner under ZeRO-2.
    #[serde(default = "default_bucket_bytes")]
    pub bucket_bytes: usize,
    /// Whether the gradients' reduction overlaps the last micro-batch's backward: each
    /// bucket reduced on a communication thread as soon as backward has produced it (as
    /// PyTorch DDP does), instead of all of them after backward. The same bits either way;
    /// a rank holds up to two buckets more while they are under way. `true` (the default)
    /// is not written.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub overlap: bool,
    /// Ranks each layer is split over (tensor parallelism, Megatron's layout): the `ranks`
    /// form `ranks / tensor` data-parallel replicas of `tensor` consecutive ranks each. 1
    /// (the default, not written) splits nothing.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub tensor: usize,
    /// Sequence parallelism (Korthikanti et al. 2022), with `tensor` > 1: the residual
    /// stream between the split layers is split over the tensor-parallel group too, each
    /// rank holding its rows of the tokens, so the norms, dropout and residual adds run on
    /// `1/tensor` of them. It changes where the activations live, not what the run
    /// computes: a checkpoint does not depend on it. `false` (the default) is not written.
    #[serde(default, skip_serializing_if = "is_false")]
    pub sequence_parallel: bool,
    /// Pipeline stages' ranks: the model's blocks cut into `pipeline · stages_per_rank`
    /// consecutive stages, each micro-batch streamed through them by `schedule`. 1 (the
    /// default, not written) cuts nothing.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub pipeline: usize,
    /// The pipeline's schedule (`gpipe`, `1f1b`, `interleaved`, `zb-h1`), with
    /// `pipeline` > 1.
    #[serde(
        default = "default_schedule",
        with = "schedule_name",
        skip_serializing_if = "is_default_schedule"
    )]
    pub schedule: ScheduleKind,
    /// Stages on each pipeline rank (`v`): above 1 only for the interleaved schedule.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub stages_per_rank: usize,
    /// The first block of each stage past the first (`--pp-split`); absent: balanced by
    /// parameter count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline_split: Option<Vec<usize>>,
}

fn default_schedule() -> ScheduleKind {
    ScheduleKind::OneFOneB
}

fn is_default_schedule(kind: &ScheduleKind) -> bool {
    *kind == default_schedule()
}

/// A schedule as the name the CLI takes.
mod schedule_name {
    use serde::{Deserialize, Deserializer, Serializer};
    use tl_parallel::pipeline::ScheduleKind;

    pub fn serialize<S: Serializer>(kind: &ScheduleKind, out: S) -> Result<S::Ok, S::Error> {
        out.serialize_str(kind.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(input: D) -> Result<ScheduleKind, D::Error> {
        let name = String::deserialize(input)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

fn is_false(on: &bool) -> bool {
    !on
}

fn is_true(on: &bool) -> bool {
    *on
}

fn yes() -> bool {
    true
}

fn default_bucket_bytes() -> usize {
    tl_parallel::DEFAULT_BUCKET_BYTES
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

impl Parallel {
    /// Data-parallel replicas: `ranks / (tensor · pipeline)`, the ranks that split the
    /// global batch.
    pub fn data_parallel(&self) -> usize {
        self.ranks / (self.tensor.max(1) * self.pipeline.max(1))
    }

    /// Pipeline stages in all: `pipeline · stages_per_rank`.
    pub fn stages(&self) -> usize {
        self.pipeline * self.stages_per_rank
    }
}

impl Default for Parallel {
    fn default() -> Self {
        Self {
            ranks: 1,
            zero: 0,
            bucket_bytes: default_bucket_bytes(),
            overlap: true,
            tensor: 1,
            sequence_parallel: false,
            pipeline: 1,
            schedule: default_schedule(),
            stages_per_rank: 1,
            pipeline_split: None,
        }
    }
}

impl TrainConfig {
    /// A config read from a file, JSON or (by its `.toml` extension) TOML, in the schema of
    /// the `config.json` a run writes: a run's own config fed back starts the same run.
    ///
    /// A file need not name every key: what it leaves out is the defaults of its `preset`
    /// (of `small` when it names none), as `tinyllm train --preset` would give them, and
    /// what follows the run's length or learning rate follows the file's (as with the flags
    /// `--steps` and `--lr`: the schedule's length, warmup and intervals; the final
    /// learning rate). A model whose sizes are not its preset's is a custom one (`preset`
    /// is cleared). Every key must be one of the schema's; a top-level `tinyllm` key (the
    /// version that wrote a run's `config.json`) is ignored. The sizes are checked when a
    /// run starts ([`TrainConfig::validate`]).
    ///
    /// # Errors
    /// [`TrainError::Io`] when the file cannot be read; [`TrainError::FileTooLarge`] past
    /// [`limits::MAX_CONFIG_FILE_BYTES`]; [`TrainError::ConfigFile`] naming
    /// the key (`model.d_model`, or the top level) when it is malformed, has an unknown key
    /// or a value of the wrong type.
    pub fn from_file(path: &std::path::Path) -> Result<Self> {
        Self::from_file_naming_model(path).map(|(config, _)| config)
    }

    /// [`TrainConfig::from_file`], and whether the file names the model: a `preset` key, or
    /// a size of `[model]` (its `dropout` is the recipe's, not the model's size).
    ///
    /// # Errors
    /// As [`TrainConfig::from_file`].
    pub fn from_file_naming_model(path: &std::path::Path) -> Result<(Self, bool)> {
        let bytes = crate::store::read_bounded(path, limits::MAX_CONFIG_FILE_BYTES, "--config")?;
        let refuse = |key: String, reason: String| TrainError::ConfigFile {
            path: path.to_path_buf(),
            key: if key == "." || key.is_empty() {
                "the top level".into()
            } else {
                key
            },
            reason,
        };
        let text = String::from_utf8(bytes)
            .map_err(|e| refuse(String::new(), format!("not UTF-8 text ({e})")))?;
        let toml = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("toml"));
        let mut file: serde_json::Value = if toml {
            let table: toml::Table = toml::from_str(&text)
                .map_err(|e| refuse(String::new(), e.message().to_string()))?;
            // JSON has no NaN or infinity: converted, they would become `null`, and the
            // error would speak of a type instead of the value.
            if let Some((key, value)) = non_finite_float(&table) {
                return Err(refuse(
                    key,
                    format!("{value} is not a finite number, which this key needs"),
                ));
            }
            serde_json::to_value(table).map_err(|e| refuse(String::new(), e.to_string()))?
        } else {
            super::run_config::parse_json(text.as_bytes())
                .map_err(|e| refuse(String::new(), e.to_string()))?
        };
        // The `tinyllm` key a run's `config.json` carries names the build that wrote it: it
        // is not part of the config (see `run_config`).
        super::run_config::strip_build_key(&mut file);
        let Some(keys) = file.as_object() else {
            return Err(refuse(String::new(), "expected a table of keys".into()));
        };
        let preset = match keys.get("preset") {
            Some(serde_json::Value::Null) => None,
            Some(value) => Some(
                serde_path_to_error::deserialize::<_, Preset>(value)
                    .map_err(|e| refuse("preset".into(), e.inner().to_string()))?,
            ),
            None => None,
        };
        let base = TrainConfig::for_preset(preset.unwrap_or(Preset::Small));
        let mut merged = serde_json::to_value(&base).expect("a config serializes");
        merge(&mut merged, &file);
        let given = |keys: &[&str]| {
            keys.iter()
                .try_fold(&file, |value, key| value.get(key))
                .is_some()
        };
        let mut config: TrainConfig = serde_path_to_error::deserialize(merged)
            .map_err(|e| refuse(e.path().to_string(), e.inner().to_string()))?;
        // What the file left out follows what it set, as with the flags.
        if given(&["steps"]) {
            let steps = config.steps;
            if !given(&["lr", "total"]) {
                config.lr.total = steps;
            }
            if !given(&["lr", "warmup"]) {
                config.lr.warmup = default_warmup(steps);
            }
            if !given(&["eval_interval"]) {
                config.eval_interval = default_eval_interval(steps);
            }
            if !given(&["save_interval"]) {
                config.save_interval = default_save_interval(steps);
            }
        }
        if given(&["lr", "peak"]) && !given(&["lr", "min"]) {
            config.lr.min = config.lr.peak / 10.0;
        }
        let sizes = |model: &ModelConfig| ModelConfig {
            dropout: 0.0,
            ..model.clone()
        };
        if config
            .preset
            .is_some_and(|preset| sizes(&preset.config()) != sizes(&config.model))
        {
            config.preset = None;
        }
        let names_model = given(&["preset"])
            || file
                .get("model")
                .and_then(serde_json::Value::as_object)
                .is_some_and(|model| model.keys().any(|key| key != "dropout"));
        Ok((config, names_model))
    }
}

/// The first float of `table` that is NaN or infinite, with its key path (`lr.peak`).
fn non_finite_float(table: &toml::Table) -> Option<(String, f64)> {
    fn walk(value: &toml::Value, path: &str) -> Option<(String, f64)> {
        match value {
            toml::Value::Float(x) if !x.is_finite() => Some((path.to_string(), *x)),
            toml::Value::Table(table) => table
                .iter()
                .find_map(|(key, value)| walk(value, &format!("{path}.{key}"))),
            toml::Value::Array(items) => items
                .iter()
                .enumerate()
                .find_map(|(index, item)| walk(item, &format!("{path}[{index}]"))),
            _ => None,
        }
    }
    table.iter().find_map(|(key, value)| walk(value, key))
}

/// Lays `over` onto `base`: tables merge key by key, anything else replaces. A table that
/// names one variant of an enum (`{"file": {...}}` over `{"builtin": {...}}`) replaces
/// the other variant instead of joining it.
fn merge(base: &mut serde_json::Value, over: &serde_json::Value) {
    use serde_json::Value::Object;
    match (base, over) {
        (Object(base), Object(over))
            if !(base.len() == 1 && over.len() == 1 && base.keys().ne(over.keys())) =>
        {
            for (key, value) in over {
                match base.get_mut(key) {
                    Some(slot) => merge(slot, value),
                    None => {
                        base.insert(key.clone(), value.clone());
                    }
                }
            }
        }
        (base, over) => *base = over.clone(),
    }
}

/// Warmup steps of a run of `steps` steps, unless given: a tenth of the run.
pub(crate) fn default_warmup(steps: u64) -> u64 {
    (steps / 10).max(1).min(steps)
}

/// Steps between validation losses, unless given: ten over the run.
pub(crate) fn default_eval_interval(steps: u64) -> u64 {
    (steps / 10).max(1)
}

/// Steps between checkpoints, unless given: four over the run.
pub(crate) fn default_save_interval(steps: u64) -> u64 {
    (steps / 4).max(1)
}

/// AdamW's hyperparameters other than the learning rate and the weight decay, as
/// PyTorch's `torch.optim.AdamW(betas=(beta1, beta2), eps=eps)` takes them.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamWConfig {
    /// Decay rate of the first moment (the gradient's running mean), in `[0, 1)`.
    pub beta1: f64,
    /// Decay rate of the second moment (the squared gradient's running mean), in `[0, 1)`.
    pub beta2: f64,
    /// Added to the second moment's square root in the update's denominator, in `(0, 1]`.
    pub eps: f64,
}

impl Default for AdamWConfig {
    /// PyTorch's defaults: `betas=(0.9, 0.999), eps=1e-8`.
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

/// The highest ZeRO stage `tinyllm train` runs.
pub const MAX_ZERO_STAGE: u8 = 3;

/// When a run stops as diverged instead of training on.
///
/// A taken step whose loss is NaN, infinite or above `max_loss`, or a weight that is no
/// longer finite, stops the run; so do `max_skipped` consecutive fp16 steps skipped with the
/// loss scale at its floor of 1 (the scale can fall no further: the gradients overflow
/// whatever it is).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Divergence {
    /// A loss above this, nats per token, is divergence; `None`: twice the loss of guessing
    /// uniformly, `2·ln(vocab)` (11.1 for bytes), which no run that learns comes near.
    pub max_loss: Option<f64>,
    /// Consecutive skipped fp16 steps at the floor scale that stop the run.
    pub max_skipped: u32,
}

impl Default for Divergence {
    fn default() -> Self {
        Self {
            max_loss: None,
            max_skipped: 10,
        }
    }
}

fn default_keep_checkpoints() -> usize {
    2
}

fn is_f32_accumulation(accumulation: &Accumulation) -> bool {
    *accumulation == Accumulation::F32
}

/// A file's size and SHA-256.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileFingerprint {
    /// Bytes in the file.
    pub bytes: u64,
    /// Its SHA-256, as `sha256sum` prints it.
    pub sha256: String,
}

impl FileFingerprint {
    /// `N bytes, SHA-256 H`, for messages.
    pub fn describe(&self) -> String {
        format!("{} bytes, SHA-256 {}", self.bytes, self.sha256)
    }

    /// The fingerprint of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self {
            bytes: bytes.len() as u64,
            sha256: crate::store::fingerprint(bytes),
        }
    }
}

/// Bounds that keep a flag from overflowing a size or asking for more memory than any
/// machine of the kind this trains on has; the memory a step needs is checked against the
/// machine separately (`Trainer::new`).
pub mod limits {
    /// Tokens in one micro-batch (`micro_batch · context`).
    pub const MAX_MICRO_BATCH_TOKENS: usize = 1 << 24;
    /// Micro-batches per step.
    pub const MAX_ACCUM: usize = 1 << 16;
    /// Bytes of built-in training text (held in memory).
    pub const MAX_CORPUS_BYTES: usize = 1 << 30;
    /// Bytes of training text read from files (tokenized into a memory-mapped cache, so
    /// not held in memory): a bound that only a mistake reaches.
    pub const MAX_DATA_BYTES: u64 = 1 << 40;
    /// Checkpoints kept.
    pub const MAX_KEEP_CHECKPOINTS: usize = 1000;
    /// Optimizer steps of a run (and the eval and save intervals).
    pub const MAX_STEPS: u64 = 1 << 40;
    /// Peak learning rate: far past any that trains, so only a typo crosses it.
    pub const MAX_LR: f64 = 1e6;
    /// AdamW's decoupled weight decay.
    pub const MAX_WEIGHT_DECAY: f64 = 1e6;
    /// Gradient-norm clip.
    pub const MAX_CLIP: f64 = 1e12;
    /// Ranks of one run.
    pub const MAX_RANKS: usize = 1 << 12;
    /// Bytes of one bucket of gradients.
    pub const MAX_BUCKET_BYTES: usize = 1 << 32;
    /// `--max-loss`, nats per token.
    pub const MAX_LOSS_LIMIT: f64 = 1e6;
    /// Bytes of a config file, `--config` or a run's `config.json`: a config is a few hundred
    /// bytes, and the bound keeps `--config /dev/zero` from filling the memory.
    pub const MAX_CONFIG_FILE_BYTES: u64 = 1 << 20;
    /// Bytes of a `--prompt-file` (its bytes are the prompt's tokens).
    pub const MAX_PROMPT_FILE_BYTES: u64 = 1 << 24;
}

impl TrainConfig {
    /// The autocast of the run's precision on the run's accumulation model, until the guard
    /// drops (`None` in fp32). Steps turn on their precision inside it and keep the model.
    pub fn autocast(&self) -> Option<AutocastGuard> {
        self.precision
            .format()
            .map(|format| autocast_with(format, self.accumulation))
    }

    /// The defaults of `tinyllm train` for `preset`: the mixed recipe's batch of
    /// 8 × 4 sequences, fp32, no checkpointing, the built-in corpus.
    pub fn for_preset(preset: Preset) -> Self {
        let (steps, peak) = match preset {
            Preset::Tiny => (40, 3e-3),
            Preset::Small => (200, 2e-3),
            Preset::Capstone => (2000, 1e-3),
        };
        let warmup = default_warmup(steps);
        TrainConfig {
            preset: Some(preset),
            model: preset.config(),
            data: DataSource::Builtin {
                seed: 0,
                bytes: 2_000_000,
            },
            precision: Precision::Fp32,
            accumulation: Accumulation::F32,
            fp8: None,
            micro_batch: 8,
            accum: 4,
            checkpointing: Checkpointing::Off,
            chunked_loss: ChunkedLoss::Auto,
            steps,
            lr: LrSchedule {
                peak,
                min: peak / 10.0,
                warmup,
                total: steps,
            },
            weight_decay: 0.01,
            adamw: AdamWConfig::default(),
            clip: Some(1.0),
            seed: 0,
            eval_interval: default_eval_interval(steps),
            eval_batches: 4,
            save_interval: default_save_interval(steps),
            keep_checkpoints: default_keep_checkpoints(),
            divergence: Divergence::default(),
            data_file: None,
            tokenizer: None,
            init_from: None,
            parallel: Parallel::default(),
        }
    }

    /// Whether a tokenizer of `tokens` ids fits the model's table: exactly, or, for a model
    /// imported with `--init-from`, whose table may be padded, at most.
    pub fn takes_tokenizer_of(&self, tokens: usize) -> bool {
        match self.init_from {
            Some(_) => tokens <= self.model.vocab,
            None => tokens == self.model.vocab,
        }
    }

    /// Sequences per optimizer step, over all ranks: the global batch.
    pub fn sequences_per_step(&self) -> usize {
        self.micro_batch * self.accum * self.parallel.data_parallel()
    }

    /// Tokens per optimizer step, over all ranks.
    pub fn tokens_per_step(&self) -> usize {
        self.sequences_per_step() * self.model.context
    }

    /// The same run at `ranks` ranks: `accum` rescaled so that the global batch, and with it
    /// every step, stays the same.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`] when the global batch's micro-batches cannot be
    /// shared equally over `ranks` (choose `--micro-batch` so they can).
    pub fn at_ranks(&self, ranks: usize) -> Result<Self> {
        self.at_layout(ranks, 1, 1)
    }

    /// The same run at `ranks` ranks split into tensor-parallel groups of `tensor` and
    /// pipelines of `pipeline` stages' ranks: `accum` rescaled over the
    /// `ranks / (tensor · pipeline)` data-parallel replicas so that the global batch stays
    /// the same. Back at `pipeline` 1 the pipeline's schedule and split are dropped.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`] when `tensor · pipeline` does not divide `ranks`, or
    /// the global batch's micro-batches cannot be shared equally over the replicas.
    pub fn at_layout(&self, ranks: usize, tensor: usize, pipeline: usize) -> Result<Self> {
        if tensor == 0 || ranks == 0 || !ranks.is_multiple_of(tensor) {
            return Err(TrainError::InvalidArgument {
                name: "tp",
                value: tensor.to_string(),
                reason: format!(
                    "{ranks} ranks cannot be split into tensor-parallel groups of {tensor}"
                ),
            });
        }
        if pipeline == 0 || !ranks.is_multiple_of(tensor * pipeline) {
            return Err(TrainError::InvalidArgument {
                name: "pp",
                value: pipeline.to_string(),
                reason: format!(
                    "{ranks} ranks cannot form pipelines of {pipeline} stages' ranks \
                     (with tensor-parallel groups of {tensor})"
                ),
            });
        }
        let replicas = ranks / (tensor * pipeline);
        let micro_batches = self.accum * self.parallel.data_parallel();
        if !micro_batches.is_multiple_of(replicas) {
            return Err(TrainError::InvalidArgument {
                name: "ranks",
                value: ranks.to_string(),
                reason: format!(
                    "the run's global batch is {micro_batches} micro-batches of {} sequences, \
                     which {replicas} data-parallel replicas cannot share equally",
                    self.micro_batch
                ),
            });
        }
        let mut config = self.clone();
        config.accum = micro_batches / replicas;
        config.parallel.ranks = ranks;
        config.parallel.tensor = tensor;
        // Nothing to split the residual stream over without a tensor-parallel group.
        config.parallel.sequence_parallel &= tensor > 1;
        if pipeline != config.parallel.pipeline {
            // Another pipeline's cut and interleaving would not fit this one.
            config.parallel.pipeline_split = None;
            config.parallel.stages_per_rank = 1;
            if pipeline == 1 {
                config.parallel.schedule = default_schedule();
            }
        }
        config.parallel.pipeline = pipeline;
        Ok(config)
    }

    /// The loss above which a step counts as divergence: [`Divergence::max_loss`], or
    /// `2·ln(vocab)`.
    pub fn max_loss(&self) -> f64 {
        self.divergence
            .max_loss
            .unwrap_or(2.0 * (self.model.vocab as f64).ln())
    }

    /// Checks every option, naming the first that is out of range.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`] or [`TrainError::InvalidConfig`].
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        let invalid = |name: &'static str, value: String, reason: &str| {
            Err(TrainError::InvalidArgument {
                name,
                value,
                reason: reason.to_string(),
            })
        };
        if self.micro_batch == 0 {
            return invalid("micro-batch", "0".into(), "must be at least 1");
        }
        let micro_batch_tokens = self.micro_batch.checked_mul(self.model.context);
        if micro_batch_tokens.is_none_or(|t| t > limits::MAX_MICRO_BATCH_TOKENS) {
            return invalid(
                "micro-batch",
                self.micro_batch.to_string(),
                &format!(
                    "micro-batch x context must be at most {} tokens",
                    limits::MAX_MICRO_BATCH_TOKENS
                ),
            );
        }
        if !(1..=limits::MAX_ACCUM).contains(&self.accum) {
            return invalid(
                "accum",
                self.accum.to_string(),
                &format!("must be in 1..={}", limits::MAX_ACCUM),
            );
        }
        if !(1..=limits::MAX_STEPS).contains(&self.steps) {
            return invalid(
                "steps",
                self.steps.to_string(),
                &format!("must be in 1..={}", limits::MAX_STEPS),
            );
        }
        if self.lr.warmup > self.steps {
            return invalid(
                "warmup",
                self.lr.warmup.to_string(),
                &format!("must not exceed the run's {} steps", self.steps),
            );
        }
        if !(1..=limits::MAX_KEEP_CHECKPOINTS).contains(&self.keep_checkpoints) {
            return invalid(
                "keep-checkpoints",
                self.keep_checkpoints.to_string(),
                &format!("must be in 1..={}", limits::MAX_KEEP_CHECKPOINTS),
            );
        }
        if let Some(max_loss) = self.divergence.max_loss
            && !(max_loss > 0.0 && max_loss <= limits::MAX_LOSS_LIMIT)
        {
            return invalid(
                "max-loss",
                max_loss.to_string(),
                &format!("must be positive and at most {}", limits::MAX_LOSS_LIMIT),
            );
        }
        if self.divergence.max_skipped == 0 {
            return invalid("max-skipped", "0".into(), "must be at least 1");
        }
        let LrSchedule { peak, min, .. } = self.lr;
        if !(peak > 0.0 && peak <= limits::MAX_LR) {
            return invalid(
                "lr",
                peak.to_string(),
                &format!("must be positive and at most {}", limits::MAX_LR),
            );
        }
        if !(min.is_finite() && (0.0..=peak).contains(&min)) {
            return invalid("min-lr", min.to_string(), "must be in [0, lr]");
        }
        if !(0.0..=limits::MAX_WEIGHT_DECAY).contains(&self.weight_decay) {
            return invalid(
                "weight-decay",
                self.weight_decay.to_string(),
                &format!("must be in [0, {}]", limits::MAX_WEIGHT_DECAY),
            );
        }
        for (name, beta) in [
            ("adam-beta1", self.adamw.beta1),
            ("adam-beta2", self.adamw.beta2),
        ] {
            if !(0.0..1.0).contains(&beta) {
                return invalid(name, beta.to_string(), "must be in [0, 1)");
            }
        }
        // The update divides by sqrt(v) + eps in f32: an eps below f32's smallest normal
        // number is 0 or subnormal there, and a weight whose moments are both 0 then gets
        // 0/0.
        if !(self.adamw.eps >= f64::from(f32::MIN_POSITIVE) && self.adamw.eps <= 1.0) {
            return invalid(
                "adam-epsilon",
                self.adamw.eps.to_string(),
                "must be in [1.2e-38, 1]: smaller is 0 or subnormal in f32",
            );
        }
        if let Some(clip) = self.clip
            && !(clip > 0.0 && clip <= limits::MAX_CLIP)
        {
            return invalid(
                "clip",
                clip.to_string(),
                &format!("must be positive and at most {}", limits::MAX_CLIP),
            );
        }
        for (name, interval) in [
            ("eval-interval", self.eval_interval),
            ("save-interval", self.save_interval),
        ] {
            if !(1..=limits::MAX_STEPS).contains(&interval) {
                return invalid(
                    name,
                    interval.to_string(),
                    &format!("must be in 1..={}", limits::MAX_STEPS),
                );
            }
        }
        if !(1..=limits::MAX_RANKS).contains(&self.parallel.ranks) {
            return invalid(
                "ranks",
                self.parallel.ranks.to_string(),
                &format!("must be in 1..={}", limits::MAX_RANKS),
            );
        }
        if self
            .accum
            .checked_mul(self.parallel.ranks)
            .is_none_or(|a| a > limits::MAX_ACCUM)
        {
            return invalid(
                "accum",
                self.accum.to_string(),
                &format!(
                    "accum x ranks must be at most {} micro-batches per step",
                    limits::MAX_ACCUM
                ),
            );
        }
        if !(4..=limits::MAX_BUCKET_BYTES).contains(&self.parallel.bucket_bytes) {
            return invalid(
                "bucket-mib",
                format!("{} bytes", self.parallel.bucket_bytes),
                &format!(
                    "must hold one gradient (4 bytes) and at most {} MiB",
                    limits::MAX_BUCKET_BYTES >> 20
                ),
            );
        }
        let tensor = self.parallel.tensor;
        if tensor == 0 || !self.parallel.ranks.is_multiple_of(tensor) {
            return invalid(
                "tp",
                tensor.to_string(),
                &format!(
                    "the {} ranks must form tensor-parallel groups of this size: it must \
                     divide them",
                    self.parallel.ranks
                ),
            );
        }
        if tensor > 1 {
            for (field, size) in [
                ("n_heads", self.model.n_heads),
                ("hidden", self.model.hidden),
                ("vocab", self.model.vocab),
            ] {
                if !size.is_multiple_of(tensor) {
                    return Err(TrainError::InvalidConfig {
                        field,
                        value: size.to_string(),
                        reason: format!(
                            "tensor parallelism over {tensor} ranks splits it into {tensor} \
                             equal parts, so it must be divisible by {tensor}"
                        ),
                    });
                }
            }
            let kv_heads = self.model.kv_heads();
            if !kv_heads.is_multiple_of(tensor) {
                return Err(TrainError::InvalidConfig {
                    field: "n_kv_heads",
                    value: kv_heads.to_string(),
                    reason: format!(
                        "tensor parallelism over {tensor} ranks divides the key/value heads \
                         among them with their query heads (it does not replicate them), so \
                         their number must be divisible by {tensor}"
                    ),
                });
            }
        }
        if self.model.tie_embeddings && (self.parallel.pipeline > 1 || self.parallel.zero == 3) {
            let (name, value) = match self.parallel.pipeline {
                1 => ("zero", "3".to_string()),
                pipeline => ("pp", pipeline.to_string()),
            };
            return invalid(
                name,
                value,
                "a tied head shares the embedding's table, which this layout would hold in \
                 two places (the first and the last pipeline stage, or ZeRO-3's first and last \
                 unit) with no step to keep them one: untie the head (no \
                 --tie-embeddings) or choose another layout",
            );
        }
        if self.parallel.sequence_parallel && tensor <= 1 {
            return invalid(
                "sequence-parallel",
                "on".into(),
                &format!(
                    "splits the residual stream over the tensor-parallel group, so it \
                     requires --tp > 1, and the run has --tp {tensor}"
                ),
            );
        }
        if self.parallel.sequence_parallel && !self.model.context.is_multiple_of(tensor) {
            // Every batch, a validation batch of fewer rows included, then splits evenly.
            return Err(TrainError::InvalidConfig {
                field: "context",
                value: self.model.context.to_string(),
                reason: format!(
                    "sequence parallelism over {tensor} ranks gives each rank 1/{tensor} of \
                     every batch's tokens, so the context must be divisible by {tensor}"
                ),
            });
        }
        self.validate_pipeline()?;
        if self.parallel.zero > MAX_ZERO_STAGE {
            return invalid(
                "zero",
                self.parallel.zero.to_string(),
                &format!("tinyllm train runs ZeRO stages 0 to {MAX_ZERO_STAGE}"),
            );
        }
        if self.accumulation != Accumulation::F32 {
            let value = self.accumulation.to_string();
            let Some(format) = self.precision.format() else {
                return invalid(
                    "accumulate",
                    value,
                    "a tensor-core or AMX model multiplies 16-bit operands: add --bf16 or --fp16",
                );
            };
            if self.accumulation.block_fma().is_err() {
                return invalid(
                    "accumulate",
                    value,
                    "a tensor-core block must be 1 to 65536 products with 0 to 40 extra bits",
                );
            }
            if !self.accumulation.supports(format) {
                let reason = if self.accumulation == Accumulation::Amx {
                    "AMX-BF16 tiles multiply bf16 operands only: use --bf16"
                } else {
                    "V100 tensor cores have no bf16 mode: use --fp16, or a100/h100"
                };
                return invalid("accumulate", value, reason);
            }
        }
        if let Some(recipe) = &self.fp8 {
            recipe.validate()?;
            if self.accumulation != Accumulation::F32 {
                return invalid(
                    "fp8",
                    self.accumulation.to_string(),
                    "the tensor-core and AMX models are those of 16-bit inputs; fp8 products add \
                     up in f32 here (--accumulate f32)",
                );
            }
        }
        if self.eval_batches == 0 {
            return invalid("eval-batches", "0".into(), "must be at least 1");
        }
        if let DataSource::Builtin { bytes, .. } = self.data
            && bytes > limits::MAX_CORPUS_BYTES
        {
            return invalid(
                "corpus-bytes",
                bytes.to_string(),
                &format!("must be at most {} (1 GiB)", limits::MAX_CORPUS_BYTES),
            );
        }
        if let DataSource::Builtin { bytes, .. } = self.data
            && bytes < 20 * (self.model.context + 1)
        {
            return invalid(
                "corpus-bytes",
                bytes.to_string(),
                "the built-in corpus needs at least 20 windows of context + 1 bytes",
            );
        }
        if let Checkpointing::Budget(budget) = self.checkpointing {
            if budget > self.model.n_layers {
                return invalid(
                    "checkpoint-budget",
                    budget.to_string(),
                    &format!("must be at most the model's {} layers", self.model.n_layers),
                );
            }
            checkpoint_schedule(self.model.n_layers, budget)?;
        }
        Ok(())
    }
}

#[cfg(test)]
impl TrainConfig {
    /// The tiny preset on 20 kB of built-in text, 2 × 2 sequences per step: the smallest run
    /// the unit tests of several modules train.
    pub(crate) fn tiny_for_tests() -> Self {
        TrainConfig {
            data: DataSource::Builtin {
                seed: 0,
                bytes: 20_000,
            },
            micro_batch: 2,
            accum: 2,
            ..TrainConfig::for_preset(Preset::Tiny)
        }
    }
}

impl TrainConfig {
    /// The pipeline's schedule for one step: `pipeline` ranks, this run's micro-batches
    /// (`accum`, each data-parallel replica's), `stages_per_rank` stages a rank.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`] naming `accum` (or `stages-per-rank`) when the
    /// schedule cannot be made of these sizes, with the generator's reason.
    pub fn pipeline_schedule(&self) -> Result<Schedule> {
        let parallel = &self.parallel;
        Schedule::new(
            parallel.schedule,
            parallel.pipeline,
            self.accum,
            parallel.stages_per_rank,
        )
        .map_err(|error| TrainError::InvalidArgument {
            name: match &error {
                tl_parallel::pipeline::ScheduleError::Invalid {
                    what: "stages per rank",
                    ..
                } => "stages-per-rank",
                _ => "accum",
            },
            value: match &error {
                tl_parallel::pipeline::ScheduleError::Invalid { value, .. } => value.to_string(),
                _ => self.accum.to_string(),
            },
            reason: format!(
                "{error} (the step's micro-batches are what streams through the pipeline)"
            ),
        })
    }

    /// The pipeline's options, with `pipeline` > 1: a schedule that can be made and run,
    /// and a cut of the blocks.
    fn validate_pipeline(&self) -> Result<()> {
        let parallel = &self.parallel;
        let pipeline = parallel.pipeline;
        let invalid = |name: &'static str, value: String, reason: String| {
            Err(TrainError::InvalidArgument {
                name,
                value,
                reason,
            })
        };
        if pipeline == 0
            || !parallel
                .ranks
                .is_multiple_of(pipeline * parallel.tensor.max(1))
        {
            return invalid(
                "pp",
                pipeline.to_string(),
                format!(
                    "the {} ranks must form pipelines of this many ranks (times --tp {}): it \
                     must divide them",
                    parallel.ranks, parallel.tensor
                ),
            );
        }
        if pipeline == 1 {
            if parallel.stages_per_rank != 1 || parallel.pipeline_split.is_some() {
                return invalid(
                    "pp",
                    "1".into(),
                    "--stages-per-rank and --pp-split cut a pipeline: add --pp > 1".into(),
                );
            }
            return Ok(());
        }
        self.pipeline_schedule()?;
        crate::model::pipeline::stage_blocks(
            &self.model,
            parallel.stages(),
            parallel.pipeline_split.as_deref(),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_default_is_valid() {
        for preset in Preset::ALL {
            let config = TrainConfig::for_preset(preset);
            config.validate().unwrap();
            assert_eq!(config.lr.total, config.steps);
        }
        // 8 rows × 4 micro-batches × 512 tokens
        assert_eq!(
            TrainConfig::for_preset(Preset::Capstone).tokens_per_step(),
            16_384
        );
    }

    #[test]
    fn out_of_range_options_are_named() {
        let base = TrainConfig::for_preset(Preset::Tiny);
        type Breaker = fn(&mut TrainConfig);
        let cases: [(&str, Breaker); 6] = [
            ("micro-batch", |c| c.micro_batch = 0),
            ("accum", |c| c.accum = 0),
            ("steps", |c| c.steps = 0),
            ("lr", |c| c.lr.peak = f64::NAN),
            ("clip", |c| c.clip = Some(-1.0)),
            ("min-lr", |c| c.lr.min = 1.0),
        ];
        for (name, break_it) in cases {
            let mut config = base.clone();
            break_it(&mut config);
            let error = config.validate().unwrap_err();
            assert!(error.to_string().contains(name), "{name}: {error}");
        }
        let mut config = base.clone();
        config.checkpointing = Checkpointing::Budget(0);
        assert!(matches!(config.validate(), Err(TrainError::Recompute(_))));
    }

    #[test]
    fn sequence_parallelism_needs_a_group_whose_size_divides_the_context() {
        let mut config = TrainConfig::for_preset(Preset::Tiny);
        config.parallel.sequence_parallel = true;
        let error = config.validate().unwrap_err().to_string();
        assert!(error.contains("requires --tp > 1"), "{error}");
        config.parallel.ranks = 2;
        config.parallel.tensor = 2;
        config.validate().unwrap();
        config.model.context = 63;
        let error = config.validate().unwrap_err().to_string();
        assert!(
            error.contains("context") && error.contains("divisible by 2"),
            "{error}"
        );
        // Off, and not written, at tp 1; written when on.
        config.model.context = 64;
        let json = serde_json::to_value(&config).unwrap();
        assert_eq!(json["parallel"]["sequence_parallel"], true);
        let single = config.at_layout(2, 1, 1).unwrap();
        assert!(!single.parallel.sequence_parallel);
        let json = serde_json::to_value(&single).unwrap();
        assert!(json["parallel"].get("sequence_parallel").is_none());
    }
}
