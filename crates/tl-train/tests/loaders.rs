//! Every file a user can hand the trainer, damaged at random: a byte flipped, the file cut
//! short or extended. Never a panic; always a typed error that names the file, or the same
//! result as the undamaged file where the change lands in bytes that carry nothing (a
//! trailing newline, say).

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use proptest::prelude::*;
use tl_precision::{DynamicLossScaler, ScalerState};
use tl_train::TrainError;
use tl_train::data::{CacheOptions, Corpus, DEFAULT_CHUNK_BYTES, Tokenizer};
use tl_train::model::ModelConfig;
use tl_train::store::decode_tensors;
use tl_train::train::{TrainConfig, Trainer, read_config, read_records, snapshot};

/// A damage to a file's bytes.
#[derive(Clone, Debug)]
enum Damage {
    /// XOR one byte (at `at` modulo the length) with a nonzero mask.
    Flip { at: usize, mask: u8 },
    /// Keep the first `at` modulo the length bytes.
    Truncate { at: usize },
    /// Append bytes.
    Extend { tail: Vec<u8> },
}

impl Damage {
    fn apply(&self, bytes: &[u8]) -> Vec<u8> {
        let mut bytes = bytes.to_vec();
        match self {
            Damage::Flip { at, mask } if !bytes.is_empty() => {
                let at = at % bytes.len();
                bytes[at] ^= mask;
            }
            Damage::Flip { .. } => {}
            Damage::Truncate { at } => bytes.truncate(at % (bytes.len() + 1)),
            Damage::Extend { tail } => bytes.extend_from_slice(tail),
        }
        bytes
    }
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        4 => (any::<usize>(), 1..=255u8).prop_map(|(at, mask)| Damage::Flip { at, mask }),
        1 => any::<usize>().prop_map(|at| Damage::Truncate { at }),
        1 => proptest::collection::vec(any::<u8>(), 1..16).prop_map(|tail| Damage::Extend { tail }),
    ]
}

/// A run of a model small enough that a checkpoint loads in well under a millisecond.
fn micro_run(dir: &Path) -> PathBuf {
    let run = dir.join("run");
    let mut config = TrainConfig {
        model: ModelConfig {
            vocab: 256,
            d_model: 8,
            n_layers: 1,
            n_heads: 2,
            hidden: 12,
            context: 16,
            norm_eps: 1e-5,
            rope_base: 10_000.0,
            dropout: 0.0,
            n_kv_heads: None,
            tie_embeddings: false,
        },
        preset: None,
        micro_batch: 2,
        accum: 1,
        steps: 2,
        eval_interval: 1,
        save_interval: 1,
        ..TrainConfig::for_preset(tl_train::model::Preset::Tiny)
    };
    config.data = tl_train::train::DataSource::Builtin {
        seed: 0,
        bytes: 2_000,
    };
    config.lr.total = 2;
    config.lr.warmup = 1;
    let mut trainer = Trainer::new(config, &run).unwrap();
    trainer
        .run(2, &AtomicBool::new(false), &mut |_| {})
        .unwrap();
    run
}

/// Whether `error` names `file` (its message carries the file's name).
fn names(error: &TrainError, file: &str) -> bool {
    error.to_string().contains(file)
}

