//! `tinyllm train` and `tinyllm sample` end to end on the tiny preset: learning, exact
//! resumption, and inputs that must be refused without writing anything wrong.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;

use common::{TINY_TRAIN, run_error, tinyllm};
use tl_train::TrainError;
use tl_train::cli::{CliError, Exit};
use tl_train::train::{Record, read_records};

/// [`TINY_TRAIN`] into `out`, with `extra` flags.
fn tiny_args<'a>(out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = TINY_TRAIN.to_vec();
    args.extend(["--out", out]);
    args.extend_from_slice(extra);
    args
}

fn latest_checkpoint(run: &Path) -> std::path::PathBuf {
    run.join(
        fs::read_to_string(run.join("LATEST"))
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
}

fn train_losses(run: &Path) -> Vec<(u64, u64)> {
    read_records(&run.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter_map(|record| match record {
            Record::Train { step, loss, .. } => Some((step, loss.to_bits())),
            Record::Eval { .. } => None,
        })
        .collect()
}

#[test]
fn a_short_run_lowers_the_loss_and_leaves_a_usable_run_directory() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let out_str = out.to_str().unwrap();
    let args = tiny_args(out_str, &["--steps", "30", "--lr", "1e-2", "--bf16"]);
    assert_eq!(tinyllm(&args).unwrap(), Exit::Success);

    let records = read_records(&out.join("metrics.jsonl")).unwrap();
    let first = records.iter().find_map(|r| match r {
        Record::Train { loss, .. } => Some(*loss),
        _ => None,
    });
    let last_val = records.iter().rev().find_map(|r| match r {
        Record::Eval { val_loss, .. } => Some(*val_loss),
        _ => None,
    });
    let (first, last_val) = (first.unwrap(), last_val.unwrap());
    // An untrained byte model starts above ln 256 ≈ 5.55; thirty steps learn the grammar's
    // most common bytes and words.
    assert!(first > 5.0, "first loss {first}");
    assert!(
        last_val < first - 2.0,
        "validation loss {last_val} after starting at {first}"
    );

    for file in ["config.json", "metrics.jsonl", "loss.svg", "LATEST"] {
        assert!(out.join(file).exists(), "{file} missing");
    }
    // The loss chart is on a log axis, says so, and draws the entropy floor.
    let chart = fs::read_to_string(out.join("loss.svg")).unwrap();
    assert!(chart.contains("loss (nats/byte, log scale)"), "{chart}");
    assert!(chart.contains("entropy floor"), "{chart}");
    let checkpoint = latest_checkpoint(&out);
    assert!(checkpoint.ends_with("checkpoint-000030"));
    for file in ["model.safetensors", "optimizer.safetensors", "state.json"] {
        assert!(checkpoint.join(file).exists(), "{file} missing");
    }
    let sample = [
        "sample", "--from", out_str, "--tokens", "20", "--prompt", "the ",
    ];
    assert_eq!(tinyllm(&sample).unwrap(), Exit::Success);
}

#[test]
fn an_interrupted_and_resumed_run_ends_bit_identical_to_an_uninterrupted_one() {
    // fp16 (a loss scaler to restore), dropout (a generator to restore), per-block
    // checkpointing (dropout replayed in reruns) and accumulation all at once.
    let dir = tempfile::tempdir().unwrap();
    let (whole, split) = (dir.path().join("whole"), dir.path().join("split"));
    let recipe = [
        "--steps",
        "6",
        "--fp16",
        "--dropout",
        "0.1",
        "--checkpoint-activations",
        "--save-interval",
        "4",
    ];
    tinyllm(&tiny_args(whole.to_str().unwrap(), &recipe)).unwrap();

    let mut first_part = recipe.to_vec();
    first_part.extend(["--until-step", "3"]);
    tinyllm(&tiny_args(split.to_str().unwrap(), &first_part)).unwrap();
    assert!(latest_checkpoint(&split).ends_with("checkpoint-000003"));
    let resume = ["train", "--resume", split.to_str().unwrap(), "--quiet"];
    assert_eq!(tinyllm(&resume).unwrap(), Exit::Success);

    for file in ["model.safetensors", "optimizer.safetensors"] {
        let a = fs::read(latest_checkpoint(&whole).join(file)).unwrap();
        let b = fs::read(latest_checkpoint(&split).join(file)).unwrap();
        assert!(a == b, "{file} differs after resuming");
    }
    assert_eq!(train_losses(&whole), train_losses(&split));
    assert_eq!(train_losses(&whole).len(), 6);
}

#[test]
fn resuming_with_different_flags_or_a_damaged_checkpoint_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let out_str = out.to_str().unwrap();
    tinyllm(&tiny_args(out_str, &["--steps", "4", "--until-step", "2"])).unwrap();

    let error = run_error(&[
        "train",
        "--resume",
        out_str,
        "--micro-batch",
        "4",
        "--quiet",
    ]);
    assert!(error.to_string().contains("micro_batch"), "{error}");

    // Flip one byte of the weights: the fingerprint check names the file.
    let weights = latest_checkpoint(&out).join("model.safetensors");
    let mut bytes = fs::read(&weights).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x10;
    fs::write(&weights, &bytes).unwrap();
    let error = run_error(&["train", "--resume", out_str, "--quiet"]);
    assert!(matches!(error, TrainError::Checkpoint { .. }));
    assert!(
        error.to_string().contains("model.safetensors") && error.to_string().contains("damaged")
    );
    assert_eq!(
        fs::read(&weights).unwrap(),
        bytes,
        "the damaged file is left for inspection"
    );

    fs::write(latest_checkpoint(&out).join("state.json"), "{ not json").unwrap();
    let error = run_error(&["sample", "--from", out_str]);
    assert!(error.to_string().contains("state.json"), "{error}");

    let error = run_error(&[
        "train",
        "--resume",
        dir.path().join("nothing").to_str().unwrap(),
    ]);
    assert!(error.to_string().contains("not a run directory"), "{error}");
}

