//! The run read back: its `config.json`, a checkpoint restored into a model and its
//! optimizer one tensor at a time, and everything a rank needs to continue (or, before the
//! first checkpoint, to start again).

use std::collections::BTreeMap;
use std::path::Path;

use tl_precision::{DynamicLossScaler, Fp8State};
use tl_tensor::optim::AdamW;
use tl_tensor::{Generator, Tensor};

use super::config::{DataSource, FileFingerprint, TrainConfig};
use super::data::{load_corpus, token_cache_root};
use super::lock::RunLock;
use super::memory_check::check_memory;
use super::run_config::{config_json, read_config_json};
use super::snapshot;
use super::trainer::{CONFIG_FILE, DATA_STREAM, ResumeOptions, new_optimizer, new_scaler};
use crate::data::{Corpus, DataError};
use crate::error::{Result, TrainError};
use crate::model::Llama;
use crate::store::write_atomic;

/// The run's config as its `config.json` holds it (the `tinyllm` key naming the build that
/// wrote it aside: see [`config_json`]).
///
/// # Errors
/// [`TrainError::Io`] when the file cannot be read, [`TrainError::Checkpoint`] naming it
/// when it is not a config.
pub fn read_config(run_dir: &Path) -> Result<TrainConfig> {
    let path = run_dir.join(CONFIG_FILE);
    let bytes =
        crate::store::read_bounded(&path, super::limits::MAX_CONFIG_FILE_BYTES, CONFIG_FILE)?;
    read_config_json(&bytes)
        .map_err(|error| TrainError::checkpoint(&path, format!("malformed: {error}")))
}

/// The first field in which two configs differ, as `name: a vs b`, the data file's
/// fingerprint aside (it is checked against the file itself).
fn config_difference(left: &TrainConfig, right: &TrainConfig) -> Option<String> {
    let strip = |config: &TrainConfig| {
        let mut value = serde_json::to_value(TrainConfig {
            data_file: None,
            ..config.clone()
        })
        .expect("serializes");
        std::mem::take(value.as_object_mut().expect("a struct"))
    };
    let (left, right) = (strip(left), strip(right));
    left.iter()
        .find(|(key, value)| right.get(key.as_str()) != Some(value))
        .map(|(key, value)| format!("{key}: {value} vs {}", right[key.as_str()]))
}

/// The run's corpus, from its token cache when its files are as they were (nothing is read
/// then). A changed file is refused, naming it, unless `data_changed_ok`: the corpus is then
/// read anew and its fingerprint becomes the run's (written to its `config.json`), with a
/// warning.
fn load_checked_corpus(
    run_dir: &Path,
    config: &mut TrainConfig,
    options: ResumeOptions,
    leader: bool,
) -> Result<Corpus> {
    let root = token_cache_root(Some(run_dir));
    let expected = config.data_file.clone();
    let (path, expected, found) = match load_corpus(config, &root, expected.as_ref()) {
        Ok(corpus) if corpus.fingerprint == config.data_file => return Ok(corpus),
        Ok(corpus) => {
            let describe = |fingerprint: &Option<FileFingerprint>| {
                fingerprint
                    .as_ref()
                    .map_or("unknown".to_string(), FileFingerprint::describe)
            };
            let path = match &config.data {
                DataSource::File { path } => path.clone(),
                DataSource::Builtin { .. } => run_dir.join(CONFIG_FILE),
            };
            (
                path,
                describe(&config.data_file),
                describe(&corpus.fingerprint),
            )
        }
        Err(TrainError::Data(DataError::Changed {
            path,
            expected,
            found,
        })) => (path, expected, found),
        Err(error) => return Err(error),
    };
    if !options.data_changed_ok {
        return Err(TrainError::DataChanged {
            path,
            expected,
            found,
        });
    }
    let message = format!(
        "{} changed since the run began (was {expected}, now {found}); continuing on the new \
         data as asked",
        path.display(),
    );
    let corpus = load_corpus(config, &root, None)?;
    config.data_file = corpus.fingerprint.clone();
    if leader {
        crate::output::warn(&message);
        write_atomic(&run_dir.join(CONFIG_FILE), &config_json(config))?;
    }
    Ok(corpus)
}

