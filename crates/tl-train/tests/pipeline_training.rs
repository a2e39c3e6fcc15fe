//! `tinyllm train --pp P` on ranks (`tinyllm launch -n P -- train ... --pp P`): the model's
//! blocks cut into stages, the step's micro-batches streamed through them by GPipe, 1F1B,
//! the interleaved schedule or ZB-H1, and the run one process's to the bit (the weights' bytes and
//! every loss); in bf16, with checkpointing and with clipping too; fp16 with an overflow in
//! one stage skipping the step on every rank; fp8's delayed scaling (its scales, its range
//! counts) and dropout's masks one process's too; checkpoints that resume at pp 1, pp 4 and
//! on two data-parallel ranks; data-parallel pipelines at ZeRO-1, 2 and 3; sizes that
//! cannot be, refused before any step. Every multi-process run here is bounded in time.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

use common::ranks::{largest_relative, run_ranks, succeed, train_losses};
use tl_collective::{RingComm, RingConfig};
use tl_precision::{Fp8Recipe, Fp8State, Precision};
use tl_train::model::{Llama, Preset};
use tl_train::train::{
    Fp8Counts, Record, TrainConfig, Trainer, read_config, read_records, snapshot,
};

/// The tiny model with 4 blocks, so that 4 stages hold one each.
fn four_blocks(dir: &Path) -> PathBuf {
    let path = dir.join("tiny4.toml");
    fs::write(&path, "preset = \"tiny\"\n[model]\nn_layers = 4\n").unwrap();
    path
}

/// The 4-block tiny run into `out` for 5 steps: micro-batches of 2 sequences, `accum` of
/// them a step, then `extra`.
fn run(model: &Path, out: &Path, accum: usize, extra: &[&str]) -> Vec<String> {
    let accum = accum.to_string();
    let mut args: Vec<&str> = vec![
        "train",
        "--config",
        model.to_str().unwrap(),
        "--micro-batch",
        "2",
        "--accum",
        &accum,
        "--corpus-bytes",
        "40000",
        "--quiet",
        "--steps",
        "5",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend(extra);
    args.into_iter().map(String::from).collect()
}

/// The bytes of a run's latest weights.
fn weights(run: &Path) -> Vec<u8> {
    common::model_bytes(run)
}

#[test]
fn every_schedule_trains_as_one_process_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let model = four_blocks(dir.path());
    for recipe in [&["--no-clip"][..], &["--no-clip", "--bf16"], &[]] {
        let one = dir.path().join(format!("one{}", recipe.join("")));
        succeed(1, &run(&model, &one, 4, recipe));
        let expected = (weights(&one), train_losses(&one));
        for (ranks, flags) in [
            (2, &["--schedule", "1f1b"][..]),
            (2, &["--schedule", "gpipe"]),
            (2, &["--schedule", "interleaved"]),
            (4, &["--schedule", "1f1b"]),
            (4, &["--schedule", "gpipe", "--checkpoint-activations"]),
            (2, &["--schedule", "zb-h1"]),
            (4, &["--schedule", "zb-h1", "--checkpoint-activations"]),
            (2, &["--pp-split", "3"]),
        ] {
            let pp = ranks.to_string();
            let extra: Vec<&str> = ["--pp", &pp]
                .into_iter()
                .chain(flags.iter().copied())
                .chain(recipe.iter().copied())
                .collect();
            let out = dir.path().join(extra.join(""));
            succeed(ranks, &run(&model, &out, 4, &extra));
            let what = format!("{extra:?}");
            // Every stage's backwards run in micro-batch order, so every gradient is the
            // same sum as one process's; with clipping the stages' squares are added over
            // the pipeline, in another order, and that happened to give the same bits here.
            assert_eq!(train_losses(&out), expected.1, "{what}: losses");
            assert!(weights(&out) == expected.0, "{what}: the weights differ");
        }
    }
}

/// The fp8 figures `metrics.jsonl` reports, step by step.
fn fp8_counts(run: &Path) -> Vec<Fp8Counts> {
    (read_records(&run.join("metrics.jsonl"))
        .unwrap()
        .into_iter())
    .filter_map(|record| match record {
        Record::Train { fp8, .. } => Some(fp8.expect("fp8 counts")),
        Record::Eval { .. } => None,
    })
    .collect()
}

/// The fp8 scales and amax histories of a run's latest checkpoint (rank 0's).
fn fp8_state(run: &Path) -> Fp8State {
    snapshot::load(run)
        .unwrap()
        .state
        .fp8
        .expect("an fp8 state")
}

