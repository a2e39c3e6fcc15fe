//! The companion's two experiments from the command line: `tinyllm gradients` (the fp16
//! gradient window) and `--checkpoint-policy` (what a checkpointed block keeps), on the tiny
//! preset.

mod common;

use std::fs;

use common::{TINY_TRAIN, run_error, stdout_of, tinyllm};
use tl_train::cli::{CliError, Exit};
use tl_train::gradients::GradientReport;

#[test]
fn gradients_of_a_fresh_model_and_of_a_trained_run_are_written_and_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("fresh");
    let text = stdout_of(&[
        "gradients",
        "--preset",
        "tiny",
        "--micro-batch",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(text.contains("the default S = 2^16 is"), "{text}");
    assert!(text.contains("fp16 is more accurate than bf16"), "{text}");
    let report: GradientReport =
        serde_json::from_slice(&fs::read(out.join("gradients.json")).unwrap()).unwrap();
    assert!(report.weights.starts_with("initialisation"));
    assert_eq!(report.batch.0, 2);
    assert!(out.join("histogram.svg").exists() && out.join("sweep.svg").exists());

    // From a run's checkpoint: its weights, and its data.
    let run = dir.path().join("run");
    let mut args = TINY_TRAIN.to_vec();
    args.extend(["--steps", "2", "--out", run.to_str().unwrap()]);
    assert_eq!(tinyllm(&args).unwrap(), Exit::Success);
    let trained = dir.path().join("trained");
    stdout_of(&[
        "gradients",
        "--from",
        run.to_str().unwrap(),
        "--out",
        trained.to_str().unwrap(),
    ]);
    let after: GradientReport =
        serde_json::from_slice(&fs::read(trained.join("gradients.json")).unwrap()).unwrap();
    assert!(
        after.weights.contains("latest checkpoint"),
        "{}",
        after.weights
    );
    assert_ne!(after.loss, report.loss);
}

#[test]
fn gradients_refuses_what_it_cannot_measure() {
    let dir = tempfile::tempdir().unwrap();
    // --checkpoint belongs to --from; --preset and --from contradict each other.
    for args in [
        vec!["gradients", "--checkpoint", "3"],
        vec!["gradients", "--preset", "tiny", "--from", "somewhere"],
    ] {
        assert!(
            matches!(tinyllm(&args), Err(CliError::Usage(_))),
            "{args:?}"
        );
    }
    let missing = dir.path().join("no-run");
    let error = run_error(&["gradients", "--from", missing.to_str().unwrap()]);
    assert!(error.to_string().contains("no-run"), "{error}");
    let error = run_error(&["gradients", "--preset", "huge"]);
    assert!(error.to_string().contains("huge"), "{error}");
    assert!(!dir.path().join("gradients-tiny").exists());
}

#[test]
fn a_checkpoint_policy_is_recorded_with_the_run_and_must_agree_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut args = TINY_TRAIN.to_vec();
    args.extend([
        "--steps",
        "4",
        "--until-step",
        "2",
        "--checkpoint-policy",
        "matmuls",
        "--out",
        run.to_str().unwrap(),
    ]);
    tinyllm(&args).unwrap();
    let text = fs::read_to_string(run.join("config.json")).unwrap();
    assert!(text.contains(r#""checkpointing": "matmuls""#), "{text}");
    let error = run_error(&[
        "train",
        "--resume",
        run.to_str().unwrap(),
        "--checkpoint-policy",
        "block",
        "--quiet",
    ]);
    assert!(error.to_string().contains("checkpointing"), "{error}");
    // --checkpoint-activations is the block policy; the two flags do not combine.
    assert!(matches!(
        tinyllm(&[
            "train",
            "--checkpoint-activations",
            "--checkpoint-policy",
            "block"
        ]),
        Err(CliError::Usage(_))
    ));
}

#[test]
fn plan_lists_the_four_policies_and_the_updates_memory() {
    let text = stdout_of(&[
        "plan",
        "--preset",
        "tiny",
        "--micro-batch",
        "2",
        "--accum",
        "1",
    ]);
    let rows: Vec<&str> = text
        .lines()
        .skip_while(|line| !line.starts_with("checkpoint policies"))
        .skip(2)
        .take(4)
        .collect();
    let names: Vec<&str> = rows
        .iter()
        .filter_map(|row| row.split_whitespace().next())
        .collect();
    assert_eq!(
        names,
        ["none", "matmuls", "first-matmul", "block"],
        "{text}"
    );
    assert!(
        rows[1].ends_with("nothing"),
        "matmuls reruns no product: {}",
        rows[1]
    );
    assert!(rows[3].ends_with("wq wk wv wo w1 w3 w2"), "{}", rows[3]);
    assert!(text.contains("0.00 × 4P (it updates in place)"), "{text}");
}