/// Everything one rank holds of a run before it trains on: read from a checkpoint, or at
/// step 0 of its config.
pub(super) struct RunParts {
    pub(super) config: TrainConfig,
    pub(super) lock: Option<RunLock>,
    pub(super) corpus: Corpus,
    pub(super) model: Llama<f32>,
    pub(super) optimizer: AdamW<f32>,
    pub(super) scaler: Option<DynamicLossScaler>,
    pub(super) fp8: Option<Fp8State>,
    pub(super) data_rng: Generator,
    pub(super) step: u64,
    pub(super) tokens_seen: u64,
}

impl RunParts {
    /// Step 0 of `config`: a fresh loss scaler and data stream.
    pub(super) fn fresh(
        config: TrainConfig,
        lock: Option<RunLock>,
        corpus: Corpus,
        model: Llama<f32>,
        optimizer: AdamW<f32>,
    ) -> Self {
        let layers = model.fp8_layer_names().len();
        Self {
            scaler: new_scaler(&config),
            fp8: config
                .fp8
                .map(|recipe| Fp8State::new(recipe, layers).expect("a validated recipe")),
            data_rng: Generator::new(config.seed ^ DATA_STREAM),
            config,
            lock,
            corpus,
            model,
            optimizer,
            step: 0,
            tokens_seen: 0,
        }
    }
}

/// The run's config at `world` ranks (and the ZeRO stage asked for); the leader writes it
/// to `config.json` when it changed, saying how the global batch was kept.
fn config_at_world(
    run_dir: &Path,
    run_config: &TrainConfig,
    world: usize,
    leader: bool,
    options: ResumeOptions,
) -> Result<TrainConfig> {
    let tensor = options.tensor.unwrap_or(run_config.parallel.tensor);
    let pipeline = options.pipeline.unwrap_or(run_config.parallel.pipeline);
    let mut config = run_config.at_layout(world, tensor, pipeline)?;
    if let Some(schedule) = options.schedule {
        config.parallel.schedule = schedule;
    }
    if let Some(stages) = options.stages_per_rank {
        config.parallel.stages_per_rank = stages;
    }
    if let Some(zero) = options.zero {
        config.parallel.zero = zero;
    }
    if let Some(bytes) = options.bucket_bytes {
        config.parallel.bucket_bytes = bytes;
    }
    if let Some(overlap) = options.overlap {
        config.parallel.overlap = overlap;
    }
    if let Some(on) = options.sequence_parallel {
        config.parallel.sequence_parallel = on;
    }
    config.validate()?;
    if leader && config != *run_config {
        if world != run_config.parallel.ranks
            || tensor != run_config.parallel.tensor
            || pipeline != run_config.parallel.pipeline
        {
            let layout = |t: usize, p: usize| {
                let mut words = String::new();
                if t > 1 {
                    words += &format!(" (layers split over {t})");
                }
                if p > 1 {
                    words += &format!(" (a pipeline of {p})");
                }
                words
            };
            crate::output::warn(&format!(
                "the run was trained on {} rank(s){}, resumed on {world}{}: accum {} -> {} \
                 keeps its global batch of {} sequences",
                run_config.parallel.ranks,
                layout(run_config.parallel.tensor, run_config.parallel.pipeline),
                layout(tensor, pipeline),
                run_config.accum,
                config.accum,
                config.sequences_per_step()
            ));
        }
        write_atomic(&run_dir.join(CONFIG_FILE), &config_json(&config))?;
    }
    Ok(config)
}

