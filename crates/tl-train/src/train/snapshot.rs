//! Saving and loading everything a run needs to continue bit for bit.
//!
//! A run directory holds at most one complete checkpoint, `checkpoint-NNNNNN/`, named by the
//! file `LATEST`:
//!
//! - `model.safetensors`: the weights, by their `llama_ref.py` names;
//! - `optimizer.safetensors`: AdamW's two moments of every weight (`NAME.exp_avg`,
//!   `NAME.exp_avg_sq`);
//! - `state.json`: the step, the config, AdamW's hyperparameters and step counts, the loss
//!   scaler, both generators' states (batches and dropout), and a fingerprint of each
//!   tensor file.
//!
//! Saving writes a new directory beside the old one, flushes it, renames it into place, then
//! points `LATEST` at it with an atomic rename, and only then deletes the old one: a crash at
//! any moment leaves `LATEST` naming a complete checkpoint.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tl_precision::ScalerState;
use tl_tensor::GeneratorState;
use tl_tensor::optim::{AdamWParamState, AdamWState};

use super::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::store::{
    NamedTensor, TensorMap, decode_tensors, encode_tensors, fingerprint, write_atomic,
};

/// The version of the checkpoint layout this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// AdamW's state apart from its moments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWMeta {
    /// Learning rate of the last step.
    pub lr: f64,
    /// Moment decay rates.
    pub betas: (f64, f64),
    /// Denominator constant.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Each weight's step count (0: no moments yet).
    pub steps: Vec<u64>,
}

/// `state.json`: everything but the tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// [`FORMAT_VERSION`] of the writer.
    pub format: u32,
    /// Optimizer steps taken.
    pub step: u64,
    /// Training tokens consumed.
    pub tokens_seen: u64,
    /// The run's config.
    pub config: TrainConfig,
    /// AdamW's hyperparameters and step counts.
    pub adamw: AdamWMeta,
    /// The dynamic loss scaler (fp16 runs).
    pub scaler: Option<ScalerState>,
    /// The generator that draws training batches.
    pub data_rng: GeneratorState,
    /// The generator dropout draws from.
    pub dropout_rng: GeneratorState,
    /// Fingerprint of each tensor file, by file name.
    pub files: BTreeMap<String, String>,
}

/// A loaded checkpoint.
pub struct Snapshot {
    /// Where it was read from.
    pub dir: PathBuf,
    /// Its `state.json`.
    pub state: RunState,
    /// Weights by name.
    pub weights: TensorMap,
    /// AdamW moments by `NAME.exp_avg` / `NAME.exp_avg_sq`.
    pub moments: TensorMap,
}

const MODEL_FILE: &str = "model.safetensors";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const STATE_FILE: &str = "state.json";
const LATEST_FILE: &str = "LATEST";

/// Writes a checkpoint of `state` with `weights` and the optimizer's `adamw` state into
/// `run_dir`, replacing the previous one only once the new one is complete. Returns its
/// directory.
///
/// # Errors
/// [`TrainError::Io`] for a file that could not be written; the previous checkpoint is then
/// still the one `LATEST` names.
pub fn save(
    run_dir: &Path,
    mut state: RunState,
    weights: &[NamedTensor],
    adamw: &AdamWState,
) -> Result<PathBuf> {
    let name = format!("checkpoint-{:06}", state.step);
    let final_dir = run_dir.join(&name);
    let staging = run_dir.join(format!(".{name}.tmp"));
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TrainError::io(path, source)
    };
    if staging.exists() {
        fs::remove_dir_all(&staging).map_err(io(&staging))?;
    }
    fs::create_dir_all(&staging).map_err(io(&staging))?;

    let model_bytes = encode_tensors(weights);
    let optimizer_bytes = encode_tensors(&moment_tensors(weights, adamw));
    state.files = BTreeMap::from([
        (MODEL_FILE.to_string(), fingerprint(&model_bytes)),
        (OPTIMIZER_FILE.to_string(), fingerprint(&optimizer_bytes)),
    ]);
    write_atomic(&staging.join(MODEL_FILE), &model_bytes)?;
    write_atomic(&staging.join(OPTIMIZER_FILE), &optimizer_bytes)?;
    let json = serde_json::to_vec_pretty(&state).expect("the state serializes");
    write_atomic(&staging.join(STATE_FILE), &json)?;

    if final_dir.exists() {
        // The same step saved again (an interrupt right after a periodic save): the staged
        // copy is identical, so nothing is lost in the gap.
        fs::remove_dir_all(&final_dir).map_err(io(&final_dir))?;
    }
    fs::rename(&staging, &final_dir).map_err(io(&final_dir))?;
    write_atomic(&run_dir.join(LATEST_FILE), name.as_bytes())?;
    for entry in fs::read_dir(run_dir).map_err(io(run_dir))? {
        let entry = entry.map_err(io(run_dir))?;
        let stale = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with("checkpoint-") && n != name);
        if stale {
            fs::remove_dir_all(entry.path()).map_err(io(&entry.path()))?;
        }
    }
    Ok(final_dir)
}

