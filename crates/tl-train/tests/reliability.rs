//! No work lost and no silent failure: what a scheduler, a shared machine, a damaged disk or a
//! careless flag does to a run, on the tiny preset. Each test is one finding of issue 17.

mod common;

use std::fs;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::{TINY_TRAIN, latest_checkpoint, model_bytes, run_error, tinyllm, train_steps};
use tl_train::TrainError;
use tl_train::cli::Exit;
use tl_train::store::fingerprint;

/// [`TINY_TRAIN`] into `out`, with `extra` flags.
fn tiny_args(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = TINY_TRAIN.map(String::from).to_vec();
    args.extend(["--out".to_string(), out.to_str().unwrap().to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn run_in_process(args: &[String]) -> Exit {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    tinyllm(&args).unwrap()
}

fn error_in_process(args: &[String]) -> TrainError {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_error(&args)
}

fn binary() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tinyllm"))
}

/// Waits for `child` at most `limit`, killing it and failing the test past that.
fn wait_bounded(child: &mut std::process::Child, limit: Duration) -> ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("tinyllm did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Entries a crashed writer would leave: hidden temporaries (the lock file aside).
fn leftovers(run: &Path) -> Vec<String> {
    fs::read_dir(run)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".tmp"))
        .collect()
}

/// Rewrites a checkpoint's SHA256SUMS after a deliberate edit, as a forger would, and points
/// `LATEST` at it by name alone, as a person writes it.
fn reseal(checkpoint: &Path) {
    let mut sums = String::new();
    for file in ["model.safetensors", "optimizer.safetensors", "state.json"] {
        let bytes = fs::read(checkpoint.join(file)).unwrap();
        sums.push_str(&format!("{}  {file}\n", fingerprint(&bytes)));
    }
    fs::write(checkpoint.join("SHA256SUMS"), sums).unwrap();
    let name = checkpoint.file_name().unwrap().to_str().unwrap();
    fs::write(checkpoint.parent().unwrap().join("LATEST"), name).unwrap();
}

// 1. Every stopping signal checkpoints and exits with 128 + signal.
#[test]
fn sigint_sigterm_and_sighup_checkpoint_the_last_step_and_exit_conventionally() {
    for (signal, number) in [("INT", 2), ("TERM", 15), ("HUP", 1)] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        let mut child = binary()
            .args(tiny_args(
                &out,
                &["--steps", "100000", "--save-interval", "100000"],
            ))
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while train_steps(&out) < 2 {
            assert!(started.elapsed() < Duration::from_secs(60), "no steps");
            std::thread::sleep(Duration::from_millis(20));
        }
        let sent = Command::new("kill")
            .args([format!("-{signal}"), child.id().to_string()])
            .status();
        assert!(sent.unwrap().success());
        let status = wait_bounded(&mut child, Duration::from_secs(60));
        assert_eq!(status.code(), Some(128 + number), "SIG{signal}");
        let steps = train_steps(&out);
        assert!(
            latest_checkpoint(&out).ends_with(format!("checkpoint-{steps:06}")),
            "SIG{signal}: the checkpoint is of the last logged step {steps}"
        );
    }
}

// 2. A directory with a config and no checkpoint resumes from step 0.
#[test]
fn a_run_stopped_before_its_first_checkpoint_resumes_from_step_zero() {
    let dir = tempfile::tempdir().unwrap();
    let (whole, stopped) = (dir.path().join("whole"), dir.path().join("stopped"));
    run_in_process(&tiny_args(&whole, &["--steps", "4"]));
    // Killed right after the run directory was made: config.json, no checkpoint.
    let mut child = binary()
        .args(tiny_args(&stopped, &["--steps", "4"]))
        // The fifth operation is the first after config.json was renamed into place.
        .env(tl_train::store::FAULT_ENV, "5")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(!wait_bounded(&mut child, Duration::from_secs(60)).success());
    assert!(stopped.join("config.json").exists());
    assert!(!stopped.join("LATEST").exists());
    let again = error_in_process(&tiny_args(&stopped, &["--steps", "4"]));
    assert!(again.to_string().contains("--resume"), "{again}");
    let resume = ["train", "--resume", stopped.to_str().unwrap(), "--quiet"].map(String::from);
    assert_eq!(run_in_process(&resume), Exit::Success);
    assert_eq!(model_bytes(&whole), model_bytes(&stopped));
}