/// fp8 on a pipeline. Each rank casts only its stages' layers, but holds every layer's
/// delayed scales: after each step the amaxes and range counts go through the one
/// all-reduce that makes them global over the run's ranks, where a stage that does not hold
/// a layer adds nothing (an amax of 0, no counts). So every rank steps every layer's scales
/// as one process does, rank 0 reports one process's counts and writes its whole state.
/// Every schedule's weights, losses, figures and scales are one process's to the byte, and
/// two data-parallel pipelines are two data-parallel ranks' (fp8 at dp 2 is not one
/// process's bits: `fp8_ranks.rs`).
#[test]
fn fp8_on_a_pipeline_is_one_processes_to_the_byte() {
    let dir = tempfile::tempdir().unwrap();
    let model = four_blocks(dir.path());
    let path = |name: &str| dir.path().join(name);
    let fp8 = ["--fp8"];
    succeed(1, &run(&model, &path("one"), 4, &fp8));
    succeed(2, &run(&model, &path("dp2"), 2, &fp8));
    let counts = fp8_counts(&path("one"));
    assert!(
        counts.iter().all(|c| !c.tensors.is_empty()),
        "every step flushes or saturates something: {counts:?}"
    );
    for (ranks, pp, accum, reference, flags) in [
        (2, "2", 4, "one", &["--schedule", "1f1b"][..]),
        (2, "2", 4, "one", &["--schedule", "interleaved"]),
        (2, "2", 4, "one", &["--schedule", "zb-h1"]),
        (4, "4", 4, "one", &["--checkpoint-activations"]),
        (4, "2", 2, "dp2", &[]),
    ] {
        let extra: Vec<&str> = ["--pp", pp]
            .into_iter()
            .chain(flags.iter().copied())
            .chain(fp8)
            .collect();
        let out = path(&format!("{ranks}{}", extra.join("")));
        succeed(ranks, &run(&model, &out, accum, &extra));
        let (expected, what) = (path(reference), format!("{extra:?} on {ranks} ranks"));
        assert!(weights(&out) == weights(&expected), "{what}: the weights");
        assert_eq!(
            train_losses(&out),
            train_losses(&expected),
            "{what}: losses"
        );
        assert_eq!(
            fp8_counts(&out),
            fp8_counts(&expected),
            "{what}: fp8 counts"
        );
        assert_eq!(fp8_state(&out), fp8_state(&expected), "{what}: fp8 scales");
    }
}

/// Dropout on a pipeline. One process draws a micro-batch's masks block after block from
/// the micro-batch's own stream; a stage starts from the same stream and skips the draws of
/// the blocks before it, so each block draws one process's masks, whatever the stage, the
/// schedule's order or a checkpointed block's rerun. The run is one process's to the byte.
#[test]
fn dropout_on_a_pipeline_is_one_processes_to_the_byte() {
    let dir = tempfile::tempdir().unwrap();
    let model = four_blocks(dir.path());
    let path = |name: &str| dir.path().join(name);
    let dropout = ["--dropout", "0.1"];
    succeed(1, &run(&model, &path("one"), 4, &dropout));
    succeed(1, &run(&model, &path("plain"), 4, &[]));
    assert!(
        weights(&path("one")) != weights(&path("plain")),
        "dropout changes the run"
    );
    succeed(2, &run(&model, &path("dp2"), 2, &dropout));
    for (ranks, accum, reference, flags) in [
        (2, 4, "one", &["--pp", "2"][..]),
        (2, 4, "one", &["--pp", "2", "--checkpoint-activations"]),
        (
            2,
            4,
            "one",
            &[
                "--pp",
                "2",
                "--schedule",
                "interleaved",
                "--checkpoint-activations",
            ],
        ),
        (4, 4, "one", &["--pp", "4", "--schedule", "gpipe"]),
        (
            4,
            4,
            "one",
            &[
                "--pp",
                "4",
                "--schedule",
                "zb-h1",
                "--checkpoint-activations",
            ],
        ),
        (4, 2, "dp2", &["--pp", "2"]),
    ] {
        let extra: Vec<&str> = flags.iter().copied().chain(dropout).collect();
        let out = path(&format!("{ranks}{}", extra.join("")));
        succeed(ranks, &run(&model, &out, accum, &extra));
        let (expected, what) = (path(reference), format!("{extra:?} on {ranks} ranks"));
        assert!(weights(&out) == weights(&expected), "{what}: the weights");
        assert_eq!(
            train_losses(&out),
            train_losses(&expected),
            "{what}: losses"
        );
    }
}

