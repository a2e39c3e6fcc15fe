//! `--fp8`: the blocks' projections in fp8 with delayed scaling.

mod common;

use std::fs;

use common::{TINY_TRAIN, latest_checkpoint, run_error, tinyllm};
use tl_train::TrainError;
use tl_train::cli::Exit;
use tl_train::train::{Record, read_config, read_records, snapshot};

fn train_args<'a>(out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = TINY_TRAIN.to_vec();
    args.extend(["--out", out, "--lr", "1e-2"]);
    args.extend(extra);
    args
}

fn val_loss(run: &std::path::Path) -> f64 {
    read_records(&run.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .rev()
        .find_map(|r| match r {
            Record::Eval { val_loss, .. } => Some(*val_loss),
            _ => None,
        })
        .unwrap()
}

#[test]
fn an_fp8_run_trains_tracks_fp32_and_keeps_its_scales_in_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (fp8, fp32) = (dir.path().join("fp8"), dir.path().join("fp32"));
    let fp8_out = fp8.to_str().unwrap();
    assert_eq!(
        tinyllm(&train_args(fp8_out, &["--fp8", "--steps", "30"])).unwrap(),
        Exit::Success
    );
    assert_eq!(
        tinyllm(&train_args(fp32.to_str().unwrap(), &["--steps", "30"])).unwrap(),
        Exit::Success
    );
    let (loss8, loss32) = (val_loss(&fp8), val_loss(&fp32));
    // It learned (an untrained byte model is at ln 256 ≈ 5.5) and tracks fp32.
    assert!(loss8 < 3.5, "fp8 validation loss {loss8}");
    assert!(
        (loss8 - loss32).abs() / loss32 < 0.05,
        "fp8 {loss8} vs fp32 {loss32}"
    );

    let config = read_config(&fp8).unwrap();
    assert_eq!(config.fp8, Some(tl_precision::Fp8Recipe::default()));
    // Every step logs its range counts; the scales moved off 1 after the first step.
    let records = read_records(&fp8.join("metrics.jsonl")).unwrap();
    let steps: Vec<_> = records
        .iter()
        .filter_map(|r| match r {
            Record::Train { fp8, .. } => Some(fp8.clone().expect("fp8 counts")),
            _ => None,
        })
        .collect();
    assert_eq!(steps.len(), 30);
    let state = snapshot::load(&fp8)
        .unwrap()
        .state
        .fp8
        .expect("an fp8 state");
    assert_eq!(state.layers.len(), 2 * 7);
    for layer in &state.layers {
        for s in layer.all() {
            assert_eq!(s.history.len(), 30);
            assert!(
                s.scale != 1.0 && s.scale.is_finite() && s.scale > 0.0,
                "{}",
                s.scale
            );
        }
    }
    // The first step casts with scale 1: the tiny activations and gradients flush.
    assert!(steps[0].flushed > 0, "{:?}", steps[0]);
    assert!(
        steps[0].tensors.keys().any(|k| k.ends_with(".grad")),
        "{:?}",
        steps[0].tensors
    );
}

#[test]
fn an_fp8_run_resumes_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let (whole, split) = (dir.path().join("whole"), dir.path().join("split"));
    let extra = ["--fp8", "--fp8-history", "3", "--steps", "6"];
    assert_eq!(
        tinyllm(&train_args(whole.to_str().unwrap(), &extra)).unwrap(),
        Exit::Success
    );
    let mut first = extra.to_vec();
    first.extend(["--until-step", "3"]);
    let split_out = split.to_str().unwrap();
    tinyllm(&train_args(split_out, &first)).unwrap();
    let state = snapshot::load(&split).unwrap().state.fp8.unwrap();
    assert!(state.layers.iter().all(|l| l.input.history.len() == 3));
    assert_eq!(
        tinyllm(&["train", "--resume", split_out, "--quiet"]).unwrap(),
        Exit::Success
    );
    let model =
        |run: &std::path::Path| fs::read(latest_checkpoint(run).join("model.safetensors")).unwrap();
    assert_eq!(model(&whole), model(&split));
    assert_eq!(
        snapshot::load(&whole).unwrap().state.fp8,
        snapshot::load(&split).unwrap().state.fp8
    );
    // Resuming without fp8's recipe (another history) is refused.
    let error = run_error(&[
        "train",
        "--resume",
        split_out,
        "--steps",
        "8",
        "--fp8-history",
        "4",
        "--quiet",
    ]);
    assert!(error.to_string().contains("fp8"), "{error}");
}

