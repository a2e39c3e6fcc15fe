//! `tinyllm launch` tried as a hostile user would (issue 32): the documented exit statuses
//! under the launcher, ranks that die with their launcher, commands and sizes refused before
//! anything starts. Every process started here is bounded in time.

mod common;

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::TINY_TRAIN;

/// How long any one command may take before the test fails.
const LIMIT: Duration = Duration::from_secs(120);

fn binary() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tinyllm"));
    // A collective that hangs fails fast instead of holding the test.
    command.env("TINYLLM_COMM_TIMEOUT_MS", "20000");
    command
}

/// Waits for `child` within [`LIMIT`], killing it and failing past it.
fn wait_output(mut child: Child) -> Output {
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > LIMIT {
            let _ = child.kill();
            panic!("tinyllm did not finish within {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// `tinyllm ARGS`, run to the end within [`LIMIT`].
fn tinyllm(args: &[&str]) -> Output {
    let child = binary()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_output(child)
}

/// `tinyllm launch -n 2 -- ARGS`.
fn launch2(args: &[&str]) -> Output {
    let mut all = vec!["launch", "-n", "2", "--"];
    all.extend_from_slice(args);
    tinyllm(&all)
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The tiny run of the CLI tests into `out`, with `extra` flags.
fn tiny<'a>(out: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = TINY_TRAIN.to_vec();
    args.extend(["--out", out.to_str().unwrap()]);
    args.extend_from_slice(extra);
    args
}

/// Arguments every rank refuses exit 2 under the launcher as they do alone (the launcher
/// said 1).
#[test]
fn refused_arguments_exit_2_under_launch_as_alone() {
    let alone = tinyllm(&["train", "--preset", "nope"]);
    assert_eq!(alone.status.code(), Some(2), "{}", stderr(&alone));
    let launched = launch2(&["train", "--preset", "nope"]);
    let text = stderr(&launched);
    assert_eq!(launched.status.code(), Some(2), "{text}");
    assert!(text.contains("unknown preset"), "{text}");
}

/// A run that diverges exits 4 under the launcher as it does alone (the launcher said 1).
#[test]
fn a_diverged_run_exits_4_under_launch_as_alone() {
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--steps", "3", "--max-loss", "0.5"];
    let alone = tinyllm(&tiny(&dir.path().join("alone"), &flags));
    assert_eq!(alone.status.code(), Some(4), "{}", stderr(&alone));
    let launched = launch2(&tiny(&dir.path().join("launched"), &flags));
    let text = stderr(&launched);
    assert_eq!(launched.status.code(), Some(4), "{text}");
    assert!(text.contains("diverged"), "{text}");
}

/// Ranks started by hand with different `--until-step`s (not part of the config, so not in
/// the start-up fingerprint) are refused before any step, naming the rank that differs; they
/// used to train on until the first rank saved, and part there as a collective mismatch.
#[test]
fn ranks_given_different_until_steps_refuse_before_any_step() {
    use std::sync::atomic::AtomicBool;
    use tl_collective::Communicator;
    use tl_train::TrainError;
    use tl_train::train::{TrainConfig, Trainer};

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let errors: Vec<TrainError> = common::thread_world(2, Duration::from_secs(10), |comm| {
        let rank = comm.rank();
        let train = TrainConfig {
            steps: 8,
            save_interval: 8,
            ..common::tiny_ranks_config()
        };
        let mut trainer = Trainer::new_on(train, &out, Box::new(comm)).unwrap();
        let until = 2 + 2 * rank as u64; // rank 1 was given --until-step 4
        let stop = AtomicBool::new(false);
        let outcome = trainer.run(until, &stop, &mut |_| {});
        assert_eq!(trainer.step(), 0, "a step was taken");
        outcome.expect_err("the ranks refuse")
    });
    for error in errors {
        assert!(
            matches!(&error, TrainError::Ranks { ranks, .. } if ranks == &[1]),
            "{error}"
        );
        assert!(error.to_string().contains("--until-step"), "{error}");
    }
}

/// A command that does not run as ranks (`export`, `sample`, ...) would run N times side by
/// side; it is refused with exit 2 before any rank starts.
/// The same, resumed by hand at step 2 where rank 0's `--until-step` is already reached:
/// rank 0 used to return with nothing to do while rank 1 waited in vain for it.
#[test]
fn ranks_resumed_with_different_until_steps_refuse_even_with_nothing_to_do() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let first = launch2(&tiny(&out, &["--steps", "4", "--until-step", "2"]));
    assert!(first.status.success(), "{}", stderr(&first));
    let rendezvous = dir.path().join("rendezvous");
    std::fs::create_dir(&rendezvous).unwrap();
    std::fs::set_permissions(&rendezvous, std::fs::Permissions::from_mode(0o700)).unwrap();
    let ranks: Vec<Child> = [("0", "2"), ("1", "4")]
        .iter()
        .map(|(rank, until)| {
            binary()
                .args(["train", "--resume", out.to_str().unwrap(), "--quiet"])
                .args(["--until-step", until])
                .env("TINYLLM_RANK", rank)
                .env("TINYLLM_WORLD_SIZE", "2")
                .env("TINYLLM_RENDEZVOUS", &rendezvous)
                .env("TINYLLM_SECRET", "ab".repeat(32))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let started = Instant::now();
    for (rank, child) in ranks.into_iter().enumerate() {
        let output = wait_output(child);
        let message = stderr(&output);
        assert!(!output.status.success(), "rank {rank}: {message}");
        assert!(message.contains("--until-step"), "rank {rank}: {message}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "refused by a timeout, not at once"
    );
    assert!(out.join("checkpoint-000002").exists());
}

#[test]
fn launch_refuses_a_command_that_does_not_run_as_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let output = launch2(&["export", "--from", run.to_str().unwrap()]);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(text.contains("export") && text.contains("train"), "{text}");
    assert!(!text.contains("[rank"), "a rank started: {text}");
}

/// `comm-bench --max-bytes 2^64-1` made the kernel's OOM killer fire; it is refused, naming
/// the flag and the bound, before anything is allocated. Run under a 4 GiB address-space
/// limit so that a regression fails here instead of taking the machine's memory.
#[test]
fn comm_bench_refuses_sizes_past_its_bound_before_allocating() {
    let child = Command::new("sh")
        .args(["-c", "ulimit -v 4194304 && exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_tinyllm"))
        .args(["launch", "-n", "2", "--", "comm-bench"])
        .args(["--max-bytes", "18446744073709551615"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let output = wait_output(child);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(
        text.contains("--max-bytes") && text.contains("1073741824"),
        "{text}"
    );
}

/// A TMPDIR too long for the ranks' socket paths (at most 107 bytes) is named, with the
/// length and the limit, before any rank starts (the ranks failed to listen, with no hint).
#[test]
fn a_tmpdir_too_long_for_socket_paths_is_named_before_any_rank_starts() {
    let dir = tempfile::tempdir().unwrap();
    let long = dir.path().join("t".repeat(100));
    std::fs::create_dir(&long).unwrap();
    let output = binary()
        .env("TMPDIR", &long)
        .args(["launch", "-n", "2", "--", "comm-bench"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let output = wait_output(output);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.contains("TMPDIR") && text.contains("107"), "{text}");
    assert!(!text.contains("[rank"), "a rank started: {text}");
}

/// The process ids of `launcher`'s children.
fn children(launcher: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{launcher}/task/{launcher}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|pid| pid.parse().ok())
        .collect()
}

/// Whether process `pid` is gone (or a zombie, dead and not yet reaped).
fn gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
        stat.rsplit(") ")
            .next()
            .is_some_and(|state| state.starts_with('Z'))
    })
}

/// `kill -9` of the launcher left its ranks training under PID 1, holding the run's lock (so
/// `--resume` was refused) and the rendezvous directory. Now the ranks get SIGTERM when it
/// dies, checkpoint and exit; the run resumes at once, and no directory is left.
#[test]
fn a_launcher_killed_outright_takes_its_ranks_and_the_run_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = vec!["launch", "-n", "2", "--"];
    args.extend(tiny(&out, &["--steps", "100000", "--save-interval", "2"]));
    let mut launcher = binary()
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while common::train_steps(&out) < 3 {
        assert!(started.elapsed() < LIMIT, "the run did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    let ranks = children(launcher.id());
    assert_eq!(ranks.len(), 2, "{ranks:?}");
    let environ = std::fs::read(format!("/proc/{}/environ", ranks[0])).unwrap();
    let rendezvous = environ
        .split(|&b| b == 0)
        .find_map(|var| var.strip_prefix(b"TINYLLM_RENDEZVOUS="))
        .map(|path| std::path::PathBuf::from(String::from_utf8_lossy(path).into_owned()))
        .unwrap();
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let killed = Instant::now();
    while !ranks.iter().all(|&pid| gone(pid)) {
        if killed.elapsed() > LIMIT {
            for pid in &ranks {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
            panic!("the ranks {ranks:?} outlived their launcher");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!rendezvous.exists(), "{} was left", rendezvous.display());
    let steps = common::train_steps(&out);
    let until = (steps + 1).to_string();
    let resumed = launch2(&[
        "train",
        "--resume",
        out.to_str().unwrap(),
        "--quiet",
        "--until-step",
        &until,
    ]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
}