/// A pipeline's checkpoint with dropout or fp8 resumes in one process and continues the
/// uninterrupted one-process run to the byte: the masks come from each micro-batch's
/// stream, and rank 0's fp8 state holds every stage's layers.
#[test]
fn a_pipeline_with_dropout_or_fp8_resumes_in_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let model = four_blocks(dir.path());
    for recipe in [&["--dropout", "0.1"][..], &["--fp8"]] {
        let name = recipe.join("");
        let one = dir.path().join(format!("one{name}"));
        succeed(1, &run(&model, &one, 4, recipe));
        let out = dir.path().join(format!("pp2-to-1{name}"));
        let until: Vec<&str> = ["--pp", "2", "--until-step", "3"]
            .into_iter()
            .chain(recipe.iter().copied())
            .collect();
        succeed(2, &run(&model, &out, 4, &until));
        let resume: Vec<String> = ["train", "--resume", out.to_str().unwrap(), "--quiet"]
            .into_iter()
            .chain(["--pp", "1"])
            .map(String::from)
            .collect();
        succeed(1, &resume);
        assert_eq!(read_config(&out).unwrap().parallel.pipeline, 1);
        assert!(weights(&out) == weights(&one), "{recipe:?}: the weights");
        assert_eq!(train_losses(&out), train_losses(&one), "{recipe:?}: losses");
    }
}

/// The mesh dp × tp × pp: two data-parallel pipelines, and pipelines of tensor-parallel
/// stages (with sequence parallelism too), train what one process trains on the same global
/// batch, to the rounding of their sums.
#[test]
fn a_pipeline_composes_with_data_and_tensor_parallelism() {
    let dir = tempfile::tempdir().unwrap();
    let model = four_blocks(dir.path());
    let one = dir.path().join("one");
    succeed(1, &run(&model, &one, 4, &[]));
    let expected = (train_losses(&one), common::ranks::weights(&one));
    for (accum, flags) in [
        (2, &["--pp", "2"][..]),
        (4, &["--pp", "2", "--tp", "2"]),
        (4, &["--pp", "2", "--tp", "2", "--sequence-parallel"]),
        (2, &["--pp", "2", "--schedule", "interleaved"]),
    ] {
        let out = dir.path().join(flags.join(""));
        succeed(4, &run(&model, &out, accum, flags));
        let what = format!("{flags:?}");
        let config = read_config(&out).unwrap();
        assert_eq!(
            config.parallel.data_parallel() * config.parallel.tensor * config.parallel.pipeline,
            4,
            "{what}"
        );
        // Measured: the data-parallel sum and the split products' sums in another order
        // than one process's, as without a pipeline.
        let losses = largest_relative(&train_losses(&out), &expected.0);
        assert!(losses < 1e-6, "{what}: losses differ by {losses:e}");
        let weights = common::ranks::largest_difference(&common::ranks::weights(&out), &expected.1);
        assert!(weights < 5e-5, "{what}: weights differ by {weights:e}");
    }
    // ZeRO-1 over the pipelines' data-parallel groups: each rank updates its shard of its
    // stages' moments, and the run is the DDP pipeline's, weights and moments to the byte.
    let zero1 = dir.path().join("zero1");
    succeed(4, &run(&model, &zero1, 2, &["--pp", "2", "--zero", "1"]));
    let ddp = dir.path().join("--pp2");
    assert!(weights(&zero1) == weights(&ddp), "ZeRO-1 x pp 2: weights");
    let moments = |run: &Path| {
        fs::read(common::latest_checkpoint(run).join("optimizer.safetensors")).unwrap()
    };
    assert!(moments(&zero1) == moments(&ddp), "ZeRO-1 x pp 2: moments");
    // ZeRO-2 reduce-scatters each stage's gradients after the schedule: without clipping
    // (whose sum of squares ZeRO-2 adds shard by shard), the DDP pipeline's weights.
    let (zero2, ddp) = (dir.path().join("zero2"), dir.path().join("ddp-no-clip"));
    succeed(
        4,
        &run(
            &model,
            &zero2,
            2,
            &["--pp", "2", "--zero", "2", "--no-clip"],
        ),
    );
    succeed(4, &run(&model, &ddp, 2, &["--pp", "2", "--no-clip"]));
    assert!(weights(&zero2) == weights(&ddp), "ZeRO-2 x pp 2: weights");
}

