//! Saving and loading everything a run needs to continue bit for bit.
//!
//! A run directory holds its last few complete checkpoints, `checkpoint-NNNNNN/`, the
//! newest named by the file `LATEST`:
//!
//! - `model.safetensors`: the weights, by their `llama_ref.py` names;
//! - `optimizer.safetensors`: AdamW's two moments of every weight (`NAME.exp_avg`,
//!   `NAME.exp_avg_sq`);
//! - `state.json`: the step, the config, AdamW's hyperparameters and step counts, the loss
//!   scaler, both generators' states (batches and dropout);
//! - `SHA256SUMS`: the SHA-256 of each of the three, as `sha256sum` writes it (so
//!   `sha256sum -c SHA256SUMS` checks a checkpoint by hand). Loading checks every file
//!   against it: a damaged or edited file is refused, never half-trusted.
//!
//! Saving writes a new directory beside the old ones, flushes it, renames it into place, then
//! points `LATEST` at it with an atomic rename, and only then deletes the checkpoints past
//! the number kept: a crash at any moment leaves `LATEST` naming a complete checkpoint.
//!
//! `LATEST` is sealed too. Its first line names the checkpoint; its second is the SHA-256
//! of that checkpoint's `SHA256SUMS`, in `sha256sum`'s format:
//!
//! ```text
//! checkpoint-000002
//! 3f9c…e1  checkpoint-000002/SHA256SUMS
//! ```
//!
//! Without the seal, one damaged digit would name an older checkpoint that is itself
//! intact: the run would resume a step back, and [`clean`] would delete the newer
//! checkpoints as a crash's leftovers. With it, such a `LATEST` is refused and nothing is
//! removed. A `LATEST` of the name alone is still read, as a person writes it to roll a
//! run back by hand.
//! Whatever a crash leaves behind (a staging directory, a temporary file, a complete
//! checkpoint that `LATEST` never came to name) is removed by [`clean`] at the next start.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tl_precision::ScalerState;
use tl_tensor::GeneratorState;
use tl_tensor::Tensor;
use tl_tensor::optim::{AdamW, AdamWState};

use super::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::store::{
    TensorMap, TensorSource, TensorVisitor, Values, fault_point, fingerprint, is_temporary,
    read_tensors, write_atomic, write_tensors_atomic,
};

/// The version of the checkpoint layout this build writes and reads.
pub const FORMAT_VERSION: u32 = 2;

/// A parameter's two moments `(m, v)` as [`save`] streams them; `None` before its first
/// step (saved as zeros).
pub type MomentValues<'a> = Option<(Values<'a>, Values<'a>)>;

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

impl AdamWMeta {
    /// The hyperparameters and step counts of a state gathered from ZeRO's shards.
    pub fn of_state(state: &AdamWState) -> Self {
        Self {
            lr: state.lr,
            betas: state.betas,
            eps: state.eps,
            weight_decay: state.weight_decay,
            steps: state
                .params
                .iter()
                .map(|param| param.as_ref().map_or(0, |param| param.step))
                .collect(),
        }
    }

