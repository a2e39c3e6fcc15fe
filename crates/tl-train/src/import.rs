//! A Hugging Face Llama directory as a tinyllm model, for `tinyllm train --init-from DIR`:
//! the inverse of [`export`](crate::export).
//!
//! The directory is what `save_pretrained` writes: `config.json`, the weights as one
//! `model.safetensors` or as shards named by `model.safetensors.index.json`, in float32,
//! bfloat16 or float16 (each widened to f32 exactly), and usually `tokenizer.json`.
//! [`hf_model_config`] reads the sizes and refuses what tinyllm does not compute, naming the
//! key: another architecture, biases, rope scaling, sliding windows, an activation other
//! than SiLU. [`load_hf_weights`] puts the tensors into a model of those sizes, undoing the
//! export's three conversions (names, `[out, in]` → `[in, out]`, the rotary rows of the query
//! and key projections), and refuses a missing tensor, an unknown one, or a wrong shape.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::error::{Result, TrainError};
use crate::export::{CONFIG_FILE, WEIGHTS_FILE, hf_name, rotary_source};
use crate::model::{Llama, ModelConfig};

/// The index of a sharded checkpoint: which file holds each tensor.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Tensors a checkpoint may hold that are not weights (older transformers saved the rotary
/// frequencies): skipped.
const BUFFERS: [&str; 1] = ["rotary_emb.inv_freq"];

/// The model sizes of the Hugging Face Llama in `dir` (its `config.json`), with no dropout.
///
/// Reads the keys of transformers 4 (`rope_theta`, `rope_scaling`) and 5 (`rope_parameters`).
///
/// # Errors
/// [`TrainError::ConfigFile`] naming the key: an architecture other than Llama's, a missing
/// or mistyped size, or an option tinyllm does not compute (biases, rope scaling, a sliding
/// window, an activation other than SiLU, a head size other than `hidden_size /
/// num_attention_heads`); [`TrainError::Io`] when the file cannot be read; and
/// [`TrainError::InvalidConfig`] when the sizes do not fit together.
pub fn hf_model_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|source| TrainError::io(&path, source))?;
    let refuse = |key: &str, reason: String| TrainError::ConfigFile {
        path: path.clone(),
        key: key.to_string(),
        reason,
    };
    let json: Value = serde_json::from_str(&text).map_err(|e| refuse("", e.to_string()))?;
    let Value::Object(keys) = &json else {
        return Err(refuse("", "not a JSON object".into()));
    };
    let model_type = keys.get("model_type").and_then(Value::as_str);
    if model_type != Some("llama") {
        return Err(refuse(
            "model_type",
            format!("{model_type:?}: tinyllm imports Llama models (model_type \"llama\") only"),
        ));
    }
    if let Some(architectures) = keys.get("architectures") {
        let llama = serde_json::json!(["LlamaForCausalLM"]);
        if architectures != &llama {
            return Err(refuse(
                "architectures",
                format!("{architectures}: tinyllm imports LlamaForCausalLM only"),
            ));
        }
    }
    let size = |key: &str| -> Result<usize> {
        let value = keys.get(key).ok_or_else(|| refuse(key, "missing".into()))?;
        (value.as_u64())
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| refuse(key, format!("{value}: expected a whole number")))
    };
    let number = |key: &str, default: Option<f64>| -> Result<f64> {
        match keys.get(key) {
            Some(value) => {
                (value.as_f64()).ok_or_else(|| refuse(key, format!("{value}: expected a number")))
            }
            None => default.ok_or_else(|| refuse(key, "missing".into())),
        }
    };
    // Options tinyllm does not compute: refused unless absent, null or the plain value.
    let plain = |key: &str, allowed: &[Value]| -> Result<()> {
        match keys.get(key) {
            Some(value) if !value.is_null() && !allowed.contains(value) => Err(refuse(
                key,
                format!("{value}: not supported (tinyllm computes a Llama without it)"),
            )),
            _ => Ok(()),
        }
    };
    plain("attention_bias", &[Value::Bool(false)])?;
    plain("mlp_bias", &[Value::Bool(false)])?;
    plain("rope_scaling", &[])?;
    plain("sliding_window", &[])?;
    plain("hidden_act", &[Value::from("silu")])?;
    plain("pretraining_tp", &[Value::from(1)])?;
    let mut rope_base = number("rope_theta", Some(10_000.0))?;
    if let Some(parameters) = keys.get("rope_parameters").filter(|v| !v.is_null()) {
        let kind = parameters.get("rope_type").and_then(Value::as_str);
        if kind.is_some_and(|kind| kind != "default") {
            return Err(refuse(
                "rope_parameters.rope_type",
                format!("{kind:?}: not supported (tinyllm computes the default rotary embedding)"),
            ));
        }
        if let Some(theta) = parameters.get("rope_theta") {
            rope_base = (theta.as_f64()).ok_or_else(|| {
                refuse(
                    "rope_parameters.rope_theta",
                    format!("{theta}: expected a number"),
                )
            })?;
        }
    }
    let (d_model, n_heads) = (size("hidden_size")?, size("num_attention_heads")?);
    if keys.get("head_dim").is_some_and(|v| !v.is_null()) {
        let head_dim = size("head_dim")?;
        if n_heads == 0 || head_dim * n_heads != d_model {
            return Err(refuse(
                "head_dim",
                format!(
                    "{head_dim}: tinyllm's heads are hidden_size / num_attention_heads = \
                     {d_model} / {n_heads} wide"
                ),
            ));
        }
    }
    let n_kv_heads = match keys.get("num_key_value_heads") {
        Some(value) if !value.is_null() => Some(size("num_key_value_heads")?),
        _ => None,
    };
    let config = ModelConfig {
        vocab: size("vocab_size")?,
        d_model,
        n_layers: size("num_hidden_layers")?,
        n_heads,
        hidden: size("intermediate_size")?,
        context: size("max_position_embeddings")?,
        norm_eps: number("rms_norm_eps", None)?,
        rope_base,
        dropout: 0.0,
        n_kv_heads: n_kv_heads.filter(|&kv| kv != n_heads),
        tie_embeddings: match keys.get("tie_word_embeddings") {
            None | Some(Value::Null) => false,
            Some(value) => (value.as_bool()).ok_or_else(|| {
                refuse(
                    "tie_word_embeddings",
                    format!("{value}: expected true or false"),
                )
            })?,
        },
    };
    config.validate()?;
    Ok(config)
}

