//! A trained model in Hugging Face's Llama format, for `tinyllm export`.
//!
//! The directory [`export_run`] writes is what `transformers.LlamaForCausalLM
//! .from_pretrained(dir)` loads: `config.json` and `model.safetensors` (F32, header metadata
//! `{"format": "pt"}`), and what `AutoTokenizer` and `pipeline("text-generation")` load
//! with it: the run's `tokenizer.json` (for a run on bytes, one whose token `b` is byte `b`),
//! `tokenizer_config.json` and `generation_config.json` (greedy, at most the context). tinyllm's model is Hugging Face's Llama computation for computation
//! (pre-norm RMSNorm `x · rsqrt(mean(x²) + eps) · g`, rotary positions with
//! `θ = t · base^(−2i/hd)`, attention scaled by `1/√hd`, the SwiGLU MLP
//! `down(silu(gate(x)) · up(x))`, no biases, grouped-query attention as
//! `num_key_value_heads`, a head of its own or tied to the embedding as
//! `tie_word_embeddings`); dropout is off at inference.
//! Three things differ only in how the weights are laid out, and the export converts them:
//!
//! - **Names.** `emb.weight` → `model.embed_tokens.weight`; block `i`'s `n1.w` →
//!   `model.layers.{i}.input_layernorm.weight`, `wq`/`wk`/`wv`/`wo` →
//!   `self_attn.{q,k,v,o}_proj`, `n2.w` → `post_attention_layernorm`, `w1` (gate) →
//!   `mlp.gate_proj`, `w3` (up) → `mlp.up_proj`, `w2` (down) → `mlp.down_proj`;
//!   `norm.w` → `model.norm.weight`; `head.weight` → `lm_head.weight` (absent when the
//!   head is tied).
//! - **Linear weights are transposed**: tinyllm stores `[in, out]` and computes `x·W`,
//!   PyTorch stores `[out, in]` and computes `x·Wᵀ`.
//! - **Rotary pairs.** tinyllm turns the interleaved pairs `(2i, 2i+1)` of each head (as
//!   Meta's Llama); Hugging Face turns `(j, j + hd/2)` ("rotate half"). Both use frequency
//!   `i` for pair `i`, so row `j < hd/2` of a head of Hugging Face's `q_proj` (and `k_proj`)
//!   is tinyllm's output `2j` of that head, and row `j + hd/2` is output `2j + 1`. Queries
//!   and keys are permuted alike, so every score `q·k` is unchanged; values and the output
//!   projection keep their order.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::json;

use crate::data::{Tokenizer, bytes_tokenizer_json};
use crate::error::{Result, TrainError};
use crate::model::{Llama, ModelConfig};
use crate::store::{NamedTensor, encode_tensors, write_atomic};
use crate::train::load_model;

/// The weights file of an exported model.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The config file of an exported model.
pub const CONFIG_FILE: &str = "config.json";
/// The tokenizer of an exported model, its settings for `transformers`, and the settings
/// of its generation.
pub const TOKENIZER_FILES: [&str; 3] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
];
/// The safetensors header metadata transformers expects of PyTorch weights.
pub const WEIGHTS_METADATA: &[(&str, &str)] = &[("format", "pt")];

/// What [`export_run`] wrote.
#[derive(Clone, Debug)]
pub struct Exported {
    /// The checkpoint the weights came from.
    pub checkpoint_step: Option<u64>,
    /// The model's sizes.
    pub config: ModelConfig,
    /// The directory written.
    pub dir: PathBuf,
}

/// Hugging Face's name of tinyllm's parameter `name`, and whether it is a linear weight
/// (to transpose) and a query or key projection (to permute).
pub(crate) fn hf_name(name: &str) -> Option<(String, bool, bool)> {
    match name {
        "emb.weight" => return Some(("model.embed_tokens.weight".into(), false, false)),
        "norm.w" => return Some(("model.norm.weight".into(), false, false)),
        "head.weight" => return Some(("lm_head.weight".into(), true, false)),
        _ => {}
    }
    let rest = name.strip_prefix("blocks.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (hf, linear, rotary) = match part {
        "n1.w" => ("input_layernorm.weight", false, false),
        "wq.weight" => ("self_attn.q_proj.weight", true, true),
        "wk.weight" => ("self_attn.k_proj.weight", true, true),
        "wv.weight" => ("self_attn.v_proj.weight", true, false),
        "wo.weight" => ("self_attn.o_proj.weight", true, false),
        "n2.w" => ("post_attention_layernorm.weight", false, false),
        "w1.weight" => ("mlp.gate_proj.weight", true, false),
        "w3.weight" => ("mlp.up_proj.weight", true, false),
        "w2.weight" => ("mlp.down_proj.weight", true, false),
        _ => return None,
    };
    Some((format!("model.layers.{layer}.{hf}"), linear, rotary))
}