    /// The hyperparameters and step counts of a whole AdamW.
    pub fn of_adamw(adamw: &AdamW<f32>) -> Self {
        use tl_tensor::optim::Optimizer;
        Self {
            lr: adamw.learning_rate(),
            betas: adamw.betas(),
            eps: adamw.eps(),
            weight_decay: adamw.weight_decay(),
            steps: adamw
                .moments()
                .iter()
                .map(|moments| moments.as_ref().map_or(0, |moments| moments.step))
                .collect(),
        }
    }
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
    /// The fp8 layers' scales and amax histories (fp8 runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<tl_precision::Fp8State>,
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
const SUMS_FILE: &str = "SHA256SUMS";
const LATEST_FILE: &str = "LATEST";
const PREFIX: &str = "checkpoint-";
/// The longest `state.json` or `SHA256SUMS` read (a state is a few KiB; fp8 amax histories
/// make it larger).
const MAX_STATE_BYTES: u64 = 1 << 28;

/// The name of the checkpoint of `step`.
fn checkpoint_name(step: u64) -> String {
    format!("{PREFIX}{step:06}")
}

/// The step of a checkpoint directory's name, if `name` is one: `checkpoint-` and digits,
/// nothing else (no path separators, so `LATEST` cannot lead out of the run directory).
fn checkpoint_step(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(PREFIX)?;
    if digits.len() < 6 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The steps of the complete checkpoints in `run_dir`, in increasing order.
///
/// # Errors
/// [`TrainError::Io`] if the directory cannot be listed.
pub fn checkpoint_steps(run_dir: &Path) -> Result<Vec<u64>> {
    let mut steps = Vec::new();
    for entry in fs::read_dir(run_dir).map_err(|source| TrainError::io(run_dir, source))? {
        let entry = entry.map_err(|source| TrainError::io(run_dir, source))?;
        if let Some(step) = entry.file_name().to_str().and_then(checkpoint_step) {
            steps.push(step);
        }
    }
    steps.sort_unstable();
    Ok(steps)
}

/// The step `LATEST` names, or `None` when the run has no checkpoint yet. A sealed `LATEST`
/// (see the module's documentation) is checked against the `SHA256SUMS` it names.
///
/// # Errors
/// [`TrainError::Checkpoint`] when `LATEST` exists but does not name a checkpoint of this
/// run, or its seal does not match that checkpoint; [`TrainError::Io`] when it cannot be
/// read.
pub fn latest_step(run_dir: &Path) -> Result<Option<u64>> {
    let latest = run_dir.join(LATEST_FILE);
    let bytes = match fs::read(&latest) {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(TrainError::io(latest, source)),
    };
    let text = std::str::from_utf8(&bytes).unwrap_or("");
    let mut lines = text.trim_end().lines();
    let name = lines.next().unwrap_or("").trim();
    let seal = lines.next();
    let Some(step) = checkpoint_step(name).filter(|_| lines.next().is_none()) else {
        return Err(TrainError::checkpoint(
            &latest,
            format!(
                "names {:?}, which is not a checkpoint of this run (expected checkpoint-NNNNNN)",
                String::from_utf8_lossy(&bytes)
            ),
        ));
    };
    if let Some(seal) = seal {
        check_seal(run_dir, &latest, name, seal)?;
    }
    Ok(Some(step))
}

/// The contents of a sealed `LATEST` naming the checkpoint `name` with `sums`, the bytes of
/// its `SHA256SUMS`.
fn seal(name: &str, sums: &[u8]) -> String {
    format!("{name}\n{}  {name}/{SUMS_FILE}\n", fingerprint(sums))
}

/// Checks the second line of `LATEST` (at `latest`), `seal`, against the `SHA256SUMS` of
/// the checkpoint `name` in `run_dir`.
fn check_seal(run_dir: &Path, latest: &Path, name: &str, seal: &str) -> Result<()> {
    let sums_path = format!("{name}/{SUMS_FILE}");
    let (recorded, file) = seal
        .split_once("  ")
        .filter(|(hash, _)| hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| {
            TrainError::checkpoint(
                latest,
                format!("damaged: its second line is not `SHA256  {sums_path}`"),
            )
        })?;
    if file != sums_path {
        return Err(TrainError::checkpoint(
            latest,
            format!("damaged: its first line names {name}, its second {file:?}"),
        ));
    }
    let sums = fs::read(run_dir.join(&sums_path)).map_err(|error| {
        TrainError::checkpoint(
            latest,
            format!("names {name}, whose {SUMS_FILE} cannot be read: {error}"),
        )
    })?;
    let actual = fingerprint(&sums);
    if actual != recorded {
        return Err(TrainError::checkpoint(
            latest,
            format!("damaged: it records {recorded} for {sums_path}, whose SHA-256 is {actual}"),
        ));
    }
    Ok(())
}

/// Removes what an interrupted writer left in `run_dir`: staging directories and temporary
/// files, and complete checkpoints newer than the one `LATEST` names (a crash between the
/// rename and the update of `LATEST`; the metrics of their steps are dropped on resume too).
/// Returns what was removed. Call it only while holding the run's lock.
///
/// # Errors
/// [`TrainError::Io`] for an entry that cannot be removed; [`TrainError::Checkpoint`] for a
/// `LATEST` that names no checkpoint of the run (nothing is removed then).
pub fn clean(run_dir: &Path) -> Result<Vec<PathBuf>> {
    let latest = latest_step(run_dir)?;
    let mut removed = Vec::new();
    for entry in fs::read_dir(run_dir).map_err(|source| TrainError::io(run_dir, source))? {
        let entry = entry.map_err(|source| TrainError::io(run_dir, source))?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let orphan = checkpoint_step(&name).is_some_and(|step| latest.is_none_or(|l| step > l));
        if !(is_temporary(&name) || orphan) {
            continue;
        }
        let path = entry.path();
        let result = if path.is_dir() {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        result.map_err(|source| TrainError::io(&path, source))?;
        removed.push(path);
    }
    Ok(removed)
}

/// The header metadata of a checkpoint's `model.safetensors`: what each tensor is. Readers
/// go by the tensor names and ignore it; it is there for people and other tools (see
/// `tinyllm export` for Hugging Face's layout).
pub const MODEL_METADATA: &[(&str, &str)] = &[
    ("format", "tinyllm"),
    ("dtype", "F32, little-endian, row-major"),
    (
        "names",
        "emb.weight; blocks.{i}.{n1.w, wq.weight, wk.weight, wv.weight, wo.weight, n2.w, \
         w1.weight, w3.weight, w2.weight} for each block i; norm.w; head.weight",
    ),
    (
        "layout",
        "linear weights (wq, wk, wv, wo, w1, w3, w2, head) are [in, out] and compute x·W; \
         emb.weight is [vocab, d_model]; n1.w, n2.w and norm.w are RMSNorm gains [d_model]; \
         the rotary embedding turns the interleaved pairs (2i, 2i+1) of each head of wq's \
         and wk's outputs",
    ),
    (
        "roles",
        "n1.w normalises attention's input, n2.w the MLP's; the MLP is \
         w2·(silu(w1·x) * w3·x) (w1 gate, w3 up, w2 down); head.weight is untied from \
         emb.weight",
    ),
];

/// The header metadata of a checkpoint's `optimizer.safetensors`.
pub const OPTIMIZER_METADATA: &[(&str, &str)] = &[
    ("format", "tinyllm"),
    ("dtype", "F32, little-endian, row-major"),
    (
        "contents",
        "AdamW's moments: {name}.exp_avg and {name}.exp_avg_sq for each tensor {name} of \
         model.safetensors, in its shape and layout (zeros before the first step)",
    ),
];

/// Writes a checkpoint of `state` with `weights` and the optimizer's `adamw` state into
/// `run_dir`, makes it the latest only once it is complete, then keeps the newest `keep`
/// checkpoints (at least this one) and removes the older ones. Returns its directory.
///
/// # Errors
/// [`TrainError::Io`] for a file that could not be written; the previous checkpoint is then
/// still the one `LATEST` names.
pub fn save(
    run_dir: &Path,
    state: RunState,
    weights: &[(String, Tensor<f32>)],
    moments: Vec<MomentValues<'_>>,
    keep: usize,
) -> Result<PathBuf> {
    let name = checkpoint_name(state.step);
    let final_dir = run_dir.join(&name);
    let staging = run_dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TrainError::io(path, source)
    };
    if staging.exists() {
        fs::remove_dir_all(&staging).map_err(io(&staging))?;
    }
    fault_point();
    fs::create_dir_all(&staging).map_err(io(&staging))?;

    // Streamed from the tensors themselves: a checkpoint costs no second copy of the model
    // or its optimizer state.
    let weight_sources: Vec<TensorSource<'_>> = weights
        .iter()
        .map(|(name, tensor)| TensorSource {
            name: name.clone(),
            shape: tensor.shape(),
            values: Values::Tensor(tensor.clone()),
        })
        .collect();
    let model_sum =
        write_tensors_atomic(&staging.join(MODEL_FILE), &weight_sources, MODEL_METADATA)?;
    let optimizer_sum = write_tensors_atomic(
        &staging.join(OPTIMIZER_FILE),
        &moment_sources(weights, moments),
        OPTIMIZER_METADATA,
    )?;
    let state_bytes = serde_json::to_vec_pretty(&state).expect("the state serializes");
    write_atomic(&staging.join(STATE_FILE), &state_bytes)?;
    let sums = format!(
        "{model_sum}  {MODEL_FILE}\n{optimizer_sum}  {OPTIMIZER_FILE}\n{}  {STATE_FILE}\n",
        fingerprint(&state_bytes)
    );
    write_atomic(&staging.join(SUMS_FILE), sums.as_bytes())?;

    fault_point();
    if final_dir.exists() {
        // The same step saved again (an interrupt right after a periodic save): the staged
        // copy is identical, so nothing is lost in the gap.
        fs::remove_dir_all(&final_dir).map_err(io(&final_dir))?;
    }
    fault_point();
    fs::rename(&staging, &final_dir).map_err(io(&final_dir))?;
    write_atomic(
        &run_dir.join(LATEST_FILE),
        seal(&name, sums.as_bytes()).as_bytes(),
    )?;
    let steps = checkpoint_steps(run_dir)?;
    let kept_from = steps.len().saturating_sub(keep.max(1));
    for &step in &steps[..kept_from] {
        let stale = run_dir.join(checkpoint_name(step));
        fault_point();
        fs::remove_dir_all(&stale).map_err(io(&stale))?;
    }
    Ok(final_dir)
}

/// The moments of each weight (`NAME.exp_avg`, `NAME.exp_avg_sq`), zeros for weights
/// that have none yet.
fn moment_sources<'a>(
    weights: &[(String, Tensor<f32>)],
    moments: Vec<MomentValues<'a>>,
) -> Vec<TensorSource<'a>> {
    let mut sources = Vec::with_capacity(2 * weights.len());
    for ((name, weight), moments) in weights.iter().zip(moments) {
        let (avg, avg_sq) = match moments {
            Some(pair) => pair,
            None => (Values::Zeros(weight.numel()), Values::Zeros(weight.numel())),
        };
        for (suffix, values) in [("exp_avg", avg), ("exp_avg_sq", avg_sq)] {
            sources.push(TensorSource {
                name: format!("{name}.{suffix}"),
                shape: weight.shape(),
                values,
            });
        }
    }
    sources
}