/// The weights files of the checkpoint in `dir` and the tensors each holds: the index's
/// shards, or the one `model.safetensors`.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(INDEX_FILE);
    if !index.exists() {
        return Ok(vec![dir.join(WEIGHTS_FILE)]);
    }
    let text = std::fs::read_to_string(&index).map_err(|source| TrainError::io(&index, source))?;
    let bad = |reason: String| TrainError::ConfigFile {
        path: index.clone(),
        key: "weight_map".into(),
        reason,
    };
    let json: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = (json.get("weight_map").and_then(Value::as_object))
        .ok_or_else(|| bad("missing, or not an object of tensor names to files".into()))?;
    let mut files: Vec<PathBuf> = Vec::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("{tensor}: not a file name")))?;
        // A shard is a file beside the index, never a path elsewhere.
        if file.contains('/') || file.contains('\\') || file == ".." {
            return Err(bad(format!(
                "{tensor}: {file:?} is not a file beside the index"
            )));
        }
        let path = dir.join(file);
        if !files.contains(&path) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// A tensor read: its shape and its values widened to f32.
type Widened = (Vec<usize>, Vec<f32>);

/// Every tensor of the checkpoint in `dir` by name.
fn read_tensors(dir: &Path) -> Result<BTreeMap<String, Widened>> {
    let mut tensors = BTreeMap::new();
    for path in weight_files(dir)? {
        let bad = |reason: String| TrainError::Checkpoint {
            path: path.clone(),
            reason,
        };
        let file = File::open(&path).map_err(|source| TrainError::io(&path, source))?;
        // SAFETY: the map is read only, and only while this function holds it; a file changed
        // underneath by another process can give wrong values, never unsafety in this
        // process beyond what reading a changing file gives.
        let map =
            unsafe { memmap2::Mmap::map(&file) }.map_err(|source| TrainError::io(&path, source))?;
        let file = SafeTensors::deserialize(&map).map_err(|e| bad(e.to_string()))?;
        for (name, view) in file.tensors() {
            let data = view.data();
            let values: Vec<f32> = match view.dtype() {
                Dtype::F32 => (data.chunks_exact(4))
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect(),
                Dtype::BF16 => (data.chunks_exact(2))
                    .map(|c| half::bf16::from_le_bytes(c.try_into().expect("2 bytes")).to_f32())
                    .collect(),
                Dtype::F16 => (data.chunks_exact(2))
                    .map(|c| half::f16::from_le_bytes(c.try_into().expect("2 bytes")).to_f32())
                    .collect(),
                other => {
                    return Err(bad(format!(
                        "{name} is {other:?}: tinyllm imports F32, BF16 and F16 weights"
                    )));
                }
            };
            if tensors
                .insert(name.clone(), (view.shape().to_vec(), values))
                .is_some()
            {
                return Err(bad(format!("{name} is in more than one file")));
            }
        }
    }
    Ok(tensors)
}

