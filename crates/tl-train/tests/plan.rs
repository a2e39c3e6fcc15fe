//! `tinyllm plan`: its predictions against the memory meter on real steps, and the command
//! on the tiny preset, bad arguments included.

mod common;

use common::{run_error, stdout_of, tinyllm};
use tl_precision::Precision;
use tl_train::TrainError;
use tl_train::cli::{CliError, Exit};
use tl_train::model::{Checkpointing, Preset};
use tl_train::plan::{MemoryPlan, Recipe, measure_steps, predict_step, relative_error};
use tl_train::train::{DataSource, TrainConfig};

/// The stated tolerance: a predicted peak within 1% of the measured one. (The plan runs
/// the trainer's own step on meta tensors and is exact, so every check below also holds
/// with 0: `exactly` checks that.)
const TOLERANCE: f64 = 0.01;

fn tiny(
    micro_batch: usize,
    accum: usize,
    precision: Precision,
    checkpointing: Checkpointing,
) -> TrainConfig {
    let mut config = TrainConfig::for_preset(Preset::Tiny);
    config.data = DataSource::Builtin {
        seed: 0,
        bytes: 20_000,
    };
    config.micro_batch = micro_batch;
    config.accum = accum;
    config.precision = precision;
    config.checkpointing = checkpointing;
    config
}

/// Predicts and measures `config`; returns the relative errors of the steady-state peak,
/// the first step's peak and the live bytes between steps.
fn errors(config: &TrainConfig) -> [f64; 3] {
    let predicted = predict_step(&Recipe::from(config)).unwrap();
    let measured = measure_steps(config).unwrap();
    [
        relative_error(predicted.peak_bytes, measured.peak_bytes),
        relative_error(
            predicted.first_step_peak_bytes,
            measured.first_step_peak_bytes,
        ),
        relative_error(predicted.between_steps_bytes, measured.between_steps_bytes),
    ]
}

fn assert_within_tolerance(config: &TrainConfig) {
    for (error, what) in errors(config)
        .into_iter()
        .zip(["peak", "first step", "between steps"])
    {
        assert!(
            error.abs() <= TOLERANCE,
            "{what}: error {:+.4}%",
            100.0 * error
        );
    }
}

#[test]
fn a_plain_fp32_step_peaks_where_predicted() {
    assert_within_tolerance(&tiny(4, 2, Precision::Fp32, Checkpointing::Off));
}

#[test]
fn a_plain_step_without_accumulation_peaks_where_predicted() {
    // One micro-batch: the gradients fill in during the only backward pass.
    assert_within_tolerance(&tiny(4, 1, Precision::Fp32, Checkpointing::Off));
}

#[test]
fn a_checkpointed_bf16_step_peaks_where_predicted() {
    assert_within_tolerance(&tiny(4, 2, Precision::Bf16, Checkpointing::PerBlock));
}

#[test]
fn an_fp16_step_with_dropout_and_a_budget_peaks_where_predicted() {
    // Four blocks and budget 3: the first block checkpointed, the other three plain.
    let mut config = tiny(2, 2, Precision::Fp16, Checkpointing::Budget(3));
    config.model.n_layers = 4;
    config.model.dropout = 0.1;
    assert_within_tolerance(&config);
}

/// The prediction equals the meter's reading of real steps, to the byte.
fn assert_exact(config: &TrainConfig) {
    let predicted = predict_step(&Recipe::from(config)).unwrap();
    let measured = measure_steps(config).unwrap();
    assert_eq!(
        (
            predicted.peak_bytes,
            predicted.first_step_peak_bytes,
            predicted.between_steps_bytes
        ),
        (
            measured.peak_bytes,
            measured.first_step_peak_bytes,
            measured.between_steps_bytes
        )
    );
}

#[test]
fn fp8_and_tensor_core_recipes_peak_exactly_where_predicted() {
    // Neither was plannable before the plan ran the trainer's own step.
    let mut fp8 = tiny(2, 2, Precision::Bf16, Checkpointing::PerBlock);
    fp8.fp8 = Some(tl_precision::Fp8Recipe::default());
    assert_exact(&fp8);
    let mut h100 = tiny(2, 2, Precision::Bf16, Checkpointing::Matmuls);
    h100.accumulation = tl_precision::Accumulation::H100;
    assert_exact(&h100);
    assert_exact(&tiny(4, 2, Precision::Fp32, Checkpointing::Off));
}

