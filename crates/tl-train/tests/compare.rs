//! `tinyllm compare` end to end on the tiny preset.

mod common;

use std::fs;

use common::tinyllm;
use tl_train::cli::{CliError, Exit};
use tl_train::compare::Comparison;

#[test]
fn the_recipe_tracks_the_fp32_baseline_with_less_memory() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cmp");
    let args = [
        "compare",
        "--preset",
        "tiny",
        "--steps",
        "40",
        "--lr",
        "1e-2",
        "--micro-batch",
        "2",
        "--accum",
        "4",
        "--corpus-bytes",
        "40000",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ];
    let exit = tinyllm(&args).unwrap();
    let report: Comparison =
        serde_json::from_slice(&fs::read(out.join("comparison.json")).unwrap()).unwrap();
    // Same global batch: 8 sequences, taken whole by the baseline, as 4 × 2 by the recipe.
    assert_eq!(
        (
            report.baseline_config.micro_batch,
            report.baseline_config.accum
        ),
        (8, 1)
    );
    assert_eq!(
        (report.recipe_config.micro_batch, report.recipe_config.accum),
        (2, 4)
    );
    assert_eq!(report.baseline.steps, 40);
    assert_eq!(report.recipe.steps, 40);
    // Both learned (an untrained byte model sits above ln 256 ≈ 5.5).
    assert!(report.baseline.val_loss.unwrap() < 3.0 && report.recipe.val_loss.unwrap() < 3.0);
    assert!(report.val_gap.abs() < 0.05, "gap {}", report.val_gap);
    // A quarter of the batch, and per-block checkpointing: well under the baseline's peak.
    assert!(
        report.peak_live_ratio < 0.8,
        "ratio {}",
        report.peak_live_ratio
    );
    assert_eq!(exit == Exit::Success, report.passes);
    for file in [
        "compare.svg",
        "fp32-baseline/metrics.jsonl",
        "recipe/metrics.jsonl",
    ] {
        assert!(out.join(file).exists(), "{file} missing");
    }
}

#[test]
fn bad_compare_arguments_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cmp");
    let out_str = out.to_str().unwrap();
    let error = match tinyllm(&["compare", "--micro-batch", "0", "--out", out_str]) {
        Err(CliError::Run(error)) => error,
        other => panic!("expected a run error, got {other:?}"),
    };
    assert!(error.to_string().contains("micro-batch"), "{error}");
    let unknown = tinyllm(&["compare", "--preset", "gigantic", "--out", out_str]);
    assert!(matches!(unknown, Err(CliError::Run(e)) if e.to_string().contains("gigantic")));
    assert!(matches!(
        tinyllm(&["compare", "--fp16", "--fp32"]),
        Err(CliError::Usage(_))
    ));
    assert!(!out.exists());
}
