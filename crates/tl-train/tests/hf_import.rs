//! `tinyllm train --init-from`: a Llama made by transformers (the fixtures of
//! `scripts/make_hf_fixture.py`: grouped-query attention, a tied head, rotary base 500, in
//! float32 and as bfloat16 shards) imported computes transformers' logits; exported again,
//! the same bits; what tinyllm does not compute is refused naming the key or the tensor.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::{run_error, tinyllm};
use safetensors::{Dtype, SafeTensors};
use tl_tensor::nn::Module;
use tl_tensor::no_grad;
use tl_train::TrainError;
use tl_train::cli::{CliError, Exit};
use tl_train::data::Tokenizer;
use tl_train::export::export_model;
use tl_train::import::{hf_model_config, import_model};
use tl_train::model::Llama;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The prompt's ids and transformers' float32 logits at every position.
fn expected(dir: &Path) -> (Vec<usize>, Vec<Vec<f64>>) {
    let json: serde_json::Value =
        serde_json::from_slice(&fs::read(dir.join("expected.json")).unwrap()).unwrap();
    let ids = serde_json::from_value(json["ids"].clone()).unwrap();
    let logits = serde_json::from_value(json["logits"].clone()).unwrap();
    (ids, logits)
}

/// The largest `|tinyllm − transformers| / max(1, |transformers|)` over every logit.
fn logit_error(model: &Llama<f32>, dir: &Path) -> f64 {
    let (ids, theirs) = expected(dir);
    let _inference = no_grad();
    model.set_training(false);
    let ours = model.forward_ids(&ids, 1, ids.len()).unwrap().to_vec();
    let vocab = model.config().vocab;
    assert_eq!(theirs.len(), ids.len());
    let mut worst: f64 = 0.0;
    for (row, expected) in ours.chunks_exact(vocab).zip(&theirs) {
        assert_eq!(expected.len(), vocab);
        for (&a, &b) in row.iter().zip(expected) {
            worst = worst.max((f64::from(a) - b).abs() / b.abs().max(1.0));
        }
    }
    worst
}

#[test]
fn a_transformers_llama_with_grouped_queries_and_a_tied_head_computes_its_logits() {
    for name in ["hf-llama", "hf-llama-bf16"] {
        let dir = fixture(name);
        let config = hf_model_config(&dir).unwrap();
        assert_eq!(
            (
                config.n_heads,
                config.kv_heads(),
                config.tie_embeddings,
                config.rope_base
            ),
            (4, 2, true, 500.0),
            "{name}"
        );
        let model = import_model(&dir).unwrap();
        let error = logit_error(&model, &dir);
        eprintln!("{name}: largest logit difference from transformers {error:e}");
        assert!(error <= 1e-5, "{name}: {error:e}");
    }
}

/// The export of an imported model is the file transformers wrote, tensor for tensor, bit
/// for bit (the bf16 shards widened to f32 and back are their bf16 bits).
#[test]
fn an_imported_model_exports_to_the_same_bits() {
    let scratch = tempfile::tempdir().unwrap();
    for name in ["hf-llama", "hf-llama-bf16"] {
        let dir = fixture(name);
        let model = import_model(&dir).unwrap();
        let tokenizer = Tokenizer::load(&dir.join("tokenizer.json")).unwrap();
        let to = scratch.path().join(name);
        export_model(&model, &tokenizer, &to, false).unwrap();
        let bytes = fs::read(to.join("model.safetensors")).unwrap();
        let exported = SafeTensors::deserialize(&bytes).unwrap();
        let mut originals = Vec::new();
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "safetensors") {
                originals.push(fs::read(path).unwrap());
            }
        }
        let mut count = 0;
        for bytes in &originals {
            let original = SafeTensors::deserialize(bytes).unwrap();
            for (tensor, view) in original.tensors() {
                let ours = exported.tensor(&tensor).unwrap();
                assert_eq!(ours.shape(), view.shape(), "{name} {tensor}");
                let widened: Vec<u32> = match view.dtype() {
                    Dtype::F32 => (view.data().chunks_exact(4))
                        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                        .collect(),
                    Dtype::BF16 => (view.data().chunks_exact(2))
                        .map(|c| u32::from(u16::from_le_bytes(c.try_into().unwrap())) << 16)
                        .collect(),
                    other => panic!("{other:?}"),
                };
                let bits: Vec<u32> = (ours.data().chunks_exact(4))
                    .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                assert!(bits == widened, "{name} {tensor}: other bits");
                count += 1;
            }
        }
        assert_eq!(count, exported.len(), "{name}: the same tensors, no more");
        // The tokenizer goes out byte for byte.
        assert_eq!(
            fs::read(to.join("tokenizer.json")).unwrap(),
            fs::read(dir.join("tokenizer.json")).unwrap()
        );
    }
}