// 3. A reader that goes away does not stop the run.
#[test]
fn a_closed_stderr_does_not_stop_training() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = tiny_args(&out, &["--steps", "3"]);
    args.retain(|arg| arg != "--quiet");
    let mut child = binary()
        .args(&args)
        .stderr(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Like `| head -1`: nothing reads, and the pipes close at once.
    drop(child.stderr.take());
    drop(child.stdout.take());
    let status = wait_bounded(&mut child, Duration::from_secs(60));
    assert!(status.success(), "{status}");
    assert!(latest_checkpoint(&out).ends_with("checkpoint-000003"));
}

// 4. Divergence is an error with its own exit status, and no checkpoint is written past it.
#[test]
fn a_diverging_fp16_run_stops_with_status_4_and_keeps_its_last_good_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let args = tiny_args(
        &out,
        &[
            "--fp16",
            "--lr",
            "10",
            "--no-clip",
            "--steps",
            "60",
            "--save-interval",
            "1",
        ],
    );
    let output = binary().args(&args).output().unwrap();
    assert_eq!(output.status.code(), Some(4));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("diverged at step"), "{stderr}");
    let checkpoint = latest_checkpoint(&out);
    let step: usize = checkpoint.to_str().unwrap()[checkpoint.to_str().unwrap().len() - 6..]
        .parse()
        .unwrap();
    assert!(
        stderr.contains(&format!("diverged at step {}", step + 1)),
        "{stderr}"
    );
    assert!(!out.join("summary.json").exists(), "no summary of success");
    // The checkpoint before it is kept too (two by default).
    if step > 1 {
        assert!(out.join(format!("checkpoint-{:06}", step - 1)).exists());
    }
}

#[test]
fn an_exploding_fp32_run_names_the_step_and_the_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let error = error_in_process(&tiny_args(
        &out,
        &["--lr", "1e4", "--no-clip", "--steps", "60"],
    ));
    match &error {
        TrainError::Diverged { step, what, .. } => {
            assert!(*step > 1);
            assert!(what.contains("weight") || what.contains("gradient") || what.contains("loss"));
        }
        other => panic!("expected Diverged, got {other}"),
    }
    assert!(error.to_string().contains("diverged at step"), "{error}");
}

#[test]
fn sample_refuses_weights_that_are_not_finite() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    run_in_process(&tiny_args(&out, &["--steps", "1"]));
    let checkpoint = latest_checkpoint(&out);
    let path = checkpoint.join("model.safetensors");
    let mut bytes = fs::read(&path).unwrap();
    let last = bytes.len() - 4;
    bytes[last..].copy_from_slice(&f32::NAN.to_le_bytes());
    fs::write(&path, bytes).unwrap();
    reseal(&checkpoint);
    let error = run_error(&["sample", "--from", out.to_str().unwrap()]);
    assert!(error.to_string().contains("NaN"), "{error}");
}

// 6. One process at a time in a run directory.
#[test]
fn a_second_trainer_on_a_running_directory_is_refused_naming_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut child = binary()
        .args(tiny_args(&out, &["--steps", "100000"]))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while train_steps(&out) < 1 {
        assert!(started.elapsed() < Duration::from_secs(60), "no steps");
        std::thread::sleep(Duration::from_millis(20));
    }
    let resume = ["train", "--resume", out.to_str().unwrap(), "--quiet"].map(String::from);
    let error = error_in_process(&resume);
    let _ = child.kill();
    let _ = child.wait();
    assert!(matches!(error, TrainError::Locked { .. }), "{error}");
    assert!(
        error
            .to_string()
            .contains(&format!("process {}", child.id())),
        "{error}"
    );
}

// 7. What a checkpoint says is verified, not trusted.
#[test]
fn an_edited_state_or_a_latest_pointing_elsewhere_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (out, other) = (dir.path().join("run"), dir.path().join("other"));
    run_in_process(&tiny_args(&out, &["--steps", "4", "--until-step", "2"]));
    run_in_process(&tiny_args(&other, &["--steps", "4", "--until-step", "2"]));
    let resume = ["train", "--resume", out.to_str().unwrap(), "--quiet"].map(String::from);

    let state = latest_checkpoint(&out).join("state.json");
    let original = fs::read_to_string(&state).unwrap();
    fs::write(&state, original.replace("\"accum\": 2", "\"accum\": 8")).unwrap();
    let error = error_in_process(&resume);
    assert!(error.to_string().contains("state.json"), "{error}");
    assert!(error.to_string().contains("SHA-256"), "{error}");

    // Resealed, the edit still disagrees with the run's config.json.
    reseal(&latest_checkpoint(&out));
    let error = error_in_process(&resume);
    assert!(error.to_string().contains("accum"), "{error}");
    fs::write(&state, &original).unwrap();
    reseal(&latest_checkpoint(&out));

    fs::write(out.join("LATEST"), "../other/checkpoint-000002").unwrap();
    let error = error_in_process(&resume);
    assert!(
        error.to_string().contains("not a checkpoint of this run"),
        "{error}"
    );
    fs::write(out.join("LATEST"), "checkpoint-000002").unwrap();
    assert_eq!(run_in_process(&resume), Exit::Success);
}