/// Everything rank `rank` needs to continue the run in `run_dir` at `world` ranks. Only the
/// leader (rank 0) locks, cleans or writes the directory.
pub(super) fn resume_state(
    run_dir: &Path,
    options: ResumeOptions,
    rank: usize,
    world: usize,
) -> Result<RunParts> {
    let leader = rank == 0;
    if !run_dir.is_dir() {
        return Err(TrainError::checkpoint(run_dir, "is not a run directory"));
    }
    let lock = leader.then(|| RunLock::acquire(run_dir)).transpose()?;
    if !run_dir.join(CONFIG_FILE).exists() && snapshot::latest_step(run_dir)?.is_none() {
        return Err(TrainError::InvalidArgument {
            name: "resume",
            value: run_dir.display().to_string(),
            reason: format!(
                "holds no run: it has no {CONFIG_FILE} and no checkpoint (a run stopped \
                 before writing its config trained nothing); start it anew with --out {}",
                run_dir.display()
            ),
        });
    }
    let run_config = read_config(run_dir)?;
    if leader {
        snapshot::clean(run_dir)?;
    }
    let run_config = config_at_world(run_dir, &run_config, world, leader, options)?;
    // Before the checkpoint is read: the snapshot's config is this one (checked below).
    check_memory(&run_config, rank)?;
    if snapshot::latest_step(run_dir)?.is_none() {
        let mut config = run_config;
        let corpus = load_checked_corpus(run_dir, &mut config, options, leader)?;
        let model = Llama::new(&config.model, config.seed)?;
        let optimizer = new_optimizer(&model, &config)?;
        return Ok(RunParts::fresh(config, lock, corpus, model, optimizer));
    }
    let snapshot = snapshot::open(run_dir)?;
    let state = &snapshot.state;
    let parallel = &run_config.parallel;
    let mut config = state
        .config
        .at_layout(world, parallel.tensor, parallel.pipeline)?;
    config.parallel.schedule = parallel.schedule;
    config.parallel.stages_per_rank = parallel.stages_per_rank;
    config.parallel.pipeline_split = parallel.pipeline_split.clone();
    config.parallel.zero = run_config.parallel.zero;
    config.parallel.bucket_bytes = run_config.parallel.bucket_bytes;
    config.parallel.overlap = run_config.parallel.overlap;
    config.parallel.sequence_parallel = run_config.parallel.sequence_parallel;
    if let Some(difference) = config_difference(&config, &run_config) {
        return Err(TrainError::checkpoint(
            snapshot.dir.join("state.json"),
            format!("its config differs from the run's config.json ({difference})"),
        ));
    }
    config.validate()?;
    let corpus = load_checked_corpus(run_dir, &mut config, options, leader)?;
    let model = restore_model(&snapshot)?;
    let mut optimizer = new_optimizer(&model, &config)?;
    restore_moments(&snapshot, &model, &mut optimizer)?;
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
    let fp8 = match (&config.fp8, &state.fp8) {
        (Some(recipe), Some(saved)) if *recipe == saved.recipe => {
            saved
                .check(model.fp8_layer_names().len())
                .map_err(|error| {
                    TrainError::checkpoint(snapshot.dir.join("state.json"), error.to_string())
                })?;
            Some(saved.clone())
        }
        (None, None) => None,
        _ => {
            return Err(TrainError::checkpoint(
                snapshot.dir.join("state.json"),
                "its fp8 scaling state does not match the config's fp8 recipe",
            ));
        }
    };
    let tokens = state.step.checked_mul(config.tokens_per_step() as u64);
    if tokens != Some(state.tokens_seen) {
        return Err(TrainError::checkpoint(
            snapshot.dir.join("state.json"),
            format!(
                "says {} tokens were seen in {} steps of {} tokens",
                state.tokens_seen,
                state.step,
                config.tokens_per_step()
            ),
        ));
    }
    let data_rng = Generator::new(0);
    data_rng.set_state(&state.data_rng);
    model.dropout_generator().set_state(&state.dropout_rng);
    Ok(RunParts {
        config,
        lock,
        corpus,
        model,
        optimizer,
        scaler,
        fp8,
        data_rng,
        step: state.step,
        tokens_seen: state.tokens_seen,
    })
}

/// The model of the latest checkpoint in `run_dir`, for inference (no data, optimizer or
/// metrics are touched).
///
/// # Errors
/// [`TrainError::Checkpoint`] when there is no checkpoint or it is damaged.
pub fn load_model(run_dir: &Path) -> Result<(TrainConfig, Llama<f32>)> {
    load_model_at(run_dir, None)
}

/// [`load_model`] of the checkpoint of `step` in `run_dir`, or of the latest when `None`.
///
/// # Errors
/// Those of [`load_model`]; [`TrainError::InvalidArgument`] listing the run's checkpoints
/// when it has none of `step`.
pub fn load_model_at(run_dir: &Path, step: Option<u64>) -> Result<(TrainConfig, Llama<f32>)> {
    let snapshot = match step {
        Some(step) => snapshot::open_step(run_dir, step)?,
        None => snapshot::open(run_dir)?,
    };
    let model = restore_model(&snapshot)?;
    for (name, tensor) in model.named_parameters() {
        if let Some(bad) = tensor.value().iter().find(|v| !v.is_finite()) {
            return Err(TrainError::checkpoint(
                snapshot.dir.join("model.safetensors"),
                format!("weight {name} holds {bad}: the run diverged before this checkpoint"),
            ));
        }
    }
    Ok((snapshot.state.config, model))
}

