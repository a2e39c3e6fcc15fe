//! `tinyllm train --tp T` on ranks (`tinyllm launch -n N -- train ... --tp T`): the same run
//! as one process on the same global batch in every layout (tp 2, tp 4, dp 2 × tp 2 with
//! ZeRO-1, each with and without `--sequence-parallel`), in 16 bits to the rounding the
//! split implies, checkpoints that resume in any other layout, and layouts that cannot be,
//! refused before any step. Every multi-process run here is bounded in time.

mod common;

use std::fs;
use std::path::Path;

use common::ranks::{
    checkpoint, grad_norms, largest_difference, largest_relative, median_difference, run_ranks,
    succeed, tiny_run, train_losses,
};
use tl_train::train::read_config;

/// [`tiny_run`] with micro-batches of 2 sequences.
fn tiny(out: &Path, accum: usize, extra: &[&str]) -> Vec<String> {
    tiny_run(out, 2, accum, extra)
}

/// Weights `got` after the tiny run's 5 steps equal to rounding to `expected`, one process's.
///
/// AdamW divides each gradient by its own running size, so a last-bit difference of a small
/// gradient (the split products add in another order) moves its weight by up to a few
/// percent of the learning rate (3e-3), and the next steps carry it on: which weights, and
/// how far, is chance. Measured over seeds 0–9 at tp 2 (the `--seed` flag): 108 of the
/// 133,440 weights more than 1e-7 apart at seed 0, 25 to 282 over the ten, the largest
/// difference 2.5e-6 to 3.7e-5; with RMSNorm's row sums in eight lanes, 25 to 1,316 and
/// 2.2e-6 to 8.6e-5 (seed 0, `blocks.1.wo[3635]`, also the weight of `blocks.1.wo` that
/// moves most without the lanes). A layout that loses a slice or a shard moves most weights
/// by a learning-rate step (a wrong scale shows in the gradient norms): the median difference (at most 9.3e-10 over seeds 0–9 at tp 2 and at
/// tp 4 with sequence parallelism and ZeRO-1, with the lanes) catches it, and the largest is
/// bounded at a tenth of the learning rate.
fn assert_weights_to_rounding(got: &[f32], expected: &[f32], what: &str) {
    let median = median_difference(got, expected);
    assert!(
        median < 1e-7,
        "{what}: weights differ by {median:e} at the median"
    );
    let largest = largest_difference(got, expected);
    assert!(
        largest < 3e-4,
        "{what}: weights differ by up to {largest:e}"
    );
}

/// Every layout trains what one process trains on the same global batch of 4 sequences,
/// with clipping (the tiny run's default), and writes whole tensors.
#[test]
fn every_layout_trains_what_one_process_trains() {
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one");
    succeed(1, &tiny(&one, 2, &[]));
    let (header, expected) = checkpoint(&one);
    // (ranks, accum per replica, flags)
    for (ranks, accum, flags) in [
        (2, 2, &["--tp", "2"][..]),
        (4, 2, &["--tp", "4"][..]),
        (4, 1, &["--tp", "2", "--zero", "1"][..]),
        (4, 1, &["--tp", "2"][..]),
        (2, 2, &["--tp", "2", "--sequence-parallel"][..]),
        (4, 1, &["--tp", "2", "--sequence-parallel"][..]),
        (
            4,
            2,
            &["--tp", "4", "--sequence-parallel", "--zero", "1"][..],
        ),
    ] {
        let out = dir.path().join(format!("{ranks}-{}", flags.join("")));
        succeed(ranks, &tiny(&out, accum, flags));
        let what = format!("{ranks} ranks {flags:?}");
        // Measured: 5.3e-8 at most (the f32 sums of the split products in another order),
        // with sequence parallelism too.
        let losses = largest_relative(&train_losses(&out), &train_losses(&one));
        assert!(losses < 1e-6, "{what}: losses differ by {losses:e}");
        // The norm the step clips by is the whole model's: measured 4.0e-8 at most.
        let norms = largest_relative(&grad_norms(&out), &grad_norms(&one));
        assert!(norms < 1e-6, "{what}: gradient norms differ by {norms:e}");
        let (got_header, got) = checkpoint(&out);
        assert_eq!(
            got_header, header,
            "{what}: the checkpoint holds whole tensors"
        );
        assert_weights_to_rounding(&got, &expected, &what);
        let config = read_config(&out).unwrap();
        assert_eq!(config.parallel.ranks, ranks);
        let sequence_parallel = flags.contains(&"--sequence-parallel");
        assert_eq!(
            config.parallel.sequence_parallel, sequence_parallel,
            "{what}"
        );
    }
}