// 7b. A damaged LATEST that names another intact checkpoint (one digit off) is refused, and
// nothing is deleted as a crash's leftovers: LATEST is sealed with its checkpoint's sums.
#[test]
fn a_latest_damaged_into_naming_an_older_checkpoint_is_refused_and_nothing_removed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    run_in_process(&tiny_args(&out, &["--steps", "4", "--until-step", "2"]));
    let latest = out.join("LATEST");
    let sealed = fs::read_to_string(&latest).unwrap();
    let mut lines = sealed.lines();
    assert_eq!(lines.next(), Some("checkpoint-000002"));
    let seal = lines.next().unwrap();
    assert!(seal.ends_with("  checkpoint-000002/SHA256SUMS"), "{seal}");
    let sums = fs::read(out.join("checkpoint-000002/SHA256SUMS")).unwrap();
    assert_eq!(seal.split_once("  ").unwrap().0, fingerprint(&sums));

    // '2' XOR 3 is '1': the flip the loaders' proptest found.
    assert!(out.join("checkpoint-000001").is_dir());
    fs::write(&latest, sealed.replacen("000002", "000001", 1)).unwrap();
    let resume = ["train", "--resume", out.to_str().unwrap(), "--quiet"].map(String::from);
    let error = error_in_process(&resume);
    assert!(matches!(error, TrainError::Checkpoint { .. }), "{error}");
    assert!(error.to_string().contains("LATEST"), "{error}");
    assert!(error.to_string().contains("damaged"), "{error}");
    assert!(
        out.join("checkpoint-000002").is_dir(),
        "the newer checkpoint was removed"
    );

    // Both lines renamed: the seal is not the older checkpoint's.
    fs::write(&latest, sealed.replace("000002", "000001")).unwrap();
    let error = error_in_process(&resume);
    assert!(error.to_string().contains("LATEST"), "{error}");
    assert!(error.to_string().contains("SHA-256"), "{error}");
    assert!(out.join("checkpoint-000002").is_dir());

    // A damaged seal is refused the same way; the intact LATEST resumes.
    fs::write(&latest, sealed.replacen("  checkpoint", "0  checkpoint", 1)).unwrap();
    let error = error_in_process(&resume);
    assert!(error.to_string().contains("LATEST"), "{error}");
    fs::write(&latest, &sealed).unwrap();
    assert_eq!(run_in_process(&resume), Exit::Success);
}

#[test]
fn a_data_file_changed_between_train_and_resume_is_noticed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let data = dir.path().join("text.txt");
    let text: String = (0..2000)
        .map(|i| format!("line {i} of the text\n"))
        .collect();
    fs::write(&data, &text).unwrap();
    let mut args = tiny_args(&out, &["--steps", "4", "--until-step", "2"]);
    let corpus = args.iter().position(|a| a == "--corpus-bytes").unwrap();
    args.drain(corpus..corpus + 2);
    args.extend(["--data".to_string(), data.to_str().unwrap().to_string()]);
    run_in_process(&args);

    fs::write(&data, text.replace("line 7 ", "line 8 ")).unwrap();
    let resume = ["train", "--resume", out.to_str().unwrap(), "--quiet"].map(String::from);
    let error = error_in_process(&resume);
    assert!(matches!(error, TrainError::DataChanged { .. }), "{error}");
    assert!(error.to_string().contains("--data-changed-ok"), "{error}");
    let mut anyway = resume.to_vec();
    anyway.push("--data-changed-ok".into());
    assert_eq!(run_in_process(&anyway), Exit::Success);
}

