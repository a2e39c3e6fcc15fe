//! L11.3: data parallelism and ZeRO stages 1 to 3. The learner writes a few files of
//! tl-parallel (the batch share, the buckets and their reduction, the step's global
//! decisions, the sharded step's pieces, ZeRO-3's gather and release around a unit); the rest
//! of the crate (the links, the overlap, the stages, the trainer's step) stays the
//! reference's and calls them. The course tests are `tests/l11_3/`.

use super::{Chapter, CourseTest, Kind, LearnerCrate, Pitfall, Sources, test};

/// The chapter.
pub(crate) const L11_3: Chapter = Chapter {
    name: "L11.3",
    title: "Data parallelism and ZeRO stages 1 to 3",
    crates: CRATES,
    course_package: "tl-course-l11-3",
    test_binary: "l11_3",
    tests: TESTS,
    pitfalls: PITFALLS,
};

/// The files of tl-parallel the learner writes (paths under `src/`).
const LEARNER_FILES: &[&str] = &[
    "batch.rs",
    "bucket.rs",
    "decide.rs",
    "shard_step.rs",
    "zero3/unit.rs",
];

const CRATES: &[LearnerCrate] = &[LearnerCrate {
    dir: "crates/tl-parallel",
    guides: &[("", "docs/course/L11.3.md")],
    starter: STARTER,
    sources: Sources::Only(LEARNER_FILES),
    // The crate's unit tests (among them those of the learner's files) and one fast
    // integration test of the surface; between them they catch every pitfall below in
    // about a second of testing.
    own_tests: &["--lib", "--test", "learner_surface"],
}];

/// The starter tests of tl-parallel: one worked example of the chapter, to copy from.
const STARTER: &str = r#"//! Your tests of tl-parallel's data parallelism. `cargo xtask check L11.3` grades them:
//! each of the chapter's planted pitfalls must make at least one of them fail, and
//! cargo-mutants must find them catching at least 80% of the mutants of your code (batch.rs,
//! bucket.rs, decide.rs, shard_step.rs and zero3/unit.rs). Add a test for every rule of
//! docs/course/L11.3.md. Ranks can be threads of one test, each with its own
//! `tl_collective::RingComm` (see `RingConfig`); `tl_collective::Single` is a world of one,
//! and `tl_collective::Phantom` one rank of any world, counting what it would send.

use tl_parallel::batch_share;

/// A worked example of the chapter: 5 rows over 2 ranks, micro-batches of at most 2 rows.
/// The first rank takes the row that does not divide, and each rank's gradient enters the
/// sum with its share of the rows, n_r/B: 3/5 and 2/5, not 1/2 each.
#[test]
fn five_rows_over_two_ranks() {
    let first = batch_share(5, 2, 2, 0).unwrap();
    assert_eq!(first.micro_batches, vec![0..2, 2..3]);
    assert_eq!(first.weight(), 0.6);
    let second = batch_share(5, 2, 2, 1).unwrap();
    assert_eq!(second.micro_batches, vec![3..5]);
    assert_eq!(second.weight(), 0.4);
}
"#;

const B: &str = "batch";
const K: &str = "bucket";
const D: &str = "ddp";
const Z: &str = "zero";
const Z3: &str = "zero3";

