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
    let mut beta = good.clone();
    beta["adamw"]["beta2"] = 1.0.into(); // the second moment would never decay
    assert!(matches!(
        refused(&write("beta.json", &beta)),
        TrainError::InvalidArgument {
            name: "adam-beta2",
            ..
        }
    ));
    let broken = dir.path().join("broken.toml");
    fs::write(&broken, "model = [").unwrap();
    assert!(matches!(refused(&broken), TrainError::ConfigFile { .. }));
    assert!(!out.exists(), "nothing written");
}

#[test]
fn adamws_knobs_come_from_the_file_or_the_flags_and_older_configs_keep_the_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut args = TINY_TRAIN.to_vec();
    args.extend([
        "--steps",
        "2",
        "--adam-beta2",
        "0.95",
        "--adam-epsilon",
        "1e-6",
        "--eval-batches",
        "2",
        "--out",
        path(&run),
    ]);
    train(&args);
    let config = read_config(&run).unwrap();
    assert_eq!(
        (config.adamw.beta1, config.adamw.beta2, config.adamw.eps),
        (0.9, 0.95, 1e-6)
    );
    assert_eq!(config.eval_batches, 2);
    // The checkpoint's AdamW took them too.
    let state: serde_json::Value = serde_json::from_slice(
        &fs::read(common::latest_checkpoint(&run).join("state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["adamw"]["betas"], serde_json::json!([0.9, 0.95]));
    assert_eq!(state["adamw"]["eps"], serde_json::json!(1e-6));

    // A config.json written before the knobs existed reads with PyTorch's defaults.
    let mut old = serde_json::to_value(&config).unwrap();
    old.as_object_mut().unwrap().remove("adamw");
    let file = dir.path().join("old.json");
    fs::write(&file, serde_json::to_vec(&old).unwrap()).unwrap();
    let read = TrainConfig::from_file(&file).unwrap();
    assert_eq!(read.adamw, tl_train::train::AdamWConfig::default());
    assert_eq!(
        (read.adamw.beta1, read.adamw.beta2, read.adamw.eps),
        (0.9, 0.999, 1e-8)
    );
}

#[test]
fn plan_profile_and_compare_take_the_same_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = TrainConfig::for_preset(tl_train::model::Preset::Tiny);
    config.preset = None;
    config.model.d_model = 32;
    config.model.n_layers = 1;
    config.model.n_heads = 2;
    config.model.hidden = 64;
    config.model.context = 16;
    config.micro_batch = 2;
    config.accum = 2;
    config.data = tl_train::train::DataSource::Builtin {
        seed: 0,
        bytes: 20_000,
    };
    let file = dir.path().join("small-model.toml");
    fs::write(&file, toml::to_string(&config).unwrap()).unwrap();

    // plan: the prediction is of the file's model.
    let plan: serde_json::Value = serde_json::from_str(&common::stdout_of(&[
        "plan",
        "--config",
        path(&file),
        "--json",
    ]))
    .unwrap();
    let text = plan.to_string();
    let parameters = config.model.num_parameters();
    assert!(
        text.contains(&format!("{}", 4 * parameters)),
        "the plan holds the file's {parameters} f32 weights: {text}"
    );

    // profile: both runs of the file's model.
    let chart = dir.path().join("profile.svg");
    tinyllm(&["profile", "--config", path(&file), "--out", path(&chart)]).unwrap();
    let timeline: serde_json::Value =
        serde_json::from_slice(&fs::read(chart.with_extension("json")).unwrap()).unwrap();
    assert_eq!(timeline["config"]["train"]["model"]["d_model"], 32);

    // compare: the recipe is the file's, flags on top.
    let out = dir.path().join("compare");
    let _ = tinyllm(&[
        "compare",
        "--config",
        path(&file),
        "--fp16",
        "--steps",
        "2",
        "--quiet",
        "--out",
        path(&out),
    ])
    .unwrap();
    let recipe = read_config(&out.join("recipe")).unwrap();
    assert_eq!(recipe.model, config.model);
    assert_eq!(
        (recipe.micro_batch, recipe.accum),
        (2, 2),
        "the file's batch"
    );
    assert_eq!(
        recipe.precision,
        tl_precision::Precision::Fp16,
        "the flag on top"
    );
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
    // Builds before the sealed LATEST wrote the checkpoint's name alone.
    let name = checkpoint.file_name().unwrap().to_str().unwrap();
    fs::write(run.join("LATEST"), name).unwrap();

    train(&["train", "--resume", path(&run), "--quiet"]);
    assert_eq!(common::train_steps(&run), 3);
    let resumed = read_config(&run).unwrap();
    assert_eq!(
        resumed.checkpointing,
        tl_train::model::Checkpointing::Budget(2)
    );
}

#[test]
fn a_file_may_name_only_what_differs_from_its_presets_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("short.toml");
    fs::write(
        &file,
        "steps = 300\nprecision = \"bf16\"\n\n[lr]\npeak = 4e-3\n\n[model]\nd_model = 96\nn_heads = 6\n",
    )
    .unwrap();
    let config = TrainConfig::from_file(&file).unwrap();
    let small = TrainConfig::for_preset(tl_train::model::Preset::Small);
    assert_eq!(config.preset, None, "not the small preset's sizes: custom");
    assert_eq!((config.model.d_model, config.model.n_heads), (96, 6));
    assert_eq!(
        config.model.n_layers, small.model.n_layers,
        "the rest is small's"
    );
    assert_eq!(config.micro_batch, small.micro_batch);
    // What follows the run's length and peak follows the file's, as with the flags.
    assert_eq!((config.lr.total, config.lr.warmup), (300, 30));
    assert_eq!((config.eval_interval, config.save_interval), (30, 75));
    assert_eq!(config.lr.min, 4e-4);
    config.validate().unwrap();

    // A preset named in the file supplies the rest; a data file replaces the built-in text.
    let capstone = dir.path().join("capstone.json");
    fs::write(
        &capstone,
        r#"{"preset": "capstone", "data": {"file": {"path": "corpus.txt"}}}"#,
    )
    .unwrap();
    let config = TrainConfig::from_file(&capstone).unwrap();
    assert_eq!(config.preset, Some(tl_train::model::Preset::Capstone));
    assert_eq!(
        config.model,
        tl_train::model::Preset::Capstone.config(),
        "the preset's model"
    );
    assert_eq!(
        config.data,
        tl_train::train::DataSource::File {
            path: "corpus.txt".into()
        }
    );

    // Keys left out do not hide a misspelt one.
    fs::write(&file, "[model]\nd_model = 96\nlayers = 3\n").unwrap();
    assert!(matches!(
        TrainConfig::from_file(&file),
        Err(TrainError::ConfigFile { key, .. }) if key == "model.layers"
    ));
}

/// The TOML block of README.md's "Any model size" section.
fn readme_config() -> String {
    let readme = fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"))
        .expect("README.md at the workspace's root");
    let start = readme
        .find("```toml\n")
        .expect("README shows a TOML config")
        + 8;
    let end = start + readme[start..].find("```").expect("the block ends");
    readme[start..end].to_string()
}

#[test]
fn the_readmes_custom_model_trains_as_the_readme_says() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("my-model.toml");
    fs::write(&file, readme_config()).unwrap();
    let config = TrainConfig::from_file(&file).unwrap();
    assert_eq!(config.preset, None, "README's model is a custom size");
    config.validate().unwrap();
    // README's command, shortened to two steps on a little text.
    let run = dir.path().join("run");
    train(&[
        "train",
        "--config",
        path(&file),
        "--steps",
        "2",
        "--corpus-bytes",
        "100000",
        "--quiet",
        "--out",
        path(&run),
    ]);
    let trained = read_config(&run).unwrap();
    assert_eq!(trained.model, config.model);
    assert_eq!(common::train_steps(&run), 2);
    tinyllm(&[
        "sample",
        "--from",
        path(&run),
        "--tokens",
        "8",
        "--prompt",
        "The ",
    ])
    .unwrap();
}