#[test]
fn a_relative_data_path_still_resumes_from_another_directory() {
    let dir = tempfile::tempdir().unwrap();
    let text: String = (0..2000)
        .map(|i| format!("line {i} of the text\n"))
        .collect();
    fs::write(dir.path().join("text.txt"), &text).unwrap();
    let status = binary()
        .current_dir(dir.path())
        .args([
            "train",
            "--preset",
            "tiny",
            "--micro-batch",
            "2",
            "--accum",
            "2",
            "--quiet",
            "--data",
            "text.txt",
            "--out",
            "run",
            "--steps",
            "4",
            "--until-step",
            "2",
        ])
        .status()
        .unwrap();
    assert!(status.success());
    let resume = [
        "train",
        "--resume",
        dir.path().join("run").to_str().unwrap(),
        "--quiet",
    ]
    .map(String::from);
    assert_eq!(run_in_process(&resume), Exit::Success);
}

// 8. A finished run stays as it finished.
#[test]
fn resuming_a_finished_run_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    run_in_process(&tiny_args(&out, &["--steps", "2"]));
    let summary = fs::read(out.join("summary.json")).unwrap();
    let metrics = fs::read(out.join("metrics.jsonl")).unwrap();
    let output = binary()
        .args(["train", "--resume", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("finished"));
    assert_eq!(fs::read(out.join("summary.json")).unwrap(), summary);
    assert_eq!(fs::read(out.join("metrics.jsonl")).unwrap(), metrics);
}

// 9. Numeric flags: a typed error, exit status 2, nothing written.
#[test]
fn out_of_range_numeric_flags_exit_2_and_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let max = u64::MAX.to_string();
    let values = ["0", "-1", "NaN", "inf", max.as_str()];
    let flags = [
        "--micro-batch",
        "--accum",
        "--steps",
        "--corpus-bytes",
        "--lr",
        "--min-lr",
        "--weight-decay",
        "--clip",
        "--dropout",
        "--eval-interval",
        "--save-interval",
        "--keep-checkpoints",
        "--max-loss",
        "--max-skipped",
        "--checkpoint-budget",
    ];
    // Values a flag legitimately takes (0 weight decay, 0 dropout, seeds...).
    let allowed = |flag: &str, value: &str| {
        matches!(
            (flag, value),
            ("--weight-decay", "0") | ("--dropout", "0") | ("--min-lr", "0")
        )
    };
    let mut cases: Vec<Vec<String>> = Vec::new();
    for flag in flags {
        for value in values {
            if !allowed(flag, value) {
                cases.push(vec![flag.to_string(), value.to_string()]);
            }
        }
    }
    // Sizes that fit every bound but not this machine's memory.
    cases.push(vec!["--micro-batch".into(), "250000".into()]);
    cases.push(vec![
        "--warmup".into(),
        "50".into(),
        "--steps".into(),
        "10".into(),
    ]);
    for case in &cases {
        let mut args = tiny_args(&out, &[]);
        args.extend(case.iter().cloned());
        let output = binary().args(&args).output().unwrap();
        assert_eq!(
            output.status.code(),
            Some(2),
            "{case:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(!out.exists(), "{case:?} wrote the run directory");
    }
    for command in [
        &["plan", "--preset", "tiny", "--accum", max.as_str()][..],
        &["plan", "--preset", "tiny", "--micro-batch", max.as_str()],
        &["compare", "--preset", "tiny", "--micro-batch", max.as_str()],
        &["profile", "--preset", "tiny", "--accum", max.as_str()],
        &["sample", "--from", "nowhere", "--tokens", max.as_str()],
    ] {
        let mut child = binary()
            .args(command)
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let status = wait_bounded(&mut child, Duration::from_secs(30));
        assert_eq!(status.code(), Some(2), "{command:?}");
    }
    assert_eq!(
        fs::read_dir(dir.path()).unwrap().count(),
        0,
        "nothing written"
    );
}

#[test]
fn a_data_file_that_never_ends_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = tiny_args(&out, &[]);
    let corpus = args.iter().position(|a| a == "--corpus-bytes").unwrap();
    args.drain(corpus..corpus + 2);
    args.extend(["--data".to_string(), "/dev/zero".to_string()]);
    let error = error_in_process(&args);
    assert!(error.to_string().contains("may never end"), "{error}");
    assert!(!out.exists());
}

