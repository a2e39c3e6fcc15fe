//! The pre-flight memory check against the process's real peak (issue 32, defect 3): for
//! runs whose tensors are small beside their vocabulary, the whole process — start,
//! steps, checkpoints, a resume — stays within what the check asks for, and the check
//! does not ask for much more.
//!
//! Each run is a child process measured by `wait4`'s `ru_maxrss`: its own peak resident
//! memory from its first instruction, which neither the tensor meter nor the run's
//! summary (reset once training starts) covers.

mod common;

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tl_train::train::{MARGIN_PERCENT, ProcessMemory, TrainConfig};

/// Runs `tinyllm ARGS..`, which must succeed within `limit`; its peak resident bytes.
fn peak_rss_of(args: &[&str], limit: Duration) -> u64 {
    // Reaped below by `wait4`, which also gives its resource usage (`Child::wait` does
    // not).
    #[allow(clippy::zombie_processes)]
    let child = Command::new(env!("CARGO_BIN_EXE_tinyllm"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let started = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: an all-zero `rusage` is a valid value of this plain C struct.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `pid` is our own child, not yet reaped (`child` is never waited on);
        // `status` and `usage` are valid for writes. WNOHANG returns at once.
        let reaped = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        assert!(reaped >= 0, "wait4 failed");
        if reaped == pid {
            assert!(
                libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                "tinyllm {args:?} failed: status {status:#x}"
            );
            // Linux reports kibibytes.
            return usage.ru_maxrss as u64 * 1024;
        }
        if started.elapsed() > limit {
            // SAFETY: `pid` is our child, still unreaped, so the id is still its.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("tinyllm {args:?} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

/// Trains `toml` for two steps (a checkpoint after each), resumes it for a third, and
/// compares each process's peak with the check's prediction.
fn check_against_prediction(dir: &Path, name: &str, toml: &str) {
    let file = dir.join(format!("{name}.toml"));
    fs::write(&file, toml).unwrap();
    let config = TrainConfig::from_file(&file).unwrap();
    let predicted = ProcessMemory::of(&config).unwrap();
    let run = dir.join(name);
    let (file, run) = (file.to_str().unwrap(), run.to_str().unwrap());
    let limit = Duration::from_secs(300);
    let trained = peak_rss_of(
        &[
            "train",
            "--config",
            file,
            "--out",
            run,
            "--until-step",
            "2",
            "--quiet",
        ],
        limit,
    );
    let resumed = peak_rss_of(
        &["train", "--resume", run, "--until-step", "3", "--quiet"],
        limit,
    );
    for (what, measured) in [("training", trained), ("resuming", resumed)] {
        eprintln!(
            "{name}, {what}: peak {:.1} MiB; predicted {:.1} MiB ({:.1} tensors, {:.1} text, \
             {:.1} checkpoint, {:.1} program, {MARGIN_PERCENT}%)",
            mib(measured),
            mib(predicted.total()),
            mib(predicted.tensors),
            mib(predicted.corpus),
            mib(predicted.checkpoint),
            mib(predicted.runtime),
        );
        assert!(
            measured <= predicted.total(),
            "{name}, {what}: the process peaked at {:.1} MiB, above the check's {:.1} MiB",
            mib(measured),
            mib(predicted.total())
        );
        assert!(
            measured >= predicted.tensors,
            "{name}, {what}: {:.1} MiB measured is below the tensors alone ({:.1} MiB)",
            mib(measured),
            mib(predicted.tensors)
        );
    }
}

#[test]
fn a_large_vocabulary_stays_within_the_checks_prediction() {
    let dir = tempfile::tempdir().unwrap();
    // 16.2 million parameters, 15.4 million of them the embedding and the head: the
    // weights, gradients and moments are 248 MiB; a step's activations a few MiB.
    let large_vocab = "steps = 4\nmicro_batch = 1\naccum = 1\nsave_interval = 1\n\
                       eval_batches = 1\n[data.builtin]\nbytes = 100000\nseed = 0\n\
                       [model]\nvocab = 60000\n";
    check_against_prediction(dir.path(), "large-vocab", large_vocab);
    // A long context on a narrow model: the attention kernel's scores and the GEMMs'
    // packing buffers against small weights.
    let long_context = "steps = 4\nmicro_batch = 2\naccum = 1\nsave_interval = 1\n\
                        eval_batches = 1\n[data.builtin]\nbytes = 100000\nseed = 0\n\
                        [model]\ncontext = 2048\nd_model = 64\nn_heads = 2\nhidden = 176\n\
                        n_layers = 2\n";
    check_against_prediction(dir.path(), "long-context", long_context);
    // At ZeRO-1 on one process, a checkpoint gathers the moments as f64: 16 bytes more a
    // parameter, which the check counts.
    let zero = format!("{large_vocab}[parallel]\nzero = 1\n");
    check_against_prediction(dir.path(), "large-vocab-zero1", &zero);
}

// The check refuses what the process cannot be given, naming the bound: here `ulimit -v`
// below the large vocabulary's 378 MiB, where the run used to start and die.
#[test]
fn a_run_that_cannot_fit_its_address_space_limit_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("large-vocab.toml");
    fs::write(
        &file,
        "steps = 2\nmicro_batch = 1\naccum = 1\n[model]\nvocab = 60000\n",
    )
    .unwrap();
    let out = dir.path().join("run");
    let args = [
        "train",
        "--config",
        file.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--quiet",
    ];
    let output = common::capped(&args, 320, Duration::from_secs(120));
    let message = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{message}");
    assert!(
        message.contains("ulimit -v") && message.contains("MiB of tensors"),
        "{message}"
    );
    assert!(!out.exists(), "nothing written");
    // With room, the same run trains.
    let output = common::capped(&args, 4096, Duration::from_secs(300));
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