#[test]
fn checkpointing_trades_the_stored_blocks_for_one_rerun() {
    let plan = MemoryPlan::new(&Recipe::from(&tiny(
        8,
        2,
        Precision::Fp32,
        Checkpointing::PerBlock,
    )))
    .unwrap();
    // tiny at micro-batch 8: N = 512 tokens, d = 64, h = 176.
    // One block saves 8·N·d + 3·N·h = 262,144 + 270,336 floats (no T×T matrix).
    let block = 4 * (8 * 512 * 64 + 3 * 512 * 176);
    assert_eq!(plan.layers[1].saved_plain, block);
    // Checkpointed, block 0 keeps its input and its attention output (2·N·d floats); block 1
    // is the plain last segment.
    assert_eq!(plan.layers[1].saved_checkpointed, 2 * 4 * 512 * 64);
    assert_eq!(plan.layers[2].saved_checkpointed, block);
    assert!(plan.checkpointed.peak_bytes < plan.plain.peak_bytes);
}

#[test]
fn the_capstone_predictions_are_the_release_measurements() {
    // `tinyllm plan --preset capstone --micro-batch 8 --measure [--bf16]
    // [--checkpoint-activations]`, release build: the meter's steady-state peaks.
    let measured = [
        (Precision::Fp32, Checkpointing::Off, 871_977_992),
        (Precision::Fp32, Checkpointing::PerBlock, 343_794_440),
        (Precision::Bf16, Checkpointing::Off, 913_987_848),
        (Precision::Bf16, Checkpointing::PerBlock, 353_067_784),
    ];
    for (precision, checkpointing, peak) in measured {
        let mut config = TrainConfig::for_preset(Preset::Capstone);
        (config.precision, config.checkpointing) = (precision, checkpointing);
        let predicted = predict_step(&Recipe::from(&config)).unwrap();
        let error = relative_error(predicted.peak_bytes, peak);
        assert!(
            error.abs() <= TOLERANCE,
            "{precision} {checkpointing:?}: {error:+e}"
        );
    }
}

#[test]
fn plan_prints_model_state_saved_activations_and_both_peaks() {
    let text = stdout_of(&["plan", "--preset", "tiny", "--micro-batch", "2"]);
    for expected in [
        "133,440 parameters",
        "16 B/parameter",
        // 16 · 133,440
        "2,135,040",
        "q, k, v",
        "block 1",
        "peak live bytes",
        "per block peak at: step 2",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in\n{text}");
    }
}

#[test]
fn plan_json_holds_the_plan_and_the_measured_error() {
    let text = stdout_of(&[
        "plan",
        "--preset",
        "tiny",
        "--micro-batch",
        "2",
        "--accum",
        "2",
        "--bf16",
        "--checkpoint-activations",
        "--measure",
        "--json",
    ]);
    let output: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(output["plan"]["parameters"], 133_440);
    assert_eq!(output["plan"]["recipe"]["precision"], "bf16");
    assert_eq!(output["plan"]["checkpointed"]["checkpointing"], "per-block");
    let predicted = output["plan"]["checkpointed"]["peak_bytes"]
        .as_u64()
        .unwrap();
    let measured = output["measured"]["peak_bytes"].as_u64().unwrap();
    assert!(relative_error(predicted, measured).abs() <= TOLERANCE);
    assert!(output["relative_error"].as_f64().unwrap().abs() <= TOLERANCE);
}

#[test]
fn plan_runs_in_process_on_the_tiny_preset() {
    let args = [
        "plan",
        "--preset",
        "tiny",
        "--micro-batch",
        "1",
        "--checkpoint-budget",
        "2",
    ];
    assert_eq!(tinyllm(&args).unwrap(), Exit::Success);
}

#[test]
fn bad_plan_arguments_are_refused_with_their_names() {
    let error = run_error(&["plan", "--preset", "tiny", "--micro-batch", "0"]);
    assert!(error.to_string().contains("micro-batch"), "{error}");
    let error = run_error(&["plan", "--preset", "tiny", "--accum", "0"]);
    assert!(error.to_string().contains("accum"), "{error}");
    let error = run_error(&["plan", "--preset", "gigantic"]);
    assert!(matches!(error, TrainError::UnknownPreset { .. }), "{error}");
    let error = run_error(&["plan", "--preset", "tiny", "--dropout", "1.5"]);
    assert!(error.to_string().contains("dropout"), "{error}");
    // Two blocks need a budget of 2 (1·2/2 = 1 < 2): budget 1 has no schedule.
    let error = run_error(&["plan", "--preset", "tiny", "--checkpoint-budget", "1"]);
    assert!(matches!(error, TrainError::Recompute(_)), "{error}");
}

#[test]
fn conflicting_plan_flags_are_usage_errors() {
    for args in [
        &["plan", "--bf16", "--fp16"][..],
        &[
            "plan",
            "--checkpoint-activations",
            "--checkpoint-budget",
            "2",
        ],
        &["plan", "--micro-batch", "eight"],
        &["plan", "--unknown"],
    ] {
        assert!(matches!(tinyllm(args), Err(CliError::Usage(_))), "{args:?}");
    }
}