/// tinyllm's output index of row `row` of Hugging Face's q or k projection, for heads of
/// size `head_dim`: within a head, row `j < hd/2` is output `2j`, row `j + hd/2` is `2j + 1`.
pub fn rotary_source(row: usize, head_dim: usize) -> usize {
    let half = head_dim / 2;
    let (head, j) = (row / head_dim, row % head_dim);
    head * head_dim + if j < half { 2 * j } else { 2 * (j - half) + 1 }
}

/// The model's weights under Hugging Face's names and layout, in tinyllm's parameter order.
///
/// # Panics
/// If the model has a parameter this export does not know (a bug: the model and this
/// mapping changed apart).
pub fn hf_tensors(model: &Llama<f32>) -> Vec<NamedTensor> {
    let head_dim = model.config().head_dim();
    model
        .named_parameters()
        .into_iter()
        .map(|(name, tensor)| {
            let (hf, linear, rotary) =
                hf_name(&name).unwrap_or_else(|| panic!("export: unknown parameter {name}"));
            let shape = tensor.shape();
            let value = tensor.value();
            let value = value.as_standard_layout();
            let values = value.as_slice().expect("standard layout");
            if !linear {
                return (hf, shape, values.to_vec());
            }
            // [in, out] → [out, in], each output row taken from its source column.
            let (inputs, outputs) = (shape[0], shape[1]);
            let mut out = Vec::with_capacity(values.len());
            for row in 0..outputs {
                let source = if rotary {
                    rotary_source(row, head_dim)
                } else {
                    row
                };
                out.extend((0..inputs).map(|input| values[input * outputs + source]));
            }
            (hf, vec![outputs, inputs], out)
        })
        .collect()
}

/// The `config.json` of the exported model.
///
/// tinyllm prepends no begin-of-text token and pads nothing, so `bos_token_id` and
/// `pad_token_id` are null; `eos_token_id` is the tokenizer's end-of-text token, which
/// separated the documents the model was trained on (null for bytes, whose documents end
/// with a newline, an ordinary byte).
pub fn hf_config(config: &ModelConfig, tokenizer: &Tokenizer) -> serde_json::Value {
    let eos = tokenizer.end_of_text_token().map(|(id, _)| id);
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.d_model,
        "intermediate_size": config.hidden,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads(),
        "head_dim": config.head_dim(),
        "num_hidden_layers": config.n_layers,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_base,
        "rope_scaling": null,
        "vocab_size": config.vocab,
        "max_position_embeddings": config.context,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": true,
        "bos_token_id": null,
        "eos_token_id": eos,
        "pad_token_id": null,
    })
}

/// The files that let `transformers` tokenize and generate as `tinyllm sample --greedy`
/// does: [`TOKENIZER_FILES`] with their contents. `tokenizer.json` is the run's file byte
/// for byte (it must still be the one loaded), or [`bytes_tokenizer_json`].
///
/// # Errors
/// [`TrainError::Io`] when the tokenizer's file cannot be read, and
/// [`TrainError::Data`] when it changed since it was loaded.
pub fn hf_tokenizer_files(config: &ModelConfig, tokenizer: &Tokenizer) -> Result<[Vec<u8>; 3]> {
    let json = match (tokenizer.path(), tokenizer.sha256()) {
        (Some(path), Some(expected)) => {
            let bytes = fs::read(path).map_err(|e| TrainError::io(path, e))?;
            let found = crate::store::fingerprint(&bytes);
            if found != expected {
                return Err(crate::data::DataError::TokenizerChanged {
                    path: path.to_path_buf(),
                    expected: expected.to_string(),
                    found,
                }
                .into());
            }
            bytes
        }
        _ => bytes_tokenizer_json().into_bytes(),
    };
    let eos = tokenizer.end_of_text_token();
    let tokenizer_config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config.context,
        "bos_token": null,
        "eos_token": eos.as_ref().map(|(_, name)| name),
        "pad_token": null,
        "add_bos_token": false,
        "add_eos_token": false,
        "clean_up_tokenization_spaces": false,
    });
    let generation = json!({
        "bos_token_id": null,
        "eos_token_id": eos.as_ref().map(|(id, _)| id),
        "pad_token_id": null,
        "do_sample": false,
        "max_length": config.context,
    });
    let pretty = |value: &serde_json::Value| {
        let mut text = serde_json::to_vec_pretty(value).expect("JSON serializes");
        text.push(b'\n');
        text
    };
    Ok([json, pretty(&tokenizer_config), pretty(&generation)])
}