/// A model of the checkpoint's config holding its weights, read one at a time into place.
fn restore_model(checkpoint: &snapshot::Checkpoint) -> Result<Llama<f32>> {
    let config = &checkpoint.state.config;
    let path = checkpoint.weights_path();
    let model = Llama::new(&config.model, config.seed)
        .map_err(|error| TrainError::checkpoint(&checkpoint.dir, error.to_string()))?;
    let mut missing: BTreeMap<String, Tensor<f32>> = model.named_parameters().into_iter().collect();
    checkpoint.read_weights(&mut |name, shape, values| {
        let tensor = missing.remove(&name).ok_or_else(|| {
            TrainError::checkpoint(
                &path,
                format!("holds {name}, which is no weight of the model"),
            )
        })?;
        if tensor.shape() != shape {
            return Err(TrainError::checkpoint(
                &path,
                format!(
                    "{name} has shape {shape:?}, the model expects {:?}",
                    tensor.shape()
                ),
            ));
        }
        tensor.update_value(|array| {
            array
                .iter_mut()
                .zip(values)
                .for_each(|(slot, value)| *slot = value);
        });
        Ok(())
    })?;
    if let Some(name) = missing.keys().next() {
        return Err(TrainError::checkpoint(
            &path,
            format!("has no tensor {name}"),
        ));
    }
    Ok(model)
}

/// AdamW's moments and hyperparameters from the checkpoint, each moment read into place:
/// a weight whose step count is 0 has none yet (its saved zeros are skipped).
fn restore_moments(
    checkpoint: &snapshot::Checkpoint,
    model: &Llama<f32>,
    optimizer: &mut AdamW<f32>,
) -> Result<()> {
    let path = checkpoint.moments_path();
    let meta = &checkpoint.state.adamw;
    let named = model.named_parameters();
    if meta.steps.len() != named.len() {
        return Err(TrainError::checkpoint(
            &path,
            format!(
                "holds {} step counts for {} weights",
                meta.steps.len(),
                named.len()
            ),
        ));
    }
    optimizer
        .load_hyperparameters(meta.lr, meta.betas, meta.eps, meta.weight_decay)
        .map_err(|error| {
            TrainError::checkpoint(checkpoint.dir.join("state.json"), error.to_string())
        })?;
    // Each weight's index and shape by moment name; removed as they are read.
    let mut missing: BTreeMap<String, (usize, Vec<usize>)> = BTreeMap::new();
    for (index, (name, tensor)) in named.iter().enumerate() {
        for suffix in ["exp_avg", "exp_avg_sq"] {
            missing.insert(format!("{name}.{suffix}"), (index, tensor.shape()));
        }
    }
    // `NAME.exp_avg` comes just before `NAME.exp_avg_sq` (the file is in name order, and
    // a weight's name ends before its suffix): at most one moment waits for its pair.
    let mut first: Option<(usize, Vec<f32>)> = None;
    checkpoint.read_moments(&mut |name, shape, values| {
        let (index, expected) = missing.remove(&name).ok_or_else(|| {
            TrainError::checkpoint(
                &path,
                format!("holds {name}, which is no moment of the model"),
            )
        })?;
        if shape != expected {
            return Err(TrainError::checkpoint(
                &path,
                format!("{name} has shape {shape:?}, the model expects {expected:?}"),
            ));
        }
        let step = meta.steps[index];
        if name.ends_with(".exp_avg") {
            first = Some((index, values));
            return Ok(());
        }
        let exp_avg = match first.take() {
            Some((pending, exp_avg)) if pending == index => exp_avg,
            _ => {
                return Err(TrainError::checkpoint(
                    &path,
                    format!("{name} does not follow its first moment"),
                ));
            }
        };
        if step == 0 {
            return Ok(());
        }
        let array = |values: Vec<f32>| {
            ndarray::ArrayD::from_shape_vec(shape.clone(), values).expect("the shape was checked")
        };
        optimizer
            .load_moments(index, step, array(exp_avg), array(values))
            .map_err(|error| TrainError::checkpoint(&path, error.to_string()))
    })?;
    if let Some(name) = missing.keys().next() {
        return Err(TrainError::checkpoint(
            &path,
            format!("has no tensor {name}"),
        ));
    }
    Ok(())
}