/// Loads the weights of the Hugging Face Llama in `dir` into `model` (fresh, of the sizes
/// [`hf_model_config`] read from the same directory), converting each tensor to tinyllm's
/// layout.
///
/// # Errors
/// [`TrainError::Checkpoint`] naming the tensor: missing, of another shape, of a type
/// other than F32, BF16 and F16, or not a weight of this model (an unknown name); and what
/// reading the files gives.
pub fn load_hf_weights(model: &Llama<f32>, dir: &Path) -> Result<()> {
    let config = model.config().clone();
    let mut tensors = read_tensors(dir)?;
    let head_dim = config.head_dim();
    let bad = |reason: String| TrainError::Checkpoint {
        path: dir.to_path_buf(),
        reason,
    };
    for (name, parameter) in model.named_parameters() {
        let (hf, linear, rotary) =
            hf_name(&name).unwrap_or_else(|| panic!("import: unknown parameter {name}"));
        let (shape, values) = tensors
            .remove(&hf)
            .ok_or_else(|| bad(format!("{hf} is missing (tinyllm's {name})")))?;
        let ours = parameter.shape();
        let expected: Vec<usize> = if linear {
            vec![ours[1], ours[0]]
        } else {
            ours.clone()
        };
        if shape != expected {
            return Err(bad(format!(
                "{hf} is {shape:?}, the config's sizes make it {expected:?}"
            )));
        }
        parameter.update_value(|target| {
            let target = target.as_slice_mut().expect("a parameter is contiguous");
            if !linear {
                target.copy_from_slice(&values);
                return;
            }
            // Hugging Face's row `row` ([out, in]) is tinyllm's column `source` ([in, out]).
            let (inputs, outputs) = (ours[0], ours[1]);
            for row in 0..outputs {
                let source = if rotary {
                    rotary_source(row, head_dim)
                } else {
                    row
                };
                for input in 0..inputs {
                    target[input * outputs + source] = values[row * inputs + input];
                }
            }
        });
    }
    if config.tie_embeddings {
        // Some checkpoints store the tied head too: it is the embedding.
        tensors.remove("lm_head.weight");
    }
    let unknown: Vec<&String> = (tensors.keys())
        .filter(|name| !BUFFERS.iter().any(|buffer| name.ends_with(buffer)))
        .collect();
    if let Some(first) = unknown.first() {
        return Err(bad(format!(
            "{first} is not a weight of a Llama of these sizes ({} unknown tensors)",
            unknown.len()
        )));
    }
    Ok(())
}

/// The model of the Hugging Face Llama in `dir`: its sizes, its weights.
///
/// # Errors
/// As [`hf_model_config`] and [`load_hf_weights`].
pub fn import_model(dir: &Path) -> Result<Llama<f32>> {
    let config = hf_model_config(dir)?;
    let model = Llama::new(&config, 0)?;
    load_hf_weights(&model, dir)?;
    Ok(model)
}