/// Exports the latest checkpoint of `run_dir` to `to` (see [`export_model`]).
///
/// # Errors
/// [`TrainError::InvalidArgument`] when `to` is `run_dir`, holds it or lies inside it
/// (symbolic links resolved): replacing `to` would delete the run. [`TrainError::Checkpoint`]
/// when `run_dir` has no checkpoint or it is damaged (from [`load_model`]); then those of
/// [`export_model`]. Nothing is written on any error.
pub fn export_run(run_dir: &Path, to: &Path, force: bool) -> Result<Exported> {
    check_apart(run_dir, to)?;
    check_target(to, force)?;
    let (train_config, model) = load_model(run_dir)?;
    let step = crate::train::snapshot::latest_step(run_dir)?;
    let tokenizer = match &train_config.tokenizer {
        // The run's copy of its tokenizer, else the file its config names.
        Some(file) => {
            let copy = run_dir.join(crate::train::TOKENIZER_FILE);
            let path = if copy.is_file() {
                copy
            } else {
                file.path.clone()
            };
            let tokenizer = Tokenizer::load(&path)?;
            if tokenizer.sha256() != Some(file.sha256.as_str()) {
                return Err(crate::data::DataError::TokenizerChanged {
                    path,
                    expected: file.sha256.clone(),
                    found: tokenizer.sha256().unwrap_or_default().to_string(),
                }
                .into());
            }
            tokenizer
        }
        None => Tokenizer::Bytes,
    };
    export_model(&model, &tokenizer, to, force)?;
    Ok(Exported {
        checkpoint_step: step,
        config: train_config.model,
        dir: to.to_path_buf(),
    })
}

/// Refuses a target that is the run, holds it, or lies inside it, once both paths are
/// resolved (`.`, `..` and symbolic links): the export replaces its target whole, and
/// `--force` on a directory holding the run would delete every checkpoint of it.
fn check_apart(run_dir: &Path, to: &Path) -> Result<()> {
    // A run that cannot be resolved is no run to lose: loading it says what is wrong.
    let Ok(run) = fs::canonicalize(run_dir) else {
        return Ok(());
    };
    let target = resolve_partly(to).map_err(|error| TrainError::io(to, error))?;
    let relation = if target == run {
        "is the run directory itself"
    } else if run.starts_with(&target) {
        "holds the run directory"
    } else if target.starts_with(&run) {
        "lies inside the run directory"
    } else {
        return Ok(());
    };
    Err(TrainError::InvalidArgument {
        name: "--to",
        value: to.display().to_string(),
        reason: format!(
            "{relation} --from {} (resolved: {} and {}); export elsewhere",
            run_dir.display(),
            target.display(),
            run.display()
        ),
    })
}

/// `path` made absolute with every link resolved, for a path whose last components need
/// not exist yet: the longest existing prefix is resolved and the rest appended.
fn resolve_partly(path: &Path) -> std::io::Result<PathBuf> {
    let absolute = std::path::absolute(path)?;
    let mut existing = absolute.as_path();
    let mut rest = Vec::new();
    loop {
        match fs::canonicalize(existing) {
            Ok(mut resolved) => {
                for component in rest.iter().rev() {
                    match component {
                        std::path::Component::ParentDir => {
                            resolved.pop();
                        }
                        std::path::Component::CurDir => {}
                        other => resolved.push(other),
                    }
                }
                return Ok(resolved);
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                let (Some(parent), Some(last)) =
                    (existing.parent(), existing.components().next_back())
                else {
                    return Err(error);
                };
                rest.push(last);
                existing = parent;
            }
            Err(error) => return Err(error),
        }
    }
}