#[test]
fn bad_inputs_are_clear_errors_and_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let out_str = out.to_str().unwrap();
    let cases: [(&[&str], &str); 5] = [
        (&["--preset", "huge"], "unknown preset `huge`"),
        (&["--micro-batch", "0"], "micro-batch"),
        (&["--data", "/no/such/file.txt"], "/no/such/file.txt"),
        (&["--lr", "-1"], "lr"),
        (&["--checkpoint-budget", "0"], "budget"),
    ];
    for (flags, message) in cases {
        let mut args = vec!["train", "--quiet", "--out", out_str];
        args.extend_from_slice(flags);
        let error = run_error(&args);
        assert!(error.to_string().contains(message), "{flags:?}: {error}");
        assert!(!out.exists(), "{flags:?} created the run directory");
    }
    let empty = dir.path().join("empty.txt");
    fs::write(&empty, "").unwrap();
    let error = run_error(&[
        "train",
        "--quiet",
        "--out",
        out_str,
        "--data",
        empty.to_str().unwrap(),
    ]);
    assert!(matches!(error, TrainError::Data(_)), "{error}");
    assert!(!out.exists());

    // Syntax errors come from clap, before anything runs.
    for flags in [
        &["train", "--bf16", "--fp16"][..],
        &["train", "--micro-batch", "many"],
        &["fly"],
    ] {
        assert!(
            matches!(tinyllm(flags), Err(CliError::Usage(_))),
            "{flags:?}"
        );
    }
    assert!(!out.exists());
}

#[test]
fn a_new_run_never_overwrites_an_existing_one() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let out_str = out.to_str().unwrap();
    tinyllm(&tiny_args(out_str, &["--steps", "1"])).unwrap();
    let before = fs::read(latest_checkpoint(&out).join("model.safetensors")).unwrap();
    let error = run_error(&tiny_args(out_str, &["--steps", "1", "--seed", "5"]));
    assert!(error.to_string().contains("--resume"), "{error}");
    assert_eq!(
        fs::read(latest_checkpoint(&out).join("model.safetensors")).unwrap(),
        before
    );
}

/// The records' wall-clock time, training time and tokens: present, in order, and on across
/// a resume (which goes on from the `elapsed_s` of the checkpoint's step in the log).
#[test]
fn metrics_carry_the_time_the_training_time_and_the_tokens_seen() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_str = run.to_str().unwrap();
    tinyllm(&tiny_args(run_str, &["--steps", "5", "--until-step", "3"])).unwrap();
    // Step 3's record as if the first process had trained for 1000 s.
    let path = run.join("metrics.jsonl");
    let lines: Vec<String> = fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|line| {
            let mut value: serde_json::Value = serde_json::from_str(line).unwrap();
            if value["kind"] == "train" && value["step"] == 3 {
                value["elapsed_s"] = 1000.0.into();
            }
            value.to_string()
        })
        .collect();
    fs::write(&path, lines.join("\n") + "\n").unwrap();
    tinyllm(&["train", "--resume", run_str, "--quiet"]).unwrap();

    let per_step = tl_train::train::read_config(&run)
        .unwrap()
        .tokens_per_step() as u64;
    let (mut last_time, mut last_elapsed) = (String::new(), 0.0);
    let mut steps = 0;
    for record in read_records(&path).unwrap() {
        let time = match &record {
            Record::Train {
                step,
                time,
                elapsed_s,
                tokens,
                ..
            } => {
                steps += 1;
                assert_eq!(*tokens, Some(step * per_step), "step {step}");
                let elapsed = elapsed_s.unwrap();
                assert!(
                    elapsed > last_elapsed,
                    "step {step}: {elapsed} after {last_elapsed}"
                );
                if *step > 3 {
                    assert!(
                        elapsed > 1000.0,
                        "step {step}: {elapsed} restarted the clock"
                    );
                }
                last_elapsed = elapsed;
                time.clone().unwrap()
            }
            Record::Eval { time, .. } => time.clone().unwrap(),
        };
        // RFC 3339 in UTC with milliseconds: fixed width, so in order as text.
        let shape: String = time
            .chars()
            .map(|c| if c.is_ascii_digit() { 'd' } else { c })
            .collect();
        assert_eq!(shape, "dddd-dd-ddTdd:dd:dd.dddZ", "{time}");
        assert!(time >= last_time, "{time} after {last_time}");
        last_time = time;
    }
    assert_eq!(steps, 5);
}