/// ZeRO-3 over the pipelines' data-parallel groups: each stage's units gathered around every
/// micro-batch's forward and again around its backward, their gradients reduce-scattered in
/// every micro-batch's backward. The sums are ZeRO-3's own, in its order: the run is `--zero
/// 3` without a pipeline byte for byte, the DDP pipeline's byte for byte with one
/// micro-batch a replica, and one process's (and ZeRO-1's) to the rounding of those sums;
/// with tensor-parallel stages too.
#[test]
fn zero_3_over_a_pipeline_sums_as_zero_3_without_one() {
    let dir = tempfile::tempdir().unwrap();
    let model = four_blocks(dir.path());
    let path = |name: &str| dir.path().join(name);
    // The same global batch of 4 micro-batches of 2 sequences: one process, two replicas,
    // two replicas of a pipeline of 2.
    succeed(1, &run(&model, &path("one"), 4, &[]));
    succeed(2, &run(&model, &path("zero3"), 2, &["--zero", "3"]));
    for (name, flags) in [
        ("pp-zero3", &["--zero", "3"][..]),
        ("pp-zero1", &["--zero", "1"]),
        ("zb-zero3", &["--zero", "3", "--schedule", "zb-h1"]),
    ] {
        let flags: Vec<&str> = ["--pp", "2"]
            .into_iter()
            .chain(flags.iter().copied())
            .collect();
        succeed(4, &run(&model, &path(name), 2, &flags));
    }
    let pp_zero3 = path("pp-zero3");
    // Each unit's reduce-scatter per micro-batch, the shards adding them in micro-batch
    // order, with or without the pipeline, and with the weights' gradients split off
    // (ZB-H1: a unit's gradients are complete, and reduce-scattered, in its W).
    for pipelined in [&pp_zero3, &path("zb-zero3")] {
        assert!(
            weights(pipelined) == weights(&path("zero3")),
            "{pipelined:?}: the weights are not dp 2's at ZeRO-3"
        );
        assert_eq!(train_losses(pipelined), train_losses(&path("zero3")));
    }
    // ZeRO-1 (the DDP pipeline's bits) and one process sum each replica's micro-batches
    // first, then the replicas: measured 2.1e-7 (one process) and 1.6e-7 (ZeRO-1) at most
    // in the weights, 6.9e-8 and 0 in the losses.
    for reference in ["one", "pp-zero1"] {
        let reference = path(reference);
        let losses = largest_relative(&train_losses(&pp_zero3), &train_losses(&reference));
        assert!(losses < 1e-6, "{reference:?}: losses differ by {losses:e}");
        let weights = common::ranks::largest_difference(
            &common::ranks::weights(&pp_zero3),
            &common::ranks::weights(&reference),
        );
        assert!(
            weights < 5e-6,
            "{reference:?}: weights differ by {weights:e}"
        );
    }
    // One micro-batch a replica (GPipe runs m < p): each reduced element is the sum of two,
    // one addition in any order, so the DDP pipeline's bits, clipping and all.
    let gpipe = ["--pp", "2", "--schedule", "gpipe"];
    for zero in ["0", "3"] {
        let flags: Vec<&str> = gpipe.iter().copied().chain(["--zero", zero]).collect();
        succeed(4, &run(&model, &path(&format!("gpipe-{zero}")), 1, &flags));
    }
    assert!(
        weights(&path("gpipe-3")) == weights(&path("gpipe-0")),
        "one micro-batch a replica: ZeRO-3's weights are not the DDP pipeline's"
    );
    assert_eq!(
        train_losses(&path("gpipe-3")),
        train_losses(&path("gpipe-0"))
    );
    // Pipelines of tensor-parallel stages, each its own data-parallel group of one: ZeRO-3's
    // reduce-scatter over one rank is the share's multiplication, so the run is tp 2 x pp 2's
    // bits (measured: equal).
    let mesh = ["--pp", "2", "--tp", "2"];
    for zero in ["0", "3"] {
        let flags: Vec<&str> = mesh.iter().copied().chain(["--zero", zero]).collect();
        succeed(4, &run(&model, &path(&format!("tp-pp-{zero}")), 4, &flags));
    }
    assert!(
        weights(&path("tp-pp-3")) == weights(&path("tp-pp-0")),
        "tp 2 x pp 2: ZeRO-3's weights are not the run's without it"
    );
}

