//! `tinyllm export`: the exported tensors, read back by name, run through a plain forward
//! pass in Hugging Face's conventions, give tinyllm's logits; refused exports write nothing.

mod common;

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use common::{TINY_TRAIN, run_error, tinyllm};
use safetensors::{Dtype, SafeTensors};
use tl_tensor::nn::Module;
use tl_tensor::{Generator, no_grad};
use tl_train::TrainError;
use tl_train::cli::Exit;
use tl_train::data::Tokenizer;
use tl_train::export::{export_model, rotary_source};
use tl_train::model::{Llama, ModelConfig};

/// The tolerance on each logit: `|hf − tinyllm| ≤ TOLERANCE · max(1, |tinyllm|)`, i.e.
/// absolute for logits up to 1 and relative above.
const TOLERANCE: f64 = 1e-5;

/// A prompt of several tokens.
const PROMPT: &[u8] = b"The lazy fox";

/// An exported model: its config.json and its tensors by name (shape, values as f64).
struct Exported {
    config: serde_json::Value,
    tensors: HashMap<String, (Vec<usize>, Vec<f64>)>,
    metadata: HashMap<String, String>,
}

fn read_export(dir: &Path) -> Exported {
    let mut files: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    let config = serde_json::from_slice(&fs::read(dir.join("config.json")).unwrap()).unwrap();
    let bytes = fs::read(dir.join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let metadata = header.metadata().clone().expect("header metadata");
    let tensors = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), Dtype::F32, "{name}");
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
                .collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect();
    Exported {
        config,
        tensors,
        metadata,
    }
}

impl Exported {
    /// The tensor `name`, checked to have `shape`.
    fn get(&self, name: &str, shape: &[usize]) -> &[f64] {
        let (got, values) = self
            .tensors
            .get(name)
            .unwrap_or_else(|| panic!("no tensor {name}"));
        assert_eq!(got, shape, "{name}");
        values
    }

    fn size(&self, key: &str) -> usize {
        self.config[key].as_u64().unwrap() as usize
    }
}

/// `y = W·x` for a PyTorch weight `W` of shape `[out, in]`.
fn linear(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks_exact(x.len())
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// Hugging Face's LlamaRMSNorm: `w · x · rsqrt(mean(x²) + eps)`.
fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let mean_square = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (mean_square + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| g * v * r).collect()
}

/// Hugging Face's rotary embedding ("rotate half") of one head at position `t`:
/// `x·cos + rotate_half(x)·sin` with `inv_freq[i] = theta^(−2i/hd)`, each frequency used
/// for elements `i` and `i + hd/2`.
fn rotate_half(head: &mut [f64], t: usize, theta: f64) {
    let half = head.len() / 2;
    for i in 0..half {
        let angle = t as f64 * theta.powf(-((2 * i) as f64) / head.len() as f64);
        let (c, s) = (angle.cos(), angle.sin());
        let (x1, x2) = (head[i], head[i + half]);
        head[i] = x1 * c - x2 * s;
        head[i + half] = x2 * c + x1 * s;
    }
}