#[test]
fn version_names_the_commit_when_built_from_a_checkout() {
    let output = Command::new(env!("CARGO_BIN_EXE_tinyllm"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(output.status.success());
    let text = String::from_utf8(output.stdout).unwrap();
    assert!(
        text.starts_with(&format!("tinyllm {}", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    if let Some(commit) = tl_train::build_info::COMMIT {
        assert!(text.contains(commit), "{text}");
    }
}

/// `tinyllm sample ARGS..` run as a process: its standard output.
fn sample_output(args: &[&str]) -> String {
    let mut all = vec!["sample"];
    all.extend(args);
    common::stdout_of(&all)
}

#[test]
fn sample_takes_several_samples_top_k_a_checkpoint_and_a_prompt_file() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_str = run.to_str().unwrap();
    let flags = ["--steps", "4", "--save-interval", "2", "--lr", "1e-2"];
    tinyllm(&tiny_args(run_str, &flags)).unwrap();
    let base = ["--from", run_str, "--tokens", "24", "--prompt", "the "];
    let with = |extra: &[&'static str]| {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        sample_output(&args)
    };

    // --num-samples: continuations of the one prompt from seeds S, S + 1, ..., separated.
    let three = with(&["--num-samples", "3", "--seed", "5"]);
    let parts: Vec<&str> = three
        .split("\n--- sample 2 ---\n")
        .flat_map(|rest| rest.split("\n--- sample 3 ---\n"))
        .collect();
    assert_eq!(parts.len(), 3, "{three}");
    assert!(parts.iter().all(|part| part.starts_with("the ")), "{three}");
    assert!(!three.contains("--- sample 1 ---"), "{three}");
    assert_eq!(with(&["--seed", "5"]), format!("{}\n", parts[0]));
    assert_eq!(with(&["--seed", "6"]), format!("{}\n", parts[1]));
    assert!(!with(&["--seed", "5"]).contains("--- sample"));

    // --top-k 1 is greedy whatever the temperature and seed.
    let greedy = with(&["--temperature", "0"]);
    assert_eq!(
        with(&["--top-k", "1", "--temperature", "2", "--seed", "9"]),
        greedy
    );
    with(&["--top-k", "256"]);
    for k in ["0", "257"] {
        let mut args = vec!["sample"];
        args.extend_from_slice(&base);
        args.extend(["--top-k", k]);
        match run_error(&args) {
            TrainError::InvalidArgument { name, reason, .. } => {
                assert_eq!(name, "top-k");
                assert!(reason.contains("1..=256"), "{reason}");
            }
            other => panic!("--top-k {k}: {other}"),
        }
    }

    // --checkpoint: the model of another step; one the run does not have lists those it has.
    let at_2 = with(&["--checkpoint", "2", "--temperature", "0"]);
    assert!(at_2.starts_with("the "));
    assert_eq!(with(&["--checkpoint", "4", "--temperature", "0"]), greedy);
    let mut missing = vec!["sample"];
    missing.extend_from_slice(&base);
    missing.extend(["--checkpoint", "3"]);
    match run_error(&missing) {
        TrainError::InvalidArgument {
            name,
            value,
            reason,
        } => {
            assert_eq!((name, value.as_str()), ("checkpoint", "3"));
            assert!(reason.ends_with("steps: 2, 4"), "{reason}");
        }
        other => panic!("{other}"),
    }

    // --prompt-file: the file's bytes as the prompt; an empty file is refused.
    let prompt = dir.path().join("prompt.txt");
    fs::write(&prompt, "the ").unwrap();
    let prompt_str = prompt.to_str().unwrap();
    let from_file = sample_output(&[
        "--from",
        run_str,
        "--tokens",
        "24",
        "--prompt-file",
        prompt_str,
        "--temperature",
        "0",
    ]);
    assert_eq!(from_file, greedy);
    let empty = dir.path().join("empty.txt");
    fs::write(&empty, "").unwrap();
    let error = run_error(&[
        "sample",
        "--from",
        run_str,
        "--prompt-file",
        empty.to_str().unwrap(),
    ]);
    assert!(
        matches!(
            &error,
            TrainError::InvalidArgument {
                name: "prompt-file",
                ..
            }
        ),
        "{error}"
    );
    let error = run_error(&[
        "sample",
        "--from",
        run_str,
        "--prompt-file",
        "/no/such/prompt",
    ]);
    assert!(error.to_string().contains("/no/such/prompt"), "{error}");
    assert!(matches!(
        tinyllm(&[
            "sample",
            "--from",
            run_str,
            "--prompt",
            "a",
            "--prompt-file",
            prompt_str
        ]),
        Err(CliError::Usage(_))
    ));
    for n in ["0", "1001"] {
        let error = run_error(&["sample", "--from", run_str, "--num-samples", n]);
        assert!(
            matches!(
                &error,
                TrainError::InvalidArgument {
                    name: "num-samples",
                    ..
                }
            ),
            "{error}"
        );
    }
}
