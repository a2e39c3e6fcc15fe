//! `tinyllm profile` end to end on the tiny preset: the chart and the timeline it writes, and
//! arguments that must be refused before anything is written.

mod common;

use std::fs;
use std::path::Path;

use common::{run_error, tinyllm};
use tl_tensor::memory;
use tl_train::TrainError;
use tl_train::cli::{CliError, Exit};
use tl_train::model::Checkpointing;
use tl_train::profile::{Phase, Profile, read_profile, timeline_path};

/// Parameters of the tiny preset.
const TINY_PARAMETERS: u64 = 133_440;

/// Runs `tinyllm profile ARGS..` in-process.
fn profile(args: &[&str]) -> Result<Exit, CliError> {
    tinyllm(&[&["profile"], args].concat())
}

fn expect_error(args: &[&str]) -> TrainError {
    run_error(&[&["profile"], args].concat())
}

/// Profiles the tiny preset (2 × 2 sequences of 64 bytes per step) into `out`.
fn profile_tiny(out: &Path, extra: &[&str]) -> Profile {
    let out_str = out.to_str().unwrap();
    let mut args = vec![
        "--preset",
        "tiny",
        "--micro-batch",
        "2",
        "--accum",
        "2",
        "--out",
        out_str,
    ];
    args.extend_from_slice(extra);
    assert_eq!(profile(&args).unwrap(), Exit::Success);
    read_profile(&timeline_path(out)).unwrap()
}

#[test]
fn profiling_draws_plain_and_checkpointed_runs_with_their_phases_and_peaks() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("memory.svg");
    let profile = profile_tiny(&out, &[]);

    let [plain, checkpointed] = &profile.runs[..] else {
        panic!("expected two runs, got {}", profile.runs.len());
    };
    assert_eq!(plain.checkpointing, Checkpointing::Off);
    assert_eq!(checkpointed.checkpointing, Checkpointing::PerBlock);
    // Keeping only block inputs lowers the peak; the rerun makes more allocations, and the
    // loss is the same to the bit.
    assert!(checkpointed.peak().bytes < plain.peak().bytes);
    assert!(checkpointed.counts().0 > plain.counts().0);
    assert_eq!(plain.losses, checkpointed.losses);
    for run in [plain, checkpointed] {
        // A steady-state step starts with weights, gradients and both AdamW moments live:
        // 16 bytes per parameter, 133,440 × 16.
        assert_eq!(run.start_live, TINY_PARAMETERS * 16);
        // zero grad, then forward and backward of each micro-batch, then the optimizer.
        let phases: Vec<Phase> = run.spans.iter().map(|span| span.phase).collect();
        assert_eq!(
            phases,
            [
                Phase::ZeroGrad,
                Phase::Forward,
                Phase::Backward,
                Phase::Forward,
                Phase::Backward,
                Phase::Optimizer
            ]
        );
        // The step gives back everything it took.
        assert_eq!(run.events.last().unwrap().live, run.start_live);
    }

    let svg = fs::read_to_string(&out).unwrap();
    assert!(svg.trim_end().ends_with("</svg>"));
    for text in [
        "plain peak",
        "checkpointed per block peak",
        "forward",
        "backward",
        "zero grad",
        "optimizer",
        "live tensor memory (MiB)",
    ] {
        assert!(svg.contains(text), "the chart lacks {text:?}");
    }
    // The profile ran on this thread and gave back every byte it took.
    assert_eq!(memory::live_bytes(), 0);
}

#[test]
fn a_budget_fp16_and_several_steps_are_profiled_as_asked() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("budget.svg");
    let profile = profile_tiny(
        &out,
        &["--fp16", "--checkpoint-budget", "2", "--steps", "2"],
    );
    assert_eq!(profile.config.train.precision.name(), "fp16");
    assert_eq!(profile.config.steps, 2);
    let checkpointed = &profile.runs[1];
    assert_eq!(checkpointed.checkpointing, Checkpointing::Budget(2));
    assert_eq!(checkpointed.label, "checkpointed, budget 2");
    assert_eq!(checkpointed.losses.len(), 2);
    assert_eq!(checkpointed.spans.len(), 2 * 6);
    assert!(
        fs::read_to_string(&out)
            .unwrap()
            .contains("over 2 training steps")
    );
}

#[test]
fn bad_arguments_are_typed_errors_and_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("memory.svg");
    let out = out.to_str().unwrap();
    let tiny = |extra: &[&'static str]| -> Vec<String> {
        let mut args: Vec<String> = ["--preset", "tiny", "--out", out]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let error_of = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        expect_error(&args)
    };

    let error = expect_error(&["--preset", "huge", "--out", out]);
    assert!(
        matches!(&error, TrainError::UnknownPreset { input } if input == "huge"),
        "{error}"
    );
    assert_eq!(
        error.to_string(),
        "unknown preset `huge`: expected one of tiny, small, capstone"
    );
    for (extra, name) in [
        (&["--micro-batch", "0"][..], "micro-batch"),
        (&["--accum", "0"][..], "accum"),
        (&["--steps", "0"][..], "steps"),
    ] {
        let error = error_of(tiny(extra));
        assert!(
            matches!(&error, TrainError::InvalidArgument { name: n, .. } if *n == name),
            "{extra:?}: {error}"
        );
    }
    let error = error_of(tiny(&["--checkpoint-budget", "0"]));
    assert!(matches!(error, TrainError::Recompute(_)), "{error}");

    let missing = dir.path().join("missing").join("memory.svg");
    let png = dir.path().join("memory.png");
    for bad_out in [&missing, &png, &dir.path().to_path_buf()] {
        let bad_out = bad_out.to_str().unwrap();
        let error = expect_error(&["--preset", "tiny", "--out", bad_out]);
        assert!(
            matches!(&error, TrainError::InvalidArgument { name: "out", value, .. } if value == bad_out),
            "{bad_out}: {error}"
        );
    }
    assert_eq!(
        fs::read_dir(dir.path()).unwrap().count(),
        0,
        "a refused profile wrote something"
    );
}

#[test]
fn a_flag_profile_does_not_know_or_two_precisions_are_usage_errors() {
    match profile(&["--resume", "runs/x"]) {
        Err(CliError::Usage(error)) => {
            assert_eq!(error.kind(), clap::error::ErrorKind::UnknownArgument);
        }
        other => panic!("expected a usage error, got {other:?}"),
    }
    match profile(&["--bf16", "--fp16"]) {
        Err(CliError::Usage(error)) => {
            assert_eq!(error.kind(), clap::error::ErrorKind::ArgumentConflict);
        }
        other => panic!("expected a usage error, got {other:?}"),
    }
}