/// A checkpoint written by two pipelines at ZeRO-3 holds whole tensors: it resumes on the
/// same mesh, on two data-parallel ranks without a pipeline (both continue the uninterrupted
/// run byte for byte: ZeRO-3's sums do not depend on the pipeline), and on one pipeline of 2
/// or one process (each other's bits, one replica's sums).
#[test]
fn a_zero_3_pipeline_checkpoint_resumes_in_any_layout() {
    let dir = tempfile::tempdir().unwrap();
    let model = four_blocks(dir.path());
    let flags = ["--pp", "2", "--zero", "3"];
    let whole = dir.path().join("whole");
    succeed(4, &run(&model, &whole, 2, &flags));
    let expected = (weights(&whole), train_losses(&whole));
    let mut one_replica = Vec::new();
    for (ranks, pp) in [(4, 2), (2, 1), (2, 2), (1, 1)] {
        let out = dir.path().join(format!("to-{ranks}-pp{pp}"));
        let until: Vec<&str> = flags.iter().copied().chain(["--until-step", "3"]).collect();
        succeed(4, &run(&model, &out, 2, &until));
        let resume: Vec<String> = ["train", "--resume", out.to_str().unwrap(), "--quiet"]
            .into_iter()
            .chain(["--pp", &pp.to_string()])
            .map(String::from)
            .collect();
        succeed(ranks, &resume);
        let config = read_config(&out).unwrap();
        assert_eq!(
            (
                config.parallel.ranks,
                config.parallel.pipeline,
                config.parallel.zero
            ),
            (ranks, pp, 3)
        );
        let what = format!("to {ranks} ranks at pp {pp}");
        if config.parallel.data_parallel() == 2 {
            assert!(weights(&out) == expected.0, "{what}: weights");
            assert_eq!(train_losses(&out), expected.1, "{what}: losses");
        } else {
            // One replica sums its 4 micro-batches where two summed 2 each: measured
            // 6.0e-8 at most in the weights, the same losses.
            let difference = common::ranks::largest_difference(
                &common::ranks::weights(&out),
                &common::ranks::weights(&whole),
            );
            assert!(
                difference < 1e-6,
                "{what}: weights differ by {difference:e}"
            );
            one_replica.push(weights(&out));
        }
    }
    assert!(
        one_replica[0] == one_replica[1],
        "a pipeline of 2 at ZeRO-3 is not one process's bits"
    );
}

/// A checkpoint written at pp 2 resumes at pp 1, at pp 4 and on two data-parallel ranks,
/// and continues the uninterrupted one-process run.
#[test]
fn a_checkpoint_written_at_pp_2_resumes_in_any_layout() {
    let dir = tempfile::tempdir().unwrap();
    let model = four_blocks(dir.path());
    let one = dir.path().join("one");
    succeed(1, &run(&model, &one, 4, &[]));
    let expected = train_losses(&one);
    for (ranks, pp) in [(1, 1), (4, 4), (2, 1)] {
        let out = dir.path().join(format!("to-{ranks}-pp{pp}"));
        succeed(
            2,
            &run(&model, &out, 4, &["--pp", "2", "--until-step", "3"]),
        );
        let resume: Vec<String> = ["train", "--resume", out.to_str().unwrap(), "--quiet"]
            .into_iter()
            .chain(["--pp", &pp.to_string()])
            .map(String::from)
            .collect();
        succeed(ranks, &resume);
        let config = read_config(&out).unwrap();
        assert_eq!(
            (config.parallel.ranks, config.parallel.pipeline),
            (ranks, pp)
        );
        let losses = train_losses(&out);
        if ranks == pp {
            assert_eq!(losses, expected, "to {ranks} ranks at pp {pp}");
        } else {
            // Two data-parallel ranks sum their gradients: measured 1e-7 at most.
            let difference = largest_relative(&losses, &expected);
            assert!(
                difference < 1e-6,
                "to dp 2: losses differ by {difference:e}"
            );
        }
    }
}

#[test]
fn sizes_a_pipeline_cannot_run_are_refused_before_any_step() {
    let dir = tempfile::tempdir().unwrap();
    let model = four_blocks(dir.path());
    for (ranks, accum, flags, needle) in [
        (
            2,
            1,
            &["--pp", "2"][..],
            "1f1b fills the pipeline of 2 stages with 2 micro-batches",
        ),
        (
            2,
            3,
            &["--pp", "2", "--schedule", "interleaved"],
            "multiple of 2",
        ),
        (
            4,
            4,
            &["--pp", "4", "--schedule", "interleaved"],
            "at least 8 blocks",
        ),
        (2, 4, &["--pp", "3"], "must divide"),
        (2, 2, &["--pp", "2", "--pp-split", "4"], "pp-split"),
    ] {
        let out = dir.path().join(format!("bad-{ranks}-{}", flags.join("")));
        let output = run_ranks(ranks, &run(&model, &out, accum, flags));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{flags:?}: {stderr}");
        assert!(stderr.contains(needle), "{flags:?}: {stderr}");
        assert!(!out.join("checkpoint-000001").exists(), "{flags:?}");
    }
}