/// float16 weights widen exactly too.
#[test]
fn float16_weights_import_as_their_values() {
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join("f16");
    fs::create_dir(&dir).unwrap();
    let source = fixture("hf-llama");
    fs::copy(source.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = fs::read(source.join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let halves: Vec<(String, Vec<usize>, Vec<u8>)> = (file.tensors().into_iter())
        .map(|(name, view)| {
            let data = (view.data().chunks_exact(4))
                .flat_map(|c| {
                    half::f16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes()
                })
                .collect();
            (name, view.shape().to_vec(), data)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = (halves.iter())
        .map(|(name, shape, data)| {
            let view =
                safetensors::tensor::TensorView::new(Dtype::F16, shape.clone(), data).unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let from_f16 = import_model(&dir).unwrap();
    let from_f32 = import_model(&source).unwrap();
    for ((name, a), (_, b)) in from_f16
        .named_parameters()
        .into_iter()
        .zip(from_f32.named_parameters())
    {
        let rounded: Vec<f32> = (b.to_vec().into_iter())
            .map(|v| half::f16::from_f32(v).to_f32())
            .collect();
        assert_eq!(a.to_vec(), rounded, "{name}");
    }
}

/// A copy of the f32 fixture with `edit` applied to its config.json.
fn with_config(scratch: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let source = fixture("hf-llama");
    let dir = scratch.join(format!("edited-{}", fs::read_dir(scratch).unwrap().count()));
    fs::create_dir(&dir).unwrap();
    for file in ["model.safetensors", "tokenizer.json"] {
        fs::copy(source.join(file), dir.join(file)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_slice(&fs::read(source.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    fs::write(
        dir.join("config.json"),
        serde_json::to_vec(&config).unwrap(),
    )
    .unwrap();
    dir
}

#[test]
fn what_tinyllm_does_not_compute_is_refused_naming_the_key_or_the_tensor() {
    let scratch = tempfile::tempdir().unwrap();
    let scratch = scratch.path();
    for (edit, key) in [
        (serde_json::json!({"model_type": "mistral"}), "model_type"),
        (
            serde_json::json!({"architectures": ["LlamaForSequenceClassification"]}),
            "architectures",
        ),
        (
            serde_json::json!({"attention_bias": true}),
            "attention_bias",
        ),
        (serde_json::json!({"mlp_bias": true}), "mlp_bias"),
        (
            serde_json::json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
            "rope_scaling",
        ),
        (
            serde_json::json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0}}),
            "rope_parameters.rope_type",
        ),
        (
            serde_json::json!({"sliding_window": 4096}),
            "sliding_window",
        ),
        (serde_json::json!({"hidden_act": "gelu"}), "hidden_act"),
        (serde_json::json!({"head_dim": 16}), "head_dim"),
        (serde_json::json!({"hidden_size": "32"}), "hidden_size"),
    ] {
        let dir = with_config(scratch, |config| {
            for (k, v) in edit.as_object().unwrap() {
                config[k] = v.clone();
            }
        });
        match import_model(&dir) {
            Err(TrainError::ConfigFile { key: named, .. }) => assert_eq!(named, key, "{edit}"),
            other => panic!("{edit}: {:?}", other.err()),
        }
    }
    // Sizes that do not match the tensors: a missing tensor, an unknown one, a wrong shape.
    for (edit, named) in [
        (
            serde_json::json!({"num_hidden_layers": 3}),
            "model.layers.2.input_layernorm.weight is missing",
        ),
        (
            serde_json::json!({"num_hidden_layers": 1}),
            "model.layers.1.",
        ),
        (
            serde_json::json!({"intermediate_size": 40}),
            "model.layers.0.mlp.gate_proj.weight is [48, 32], the config's sizes make it [40, 32]",
        ),
        (
            serde_json::json!({"tie_word_embeddings": false}),
            "lm_head.weight is missing",
        ),
    ] {
        let dir = with_config(scratch, |config| {
            for (k, v) in edit.as_object().unwrap() {
                config[k] = v.clone();
            }
        });
        let error = import_model(&dir).err().expect("refused").to_string();
        assert!(error.contains(named), "{edit}: {error}");
    }
}

/// `tinyllm train --init-from` starts from the imported weights with the directory's
/// tokenizer: its first evaluation is the imported model's loss, and the run's tokenizer is
/// the directory's file. A model given twice is refused.
#[test]
fn train_init_from_starts_a_run_from_the_imported_model() {
    let scratch = tempfile::tempdir().unwrap();
    let data = scratch.path().join("text.txt");
    fs::write(
        &data,
        "The lazy fox chases two birds near the river. ".repeat(80),
    )
    .unwrap();
    let run = scratch.path().join("run");
    let dir = fixture("hf-llama");
    let args = |extra: &[&str]| -> Vec<String> {
        let mut args: Vec<String> = [
            "train",
            "--init-from",
            dir.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--micro-batch",
            "2",
            "--steps",
            "2",
            "--quiet",
            "--out",
            run.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let refused = tinyllm(
        &args(&["--preset", "tiny"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(matches!(refused, Err(CliError::Usage(_))), "{refused:?}");
    let config = scratch.path().join("model.toml");
    fs::write(&config, "preset = \"tiny\"\n").unwrap();
    let refused = run_error(
        &args(&["--config", config.to_str().unwrap()])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(refused.to_string().contains("init-from"), "{refused}");
    // Weights that do not fit the directory's config: refused before the run is made.
    let broken = with_config(scratch.path(), |config| {
        config["intermediate_size"] = 40.into()
    });
    let mut broken_args = args(&[]);
    broken_args[2] = broken.to_str().unwrap().to_string();
    let refused = run_error(&broken_args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(refused.to_string().contains("gate_proj"), "{refused}");
    assert!(!run.exists(), "a refused run writes nothing");
    let status = tinyllm(
        &args(&["--lr", "1e-30"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    assert_eq!(status, Exit::Success);
    assert_eq!(
        fs::read(run.join("tokenizer.json")).unwrap(),
        fs::read(dir.join("tokenizer.json")).unwrap()
    );
    // With a learning rate of 1e-30 every update is far below half an ulp of the weights:
    // they stay the imported ones, bit for bit.
    let (config, trained) = tl_train::train::load_model(&run).unwrap();
    assert_eq!(config.model, hf_model_config(&dir).unwrap());
    let imported = import_model(&dir).unwrap();
    for ((name, a), (_, b)) in trained
        .named_parameters()
        .into_iter()
        .zip(imported.named_parameters())
    {
        assert!(a.to_vec() == b.to_vec(), "{name}");
    }
}