/// Data parallelism at every ZeRO stage over the dp axis of a dp 2 × tp 2 mesh, tensor
/// parallelism over its tp axis: the run follows one process and dp = 4 on the same global
/// batch of 4 sequences, with clipping (the clip norm's sum of squares over the shards of the
/// data-parallel group and the slices of the tensor-parallel one), and with sequence
/// parallelism too. Without clipping, and with one micro-batch a rank, ZeRO-2 and ZeRO-3
/// reduce each gradient as DDP does (one addition of the two replicas' values), with
/// checkpointed blocks whose reruns gather a unit's slices again and redo the tensor
/// group's collectives, and dropout: bit for bit the DDP × TP run.
#[test]
fn data_and_tensor_parallelism_compose_at_every_zero_stage() {
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one");
    succeed(1, &tiny(&one, 2, &[]));
    let dp4 = dir.path().join("dp4");
    succeed(4, &tiny_run(&dp4, 1, 1, &[]));
    let (expected, dp4_losses) = (train_losses(&one), train_losses(&dp4));
    let (_, expected_weights) = checkpoint(&one);
    for flags in [
        &["--zero", "2"][..],
        &["--zero", "3"][..],
        &["--zero", "2", "--sequence-parallel"][..],
        &["--zero", "3", "--sequence-parallel"][..],
    ] {
        let out = dir.path().join(flags.join(""));
        let mut args = flags.to_vec();
        args.extend(["--tp", "2"]);
        succeed(4, &tiny(&out, 1, &args));
        let what = format!("dp 2 x tp 2 {flags:?}");
        let losses = train_losses(&out);
        // Measured: 5.3e-8 against one process and 1.1e-7 against dp 4 (f32 sums in other
        // orders).
        for (reference, against) in [(&expected, "one process"), (&dp4_losses, "dp 4")] {
            let difference = largest_relative(&losses, reference);
            assert!(
                difference < 1e-6,
                "{what}: losses differ from {against}'s by {difference:e}"
            );
        }
        // The norm the step clips by is the whole model's: measured 2.5e-8 from one
        // process's (a slice counted twice, or a shard missed, moves it by percents).
        let norms = largest_relative(&grad_norms(&out), &grad_norms(&one));
        assert!(norms < 1e-6, "{what}: gradient norms differ by {norms:e}");
        assert_weights_to_rounding(&checkpoint(&out).1, &expected_weights, &what);
        assert_eq!(
            read_config(&out).unwrap().parallel.zero,
            flags[1].parse::<u8>().unwrap()
        );
    }
    let exact = |name: &str, zero: &str| {
        let out = dir.path().join(name);
        let recipe = [
            "--bf16",
            "--no-clip",
            "--checkpoint-activations",
            "--dropout",
            "0.1",
            "--tp",
            "2",
            "--zero",
            zero,
        ];
        succeed(4, &tiny(&out, 1, &recipe));
        (checkpoint(&out).1, train_losses(&out))
    };
    let ddp = exact("exact0", "0");
    for zero in ["2", "3"] {
        assert!(
            exact(&format!("exact{zero}"), zero) == ddp,
            "ZeRO-{zero} x tp 2 is not DDP x tp 2 bit for bit"
        );
    }
}

/// Under autocast each rank's partial products are rounded to 16 bits and the group sums
/// them in 16 bits, each hop of the ring rounded (as NCCL adds bf16), where one process
/// rounds the whole product once: the losses differ by less than one rounding of the
/// format (u = 2⁻⁸ for bf16, 2⁻¹¹ for fp16; measured 8.7e-5 and 1.1e-5, and 2.9e-5 and
/// 6.3e-6 with f32 sums), with checkpointing and dropout on.
#[test]
fn sixteen_bit_runs_split_in_two_follow_one_process_to_the_formats_rounding() {
    let dir = tempfile::tempdir().unwrap();
    for (format, bound) in [("--bf16", 2f64.powi(-8)), ("--fp16", 2f64.powi(-11))] {
        let recipe = [format, "--checkpoint-activations", "--dropout", "0.1"];
        let one = dir.path().join(format!("one{format}"));
        succeed(1, &tiny(&one, 2, &recipe));
        let split = dir.path().join(format!("tp{format}"));
        let mut flags = recipe.to_vec();
        flags.extend(["--tp", "2"]);
        succeed(2, &tiny(&split, 2, &flags));
        let difference = largest_relative(&train_losses(&split), &train_losses(&one));
        assert!(
            difference < bound,
            "{format}: losses differ by {difference:e}"
        );
    }
}