/// Every rank's peak of live tensors and bytes sent per step are what `tinyllm plan --pp`
/// predicts for it, to the byte: the plan runs the trainer's own pipeline step on meta
/// tensors, as each rank of a phantom world.
#[test]
fn each_stages_peak_and_traffic_is_the_plans() {
    let dir = tempfile::tempdir().unwrap();
    let model = four_blocks(dir.path());
    // (ranks, pp, accum, flags). A run's peak is its step's here: the checkpoint rank 0
    // writes, gathered whole on it alone, holds less.
    for (ranks, pp, accum, flags) in [
        (2, 2, 4, &["--schedule", "1f1b"][..]),
        (2, 2, 4, &["--schedule", "gpipe"]),
        (2, 2, 4, &["--schedule", "interleaved"]),
        (4, 4, 4, &["--schedule", "1f1b", "--checkpoint-activations"]),
        (2, 2, 4, &["--schedule", "zb-h1"]),
        (4, 2, 2, &["--schedule", "zb-h1", "--zero", "3"]),
        (
            4,
            4,
            4,
            &["--schedule", "zb-h1", "--checkpoint-activations"],
        ),
        (4, 2, 2, &[]),
        (4, 2, 2, &["--zero", "1"]),
        (4, 2, 2, &["--zero", "2"]),
        (4, 2, 2, &["--zero", "3"]),
        (4, 2, 4, &["--zero", "3", "--checkpoint-activations"]),
        (4, 2, 4, &["--tp", "2"]),
        (2, 2, 4, &["--fp8"]),
        (2, 2, 4, &["--schedule", "interleaved", "--fp8"]),
        (4, 2, 2, &["--fp8"]),
        (2, 2, 4, &["--dropout", "0.1", "--checkpoint-activations"]),
    ] {
        let pp = pp.to_string();
        let extra: Vec<&str> = ["--pp", &pp]
            .into_iter()
            .chain(flags.iter().copied())
            .collect();
        let out = dir.path().join(format!("{ranks}{}", extra.join("")));
        succeed(ranks, &run(&model, &out, accum, &extra));
        let summary: serde_json::Value =
            serde_json::from_slice(&fs::read(out.join("summary.json")).unwrap()).unwrap();
        let (ranks_flag, accum_flag) = (ranks.to_string(), accum.to_string());
        let mut plan_args = vec!["plan", "--config", model.to_str().unwrap(), "--json"];
        plan_args.extend(["--micro-batch", "2", "--accum", &accum_flag]);
        plan_args.extend(["--ranks", &ranks_flag]);
        plan_args.extend(extra.iter().copied());
        let plan: serde_json::Value = serde_json::from_str(&common::stdout_of(&plan_args)).unwrap();
        let what = format!("{extra:?}");
        let measured = summary["ranks"].as_array().unwrap();
        let predicted = plan["ranks"].as_array().unwrap();
        assert_eq!(measured.len(), ranks, "{what}");
        for (rank, (m, p)) in measured.iter().zip(predicted).enumerate() {
            assert_eq!(
                m["peak_live_bytes"], p["peak_bytes"],
                "{what}: rank {rank}'s peak"
            );
            assert_eq!(
                m["bytes_sent_per_step"].as_f64().unwrap(),
                p["sent_bytes"].as_u64().unwrap() as f64,
                "{what}: rank {rank}'s bytes"
            );
            // Every stage sends and receives: its time communicating is counted.
            let comm_s = m["comm_s_per_step"].as_f64().unwrap();
            assert!(comm_s > 0.0, "{what}: rank {rank} communicated {comm_s} s");
        }
        // The bubble of equal stages is the formula's for these schedules.
        let pipeline = &plan["pipeline"];
        let formula = pipeline["bubble_formula"].as_f64().unwrap();
        for bubble in pipeline["bubble"].as_array().unwrap() {
            assert!((bubble.as_f64().unwrap() - formula).abs() < 1e-12, "{what}");
        }
    }
}