/// Logits `[time][vocab]` of `ids` from the exported tensors alone, in f64, as
/// transformers' LlamaForCausalLM computes them.
fn hf_forward(model: &Exported, ids: &[usize]) -> Vec<Vec<f64>> {
    let d = model.size("hidden_size");
    let hidden = model.size("intermediate_size");
    let heads = model.size("num_attention_heads");
    let kv_heads = model.size("num_key_value_heads");
    let layers = model.size("num_hidden_layers");
    let vocab = model.size("vocab_size");
    let eps = model.config["rms_norm_eps"].as_f64().unwrap();
    let theta = model.config["rope_theta"].as_f64().unwrap();
    let hd = d / heads;
    let (d_kv, group) = (kv_heads * hd, heads / kv_heads);
    let embed = model.get("model.embed_tokens.weight", &[vocab, d]);
    let mut x: Vec<Vec<f64>> = ids
        .iter()
        .map(|&id| embed[id * d..][..d].to_vec())
        .collect();
    for l in 0..layers {
        let p = |name: &str, shape: &[usize]| model.get(&format!("model.layers.{l}.{name}"), shape);
        let (wq, wk, wv, wo) = (
            p("self_attn.q_proj.weight", &[d, d]),
            p("self_attn.k_proj.weight", &[d_kv, d]),
            p("self_attn.v_proj.weight", &[d_kv, d]),
            p("self_attn.o_proj.weight", &[d, d]),
        );
        let n1 = p("input_layernorm.weight", &[d]);
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for (t, row) in x.iter().enumerate() {
            let h = rms_norm(row, n1, eps);
            let (mut qt, mut kt) = (linear(wq, &h), linear(wk, &h));
            for head in 0..heads {
                rotate_half(&mut qt[head * hd..(head + 1) * hd], t, theta);
            }
            for head in 0..kv_heads {
                rotate_half(&mut kt[head * hd..(head + 1) * hd], t, theta);
            }
            q.push(qt);
            k.push(kt);
            v.push(linear(wv, &h));
        }
        let scale = 1.0 / (hd as f64).sqrt();
        for t in 0..x.len() {
            let mut mixed = vec![0.0; d];
            for head in 0..heads {
                let cols = head * hd..(head + 1) * hd;
                // repeat_kv: query head h reads key/value head h / group.
                let kv = (head / group) * hd;
                let scores: Vec<f64> = (0..=t)
                    .map(|s| {
                        let dot: f64 = (0..hd).map(|c| q[t][cols.start + c] * k[s][kv + c]).sum();
                        dot * scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for (s, w) in weights.iter().enumerate() {
                    for c in 0..hd {
                        mixed[cols.start + c] += w / total * v[s][kv + c];
                    }
                }
            }
            let out = linear(wo, &mixed);
            x[t].iter_mut().zip(out).for_each(|(a, b)| *a += b);
        }
        let n2 = p("post_attention_layernorm.weight", &[d]);
        let (gate, up, down) = (
            p("mlp.gate_proj.weight", &[hidden, d]),
            p("mlp.up_proj.weight", &[hidden, d]),
            p("mlp.down_proj.weight", &[d, hidden]),
        );
        for row in &mut x {
            let h = rms_norm(row, n2, eps);
            let (g, u) = (linear(gate, &h), linear(up, &h));
            let act: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let out = linear(down, &act);
            row.iter_mut().zip(out).for_each(|(a, b)| *a += b);
        }
    }
    let norm = model.get("model.norm.weight", &[d]);
    let head = match model.config["tie_word_embeddings"].as_bool().unwrap() {
        true => embed,
        false => model.get("lm_head.weight", &[vocab, d]),
    };
    x.iter()
        .map(|row| linear(head, &rms_norm(row, norm, eps)))
        .collect()
}

/// tinyllm's own logits `[time][vocab]` for `ids`.
fn tinyllm_logits(model: &Llama<f32>, ids: &[usize]) -> Vec<Vec<f64>> {
    let _inference = no_grad();
    model.set_training(false);
    let logits = model.forward_ids(ids, 1, ids.len()).unwrap().to_vec();
    logits
        .chunks_exact(model.config().vocab)
        .map(|row| row.iter().map(|&v| f64::from(v)).collect())
        .collect()
}

/// Checks the names, shapes, metadata and config of an export of `config`, and that its
/// forward pass matches `model`'s logits on [`PROMPT`]. Returns the largest difference.
fn check_export(dir: &Path, model: &Llama<f32>) -> f64 {
    let config = model.config();
    let exported = read_export(dir);
    assert_eq!(
        exported.metadata,
        HashMap::from([("format".to_string(), "pt".to_string())])
    );
    let c = &exported.config;
    assert_eq!(c["architectures"], serde_json::json!(["LlamaForCausalLM"]));
    assert_eq!(c["model_type"], "llama");
    assert_eq!(exported.size("hidden_size"), config.d_model);
    assert_eq!(exported.size("intermediate_size"), config.hidden);
    assert_eq!(exported.size("num_attention_heads"), config.n_heads);
    assert_eq!(exported.size("num_key_value_heads"), config.kv_heads());
    assert_eq!(exported.size("num_hidden_layers"), config.n_layers);
    assert_eq!(exported.size("vocab_size"), 256);
    assert_eq!(exported.size("max_position_embeddings"), config.context);
    assert_eq!(c["rms_norm_eps"].as_f64(), Some(config.norm_eps));
    assert_eq!(c["rope_theta"].as_f64(), Some(config.rope_base));
    assert_eq!(c["tie_word_embeddings"], config.tie_embeddings);
    assert_eq!(c["torch_dtype"], "float32");
    assert_eq!(c["hidden_act"], "silu");
    assert_eq!(c["attention_bias"], false);
    assert_eq!(c["mlp_bias"], false);
    assert!(c["bos_token_id"].is_null() && c["eos_token_id"].is_null());

    let mut names: Vec<String> = vec![
        "model.embed_tokens.weight".into(),
        "model.norm.weight".into(),
    ];
    if !config.tie_embeddings {
        names.push("lm_head.weight".into());
    }
    for l in 0..config.n_layers {
        for part in [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        ] {
            names.push(format!("model.layers.{l}.{part}.weight"));
        }
    }
    names.sort();
    let mut got: Vec<String> = exported.tensors.keys().cloned().collect();
    got.sort();
    assert_eq!(got, names);

    let ids: Vec<usize> = PROMPT.iter().map(|&b| usize::from(b)).collect();
    let (hf, ours) = (hf_forward(&exported, &ids), tinyllm_logits(model, &ids));
    assert_eq!(hf.len(), ids.len());
    let mut worst: f64 = 0.0;
    for (t, (a, b)) in hf.iter().zip(&ours).enumerate() {
        for (i, (a, b)) in a.iter().zip(b).enumerate() {
            let error = (a - b).abs();
            assert!(
                error <= TOLERANCE * b.abs().max(1.0),
                "position {t}, logit {i}: reference {a}, tinyllm {b}"
            );
            worst = worst.max(error);
        }
    }
    worst
}

/// A model whose every weight, gains included, is random: a wrong transpose, permutation
/// or swapped gain cannot hide behind gains of 1 or symmetric weights.
fn random_model(config: &ModelConfig, seed: u64) -> Llama<f32> {
    let model = Llama::<f32>::new(config, seed).unwrap();
    let rng = Generator::new(seed + 100);
    for p in model.parameters() {
        p.update_value(|a| {
            a.iter_mut()
                .for_each(|v| *v = (rng.next_f64() * 1.6 - 0.8) as f32)
        });
    }
    model
}

#[test]
fn rotary_rows_take_the_even_then_the_odd_outputs_of_each_head() {
    let rows: Vec<usize> = (0..8).map(|row| rotary_source(row, 4)).collect();
    assert_eq!(rows, [0, 2, 1, 3, 4, 6, 5, 7]);
}

#[test]
fn an_export_of_random_weights_computes_tinyllms_logits_in_hf_conventions() {
    let config = ModelConfig {
        vocab: 256,
        d_model: 24,
        n_layers: 2,
        n_heads: 3,
        hidden: 40,
        context: 16,
        norm_eps: 1e-5,
        rope_base: 500.0,
        dropout: 0.1,
        n_kv_heads: None,
        tie_embeddings: false,
    };
    let model = random_model(&config, 7);
    let dir = tempfile::tempdir().unwrap();
    let to = dir.path().join("hf");
    export_model(&model, &Tokenizer::Bytes, &to, false).unwrap();
    let worst = check_export(&to, &model);
    eprintln!("largest logit difference (random weights): {worst:e}");
    // Nothing but the export is left next to it.
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);

    // Grouped-query attention (2 key/value heads of 4 query heads), a tied head.
    let config = ModelConfig {
        n_heads: 4,
        n_kv_heads: Some(2),
        tie_embeddings: true,
        ..config
    };
    let model = random_model(&config, 8);
    let to = dir.path().join("hf-gqa-tied");
    export_model(&model, &Tokenizer::Bytes, &to, false).unwrap();
    let worst = check_export(&to, &model);
    eprintln!("largest logit difference (GQA, tied): {worst:e}");
}

#[test]
fn a_trained_run_exports_through_the_cli_and_its_metadata_says_what_it_holds() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_str = run.to_str().unwrap();
    let mut train = TINY_TRAIN.to_vec();
    train.extend(["--out", run_str, "--steps", "3", "--lr", "1e-2"]);
    assert_eq!(tinyllm(&train).unwrap(), Exit::Success);

    // Our own checkpoint's header says what its tensors are.
    let latest = fs::read_to_string(run.join("LATEST")).unwrap();
    let bytes = fs::read(
        run.join(latest.lines().next().unwrap())
            .join("model.safetensors"),
    )
    .unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let metadata = header.metadata().clone().unwrap();
    assert_eq!(metadata["format"], "tinyllm");
    assert!(metadata["layout"].contains("[in, out]"), "{metadata:?}");

    let to = dir.path().join("hf");
    let to_str = to.to_str().unwrap();
    let export = ["export", "--from", run_str, "--to", to_str];
    assert_eq!(tinyllm(&export).unwrap(), Exit::Success);
    let (_, model) = tl_train::train::load_model(&run).unwrap();
    let worst = check_export(&to, &model);
    eprintln!("largest logit difference (trained tiny run): {worst:e}");

    // A run on bytes exports a tokenizer whose ids are the bytes, no end-of-text token,
    // and greedy generation up to the context.
    let bytes = Tokenizer::load(&to.join("tokenizer.json")).unwrap();
    let text = "the fox — ünïcode";
    assert_eq!(
        bytes.encode(text).unwrap(),
        Tokenizer::Bytes.encode(text).unwrap()
    );
    let json = |name: &str| -> serde_json::Value {
        serde_json::from_slice(&fs::read(to.join(name)).unwrap()).unwrap()
    };
    assert_eq!(json("config.json")["eos_token_id"], serde_json::Value::Null);
    let generation = json("generation_config.json");
    assert_eq!(generation["do_sample"], false);
    assert_eq!(generation["max_length"], model.config().context);
    let tokenizer_config = json("tokenizer_config.json");
    assert_eq!(
        tokenizer_config["tokenizer_class"],
        "PreTrainedTokenizerFast"
    );
    assert_eq!(tokenizer_config["eos_token"], serde_json::Value::Null);

    // A second export into the now non-empty directory is refused, and --force replaces it.
    let before = fs::read(to.join("model.safetensors")).unwrap();
    let error = run_error(&export);
    assert!(
        matches!(error, TrainError::InvalidArgument { name: "--to", .. }),
        "{error}"
    );
    assert!(error.to_string().contains("--force"), "{error}");
    let mut forced = export.to_vec();
    forced.push("--force");
    assert_eq!(tinyllm(&forced).unwrap(), Exit::Success);
    assert_eq!(fs::read(to.join("model.safetensors")).unwrap(), before);
    let mut names: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["hf", "run"], "no temporary directory is left");

    // `tinyllm logits` runs on the run directory.
    let logits = ["logits", "--from", run_str, "--prompt", "the "];
    assert_eq!(tinyllm(&logits).unwrap(), Exit::Success);
    let too_long = "x".repeat(model.config().context + 1);
    let error = run_error(&["logits", "--from", run_str, "--prompt", &too_long]);
    assert!(matches!(
        error,
        TrainError::InvalidArgument { name: "prompt", .. }
    ));
}