/// A run written at tp 2 resumes at tp 1 on one rank, at dp 2, and at dp 2 × tp 2, and
/// follows the uninterrupted one-process run.
#[test]
fn a_checkpoint_written_at_tp_2_resumes_in_any_layout() {
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one");
    succeed(1, &tiny(&one, 2, &[]));
    let expected = train_losses(&one);
    for (ranks, tp) in [(1, 1), (2, 1), (4, 2)] {
        let run = dir.path().join(format!("to-{ranks}-{tp}"));
        succeed(2, &tiny(&run, 2, &["--tp", "2", "--until-step", "3"]));
        let resume: Vec<String> = ["train", "--resume", run.to_str().unwrap(), "--quiet"]
            .into_iter()
            .chain(["--tp", &tp.to_string()])
            .map(String::from)
            .collect();
        let stderr = succeed(ranks, &resume);
        assert!(stderr.contains("keeps its global batch"), "{stderr}");
        let config = read_config(&run).unwrap();
        assert_eq!((config.parallel.ranks, config.parallel.tensor), (ranks, tp));
        let difference = largest_relative(&train_losses(&run), &expected);
        assert!(
            difference < 1e-6,
            "to {ranks} x tp {tp}: losses differ by {difference:e}"
        );
    }
}

/// Sequence parallelism changes where activations live, not what the run computes: a run
/// written with it at tp 2 (checkpointing and dropout on, so that the reruns replay the
/// whole model's masks) resumes at tp 1 on one rank, and at tp 2 with it turned off, and
/// follows the uninterrupted one-process run.
#[test]
fn a_sequence_parallel_run_resumes_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = ["--checkpoint-activations", "--dropout", "0.1"];
    let one = dir.path().join("one");
    succeed(1, &tiny(&one, 2, &recipe));
    let expected = train_losses(&one);
    for (ranks, tp, flags) in [(1, 1, &[][..]), (2, 2, &["--sequence-parallel=false"][..])] {
        let run = dir.path().join(format!("to-{ranks}-{tp}"));
        let mut first = recipe.to_vec();
        first.extend(["--tp", "2", "--sequence-parallel", "--until-step", "3"]);
        succeed(2, &tiny(&run, 2, &first));
        assert!(read_config(&run).unwrap().parallel.sequence_parallel);
        let tp = tp.to_string();
        let resume: Vec<String> = ["train", "--resume", run.to_str().unwrap(), "--quiet"]
            .into_iter()
            .chain(["--tp", &tp])
            .chain(flags.iter().copied())
            .map(String::from)
            .collect();
        succeed(ranks, &resume);
        let config = read_config(&run).unwrap();
        assert!(!config.parallel.sequence_parallel, "to {ranks} x tp {tp}");
        // Measured: 4.7e-8 (to tp 1) and 5.0e-8 (tp 2 without it): f32 sums in another
        // order, then resumed exactly.
        let difference = largest_relative(&train_losses(&run), &expected);
        assert!(
            difference < 1e-6,
            "to {ranks} x tp {tp}: losses differ by {difference:e}"
        );
    }
}

/// A rank's report counts its time in every group's collectives. At tp 2 on two ranks the
/// data-parallel group is each rank alone: its calls take microseconds a step. The
/// tensor-parallel group's all-reduces, 4L + 4 a micro-batch over the sockets, each a
/// round trip to the other rank or more (waiting for it included), take well over 0.1 ms a
/// step between them; a report that timed only the data-parallel group stayed below that.
#[test]
fn a_tensor_parallel_run_reports_its_groups_time() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tp");
    succeed(2, &tiny(&out, 2, &["--tp", "2"]));
    let summary: serde_json::Value =
        serde_json::from_slice(&fs::read(out.join("summary.json")).unwrap()).unwrap();
    let ranks = summary["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    for rank in ranks {
        let comm_s = rank["comm_s_per_step"].as_f64().unwrap();
        let share = rank["comm_share"].as_f64().unwrap();
        assert!(comm_s > 1e-4, "{rank}: {comm_s} s a step in collectives");
        assert!(share > 0.0 && share < 1.0, "{rank}");
    }
}

/// Layouts that cannot be are refused before any step, naming what does not fit.
#[test]
fn layouts_that_cannot_be_are_refused_before_any_step() {
    let dir = tempfile::tempdir().unwrap();
    for (ranks, flags, needle) in [
        (4, &["--tp", "3"][..], "divisible by 3"),
        (1, &["--tp", "2"][..], "must divide"),
        (1, &["--sequence-parallel"][..], "requires --tp > 1"),
    ] {
        let out = dir.path().join(format!("bad-{ranks}-{}", flags.join("")));
        let output = run_ranks(ranks, &tiny(&out, 2, flags));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{flags:?}: {stderr}");
        assert!(stderr.contains(needle), "{flags:?}: {stderr}");
        assert!(!out.join("checkpoint-000001").exists());
    }
}