/// Refuses a `to` that is a file, or a non-empty directory without `force`.
fn check_target(to: &Path, force: bool) -> Result<()> {
    match fs::symlink_metadata(to) {
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(TrainError::io(to, error)),
        Ok(meta) if !meta.is_dir() => Err(TrainError::InvalidArgument {
            name: "--to",
            value: to.display().to_string(),
            reason: "exists and is not a directory".into(),
        }),
        Ok(_) => {
            let empty = fs::read_dir(to)
                .map_err(|error| TrainError::io(to, error))?
                .next()
                .is_none();
            if empty || force {
                Ok(())
            } else {
                Err(TrainError::InvalidArgument {
                    name: "--to",
                    value: to.display().to_string(),
                    reason: "exists and is not empty; pass --force to replace it".into(),
                })
            }
        }
    }
}

/// Writes `model` in Hugging Face's Llama format to the directory `to`: `config.json` and
/// `model.safetensors`, and `tokenizer`'s files ([`hf_tokenizer_files`]).
///
/// The files are written into a temporary directory next to `to`, which is renamed into
/// place once complete; an existing `to` (empty, or any with `force`) is replaced only then.
/// A failure leaves `to` as it was and removes the temporary directory.
///
/// # Errors
/// [`TrainError::InvalidArgument`] when `to` is a file, or a non-empty directory and `force`
/// is false, or when `tokenizer`'s vocabulary is not the model's; [`TrainError::Io`] when a
/// file cannot be written; those of [`hf_tokenizer_files`].
pub fn export_model(
    model: &Llama<f32>,
    tokenizer: &Tokenizer,
    to: &Path,
    force: bool,
) -> Result<()> {
    check_target(to, force)?;
    if tokenizer.vocab_size() != model.config().vocab {
        return Err(TrainError::InvalidArgument {
            name: "tokenizer",
            value: tokenizer.describe(),
            reason: format!("the model's vocabulary is {}", model.config().vocab),
        });
    }
    let tokenizer_files = hf_tokenizer_files(model.config(), tokenizer)?;
    let name =
        to.file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| TrainError::InvalidArgument {
                name: "--to",
                value: to.display().to_string(),
                reason: "must name a directory".into(),
            })?;
    let parent = match to.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !parent.is_dir() {
        return Err(TrainError::io(
            &parent,
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such directory"),
        ));
    }
    let pid = std::process::id();
    let staging = parent.join(format!(".{name}.{pid}.tmp"));
    let old = parent.join(format!(".{name}.{pid}.old"));
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TrainError::io(path, source)
    };
    if staging.exists() {
        fs::remove_dir_all(&staging).map_err(io(&staging))?;
    }
    let write = || -> Result<()> {
        fs::create_dir(&staging).map_err(io(&staging))?;
        let config = serde_json::to_vec_pretty(&hf_config(model.config(), tokenizer))
            .expect("JSON serializes");
        write_atomic(&staging.join(CONFIG_FILE), &config)?;
        for (name, contents) in TOKENIZER_FILES.iter().zip(&tokenizer_files) {
            write_atomic(&staging.join(name), contents)?;
        }
        let weights = encode_tensors(&hf_tensors(model), WEIGHTS_METADATA);
        write_atomic(&staging.join(WEIGHTS_FILE), &weights)?;
        // Out of the way, not yet removed: put back if the rename below fails.
        let replaced = to.exists();
        if replaced {
            fs::rename(to, &old).map_err(io(to))?;
        }
        if let Err(error) = fs::rename(&staging, to) {
            if replaced {
                let _ = fs::rename(&old, to);
            }
            return Err(TrainError::io(to, error));
        }
        if replaced {
            fs::remove_dir_all(&old).map_err(io(&old))?;
        }
        fs::File::open(&parent)
            .and_then(|dir| dir.sync_all())
            .map_err(io(&parent))
    };
    write().inspect_err(|_| {
        let _ = fs::remove_dir_all(&staging);
    })
}