#[test]
fn fp8_settings_without_fp8_and_fp8_on_a_tensor_core_model_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = run.to_str().unwrap();
    for (extra, name, says) in [
        (&["--fp8-margin", "2"][..], "fp8-margin", "add --fp8"),
        (
            &["--fp8", "--bf16", "--accumulate", "h100"][..],
            "fp8",
            "16-bit inputs",
        ),
        (&["--fp8", "--fp8-history", "0"][..], "history_len", "1..="),
    ] {
        let error = run_error(&train_args(out, extra));
        let text = error.to_string();
        assert!(text.contains(name) && text.contains(says), "{text}");
        assert!(
            matches!(
                error,
                TrainError::InvalidArgument { .. } | TrainError::Precision(_)
            ),
            "{error}"
        );
        assert!(!run.exists());
    }
}

#[test]
fn compare_gives_fp8_to_the_recipe_and_not_to_the_fp32_baseline() {
    let dir = tempfile::tempdir().unwrap();
    let report = common::tiny_compare(&dir.path().join("cmp"), &["--fp8"]);
    assert_eq!(
        report.recipe_config.fp8,
        Some(tl_precision::Fp8Recipe::default())
    );
    assert_eq!(report.baseline_config.fp8, None);
    assert!(report.recipe.val_loss.unwrap().is_finite());
}

#[test]
fn a_checkpointed_fp8_run_records_every_layers_amaxes_and_evaluation_none() {
    // A checkpointed block's forward pass runs without a graph; its casts must record all
    // the same (they once did not, and its layers' input and weight scales stayed at 1).
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("ckpt");
    let out = run.to_str().unwrap();
    let args = train_args(
        out,
        &["--fp8", "--steps", "4", "--checkpoint-policy", "matmuls"],
    );
    assert_eq!(tinyllm(&args).unwrap(), Exit::Success);
    let state = snapshot::load(&run)
        .unwrap()
        .state
        .fp8
        .expect("an fp8 state");
    for (i, layer) in state.layers.iter().enumerate() {
        for s in layer.all() {
            assert_eq!(s.history.len(), 4);
            assert!(
                s.history.iter().all(|&amax| amax > 0.0) && s.scale != 1.0,
                "layer {i}: {s:?}"
            );
        }
    }
    // The same run, plain, saw the same amaxes: the policy changes no value.
    let plain = dir.path().join("plain");
    let args = train_args(plain.to_str().unwrap(), &["--fp8", "--steps", "4"]);
    assert_eq!(tinyllm(&args).unwrap(), Exit::Success);
    let plain_state = snapshot::load(&plain).unwrap().state.fp8.unwrap();
    assert_eq!(plain_state, state);
}

#[test]
fn evaluation_records_no_amax() {
    // Evaluation runs without a graph, as a checkpoint's forward does, but is not a step
    // the scales should learn from: the trainer stops observing while it evaluates.
    let dir = tempfile::tempdir().unwrap();
    let mut config = read_config(&{
        let run = dir.path().join("template");
        let args = train_args(run.to_str().unwrap(), &["--fp8", "--steps", "1"]);
        assert_eq!(tinyllm(&args).unwrap(), Exit::Success);
        run
    })
    .unwrap();
    config.checkpointing = tl_train::model::Checkpointing::PerBlock;
    let mut trainer = tl_train::train::Trainer::new(config, &dir.path().join("run")).unwrap();
    let loss = trainer.validation_loss().unwrap();
    assert!(loss.is_finite());
    trainer.save().unwrap();
    let state = snapshot::load(&dir.path().join("run"))
        .unwrap()
        .state
        .fp8
        .unwrap();
    for layer in &state.layers {
        for s in layer.all() {
            assert_eq!((s.pending, s.history.len()), (0.0, 0), "{s:?}");
        }
    }
}
