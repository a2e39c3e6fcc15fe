//! `tinyllm train --config FILE`: a run's own `config.json` fed back starts the same run, a
//! TOML file trains a model of any size, flags override the file, and a file with a key the
//! schema does not have is refused naming the key.

mod common;

use std::fs;
use std::path::Path;

use common::{TINY_TRAIN, model_bytes, run_error, tinyllm};
use tl_train::TrainError;
use tl_train::train::{TrainConfig, read_config};

fn train(args: &[&str]) {
    tinyllm(args).unwrap();
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn a_runs_own_config_fed_back_is_the_same_run() {
    let dir = tempfile::tempdir().unwrap();
    let (first, again) = (dir.path().join("first"), dir.path().join("again"));
    let mut args = TINY_TRAIN.to_vec();
    args.extend(["--steps", "3", "--dropout", "0.1", "--out", path(&first)]);
    train(&args);
    let config = first.join("config.json");
    train(&[
        "train",
        "--config",
        path(&config),
        "--quiet",
        "--out",
        path(&again),
    ]);
    assert_eq!(read_config(&first).unwrap(), read_config(&again).unwrap());
    assert_eq!(model_bytes(&first), model_bytes(&again), "the same bits");
}

#[test]
fn a_toml_file_trains_any_size_and_flags_override_it() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base");
    let mut args = TINY_TRAIN.to_vec();
    args.extend(["--steps", "2", "--out", path(&base)]);
    train(&args);
    let mut config = read_config(&base).unwrap();
    config.preset = None;
    config.model.d_model = 48;
    config.model.n_layers = 3;
    config.model.n_heads = 4; // head size 12: even, as the rotary embedding needs
    config.model.hidden = 96;
    config.model.context = 32;
    let file = dir.path().join("custom.toml");
    fs::write(&file, toml::to_string(&config).unwrap()).unwrap();
    let run = dir.path().join("custom");
    train(&[
        "train",
        "--config",
        path(&file),
        "--steps",
        "4",
        "--quiet",
        "--out",
        path(&run),
    ]);
    let trained = read_config(&run).unwrap();
    assert_eq!(trained.model, config.model);
    assert_eq!(trained.steps, 4, "--steps overrides the file");
    assert_eq!(TrainConfig::from_file(&file).unwrap(), config);
}

#[test]
fn unknown_keys_and_sizes_that_do_not_fit_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let good =
        serde_json::to_value(TrainConfig::for_preset(tl_train::model::Preset::Tiny)).unwrap();
    let write = |name: &str, value: &serde_json::Value| {
        let file = dir.path().join(name);
        fs::write(&file, serde_json::to_vec_pretty(value).unwrap()).unwrap();
        file
    };
    let out = dir.path().join("never");
    let refused = |file: &Path| {
        run_error(&[
            "train",
            "--config",
            path(file),
            "--quiet",
            "--out",
            path(&out),
        ])
    };

    let mut typo = good.clone();
    typo["model"]["d_modle"] = 64.into();
    match refused(&write("typo.json", &typo)) {
        TrainError::ConfigFile { key, reason, .. } => {
            assert_eq!(key, "model.d_modle");
            assert!(reason.contains("unknown field"), "{reason}");
        }
        other => panic!("{other}"),
    }
    let mut top = good.clone();
    top["learning_rate"] = 1.0.into();
    assert!(matches!(
        refused(&write("top.json", &top)),
        TrainError::ConfigFile { key, .. } if key == "learning_rate"
    ));
    let mut wrong_type = good.clone();
    wrong_type["steps"] = "many".into();
    assert!(matches!(
        refused(&write("type.json", &wrong_type)),
        TrainError::ConfigFile { key, .. } if key == "steps"
    ));
    let mut heads = good.clone();
    heads["model"]["n_heads"] = 5.into(); // 64 is not a multiple of 5
    assert!(matches!(
        refused(&write("heads.json", &heads)),
        TrainError::InvalidConfig { .. }
    ));
    let broken = dir.path().join("broken.toml");
    fs::write(&broken, "model = [").unwrap();
    assert!(matches!(refused(&broken), TrainError::ConfigFile { .. }));
    assert!(!out.exists(), "nothing written");
}