/// The moments `(m, v)` of each parameter as [`save`] takes them, from the state gathered
/// from ZeRO's shards (`f64` values, each exactly an `f32`).
pub fn gathered_moments(state: &AdamWState) -> Vec<MomentValues<'_>> {
    state
        .params
        .iter()
        .map(|param| {
            param.as_ref().map(|param| {
                (
                    Values::Narrowed(&param.exp_avg),
                    Values::Narrowed(&param.exp_avg_sq),
                )
            })
        })
        .collect()
}

/// The moments `(m, v)` of each parameter as [`save`] takes them, from a whole AdamW's own
/// tensors (shared, not copied).
pub fn live_moments(adamw: &AdamW<f32>) -> Vec<MomentValues<'static>> {
    adamw
        .moments()
        .into_iter()
        .map(|moments| {
            moments.map(|moments| {
                (
                    Values::Tensor(moments.exp_avg),
                    Values::Tensor(moments.exp_avg_sq),
                )
            })
        })
        .collect()
}

/// Reads the checkpoint `LATEST` names in `run_dir`, checking every file against its
/// SHA-256 in `SHA256SUMS`: [`open`], then every tensor into memory.
///
/// # Errors
/// [`TrainError::Checkpoint`] when there is no checkpoint, `LATEST` names something that is
/// not a checkpoint of this run, or a file is missing, damaged or from another format
/// version.
pub fn load(run_dir: &Path) -> Result<Snapshot> {
    open(run_dir)?.into_snapshot()
}

