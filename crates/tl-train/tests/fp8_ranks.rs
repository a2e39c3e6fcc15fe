//! `--fp8` and the tensor cores' accumulation models on several ranks
//! (`tinyllm launch -n 2 -- train ...`), against one process on the same global batch.
//!
//! After every step each rank's fp8 amaxes are made global (one all-reduce, max, over every
//! rank), so a rank scales every tensor as one process would, and its fp8 casts are one
//! process's casts: what is left is the order of the f32 sums, as in fp32. Every
//! multi-process run here is bounded in time.

mod common;

use std::path::Path;

use common::ranks::{
    checkpoint, largest_difference, largest_relative, succeed, tiny_run, train_losses,
};
use tl_precision::Fp8State;
use tl_train::train::{Fp8Counts, Record, read_records, snapshot};

/// The fp8 state of a run's last checkpoint (rank 0's; with the amaxes global, every
/// rank's).
fn fp8_state(run: &Path) -> Fp8State {
    snapshot::load(run)
        .unwrap()
        .state
        .fp8
        .expect("an fp8 state")
}

/// The fp8 counts `metrics.jsonl` reports, step by step.
fn fp8_counts(run: &Path) -> Vec<Fp8Counts> {
    read_records(&run.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter_map(|record| match record {
            Record::Train { fp8, .. } => Some(fp8.expect("fp8 counts")),
            Record::Eval { .. } => None,
        })
        .collect()
}

/// The first step's amax of every tensor (input, weight, grad of each layer, in order).
fn first_amaxes(state: &Fp8State) -> Vec<[f32; 3]> {
    state
        .layers
        .iter()
        .map(|layer| layer.all().map(|scales| scales.history[0]))
        .collect()
}

/// The one-process run every layout is held to: 5 steps on 4 sequences.
fn one_process(dir: &Path, flags: &[&str]) -> std::path::PathBuf {
    let one = dir.join(format!("one{}", flags.join("")));
    succeed(1, &tiny(&one, 2, flags));
    one
}

/// [`tiny_run`] with micro-batches of 2 sequences.
fn tiny(out: &Path, accum: usize, extra: &[&str]) -> Vec<String> {
    tiny_run(out, 2, accum, extra)
}

/// Data parallelism: each rank casts its 2 sequences of the 4, with the scales of all 4.
///
/// A rank's gradients are twice one process's while it runs backward (it weights its
/// micro-batches by its own rows, `1/2` each, where one process weights them by `1/4`; the
/// all-reduce of `n_r/B` times each rank's gradient then gives the same sum). With the
/// amaxes global the gradients' scales are then half one process's, and the E5M2 casts of
/// `2g·s/2` are the casts of `g·s`, value for value. Except in step 1: every scale starts
/// at 1, and at scale 1 tiny's gradients are mostly below E5M2's smallest normal, `2⁻¹⁴`,
/// where doubling a value changes how it rounds. One process flushed 138,782 values to
/// zero in step 1, the two ranks 91,594, and the runs part there, by as much as they do
/// without the reduction (losses 3.2e-4, weights 1.7e-2 and 1.9e-2 after 5 steps): the
/// data-parallel loss weighting, not the amaxes. With `--fp16`'s loss scale (2¹⁶) the
/// gradients are in E5M2's normal range from the start, and the runs agree as fp32 runs
/// do: losses 5.3e-8, weights 1.2e-7 (the f32 sums in another order). Without the
/// reduction, 2.9e-4 and 8.4e-3.
#[test]
fn fp8_at_dp_2_trains_what_one_process_trains() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = ["--fp8", "--fp16"];
    let one = one_process(dir.path(), &recipe);
    let dp = dir.path().join("dp2");
    succeed(2, &tiny(&dp, 1, &recipe));
    let losses = largest_relative(&train_losses(&dp), &train_losses(&one));
    let weights = largest_difference(&checkpoint(&dp).1, &checkpoint(&one).1);
    eprintln!("fp8 + fp16 at dp 2: losses {losses:e}, weights {weights:e}");
    // fp32's bounds (tensor_parallel_training.rs): AdamW moves a weight whose small
    // gradient differs in its last bits by a few ulps of the learning rate, 3e-3.
    assert!(losses < 1e-6, "losses differ by {losses:e}");
    assert!(weights < 5e-5, "weights differ by up to {weights:e}");
    // In fp32 the first step's forward pass is one process's (the same loss to f32's sum
    // order); the casts of its gradients are not, as above.
    let one = one_process(dir.path(), &["--fp8"]);
    let dp = dir.path().join("dp2-fp32");
    succeed(2, &tiny(&dp, 1, &["--fp8"]));
    let (got, want) = (train_losses(&dp), train_losses(&one));
    let first = largest_relative(&got[..1], &want[..1]);
    let all = largest_relative(&got, &want);
    eprintln!("fp8 at dp 2: first loss {first:e}, losses {all:e}");
    assert!(first < 1e-6, "the first step's loss differs by {first:e}");
}