#[test]
fn a_missing_or_damaged_checkpoint_is_a_typed_error_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let to = dir.path().join("hf");
    let to_str = to.to_str().unwrap();

    // No run at all, and a run directory without a checkpoint.
    let empty = dir.path().join("empty");
    fs::create_dir(&empty).unwrap();
    for from in [dir.path().join("no-such-run"), empty.clone()] {
        let error = run_error(&["export", "--from", from.to_str().unwrap(), "--to", to_str]);
        assert!(matches!(error, TrainError::Checkpoint { .. }), "{error}");
        assert!(!to.exists());
    }

    // A checkpoint whose weights were damaged after it was written.
    let run = dir.path().join("run");
    let run_str = run.to_str().unwrap();
    let mut train = TINY_TRAIN.to_vec();
    train.extend(["--out", run_str, "--steps", "1"]);
    tinyllm(&train).unwrap();
    let latest = fs::read_to_string(run.join("LATEST")).unwrap();
    let weights = run
        .join(latest.lines().next().unwrap())
        .join("model.safetensors");
    let mut bytes = fs::read(&weights).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    fs::write(&weights, bytes).unwrap();
    let error = run_error(&["export", "--from", run_str, "--to", to_str]);
    assert!(matches!(error, TrainError::Checkpoint { .. }), "{error}");
    assert!(error.to_string().contains("damaged"), "{error}");
    assert!(!to.exists());
    let mut names: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["empty", "run"], "nothing was written");

    // An existing non-empty --to is refused before the run is read, and left as it was.
    fs::create_dir(&to).unwrap();
    fs::write(to.join("keep.txt"), b"mine").unwrap();
    let error = run_error(&["export", "--from", run_str, "--to", to_str]);
    assert!(
        matches!(error, TrainError::InvalidArgument { .. }),
        "{error}"
    );
    assert_eq!(fs::read(to.join("keep.txt")).unwrap(), b"mine");
}