/// [`load`] of the checkpoint of `step` in `run_dir` (whichever `LATEST` names).
///
/// # Errors
/// As [`open_step`], then as [`load`].
pub fn load_step(run_dir: &Path, step: u64) -> Result<Snapshot> {
    open_step(run_dir, step)?.into_snapshot()
}

/// Opens the checkpoint `LATEST` names in `run_dir`: its `SHA256SUMS` and `state.json` are
/// read and checked; its tensors are read later, one at a time
/// ([`Checkpoint::read_weights`], [`Checkpoint::read_moments`]).
///
/// # Errors
/// [`TrainError::Checkpoint`] when there is no checkpoint, `LATEST` names something that is
/// not a checkpoint of this run, or `SHA256SUMS` or `state.json` is missing, damaged or
/// from another format version.
pub fn open(run_dir: &Path) -> Result<Checkpoint> {
    let Some(step) = latest_step(run_dir)? else {
        return Err(TrainError::checkpoint(
            run_dir,
            "has no checkpoint yet (no LATEST file)",
        ));
    };
    let dir = run_dir.join(checkpoint_name(step));
    if !fs::symlink_metadata(&dir).is_ok_and(|meta| meta.is_dir()) {
        return Err(TrainError::checkpoint(
            run_dir.join(LATEST_FILE),
            format!(
                "names {}, which is not a directory of this run",
                checkpoint_name(step)
            ),
        ));
    }
    Checkpoint::open_dir(dir, step)
}

