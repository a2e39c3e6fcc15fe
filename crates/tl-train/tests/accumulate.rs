//! `--accumulate`: training whose 16-bit products add up as a GPU's tensor cores do.

mod common;

use std::fs;

use common::{TINY_TRAIN, run_error, tinyllm, train_steps};
use tl_precision::Accumulation;
use tl_train::TrainError;
use tl_train::cli::{CliError, Exit};
use tl_train::train::read_config;

fn train_args<'a>(out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = TINY_TRAIN.to_vec();
    args.extend(["--out", out]);
    args.extend(extra);
    args
}

#[test]
fn a_tensor_core_model_trains_is_recorded_and_must_match_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = run.to_str().unwrap();
    let args = train_args(
        out,
        &[
            "--fp16",
            "--accumulate",
            "v100",
            "--steps",
            "4",
            "--until-step",
            "2",
        ],
    );
    assert_eq!(tinyllm(&args).unwrap(), Exit::Success);
    let config = read_config(&run).unwrap();
    assert_eq!(config.accumulation, Accumulation::V100);
    let json = fs::read_to_string(run.join("config.json")).unwrap();
    assert!(json.contains("\"accumulation\": \"v100\""), "{json}");

    // Resuming on other hardware is refused, naming the field; the same resumes.
    let error = run_error(&["train", "--resume", out, "--accumulate", "h100", "--quiet"]);
    assert!(error.to_string().contains("accumulation"), "{error}");
    assert_eq!(
        tinyllm(&["train", "--resume", out, "--quiet"]).unwrap(),
        Exit::Success
    );
    assert_eq!(train_steps(&run), 4);

    // The same steps with f32 sums end elsewhere: the model reached the weights.
    let other = dir.path().join("f32");
    let args = train_args(other.to_str().unwrap(), &["--fp16", "--steps", "4"]);
    assert_eq!(tinyllm(&args).unwrap(), Exit::Success);
    let latest = |run: &std::path::Path| {
        let name = fs::read_to_string(run.join("LATEST")).unwrap();
        fs::read(
            run.join(name.lines().next().unwrap())
                .join("model.safetensors"),
        )
        .unwrap()
    };
    assert_ne!(latest(&run), latest(&other));
    // A run without the flag records no accumulation: its config.json is as before.
    let json = fs::read_to_string(other.join("config.json")).unwrap();
    assert!(!json.contains("accumulation"), "{json}");
}

#[test]
fn a_model_without_16_bit_products_or_of_no_real_gpu_mode_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = run.to_str().unwrap();
    for (extra, says) in [
        (&["--accumulate", "h100"][..], "--bf16 or --fp16"),
        (&["--bf16", "--accumulate", "v100"][..], "no bf16 mode"),
        (&["--fp16", "--accumulate", "amx"][..], "bf16 operands only"),
    ] {
        let error = run_error(&train_args(out, extra));
        assert!(
            matches!(
                &error,
                TrainError::InvalidArgument {
                    name: "accumulate",
                    ..
                }
            ),
            "{error}"
        );
        assert!(error.to_string().contains(says), "{error}");
        assert!(!run.exists(), "nothing is written");
    }
    // A name that is no model is a usage error listing the models.
    let usage = |args: &[&str]| match tinyllm(&train_args(out, args)) {
        Err(CliError::Usage(error)) => error.to_string(),
        other => panic!("expected a usage error, got {other:?}"),
    };
    let b200 = usage(&["--bf16", "--accumulate", "b200"]);
    assert!(b200.contains("h100"), "{b200}");
    let zero_block = usage(&["--bf16", "--accumulate", "tensor-core:0:1"]);
    assert!(
        zero_block.contains("tensor-core:BLOCK:EXTRA_BITS"),
        "{zero_block}"
    );
    // A custom model is accepted.
    let args = train_args(
        out,
        &["--bf16", "--accumulate", "tensor-core:8:3", "--steps", "1"],
    );
    assert_eq!(tinyllm(&args).unwrap(), Exit::Success);
}

#[test]
fn compare_takes_the_model_for_the_recipe_and_not_for_the_fp32_baseline() {
    let dir = tempfile::tempdir().unwrap();
    let report = common::tiny_compare(&dir.path().join("cmp"), &["--accumulate", "h100"]);
    assert_eq!(report.recipe_config.accumulation, Accumulation::H100);
    assert_eq!(report.baseline_config.accumulation, Accumulation::F32);
    assert!(report.recipe.val_loss.unwrap().is_finite());
    let refused = tinyllm(&["compare", "--fp32", "--accumulate", "h100"]);
    assert!(refused.is_err());
}

#[test]
fn an_amx_run_has_the_same_bits_on_any_thread_count_and_others_than_the_units_order() {
    // `--accumulate amx` sums bf16 products as Intel's AMX tiles do: on the tiles where the
    // CPU has them, emulated elsewhere, the same bits either way and on any thread count.
    if !tl_tensor::kernels::bf16_dot::amx_available() {
        eprintln!("this CPU has no AMX tiles: the AMX order runs emulated here");
    }
    let dir = tempfile::tempdir().unwrap();
    let weights = |name: &str, extra: &[&str]| {
        let run = dir.path().join(name);
        let mut args = train_args(run.to_str().unwrap(), &["--bf16", "--steps", "3"]);
        args.extend(extra);
        assert_eq!(tinyllm(&args).unwrap(), Exit::Success, "{name}");
        let latest = fs::read_to_string(run.join("LATEST")).unwrap();
        let checkpoint = run.join(latest.lines().next().unwrap());
        (run, fs::read(checkpoint.join("model.safetensors")).unwrap())
    };
    let (run, one) = weights("amx-1", &["--accumulate", "amx", "--threads", "1"]);
    let (_, two) = weights("amx-2", &["--accumulate", "amx", "--threads", "2"]);
    assert!(one == two, "the AMX order on 1 and 2 threads");
    let json = fs::read_to_string(run.join("config.json")).unwrap();
    assert!(json.contains("\"accumulation\": \"amx\""), "{json}");
    let (_, units) = weights("units", &["--threads", "2"]);
    assert!(
        one != units,
        "the AMX order and the units' order train apart"
    );
}