/// The moments of `adamw` as named tensors, zeros for weights that have none yet.
fn moment_tensors(weights: &[NamedTensor], adamw: &AdamWState) -> Vec<NamedTensor> {
    let mut tensors = Vec::with_capacity(2 * weights.len());
    for ((name, shape, values), state) in weights.iter().zip(&adamw.params) {
        let (avg, avg_sq) = match state {
            // Moments of f32 weights are f32 values: the f64 → f32 conversion is exact.
            Some(state) => (
                state.exp_avg.iter().map(|&v| v as f32).collect(),
                state.exp_avg_sq.iter().map(|&v| v as f32).collect(),
            ),
            None => (vec![0.0; values.len()], vec![0.0; values.len()]),
        };
        tensors.push((format!("{name}.exp_avg"), shape.clone(), avg));
        tensors.push((format!("{name}.exp_avg_sq"), shape.clone(), avg_sq));
    }
    tensors
}

/// Reads the checkpoint `LATEST` names in `run_dir`, checking every file against its
/// fingerprint.
///
/// # Errors
/// [`TrainError::Checkpoint`] when there is no checkpoint, a file is missing, damaged or
/// from another format version.
pub fn load(run_dir: &Path) -> Result<Snapshot> {
    let latest = run_dir.join(LATEST_FILE);
    let name = fs::read_to_string(&latest).map_err(|error| {
        TrainError::checkpoint(
            run_dir,
            format!(
                "no checkpoint to resume from ({}: {error})",
                latest.display()
            ),
        )
    })?;
    let dir = run_dir.join(name.trim());
    let read = |file: &str| {
        let path = dir.join(file);
        fs::read(&path)
            .map_err(|error| TrainError::checkpoint(&path, format!("cannot be read: {error}")))
    };
    let state_path = dir.join(STATE_FILE);
    let state: RunState = serde_json::from_slice(&read(STATE_FILE)?)
        .map_err(|error| TrainError::checkpoint(&state_path, format!("malformed: {error}")))?;
    if state.format != FORMAT_VERSION {
        return Err(TrainError::checkpoint(
            &state_path,
            format!(
                "format version {} (this build reads {FORMAT_VERSION})",
                state.format
            ),
        ));
    }
    let mut tensors = Vec::new();
    for file in [MODEL_FILE, OPTIMIZER_FILE] {
        let path = dir.join(file);
        let bytes = read(file)?;
        let expected = state.files.get(file).map(String::as_str).unwrap_or("none");
        let actual = fingerprint(&bytes);
        if actual != expected {
            return Err(TrainError::checkpoint(
                &path,
                format!("damaged: its fingerprint is {actual}, state.json recorded {expected}"),
            ));
        }
        tensors.push(decode_tensors(&path, &bytes)?);
    }
    let moments = tensors.pop().expect("two files");
    let weights = tensors.pop().expect("two files");
    Ok(Snapshot {
        dir,
        state,
        weights,
        moments,
    })
}

impl Snapshot {
    /// The saved values of the weight `name`, checked against the shape the model expects.
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] if the weight is missing or shaped differently.
    pub fn weight(&self, name: &str, shape: &[usize]) -> Result<&[f32]> {
        lookup(&self.dir.join(MODEL_FILE), &self.weights, name, shape)
    }

    /// The AdamW state for weights named `names` with `shapes`, ready for
    /// `AdamW::load_state_dict`.
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] if a moment is missing or shaped differently, or the step
    /// counts do not match the weights.
    pub fn adamw_state(&self, names: &[String], shapes: &[Vec<usize>]) -> Result<AdamWState> {
        let path = self.dir.join(OPTIMIZER_FILE);
        let meta = &self.state.adamw;
        if meta.steps.len() != names.len() {
            return Err(TrainError::checkpoint(
                &path,
                format!(
                    "holds {} step counts for {} weights",
                    meta.steps.len(),
                    names.len()
                ),
            ));
        }
        let mut params = Vec::with_capacity(names.len());
        for ((name, shape), &step) in names.iter().zip(shapes).zip(&meta.steps) {
            let widen = |values: &[f32]| values.iter().map(|&v| f64::from(v)).collect();
            let exp_avg = lookup(&path, &self.moments, &format!("{name}.exp_avg"), shape)?;
            let exp_avg_sq = lookup(&path, &self.moments, &format!("{name}.exp_avg_sq"), shape)?;
            params.push((step > 0).then(|| AdamWParamState {
                step,
                exp_avg: widen(exp_avg),
                exp_avg_sq: widen(exp_avg_sq),
            }));
        }
        Ok(AdamWState {
            lr: meta.lr,
            betas: meta.betas,
            eps: meta.eps,
            weight_decay: meta.weight_decay,
            shapes: shapes.to_vec(),
            params,
        })
    }
}

fn lookup<'a>(
    path: &Path,
    tensors: &'a TensorMap,
    name: &str,
    shape: &[usize],
) -> Result<&'a [f32]> {
    match tensors.get(name) {
        None => Err(TrainError::checkpoint(
            path,
            format!("has no tensor {name}"),
        )),
        Some((saved, _)) if saved.as_slice() != shape => Err(TrainError::checkpoint(
            path,
            format!("{name} has shape {saved:?}, the model expects {shape:?}"),
        )),
        Some((_, values)) => Ok(values),
    }
}
