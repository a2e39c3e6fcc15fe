//! Inputs a hostile or careless user gives the trainer (issue 32): an export over its own
//! run, files that never end, a vocabulary the data does not fit, a model named twice, the
//! extremes of every config field. Each is a typed error with the documented exit status,
//! and nothing the user had is lost.

mod common;

use std::fs;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::{TINY_TRAIN, capped, run_error, tinyllm};
use tl_train::TrainError;
use tl_train::cli::Exit;
use tl_train::store::fingerprint;

fn binary() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tinyllm"))
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A finished two-step tiny run in `dir/name`.
fn trained_run(dir: &Path, name: &str) -> std::path::PathBuf {
    let run = dir.join(name);
    let mut args: Vec<&str> = TINY_TRAIN.to_vec();
    let out = run.to_str().unwrap();
    args.extend(["--steps", "2", "--out", out]);
    assert_eq!(tinyllm(&args).unwrap(), Exit::Success);
    run
}

/// Every file under `dir` with its SHA-256, for "nothing changed" (the lock file aside: it
/// names its last holder).
fn tree(dir: &Path) -> Vec<(String, String)> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(next) = stack.pop() {
        for entry in fs::read_dir(&next).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let name = path.strip_prefix(dir).unwrap().display().to_string();
                if name != ".lock" {
                    files.push((name, fingerprint(&fs::read(&path).unwrap())));
                }
            }
        }
    }
    files.sort();
    files
}

// Defect 1: an export that would replace its own run is refused, naming both.
#[test]
fn an_export_onto_its_own_run_or_a_directory_holding_it_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let parent = dir.path().join("p");
    fs::create_dir(&parent).unwrap();
    let run = trained_run(&parent, "run");
    let before = tree(&run);
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&parent, &link).unwrap();
    let from = run.to_str().unwrap();
    let targets = [
        run.clone(),                                  // the run itself
        parent.clone(),                               // a directory holding it
        dir.path().to_path_buf(),                     // its grandparent
        run.join("checkpoint-000002"),                // inside it, existing
        run.join("export"),                           // inside it, not yet existing
        link.join("run"),                             // the run through a link
        link.clone(),                                 // its parent through a link
        run.join("new").join("..").join(".."),        // the parent, spelled with `..`
        parent.join(".").join("run").join("missing"), // inside, spelled with `.`
    ];
    for target in &targets {
        let to = target.to_str().unwrap();
        let error = run_error(&["export", "--from", from, "--to", to, "--force"]);
        let message = error.to_string();
        assert!(
            matches!(error, TrainError::InvalidArgument { name: "--to", .. }),
            "{to}: {message}"
        );
        assert!(
            message.contains(from) && message.contains(to),
            "{to}: the message names both: {message}"
        );
    }
    assert_eq!(tree(&run), before, "the run is untouched");
    // Beside the run is fine, and a status 2 from the binary for the refusal.
    let beside = parent.join("hf");
    let to = beside.to_str().unwrap();
    assert_eq!(
        tinyllm(&["export", "--from", from, "--to", to]).unwrap(),
        Exit::Success
    );
    let output = binary()
        .args([
            "export",
            "--from",
            from,
            "--to",
            parent.to_str().unwrap(),
            "--force",
        ])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert_eq!(tree(&run), before, "the run is untouched");
}

// Defect 2: files that never end, read under a memory cap.
#[test]
fn endless_config_and_prompt_files_are_refused_within_a_memory_cap() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let out = out.to_str().unwrap();
    for (args, flag) in [
        (
            vec!["train", "--config", "/dev/zero", "--out", out],
            "--config",
        ),
        (
            vec!["train", "--config", "/dev/urandom", "--out", out],
            "--config",
        ),
        (vec!["plan", "--config", "/dev/zero"], "--config"),
        (
            vec!["sample", "--from", out, "--prompt-file", "/dev/zero"],
            "--prompt-file",
        ),
    ] {
        let output = capped(&args, 1024, Duration::from_secs(60));
        let message = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {message}");
        assert!(
            message.contains(flag) && message.contains("bytes allowed"),
            "{args:?}: names the flag and the bound: {message}"
        );
    }
    assert!(!Path::new(out).exists(), "nothing written");
}

