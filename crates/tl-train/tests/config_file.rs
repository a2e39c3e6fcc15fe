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
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tinyllm"))
        .args(["plan", "--config", path(&file), "--json"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let plan: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
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