/// Tensor parallelism: each rank casts its slices of every split layer's weight, of a
/// row-parallel layer's input and of a column-parallel layer's output gradient, with the
/// scales of the whole tensors. Each rank's partial products are summed in f32, in
/// another order than one process's product, and the head's loss is the
/// vocabulary-parallel cross-entropy where one process's is the fused head and loss (its
/// sums run by blocks of 64 rows): the losses follow one process's closely until such a
/// difference tips an fp8 rounding (a value moved by an E4M3 or E5M2 step, up to 2⁻³ or 2⁻²
/// of it), and AdamW, which moves a weight by about the learning rate whatever its
/// gradient's size, turns a tipped sign of a small gradient into a learning rate's worth.
/// Measured: losses 8.4e-5 at step 5, weights 1.2e-3, a third of the learning rate
/// (before the fused head, 1.9e-5 and 1.1e-4). Without the reduction each rank scales its
/// slices by their own amaxes: 2.0e-4 and 7.7e-3.
#[test]
fn fp8_at_tp_2_trains_what_one_process_trains() {
    let dir = tempfile::tempdir().unwrap();
    let one = one_process(dir.path(), &["--fp8"]);
    let tp = dir.path().join("tp2");
    succeed(2, &tiny(&tp, 2, &["--fp8", "--tp", "2"]));
    let losses = largest_relative(&train_losses(&tp), &train_losses(&one));
    let weights = largest_difference(&checkpoint(&tp).1, &checkpoint(&one).1);
    eprintln!("fp8 at tp 2: losses {losses:e}, weights {weights:e}");
    assert!(losses < 1.5e-4, "losses differ by {losses:e}");
    assert!(weights < 3e-3, "weights differ by up to {weights:e}");
}

/// Without the reduction a rank would record the amaxes of its own part: at dp 2 the
/// inputs of its own 2 sequences, at tp 2 the largest value of its own weight slices. The
/// first step starts from the same weights on the same batch, so what the ranks record
/// there is exactly one process's amaxes: the inputs' and weights' at dp 2 (each
/// micro-batch's forward pass is one process's, bit for bit), the weights' at tp 2. And
/// the range counts reported for them are one process's too: summed over the ranks, a
/// tensor that every rank of the group casts whole counted once.
#[test]
fn the_ranks_record_one_processes_amaxes_and_counts() {
    let dir = tempfile::tempdir().unwrap();
    let one = one_process(dir.path(), &["--fp8"]);
    let expected = first_amaxes(&fp8_state(&one));
    let expected_counts = &fp8_counts(&one)[0].tensors;
    let (dp, tp) = (dir.path().join("dp2"), dir.path().join("tp2"));
    succeed(2, &tiny(&dp, 1, &["--fp8"]));
    succeed(2, &tiny(&tp, 2, &["--fp8", "--tp", "2"]));
    for (i, (got, want)) in first_amaxes(&fp8_state(&dp))
        .iter()
        .zip(&expected)
        .enumerate()
    {
        assert_eq!(
            got[..2],
            want[..2],
            "dp 2, layer {i}: input and weight amaxes"
        );
    }
    for (i, (got, want)) in first_amaxes(&fp8_state(&tp))
        .iter()
        .zip(&expected)
        .enumerate()
    {
        assert_eq!(got[1], want[1], "tp 2, layer {i}: weight amax");
    }
    let first_step = |run: &Path| fp8_counts(run).swap_remove(0).tensors;
    let (dp_counts, tp_counts) = (first_step(&dp), first_step(&tp));
    let mut compared = 0;
    for (tensor, counts) in expected_counts {
        if !tensor.ends_with(".grad") {
            assert_eq!(dp_counts.get(tensor), Some(counts), "dp 2: {tensor}");
            compared += 1;
        }
        // Exact at tp 2: the weights, and the inputs of the first block's q, k and v
        // projections (the normed embeddings, whole and the same bits on both ranks).
        let first_inputs = [
            "blocks.0.wq.input",
            "blocks.0.wk.input",
            "blocks.0.wv.input",
        ];
        if tensor.ends_with(".weight") || first_inputs.contains(&tensor.as_str()) {
            assert_eq!(tp_counts.get(tensor), Some(counts), "tp 2: {tensor}");
            compared += 1;
        }
    }
    assert!(compared > 10, "the first step flushes: {expected_counts:?}");
}

/// A tensor-core accumulation model inside the split layers. Under `--accumulate a100` a
/// product adds its terms 8 at a time, aligned to the block's largest exponent with one
/// bit beyond binary32's 24 and cut toward zero, the block's sum cut into binary32. At tp 2
/// a row-parallel layer's ranks each add their half of the `K` terms so, round their
/// partial products to bf16, and the group adds the two partials in bf16, where one
/// process adds all `K` terms so and rounds once.
///
/// The bound, per output, with `M = Σ|x_k·w_k|` and `u = 2⁻⁸`: the roundings to bf16 give
/// `(γ₂ + u)·M ≈ 3.02u·M` (the plain bf16 split's, docs/mixed-precision.md). The model's
/// cuts add, on either side, less than `2⁻²³` of `M` per term and per block (`(K + K/8)`
/// cuts at most, `K ≤ 176` at tiny's MLP): under `2⁻¹⁵·M`, `u/128`. So the split
/// differs from one process by what the plain bf16 split does, and the bound on the losses
/// is that test's: one rounding of the format, `u`. The run is also not the plain bf16
/// one's: the model is in force inside the split layers.
#[test]
fn a_tensor_core_model_inside_the_split_layers_follows_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let model = ["--bf16", "--accumulate", "a100"];
    let one = dir.path().join("one");
    succeed(1, &tiny(&one, 2, &model));
    let tp = dir.path().join("tp2");
    succeed(2, &tiny(&tp, 2, &[&model[..], &["--tp", "2"]].concat()));
    let plain = dir.path().join("plain");
    succeed(2, &tiny(&plain, 2, &["--bf16", "--tp", "2"]));
    let losses = largest_relative(&train_losses(&tp), &train_losses(&one));
    let weights = largest_difference(&checkpoint(&tp).1, &checkpoint(&one).1);
    eprintln!("a100 at tp 2: losses {losses:e}, weights {weights:e}");
    assert!(losses < 2f64.powi(-8), "losses differ by {losses:e}");
    assert_ne!(
        checkpoint(&tp).1,
        checkpoint(&plain).1,
        "the split layers multiply on the A100's model"
    );
}