// Defect 4: a vocabulary the data does not fit.
#[test]
fn a_vocabulary_smaller_than_the_datas_bytes_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("small-vocab.toml");
    fs::write(&config, "steps = 2\n[model]\nvocab = 100\n").unwrap();
    let out = dir.path().join("run");
    let output = binary()
        .args(["train", "--config", config.to_str().unwrap()])
        .args([
            "--micro-batch",
            "1",
            "--accum",
            "1",
            "--corpus-bytes",
            "40000",
        ])
        .args(["--quiet", "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    let message = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{message}");
    assert!(
        message.contains("vocab") && message.contains("outside the vocabulary"),
        "{message}"
    );
    assert!(!message.contains("panicked"), "{message}");
    assert!(!out.exists(), "the run directory was created");
    // A text file, and the profile, which trains steps of its own.
    let text = dir.path().join("text.txt");
    fs::write(&text, "zebra ".repeat(2000)).unwrap();
    let error = run_error(&[
        "train",
        "--config",
        config.to_str().unwrap(),
        "--data",
        text.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        matches!(error, TrainError::InvalidConfig { field: "vocab", .. }),
        "{error}"
    );
    assert!(error.to_string().contains("byte 122"), "z is 122: {error}");
    let error = run_error(&[
        "profile",
        "--config",
        config.to_str().unwrap(),
        "--out",
        dir.path().join("profile.svg").to_str().unwrap(),
    ]);
    assert!(
        matches!(error, TrainError::InvalidConfig { field: "vocab", .. }),
        "{error}"
    );
    assert!(!out.exists(), "the run directory was created");
}

// Defect 6: a model named twice.
#[test]
fn a_preset_flag_and_a_config_naming_another_model_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    };
    let custom = write("custom.toml", "[model]\nd_model = 96\nn_heads = 3\n");
    let capstone = write("capstone.toml", "preset = \"capstone\"\n");
    let tiny = write("tiny.toml", "preset = \"tiny\"\nsteps = 3\n");
    let recipe = write("recipe.toml", "steps = 3\n[model]\ndropout = 0.1\n");
    for file in [&custom, &capstone] {
        let error = run_error(&["plan", "--preset", "tiny", "--config", file]);
        let message = error.to_string();
        assert!(
            matches!(error, TrainError::InvalidArgument { name: "preset", .. }),
            "{message}"
        );
        assert!(message.contains(file.as_str()), "{message}");
    }
    let error = run_error(&["plan", "--preset", "tiny", "--config", &custom]);
    assert!(error.to_string().contains("d_model 96"), "{error}");
    // Agreeing, or a file that leaves the model out: accepted, the preset's sizes and the
    // file's dropout.
    for file in [&tiny, &recipe] {
        assert!(
            tinyllm(&["plan", "--preset", "tiny", "--config", file, "--json"]).is_ok(),
            "{file}"
        );
    }
}

// Defect 11: a TOML NaN names the key and the value.
#[test]
fn a_toml_nan_or_infinity_is_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    for (text, key) in [
        ("[lr]\npeak = nan\n", "lr.peak"),
        ("weight_decay = inf\n", "weight_decay"),
        ("[model]\nnorm_eps = -inf\n", "model.norm_eps"),
    ] {
        let path = dir.path().join("bad.toml");
        fs::write(&path, text).unwrap();
        let error = run_error(&["plan", "--config", path.to_str().unwrap()]);
        let message = error.to_string();
        assert!(
            matches!(error, TrainError::ConfigFile { .. }),
            "{text}: {message}"
        );
        assert!(
            message.contains(key) && message.contains("not a finite number"),
            "{text}: {message}"
        );
        assert!(!message.contains("null"), "{text}: {message}");
    }
}