#[test]
fn config_json_names_the_build_in_its_own_key_and_reads_back_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut args = TINY_TRAIN.to_vec();
    args.extend([
        "--steps",
        "1",
        "--checkpoint-activations",
        "--out",
        path(&run),
    ]);
    train(&args);
    let file = run.join("config.json");
    let text = fs::read_to_string(&file).unwrap();
    // The checkpointing mode in its JSON name, not Rust's.
    assert!(text.contains(r#""checkpointing": "per-block""#), "{text}");
    assert!(
        !text.contains("PerBlock") && !text.contains("\"Off\""),
        "{text}"
    );
    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
    let build = &value[tl_train::train::BUILD_KEY];
    assert_eq!(build["version"], env!("CARGO_PKG_VERSION"));
    match tl_train::build_info::COMMIT {
        Some(commit) => assert_eq!(build["commit"], commit),
        None => assert!(build["commit"].is_null(), "{build}"),
    }
    if let Some(commit) = build["commit"].as_str() {
        assert_eq!(commit.len(), 40);
        assert!(commit.bytes().all(|b| b.is_ascii_hexdigit()), "{commit}");
    }
    // Fed back as a config file, and read by the trainer, the key is not part of the config.
    let config = read_config(&run).unwrap();
    assert_eq!(TrainConfig::from_file(&file).unwrap(), config);
    // The same key in a TOML file (TOML has no null: a build without a commit leaves it out).
    let mut table: toml::Table = toml::from_str(&toml::to_string(&config).unwrap()).unwrap();
    let mut build = toml::Table::new();
    build.insert("version".into(), env!("CARGO_PKG_VERSION").into());
    table.insert("tinyllm".into(), build.into());
    let toml_file = dir.path().join("stamped.toml");
    fs::write(&toml_file, toml::to_string(&table).unwrap()).unwrap();
    assert_eq!(TrainConfig::from_file(&toml_file).unwrap(), config);
}

#[test]
fn a_run_written_by_another_build_or_with_the_old_names_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut args = TINY_TRAIN.to_vec();
    args.extend([
        "--steps",
        "3",
        "--until-step",
        "1",
        "--checkpoint-budget",
        "2",
    ]);
    args.extend(["--out", path(&run)]);
    train(&args);

    // Another build's stamp, and the names of builds before the JSON names: the checkpointing
    // mode as Rust printed it, in config.json and in the checkpoint's state.json.
    let config = run.join("config.json");
    let mut value: serde_json::Value = serde_json::from_slice(&fs::read(&config).unwrap()).unwrap();
    assert_eq!(value["checkpointing"], serde_json::json!({"budget": 2}));
    value["checkpointing"] = serde_json::json!({"Budget": 2});
    value["tinyllm"] = serde_json::json!({"version": "0.0.1", "commit": null});
    fs::write(&config, serde_json::to_vec_pretty(&value).unwrap()).unwrap();
    let checkpoint = common::latest_checkpoint(&run);
    let state_file = checkpoint.join("state.json");
    let state = fs::read_to_string(&state_file).unwrap();
    let old_state = state.replace(r#""budget": 2"#, r#""Budget": 2"#);
    assert_ne!(state, old_state, "state.json holds the checkpointing mode");
    fs::write(&state_file, &old_state).unwrap();
    let sums_file = checkpoint.join("SHA256SUMS");
    let sums = fs::read_to_string(&sums_file).unwrap().replace(
        &tl_train::store::fingerprint(state.as_bytes()),
        &tl_train::store::fingerprint(old_state.as_bytes()),
    );
    fs::write(&sums_file, sums).unwrap();

    train(&["train", "--resume", path(&run), "--quiet"]);
    assert_eq!(common::train_steps(&run), 3);
    let resumed = read_config(&run).unwrap();
    assert_eq!(
        resumed.checkpointing,
        tl_train::model::Checkpointing::Budget(2)
    );
}