// 10. What a crashed writer leaves is removed at the next start.
#[test]
fn staging_directories_and_orphan_checkpoints_are_removed_at_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    run_in_process(&tiny_args(&out, &["--steps", "4", "--until-step", "2"]));
    let staging = out.join(".checkpoint-000003.4242.tmp");
    fs::create_dir(&staging).unwrap();
    fs::write(staging.join("model.safetensors"), b"partial").unwrap();
    fs::write(out.join(".LATEST.4242.tmp"), b"checkpoint-000003").unwrap();
    let orphan = out.join("checkpoint-000009");
    fs::create_dir(&orphan).unwrap();
    let resume = ["train", "--resume", out.to_str().unwrap(), "--quiet"].map(String::from);
    assert_eq!(run_in_process(&resume), Exit::Success);
    assert!(leftovers(&out).is_empty(), "{:?}", leftovers(&out));
    assert!(!orphan.exists());
}

// 11. A run killed after its last checkpoint and before its summary gets the summary at
// the next start, rebuilt from its metrics and saying so, with nothing trained again.
#[test]
fn a_finished_run_without_its_summary_gets_it_at_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    run_in_process(&tiny_args(&out, &["--steps", "3"]));
    let written: serde_json::Value =
        serde_json::from_slice(&fs::read(out.join("summary.json")).unwrap()).unwrap();
    assert!(written.get("note").is_none());
    fs::remove_file(out.join("summary.json")).unwrap();
    fs::remove_file(out.join("loss.svg")).unwrap();
    let metrics = fs::read(out.join("metrics.jsonl")).unwrap();
    let resume = ["train", "--resume", out.to_str().unwrap(), "--quiet"].map(String::from);
    assert_eq!(run_in_process(&resume), Exit::Success);
    let rebuilt: serde_json::Value =
        serde_json::from_slice(&fs::read(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(rebuilt["steps"], written["steps"]);
    assert_eq!(rebuilt["train_loss"], written["train_loss"]);
    assert!(rebuilt["note"].as_str().unwrap().contains("rebuilt"));
    assert!(out.join("loss.svg").exists());
    assert_eq!(
        fs::read(out.join("metrics.jsonl")).unwrap(),
        metrics,
        "nothing trained"
    );
}

/// A small deterministic generator for the crash points (the test's own seed).
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

// The crash-consistency test: killed at seeded moments, resumed each time, the run ends
// bit for bit where an uninterrupted one does.
#[test]
fn killed_at_random_moments_and_inside_checkpoint_writes_it_ends_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let (whole, crashed) = (dir.path().join("whole"), dir.path().join("crashed"));
    let recipe = [
        "--steps",
        "12",
        "--save-interval",
        "2",
        "--fp16",
        "--dropout",
        "0.1",
    ];
    run_in_process(&tiny_args(&whole, &recipe));

    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let (mut faults, mut kills, mut attempts) = (0, 0, 0);
    loop {
        attempts += 1;
        assert!(attempts < 200, "no progress after {attempts} attempts");
        let args = if crashed.join("config.json").exists() {
            ["train", "--resume", crashed.to_str().unwrap(), "--quiet"]
                .map(String::from)
                .to_vec()
        } else {
            tiny_args(&crashed, &recipe)
        };
        let mut command = binary();
        command.args(&args).stderr(Stdio::null());
        let roll = next_random(&mut seed);
        let fault = faults < 20 && !roll.is_multiple_of(3);
        let kill = !fault && kills < 15;
        if fault {
            // Somewhere among the writers' filesystem operations of the next few steps.
            let at = 1 + roll % 40;
            command.env(tl_train::store::FAULT_ENV, at.to_string());
        }
        let mut child = command.spawn().unwrap();
        if kill {
            std::thread::sleep(Duration::from_millis(roll % 400));
            let _ = child.kill();
        }
        let status = wait_bounded(&mut child, Duration::from_secs(60));
        if fault && !status.success() {
            faults += 1;
        } else if kill && !status.success() {
            kills += 1;
        } else if status.success() && faults >= 20 && kills >= 15 {
            break;
        }
        // Every checkpoint on disk is whole.
        if crashed.join("LATEST").exists() {
            let checkpoint = latest_checkpoint(&crashed);
            assert!(checkpoint.join("SHA256SUMS").exists(), "{checkpoint:?}");
        }
        if status.success() && crashed.join("summary.json").exists() && (faults < 20 || kills < 15)
        {
            // Finished before enough crashes: start over from scratch.
            fs::remove_dir_all(&crashed).unwrap();
        }
    }
    assert!(faults >= 20 && kills >= 15);
    assert!(
        model_bytes(&whole) == model_bytes(&crashed),
        "weights differ after the crashes"
    );
    assert!(leftovers(&crashed).is_empty(), "{:?}", leftovers(&crashed));
}