// Defect 11: refusals of a run directory exit 2, as docs/training.md says.
#[test]
fn a_taken_out_directory_and_differing_resume_flags_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let run = trained_run(dir.path(), "run");
    let before = tree(&run);
    let out = run.to_str().unwrap();
    let mut again: Vec<&str> = TINY_TRAIN.to_vec();
    again.extend(["--steps", "2", "--out", out]);
    let output = binary().args(&again).output().unwrap();
    let message = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{message}");
    assert!(message.contains("already holds a run"), "{message}");
    let output = binary()
        .args(["train", "--resume", out, "--micro-batch", "3", "--quiet"])
        .output()
        .unwrap();
    let message = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{message}");
    assert!(message.contains("micro_batch"), "{message}");
    assert_eq!(tree(&run), before, "the run is untouched");
}

// Defect 11: a directory a run was killed in before it wrote its config.
#[test]
fn resuming_a_run_killed_before_its_config_says_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    fs::create_dir(&run).unwrap();
    let out = run.to_str().unwrap();
    let output = binary()
        .args(["train", "--resume", out, "--quiet"])
        .output()
        .unwrap();
    let message = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{message}");
    assert!(
        message.contains("no config.json") && message.contains("--out"),
        "{message}"
    );
    // And the advice works.
    let mut args: Vec<&str> = TINY_TRAIN.to_vec();
    args.extend(["--steps", "1", "--out", out]);
    assert_eq!(tinyllm(&args).unwrap(), Exit::Success);
}

/// The leaves of a JSON value with their key paths.
fn leaves(value: &serde_json::Value, path: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, value) in map {
                path.push(key.clone());
                leaves(value, path, out);
                path.pop();
            }
        }
        _ => out.push(path.clone()),
    }
}

/// The values a careless or hostile file gives a leaf that holds `value`.
fn extremes(value: &serde_json::Value) -> Vec<serde_json::Value> {
    use serde_json::json;
    match value {
        serde_json::Value::Number(n) if n.is_u64() || n.is_i64() => vec![
            json!(0),
            json!(1),
            json!(-1),
            json!(1u64 << 53),
            json!(u64::MAX),
        ],
        serde_json::Value::Number(_) => vec![
            json!(0.0),
            json!(-1.0),
            json!(5e-324),
            json!(1e308),
            json!(-1e308),
        ],
        serde_json::Value::Bool(b) => vec![json!(!b)],
        serde_json::Value::String(_) => vec![json!(""), json!("\u{0}x")],
        serde_json::Value::Null => vec![json!(0), json!(u64::MAX), json!(1e308)],
        _ => vec![json!(null)],
    }
}