/// On a mesh with data-parallel replicas the plan's pipeline table gives each world rank
/// the stages its pipeline rank holds (`rank = pp·DP + dp`): ranks 0 and 1 stage 0, ranks 2
/// and 3 stage 1. (It once indexed the pipeline's ranks by the world rank, and panicked.)
#[test]
fn the_plans_pipeline_table_names_each_ranks_stages_on_a_mesh() {
    let dir = tempfile::tempdir().unwrap();
    let model = four_blocks(dir.path());
    let printed = common::stdout_of(&[
        "plan",
        "--config",
        model.to_str().unwrap(),
        "--micro-batch",
        "2",
        "--accum",
        "2",
        "--ranks",
        "4",
        "--pp",
        "2",
        "--zero",
        "3",
    ]);
    let table = printed
        .split("pipeline, 1f1b")
        .nth(1)
        .unwrap_or_else(|| panic!("no pipeline table: {printed}"));
    for (rank, stage) in [
        ("0", "0 (0..2)"),
        ("1", "0 (0..2)"),
        ("2", "1 (2..4)"),
        ("3", "1 (2..4)"),
    ] {
        let row = format!("{rank:>5} {stage}");
        assert!(
            table.lines().any(|l| l.starts_with(&row)),
            "{row:?} in {table}"
        );
    }
}

/// A pipeline run leaves its last step as it ran, which `tinyllm schedule --from RUN`
/// times against the simulator fed with the same actions' times, and draws.
#[test]
fn schedule_from_a_run_draws_its_last_step_as_it_ran() {
    let dir = tempfile::tempdir().unwrap();
    let model = four_blocks(dir.path());
    let out = dir.path().join("run");
    succeed(
        2,
        &run(&model, &out, 4, &["--pp", "2", "--schedule", "gpipe"]),
    );
    let timeline: tl_train::train::PipelineTimeline = serde_json::from_slice(
        &fs::read(out.join(tl_train::train::PIPELINE_TIMELINE_FILE)).unwrap(),
    )
    .unwrap();
    assert_eq!(timeline.step, 5);
    let schedule = read_config(&out).unwrap().pipeline_schedule().unwrap();
    for (rank, actions) in timeline.ranks.iter().enumerate() {
        // Every action but the step's last two, in order, each ending after it began.
        let expected: Vec<String> = schedule.actions(rank)[..schedule.actions(rank).len() - 2]
            .iter()
            .map(ToString::to_string)
            .collect();
        let names: Vec<&str> = actions.iter().map(|t| t.action.as_str()).collect();
        assert_eq!(names, expected, "rank {rank}");
        assert!(actions.iter().all(|t| t.end_s >= t.start_s), "rank {rank}");
        assert!(
            actions.windows(2).all(|w| w[1].start_s >= w[0].end_s),
            "rank {rank}: one action at a time"
        );
    }
    let chart = dir.path().join("ran.svg");
    let printed = common::stdout_of(&[
        "schedule",
        "--from",
        out.to_str().unwrap(),
        "--chart",
        chart.to_str().unwrap(),
    ]);
    for rank in ["    0 ", "    1 "] {
        assert!(printed.lines().any(|l| l.starts_with(rank)), "{printed}");
    }
    assert!(printed.contains("simulated, these times"), "{printed}");
    assert!(
        fs::read_to_string(&chart)
            .unwrap()
            .contains("gpipe as it ran")
    );
    // A run without a pipeline has no timeline to draw.
    let plain = dir.path().join("plain");
    succeed(1, &run(&model, &plain, 4, &[]));
    let error = common::run_error(&["schedule", "--from", plain.to_str().unwrap()]);
    assert!(
        error.to_string().contains("not trained on a pipeline"),
        "{error}"
    );
}

/// Steps of the fp16 run below.
const STEPS: usize = 8;

/// The 4-block tiny run in fp16 with clipping, on `ranks` ranks cut into `pipeline`.
fn fp16_config(ranks: usize, pipeline: usize) -> TrainConfig {
    let mut config = TrainConfig::for_preset(Preset::Tiny);
    config.model.n_layers = 4;
    config.precision = Precision::Fp16;
    config.micro_batch = 2;
    config.accum = 2;
    config.steps = STEPS as u64;
    config.parallel.ranks = ranks;
    config.parallel.pipeline = pipeline;
    config.divergence.max_skipped = STEPS as u32;
    config
}

/// The 4-block run's first stage alone overflows: the last hidden unit of block 0 made
/// loud and silent (see `common::overflow`), which only the first stage holds.
fn make_unit_loud(model: &Llama<f32>) {
    common::overflow::make_unit_loud(model, model.config().hidden - 1);
}

/// What a step reported: its loss's bits, whether it was skipped, the loss scale after it.
type Step = (u64, bool, f64);

