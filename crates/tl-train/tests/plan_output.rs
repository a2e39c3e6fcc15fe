//! `tinyllm plan`'s output, held as snapshots: tables and JSON of single-process recipes,
//! of data-parallel ranks and of a large shape. The plan runs the trainer's own step on
//! meta tensors; these snapshots were taken from the hand-kept replica it replaced, so
//! they hold the new plan to the old one's figures. One attribution changed with the
//! switch: with dropout, the mask and output of a block's second dropout now count with
//! that block (the replica put them with the next block, which reads the block's output),
//! so the per-layer rows of `capstone_fp16_dropout_budget` and its "peak at" layer moved;
//! no total did.

mod common;

use common::stdout_of;

fn plan(args: &[&str]) -> String {
    let mut all = vec!["plan"];
    all.extend_from_slice(args);
    stdout_of(&all)
}

#[test]
fn single_process_tables() {
    insta::assert_snapshot!("tiny", plan(&["--preset", "tiny"]));
    insta::assert_snapshot!(
        "small_bf16_checkpointed",
        plan(&[
            "--preset",
            "small",
            "--bf16",
            "--micro-batch",
            "8",
            "--accum",
            "4",
            "--checkpoint-activations"
        ])
    );
    insta::assert_snapshot!(
        "capstone_fp16_dropout_budget",
        plan(&[
            "--preset",
            "capstone",
            "--fp16",
            "--dropout",
            "0.1",
            "--micro-batch",
            "2",
            "--checkpoint-budget",
            "4"
        ])
    );
    insta::assert_snapshot!(
        "tiny_fp8",
        plan(&[
            "--preset",
            "tiny",
            "--bf16",
            "--fp8",
            "--checkpoint-activations"
        ])
    );
    insta::assert_snapshot!(
        "tiny_accumulate_h100",
        plan(&["--preset", "tiny", "--bf16", "--accumulate", "h100"])
    );
    insta::assert_snapshot!(
        "tiny_matmuls_json",
        plan(&[
            "--preset",
            "tiny",
            "--checkpoint-policy",
            "matmuls",
            "--json"
        ])
    );
}

#[test]
fn data_parallel_tables() {
    insta::assert_snapshot!(
        "tiny_two_ranks_every_stage",
        plan(&["--preset", "tiny", "--ranks", "2", "--zero", "0,1,2,3"])
    );
    insta::assert_snapshot!(
        "tiny_three_ranks_zero3",
        plan(&[
            "--preset",
            "tiny",
            "--ranks",
            "3",
            "--zero",
            "3",
            "--bf16",
            "--checkpoint-activations"
        ])
    );
    insta::assert_snapshot!("shape_7b_sweep", plan(&["--shape", "7b"]));
    insta::assert_snapshot!(
        "shape_7b_json",
        plan(&["--shape", "7b", "--ranks", "64", "--zero", "2", "--json"])
    );
}