// Defect 4: no panic is reachable from a config file. Every field of a tiny run's config
// takes each of its type's extremes in turn; the run either trains a step or is refused
// with a typed error, never a panic or a crash, under a 4 GiB address-space cap (so a
// value that slips past the bounds cannot take the machine's memory).
#[test]
fn every_config_field_at_its_extremes_is_refused_or_trains_never_panics() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base");
    let mut args: Vec<&str> = TINY_TRAIN.to_vec();
    args.extend(["--steps", "2", "--out", base.to_str().unwrap()]);
    assert_eq!(tinyllm(&args).unwrap(), Exit::Success);
    let mut config: serde_json::Value =
        serde_json::from_slice(&fs::read(base.join("config.json")).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("tinyllm");
    let mut paths = Vec::new();
    leaves(&config, &mut Vec::new(), &mut paths);
    let mut cases = Vec::new();
    for path in &paths {
        let pointer = format!("/{}", path.join("/"));
        for value in extremes(config.pointer(&pointer).unwrap()) {
            let mut edited = config.clone();
            *edited.pointer_mut(&pointer).unwrap() = value.clone();
            cases.push((format!("{} = {value}", path.join(".")), edited));
        }
    }
    assert!(cases.len() > 100, "{} cases", cases.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for worker in 0..2 {
            let (cases, next, failures, dir) = (&cases, &next, &failures, dir.path());
            scope.spawn(move || {
                loop {
                    let index = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let Some((name, config)) = cases.get(index) else {
                        return;
                    };
                    let file = dir.join(format!("case-{worker}.json"));
                    let out = dir.join(format!("run-{index}"));
                    fs::write(&file, serde_json::to_vec(config).unwrap()).unwrap();
                    let output = capped(
                        &[
                            "train",
                            "--config",
                            file.to_str().unwrap(),
                            "--out",
                            out.to_str().unwrap(),
                            "--until-step",
                            "1",
                            "--quiet",
                            "--threads",
                            "1",
                        ],
                        4096,
                        Duration::from_secs(120),
                    );
                    let message = stderr(&output);
                    let _ = fs::remove_dir_all(&out);
                    if !matches!(output.status.code(), Some(0..=2)) || message.contains("panicked")
                    {
                        failures.lock().unwrap().push(format!(
                            "{name}: {:?}: {}",
                            output.status,
                            message.lines().last().unwrap_or("")
                        ));
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// Defect 2: every size a user gives is bounded. Each numeric flag of every command, at
// 2^64 - 1, is refused (exit 2) or finishes (exit 0), within 30 s and 2 GiB of address
// space; seeds take any value, and run a whole command.
#[test]
fn every_numeric_flag_at_its_largest_is_refused_or_finishes() {
    let dir = tempfile::tempdir().unwrap();
    let run = trained_run(dir.path(), "run");
    let run = run.to_str().unwrap();
    let max = u64::MAX.to_string();
    let mut checked = 0;
    for command in [
        "train",
        "plan",
        "profile",
        "bench",
        "compare",
        "gradients",
        "sample",
        "logits",
        "comm-bench",
        "launch",
    ] {
        let help = binary().args(["help", command]).output().unwrap();
        let help = String::from_utf8(help.stdout).unwrap();
        // Flags that take a number: `--name <N>`, `<K>`, `<MS>`, `<BYTES>` and the like.
        let flags: Vec<String> = help
            .lines()
            .filter_map(|line| {
                let mut words = line.split_whitespace();
                let mut flag = words.next()?;
                if flag.starts_with("-n") || flag.starts_with("-") && !flag.starts_with("--") {
                    flag = words.next()?;
                }
                let value = words.next()?;
                let numeric = [
                    "<N>", "<K>", "<S>", "<M>", "<MS>", "<BYTES>", "<T>", "<STEP>",
                ]
                .contains(&value)
                    || value.starts_with("<MIB");
                (flag.starts_with("--") && numeric && !flag.contains("seed"))
                    .then(|| flag.trim_end_matches(',').to_string())
            })
            .collect();
        // A quick run around the flag, so that a value accepted finishes in seconds.
        let out = dir.path().join(format!("{command}-out"));
        let out = out.to_str().unwrap();
        let svg = format!("{out}.svg");
        let tiny = [
            ["--preset", "tiny"],
            ["--corpus-bytes", "40000"],
            ["--micro-batch", "1"],
            ["--accum", "1"],
        ];
        let base: Vec<[&str; 2]> = match command {
            "train" => [
                &tiny[..],
                &[["--steps", "2"], ["--out", out], ["--quiet", ""]],
            ]
            .concat(),
            "compare" => [
                &tiny[..],
                &[["--steps", "2"], ["--out", out], ["--quiet", ""]],
            ]
            .concat(),
            "bench" => [&tiny[..], &[["--steps", "2"]]].concat(),
            "profile" => vec![tiny[0], tiny[2], tiny[3], ["--out", &svg]],
            "gradients" => vec![tiny[0], tiny[2], ["--out", out]],
            "plan" => vec![tiny[0]],
            "sample" | "logits" => vec![["--from", run], ["--prompt", "The "]],
            _ => vec![],
        };
        for flag in flags {
            let mut args = vec![command.to_string()];
            for [name, value] in &base {
                if *name != flag {
                    args.extend([name.to_string(), value.to_string()]);
                }
            }
            args.retain(|arg| !arg.is_empty());
            args.extend([flag.clone(), max.clone()]);
            if command == "launch" {
                args.extend(["--".into(), "comm-bench".into()]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let output = capped(&args, 2048, Duration::from_secs(30));
            let message = stderr(&output);
            assert!(
                matches!(output.status.code(), Some(0 | 2)),
                "tinyllm {}: {:?}: {message}",
                args.join(" "),
                output.status
            );
            assert!(!message.contains("panicked"), "{args:?}: {message}");
            checked += 1;
        }
    }
    assert!(
        checked >= 30,
        "only {checked} flags found in the help texts"
    );
}