/// [`open`] of the checkpoint of `step` in `run_dir` (whichever `LATEST` names).
///
/// # Errors
/// [`TrainError::InvalidArgument`] (`checkpoint`) listing the steps the run has checkpoints
/// of when it has none of `step`; then those of [`open`].
pub fn open_step(run_dir: &Path, step: u64) -> Result<Checkpoint> {
    let dir = run_dir.join(checkpoint_name(step));
    if !fs::symlink_metadata(&dir).is_ok_and(|meta| meta.is_dir()) {
        let steps = checkpoint_steps(run_dir)?;
        let have = if steps.is_empty() {
            "none".to_string()
        } else {
            steps
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Err(TrainError::InvalidArgument {
            name: "checkpoint",
            value: step.to_string(),
            reason: format!(
                "{} has no checkpoint of that step; it has checkpoints of steps: {have}",
                run_dir.display()
            ),
        });
    }
    Checkpoint::open_dir(dir, step)
}

/// A checkpoint whose `state.json` is read and checked, and whose tensors are read on
/// demand, one at a time, each file checked against its SHA-256 as it is read: loading a
/// model holds no second copy of it.
pub struct Checkpoint {
    /// Its directory.
    pub dir: PathBuf,
    /// Its `state.json`.
    pub state: RunState,
    /// `SHA256SUMS`, by file name.
    sums: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Reads `SHA256SUMS` and `state.json` of the checkpoint of `step` in `dir`.
    fn open_dir(dir: PathBuf, step: u64) -> Result<Self> {
        let read = |file: &str| {
            let path = dir.join(file);
            crate::store::read_bounded(&path, MAX_STATE_BYTES, "a checkpoint's state")
                .map_err(|error| TrainError::checkpoint(&path, format!("cannot be read: {error}")))
        };
        let sums = parse_sums(&dir.join(SUMS_FILE), &read(SUMS_FILE)?)?;
        for file in [STATE_FILE, MODEL_FILE, OPTIMIZER_FILE] {
            if !sums.contains_key(file) {
                return Err(TrainError::checkpoint(
                    dir.join(SUMS_FILE),
                    format!("lists no SHA-256 of {file}"),
                ));
            }
        }
        let state_path = dir.join(STATE_FILE);
        let bytes = read(STATE_FILE)?;
        let actual = fingerprint(&bytes);
        if actual != sums[STATE_FILE] {
            return Err(TrainError::checkpoint(
                &state_path,
                format!(
                    "damaged: its SHA-256 is {actual}, SHA256SUMS records {}",
                    sums[STATE_FILE]
                ),
            ));
        }
        let state: RunState = serde_json::from_slice(&bytes)
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
        if state.step != step {
            return Err(TrainError::checkpoint(
                &state_path,
                format!("is the state of step {}, not of step {step}", state.step),
            ));
        }
        Ok(Self { dir, state, sums })
    }

    /// Hands every weight of `model.safetensors` to `visit` (name, shape, values), one at a
    /// time; the file's SHA-256 is checked at the end (see [`crate::store::read_tensors`]).
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] naming the file; `visit`'s errors.
    pub fn read_weights(&self, visit: &mut TensorVisitor<'_>) -> Result<()> {
        read_tensors(&self.dir.join(MODEL_FILE), &self.sums[MODEL_FILE], visit)
    }

    /// [`Checkpoint::read_weights`] of `optimizer.safetensors`: AdamW's moments, named
    /// `NAME.exp_avg` and `NAME.exp_avg_sq`.
    ///
    /// # Errors
    /// As [`Checkpoint::read_weights`].
    pub fn read_moments(&self, visit: &mut TensorVisitor<'_>) -> Result<()> {
        read_tensors(
            &self.dir.join(OPTIMIZER_FILE),
            &self.sums[OPTIMIZER_FILE],
            visit,
        )
    }

    /// The path of the weights' file, for errors about its contents.
    pub fn weights_path(&self) -> PathBuf {
        self.dir.join(MODEL_FILE)
    }

    /// The path of the moments' file, for errors about its contents.
    pub fn moments_path(&self) -> PathBuf {
        self.dir.join(OPTIMIZER_FILE)
    }

    /// Every tensor read into memory.
    ///
    /// # Errors
    /// As [`Checkpoint::read_weights`].
    pub fn into_snapshot(self) -> Result<Snapshot> {
        let collect = |read: &dyn Fn(&mut TensorVisitor<'_>) -> Result<()>| {
            let mut tensors = TensorMap::new();
            read(&mut |name, shape, values| {
                tensors.insert(name, (shape, values));
                Ok(())
            })?;
            Ok::<_, TrainError>(tensors)
        };
        let weights = collect(&|visit| self.read_weights(visit))?;
        let moments = collect(&|visit| self.read_moments(visit))?;
        Ok(Snapshot {
            dir: self.dir,
            state: self.state,
            weights,
            moments,
        })
    }
}

/// The `sha256sum`-format lines of a `SHA256SUMS` file, by file name.
fn parse_sums(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, String>> {
    let malformed = |reason: &str| TrainError::checkpoint(path, format!("malformed: {reason}"));
    let text = std::str::from_utf8(bytes).map_err(|_| malformed("not UTF-8 text"))?;
    let mut sums = BTreeMap::new();
    for line in text.lines() {
        let (hash, file) = line
            .split_once("  ")
            .ok_or_else(|| malformed("a line is not `HASH  FILE`"))?;
        if hash.len() != 64 || !hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(malformed("a hash is not 64 lowercase hex digits"));
        }
        sums.insert(file.to_string(), hash.to_string());
    }
    Ok(sums)
}