/// The fourteen tests of L11.3, in the chapter's order.
const TESTS: &[CourseTest] = &[
    test(
        "test_hand_example_weights",
        D,
        Kind::Unit,
        "two ranks, gradient 2 on 3 rows and 4 on 1 row: the sum is 3/4·2 + 1/4·4 = 2.5 on both, not 3",
        "every reduction of the ranks' gradients",
    ),
    test(
        "test_hand_example_overflow",
        D,
        Kind::Unit,
        "rank 1's inf at a scale of 1024: both ranks skip and halve to 512, under DDP and under ZeRO-3",
        "fp16 runs on ranks",
    ),
    test(
        "test_hand_example_capstone_at_four_ranks",
        Z,
        Kind::Unit,
        "the capstone's shapes at N = 4: 157.58/98.49/68.94/39.40 MiB of state, 59.09/88.64/59.09/88.64 MiB sent",
        "tinyllm plan's f32 16P and sent/step columns",
    ),
    test(
        "test_shares_of_uneven_batches",
        B,
        Kind::Property,
        "5 rows over 2 ranks and 7 over 3, then any batch: every row once, in order, weights n_r/B summing to 1",
        "batches that do not divide by the ranks",
    ),
    test(
        "test_buckets_fill_backwards_and_split",
        K,
        Kind::Property,
        "buckets from the last parameter, full but the last, a parameter larger than a bucket split over three",
        "collectives that start as backward produces the gradients",
    ),
    test(
        "test_no_collective_before_the_last_backward",
        D,
        Kind::Boundary,
        "three micro-batches a rank: no collective until the last backward, with and without overlap, DDP and ZeRO-1/2",
        "accumulation on ranks sends one step's bytes, not accum times them",
    ),
    test(
        "test_ddp_equals_one_process",
        D,
        Kind::Differential,
        "N = 2 bit for bit; N = 3, unequal shares and accumulation, to 1e-6 with the same gradient norms",
        "a run on ranks trains what one process trains",
    ),
    test(
        "test_zero_stages_equal_ddp",
        Z,
        Kind::Differential,
        "ZeRO-1/2 bit for bit at N = 2 and 4, ZeRO-3 at N = 2; all three to 1e-6 with accumulation at N = 3",
        "--zero 1, 2 and 3 change memory, not training",
    ),
    test(
        "test_clip_norm_is_global",
        Z,
        Kind::Differential,
        "a binding clip under ZeRO-2 and 3: every rank's norm is DDP's, the weights DDP's to 1e-6",
        "clipping with sharded gradients",
    ),
    test(
        "test_zero2_keeps_only_its_gradient_shard",
        Z,
        Kind::Unit,
        "after ZeRO-2's steps no parameter keeps a full gradient; the shards add up to P, a quarter each",
        "ZeRO-2's memory",
    ),
    test(
        "test_state_per_rank_falls_stage_by_stage",
        Z,
        Kind::Property,
        "state elements 4P, 2P + P/2, P + 3P/4, P at N = 4, and metered peaks falling from ZeRO-0 to 3",
        "choosing a stage by memory",
    ),
    test(
        "test_state_saved_at_two_resumes_at_four",
        Z,
        Kind::Differential,
        "ZeRO-2's whole state saved at N = 2 resumes at N = 4 as at N = 2, to 1e-6",
        "checkpoints independent of the world size",
    ),
    test(
        "test_zero3_releases_after_forward_and_backward",
        Z3,
        Kind::Unit,
        "one gather a unit without a graph, two a unit a micro-batch in a step, every unit released after",
        "ZeRO-3's memory",
    ),
    test(
        "test_zero3_checkpointed_unit_gathers_for_its_rerun",
        Z3,
        Kind::Differential,
        "a checkpointed unit gathers for its rerun and keeps the values for its backward: two gathers, the plain run's bits",
        "ZeRO-3 with --checkpoint-activations",
    ),
];

const PARALLEL: &str = "tl-parallel";
const BATCH: &str = "crates/tl-parallel/src/batch.rs";
const BUCKET: &str = "crates/tl-parallel/src/bucket.rs";
const DECIDE: &str = "crates/tl-parallel/src/decide.rs";
const SHARD: &str = "crates/tl-parallel/src/shard_step.rs";
const UNIT: &str = "crates/tl-parallel/src/zero3/unit.rs";