fn steps(trainer: Trainer) -> Vec<Step> {
    (common::overflow::steps(trainer, STEPS).into_iter())
        .map(|(loss, skipped, scale)| (loss.to_bits(), skipped, scale))
        .collect()
}

#[test]
fn an_overflow_in_one_stage_skips_the_step_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let one = {
        let trainer = Trainer::new(fp16_config(1, 1), &dir.path().join("one")).unwrap();
        make_unit_loud(trainer.model());
        steps(trainer)
    };
    let skipped = one.iter().filter(|s| s.1).count();
    assert!(
        (1..STEPS).contains(&skipped),
        "the loud unit overflows the first steps, then fits: {one:?}"
    );
    let run_dir = dir.path().join("pp2");
    let ranks = on_two_ranks(|comm| {
        let trainer = Trainer::new_on(fp16_config(2, 2), &run_dir, comm).unwrap();
        make_unit_loud(trainer.model());
        steps(trainer)
    });
    for (rank, steps) in ranks.into_iter().enumerate() {
        // Skipped where one process skipped, the same scales, the same losses.
        assert_eq!(steps, one, "rank {rank}");
    }
}

/// `rank_program` on the two ranks of a ring, threads of this process, in rank order.
fn on_two_ranks<T: Send>(rank_program: impl Fn(Box<RingComm>) -> T + Sync) -> Vec<T> {
    let sockets = tempfile::tempdir().unwrap();
    thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let ring = RingConfig::new(rank, 2, sockets.path(), [7; 32])
                    .unwrap()
                    .timeout(Duration::from_secs(60));
                let program = &rank_program;
                scope.spawn(move || program(Box::new(RingComm::connect(ring).unwrap())))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The 4-block run's last stage alone overflows in fp16: unit 0 of the final norm's output
/// made loud (its gain 1000 times larger) and silent (its row of the head zero). The logits
/// do not change; the head's gradient in that row, the loud output times the scaled
/// gradient of the logits, passes fp16's largest value for the first steps. (Block 0's loud
/// MLP unit above does not overflow in fp8: its products are fp8 values summed in f32.)
fn make_head_loud(model: &Llama<f32>) {
    for (name, param) in model.named_parameters() {
        match name.as_str() {
            "norm.w" => param.update_value(|w| w[[0]] *= 1000.0),
            // `[d, vocab]`: unit 0's row.
            "head.weight" => param.update_value(|w| {
                w.index_axis_mut(tl_tensor::ndarray::Axis(0), 0).fill(0.0);
            }),
            _ => {}
        }
    }
}

/// fp8 under fp16's loss scaling on a pipeline: a step that overflows in the last stage is
/// skipped on every rank, its amaxes still join every layer's history on every rank, and
/// the scales step after it as one process's do. The steps, and the fp8 state after them,
/// are one process's.
#[test]
fn a_skipped_fp8_step_steps_the_scales_as_one_process() {
    let config = |ranks, pipeline| {
        let mut config = fp16_config(ranks, pipeline);
        config.fp8 = Some(Fp8Recipe::default());
        config
    };
    // Its steps, then its fp8 state as its checkpoint holds it.
    let train = |mut trainer: Trainer| {
        make_head_loud(trainer.model());
        let run_dir = trainer.run_dir().to_path_buf();
        let mut steps = Vec::new();
        for _ in 0..STEPS {
            match trainer.train_step().unwrap() {
                Record::Train {
                    loss,
                    skipped,
                    scale,
                    ..
                } => steps.push((loss.to_bits(), skipped, scale.unwrap())),
                other => panic!("not a training step: {other:?}"),
            }
        }
        trainer.save().unwrap();
        (steps, run_dir)
    };
    let dir = tempfile::tempdir().unwrap();
    let (one, one_dir) = train(Trainer::new(config(1, 1), &dir.path().join("one")).unwrap());
    let skipped = one.iter().filter(|s| s.1).count();
    assert!(
        (1..STEPS).contains(&skipped),
        "the loud unit overflows the first steps, then fits: {one:?}"
    );
    let run_dir = dir.path().join("pp2");
    let ranks = on_two_ranks(|comm| train(Trainer::new_on(config(2, 2), &run_dir, comm).unwrap()));
    for (rank, (steps, _)) in ranks.into_iter().enumerate() {
        assert_eq!(steps, one, "rank {rank}");
    }
    assert_eq!(fp8_state(&dir.path().join("pp2")), fp8_state(&one_dir));
}