const CHECKPOINT_FILES: [&str; 4] = [
    "model.safetensors",
    "optimizer.safetensors",
    "state.json",
    "SHA256SUMS",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn a_damaged_checkpoint_file_is_refused_naming_it(
        file in 0..CHECKPOINT_FILES.len() + 1,
        damage in damage(),
    ) {
        thread_local! {
            static RUN: (tempfile::TempDir, PathBuf) = {
                let dir = tempfile::tempdir().unwrap();
                let run = micro_run(dir.path());
                (dir, run)
            };
        }
        RUN.with(|(_, run)| {
            let (path, name) = match CHECKPOINT_FILES.get(file) {
                Some(name) => (run.join("checkpoint-000002").join(name), *name),
                None => (run.join("LATEST"), "LATEST"),
            };
            let original = fs::read(&path).unwrap();
            let intact = snapshot::load(run).unwrap();
            let damaged = damage.apply(&original);
            fs::write(&path, &damaged).unwrap();
            let loaded = snapshot::load(run);
            fs::write(&path, &original).unwrap();
            match loaded {
                Ok(snapshot) => {
                    // Only a change that carries nothing is accepted.
                    prop_assert_eq!(&snapshot.state, &intact.state);
                    prop_assert_eq!(&snapshot.weights, &intact.weights);
                    prop_assert_eq!(&snapshot.moments, &intact.moments);
                }
                Err(error) => {
                    let named = names(&error, name) || (name == "SHA256SUMS"
                        && CHECKPOINT_FILES.iter().any(|f| names(&error, f)));
                    prop_assert!(named, "{:?} damaged, error: {}", name, error);
                }
            }
            Ok(())
        })?;
    }

    #[test]
    fn a_damaged_config_or_metrics_file_is_refused_naming_it(
        metrics in any::<bool>(),
        damage in damage(),
    ) {
        thread_local! {
            static RUN: (tempfile::TempDir, PathBuf) = {
                let dir = tempfile::tempdir().unwrap();
                let run = micro_run(dir.path());
                (dir, run)
            };
        }
        RUN.with(|(_, run)| {
            let name = if metrics { "metrics.jsonl" } else { "config.json" };
            let path = run.join(name);
            let original = fs::read(&path).unwrap();
            fs::write(&path, damage.apply(&original)).unwrap();
            let result = if metrics {
                read_records(&path).map(|_| ())
            } else {
                // A config that parses must also validate without a panic.
                read_config(run).and_then(|config| config.validate())
            };
            fs::write(&path, &original).unwrap();
            if let Err(error) = result {
                let typed_validation = matches!(
                    error,
                    TrainError::InvalidArgument { .. }
                        | TrainError::InvalidConfig { .. }
                        | TrainError::Recompute(_)
                );
                prop_assert!(typed_validation || names(&error, name), "{}", error);
            }
            Ok(())
        })?;
    }

    #[test]
    fn damaged_safetensors_bytes_are_an_error_naming_the_file(damage in damage()) {
        thread_local! {
            static BYTES: Vec<u8> = {
                let dir = tempfile::tempdir().unwrap();
                let run = micro_run(dir.path());
                fs::read(run.join("checkpoint-000002/model.safetensors")).unwrap()
            };
        }
        BYTES.with(|bytes| {
            let path = Path::new("some/model.safetensors");
            if let Err(error) = decode_tensors(path, &damage.apply(bytes)) {
                prop_assert!(names(&error, "some/model.safetensors"), "{}", error);
            }
            Ok(())
        })?;
    }

    #[test]
    fn a_damaged_scaler_state_is_refused_or_loads_a_valid_scaler(damage in damage()) {
        let state = DynamicLossScaler::default().with_floor(1.0, 10).unwrap().state_dict();
        let json = serde_json::to_vec(&state).unwrap();
        if let Ok(damaged) = serde_json::from_slice::<ScalerState>(&damage.apply(&json)) {
            let mut scaler = DynamicLossScaler::default();
            if scaler.load_state_dict(&damaged).is_ok() {
                let scale = scaler.state_dict().scale;
                prop_assert!(scale > 0.0 && scale.is_finite());
            }
        }
    }

    #[test]
    fn a_damaged_data_file_is_a_data_error_naming_it(damage in damage()) {
        thread_local! {
            static DIR: tempfile::TempDir = tempfile::tempdir().unwrap();
        }
        DIR.with(|dir| {
            let path = dir.path().join("text.txt");
            let text: String = (0..40).map(|i| format!("line {i} of the text\n")).collect();
            fs::write(&path, damage.apply(text.as_bytes())).unwrap();
            let cache = dir.path().join("cache");
            let options = CacheOptions {
                root: &cache,
                chunk_bytes: DEFAULT_CHUNK_BYTES,
                expected: None,
            };
            if let Err(error) = Corpus::from_path(&path, &Tokenizer::Bytes, 16, options) {
                prop_assert!(error.to_string().contains("text.txt"), "{}", error);
            }
            Ok(())
        })?;
    }
}

/// Every single-byte change of `LATEST` (each position, each nonzero XOR mask) either still
/// names the same checkpoint or is refused naming `LATEST`: no damage can point it at an
/// older checkpoint, which would resume a step back and clean the newer ones away.
#[test]
fn no_single_byte_damage_of_latest_names_another_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let run = micro_run(dir.path());
    assert!(run.join("checkpoint-000001").is_dir());
    let path = run.join("LATEST");
    let original = fs::read(&path).unwrap();
    let mut refused = 0;
    for at in 0..original.len() {
        for mask in 1..=255u8 {
            let mut damaged = original.clone();
            damaged[at] ^= mask;
            fs::write(&path, &damaged).unwrap();
            match tl_train::train::snapshot::latest_step(&run) {
                Ok(step) => assert_eq!(step, Some(2), "{:?}", String::from_utf8_lossy(&damaged)),
                Err(error) => {
                    assert!(names(&error, "LATEST"), "{error}");
                    refused += 1;
                }
            }
        }
    }
    fs::write(&path, &original).unwrap();
    // Only whitespace at the end may change and still be read.
    assert!(refused > original.len() * 250, "{refused} refused");
}