/// The pitfalls of L11.3, `d01` to `d18` as in the chapter.
const PITFALLS: &[Pitfall] = &[
    Pitfall {
        id: "d01",
        description: "each rank's gradient weighted 1/N instead of n_r/B",
        package: PARALLEL,
        file: BATCH,
        function: "replica_weight",
        pattern: "Ok(local_rows as f64 / global_rows as f64)",
        replacement: "Ok(1.0 / world_size as f64)",
        course_test: "test_hand_example_weights",
    },
    Pitfall {
        id: "d02",
        description: "the gradients divided by N twice: n_r/B and 1/N again",
        package: PARALLEL,
        file: BATCH,
        function: "replica_weight",
        pattern: "Ok(local_rows as f64 / global_rows as f64)",
        replacement: "Ok(local_rows as f64 / global_rows as f64 / world_size as f64)",
        course_test: "test_hand_example_weights",
    },
    Pitfall {
        id: "d03",
        description: "a rank's last micro-batch reaches into the next rank's rows",
        package: PARALLEL,
        file: BATCH,
        function: "batch_share",
        pattern: ".map(|start| start..(start + micro_batch_rows).min(rows.end))",
        replacement: ".map(|start| start..start + micro_batch_rows)",
        course_test: "test_shares_of_uneven_batches",
    },
    Pitfall {
        id: "d04",
        description: "buckets filled in forward order, the first parameter first",
        package: PARALLEL,
        file: BUCKET,
        function: "plan",
        pattern: "for (param, &numel) in numels.iter().enumerate().rev() {",
        replacement: "for (param, &numel) in numels.iter().enumerate() {",
        course_test: "test_buckets_fill_backwards_and_split",
    },
    Pitfall {
        id: "d05",
        description: "a parameter that does not fit is not split: the bucket overflows",
        package: PARALLEL,
        file: BUCKET,
        function: "plan",
        pattern: "let len = (numel - start).min(capacity - filled);",
        replacement: "let len = numel - start;",
        course_test: "test_buckets_fill_backwards_and_split",
    },
    Pitfall {
        id: "d06",
        description: "the gradients summed without the weights: not divided at all",
        package: PARALLEL,
        file: BUCKET,
        function: "fill_bucket",
        pattern: "run.iter_mut().for_each(|v| *v *= weight);",
        replacement: "let _ = weight;",
        course_test: "test_hand_example_weights",
    },
    Pitfall {
        id: "d07",
        description: "a bucket's sums written back at the start of a parameter split across buckets",
        package: PARALLEL,
        file: BUCKET,
        function: "write_bucket",
        pattern: "param.update_grad(|g| write_run(g, s.start, run));",
        replacement: "param.update_grad(|g| write_run(g, 0, run));",
        course_test: "test_ddp_equals_one_process",
    },
    Pitfall {
        id: "d08",
        description: "every micro-batch's backward reduces (no_sync forgotten)",
        package: PARALLEL,
        file: BUCKET,
        function: "reduces_in_backward",
        pattern: "micro_batch + 1 == micro_batches",
        replacement: "micro_batch < micro_batches",
        course_test: "test_no_collective_before_the_last_backward",
    },
    Pitfall {
        id: "d09",
        description: "the loss scaler decides per rank, from its own gradients",
        package: PARALLEL,
        file: DECIDE,
        function: "all_ranks_finite",
        pattern: "local && !failed && summary.is_some_and(|s| s.nonfinite_ranks == 0)",
        replacement: "local && !failed && summary.is_some()",
        course_test: "test_hand_example_overflow",
    },
    Pitfall {
        id: "d10",
        description: "the clip norm of the local shard",
        package: PARALLEL,
        file: DECIDE,
        function: "global_sum_squares",
        pattern: "if sharded { sum_over_ranks(local) } else { local }",
        replacement: "let _ = (sharded, sum_over_ranks); local",
        course_test: "test_clip_norm_is_global",
    },
    Pitfall {
        id: "d11",
        description: "a shard's piece read from the start of the parameter it cuts",
        package: PARALLEL,
        file: SHARD,
        function: "shard_pieces",
        pattern: "start: run.start + own.start - offset,",
        replacement: "start: run.start,",
        course_test: "test_zero_stages_equal_ddp",
    },
    Pitfall {
        id: "d12",
        description: "ZeRO-1's master copy never loaded from the weights",
        package: PARALLEL,
        file: SHARD,
        function: "take_pieces",
        pattern: "if !param.is_meta() { master.update_value(|v| { read_run(&param.value(), piece.start, v.as_slice_mut().expect(\"1-D\")); }); }",
        replacement: "",
        course_test: "test_zero_stages_equal_ddp",
    },
    Pitfall {
        id: "d13",
        description: "ZeRO-2 keeps the full gradients",
        package: PARALLEL,
        file: SHARD,
        function: "release_copied",
        pattern: "param.set_grad(None);",
        replacement: "",
        course_test: "test_zero2_keeps_only_its_gradient_shard",
    },
    Pitfall {
        id: "d14",
        description: "ZeRO-3 does not release a unit after its forward",
        package: PARALLEL,
        file: UNIT,
        function: "UnitRunner::run_unit",
        pattern: "if !rerun { self.core.borrow().release(unit); }",
        replacement: "",
        course_test: "test_zero3_releases_after_forward_and_backward",
    },
    Pitfall {
        id: "d15",
        description: "ZeRO-3 releases after a checkpointed rerun and gathers again for backward",
        package: PARALLEL,
        file: UNIT,
        function: "UnitRunner::run_unit",
        pattern: "if !rerun { self.core.borrow().release(unit); }",
        replacement: "self.core.borrow().release(unit);",
        course_test: "test_zero3_checkpointed_unit_gathers_for_its_rerun",
    },
    Pitfall {
        id: "d16",
        description: "ZeRO-3 does not release a unit after its backward",
        package: PARALLEL,
        file: UNIT,
        function: "Core::gradient_ready",
        pattern: "self.release(index);",
        replacement: "",
        course_test: "test_zero3_releases_after_forward_and_backward",
    },
    Pitfall {
        id: "d17",
        description: "ZeRO-3 reduces a unit at its first gradient, before its backward is done",
        package: PARALLEL,
        file: UNIT,
        function: "Core::gradient_ready",
        pattern: "let complete = unit.ready == unit.params.len();",
        replacement: "let complete = unit.ready >= 1;",
        course_test: "test_zero_stages_equal_ddp",
    },
    Pitfall {
        id: "d18",
        description: "ZeRO-1 updates the whole model on every rank: the shard ignored",
        package: PARALLEL,
        file: SHARD,
        function: "shard_pieces",
        pattern: "let own = offset.max(shard.start)..(offset + run.len).min(shard.end);",
        replacement: "let own = offset..offset + run.len;",
        course_test: "test_state_per_rank_falls_stage_by_stage",
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chapter_has_fourteen_tests_and_d01_to_d18_in_order() {
        assert_eq!(TESTS.len(), 14);
        let ids: Vec<&str> = PITFALLS.iter().map(|p| p.id).collect();
        let expected: Vec<String> = (1..=18).map(|i| format!("d{i:02}")).collect();
        assert_eq!(ids, expected);
    }
}
