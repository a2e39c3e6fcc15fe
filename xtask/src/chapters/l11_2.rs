//! L11.2: collectives over processes, the ring all-reduce. The learner writes the ring's
//! steps, `crates/tl-collective/src/ring_steps.rs`: the schedule of each phase, and
//! reduce-scatter, all-gather and all-reduce over a `RingLink`. The sockets, MPI and
//! everything built on them stay the reference's and call those functions, so a learner's
//! ring runs real processes. The course tests are `tests/l11_2/`.

use super::{Chapter, CourseTest, Kind, LearnerCrate, Pitfall, Sources, test};

/// The chapter.
pub(crate) const L11_2: Chapter = Chapter {
    name: "L11.2",
    title: "Collectives over processes: the ring all-reduce",
    crates: &[LearnerCrate {
        dir: "crates/tl-collective",
        guides: &[("", "docs/course/L11.2.md")],
        starter: STARTER,
        sources: Sources::Only(&["ring_steps.rs"]),
        own_tests: &["--lib", "--test", "ring_steps"],
    }],
    course_package: "tl-course-l11-2",
    test_binary: "l11_2",
    tests: TESTS,
    pitfalls: PITFALLS,
};

/// The learner's starter tests: one worked example of the chapter.
const STARTER: &str = r#"//! Your tests of the ring's steps. `cargo xtask check L11.2` grades them: each of the
//! chapter's planted pitfalls must make at least one of them fail, and cargo-mutants must
//! find them catching at least 80% of the mutants of your ring_steps.rs. Add a test for
//! every rule of docs/course/L11.2.md; `tl_collective::channel_ring` gives you a ring of
//! ranks on threads.

use tl_collective::reduce_scatter_step;

/// A worked example of the chapter (§3): with three ranks, at reduce-scatter step 0 rank 0
/// sends shard 2 and receives shard 1.
#[test]
fn rank_0_of_3_sends_shard_2_and_receives_shard_1_first() {
    assert_eq!(reduce_scatter_step(0, 0, 3), (2, 1));
}
"#;

const S: &str = "schedule";
const C: &str = "collectives";
const K: &str = "sockets";

/// The fourteen tests of L11.2, in the chapter's order.
const TESTS: &[CourseTest] = &[
    test(
        "test_three_ranks_schedule_by_hand",
        S,
        Kind::Unit,
        "§3's send/receive tables for N = 3, both phases",
        "the schedule fixes the order of every sum",
    ),
    test(
        "test_four_ranks_rank_0_sends_3_2_1_then_0_3_2",
        S,
        Kind::Unit,
        "rank 0's sends at N = 4: shards 3, 2, 1, then 0, 3, 2",
        "the second hand example",
    ),
    test(
        "test_every_rank_receives_what_its_left_neighbour_sends",
        S,
        Kind::Property,
        "at every step of both phases, for N up to 8",
        "a send without its receive is a hang on real processes",
    ),
    test(
        "test_shard_c_ends_at_rank_c",
        S,
        Kind::Property,
        "shard c's sum leaves rank c + 1 first, reaches rank c last; the gather starts from it",
        "the owner of a shard is shard_range's, which ZeRO relies on",
    ),
    test(
        "test_shards_of_unequal_length",
        S,
        Kind::Boundary,
        "7 over 3 is 3, 2, 2; 2 over 3 leaves shard 2 empty; 0 is nothing",
        "buffers rarely divide by N",
    ),
    test(
        "test_hand_example_three_ranks_step_by_step",
        C,
        Kind::Unit,
        "§3's tables after every step (rank 0: 111 222 | 303 404 | 5 6 mid-way); 8 elements sent",
        "the partial sums show who contributed, and when",
    ),
    test(
        "test_hand_example_four_ranks",
        C,
        Kind::Unit,
        "1111 2222 … 7777 8888 owned after the reduce-scatter; 12 elements sent",
        "the worked example at N = 4",
    ),
    test(
        "test_all_reduce_equals_the_reference_on_every_rank",
        C,
        Kind::Differential,
        "N = 1..8, lengths 0, 1, N - 1, N, N + 1, 1000: reference_all_reduce's bits, every rank",
        "every rank must hold the same weights",
    ),
    test(
        "test_bytes_sent_meet_the_bound",
        C,
        Kind::Property,
        "each rank sends 2(N - 1)/N of the buffer, N = 2..6; an empty buffer sends nothing",
        "the ring is bandwidth-optimal; plan's bytes are this count",
    ),
    test(
        "test_reduce_scatter_and_all_gather_alone",
        C,
        Kind::Differential,
        "each half against its definition: the owner's shard reduced; every shard from its owner",
        "ZeRO uses the halves on their own",
    ),
    test(
        "test_the_order_shows_in_bf16_and_fp16",
        C,
        Kind::Unit,
        "1 and three half-spacings: 1, 1.015625, 1.015625, 1 in bf16 (1.001953125 in fp16)",
        "where a sum starts decides a 16-bit result",
    ),
    test(
        "test_any_world_and_length_is_the_references_on_every_rank",
        C,
        Kind::Property,
        "any N < 7, length < 70 and piece size: the reference's bits in f64",
        "no size is special",
    ),
    test(
        "test_a_large_buffer_over_sockets_is_the_references_with_the_bytes_counted",
        K,
        Kind::Differential,
        "RingComm over sockets, 300,001 floats in pieces: the reference's bits, ring_bytes_sent's bytes",
        "the learner's steps run real processes",
    ),
    test(
        "test_a_rank_that_exits_makes_the_others_fail_with_a_named_error",
        K,
        Kind::Boundary,
        "a rank leaves mid-collective: the others fail with PeerExited or Timeout, not a hang",
        "a failed rank must stop a job, not freeze it",
    ),
];

const COLLECTIVE: &str = "tl-collective";
const STEPS: &str = "crates/tl-collective/src/ring_steps.rs";

/// The pitfalls of L11.2, `c01` to `c13`.
const PITFALLS: &[Pitfall] = &[
    Pitfall {
        id: "c01",
        description: "reduce-scatter sends r - k and receives r - k - 1 (one step early)",
        package: COLLECTIVE,
        file: STEPS,
        function: "reduce_scatter_step",
        pattern: "(behind(step + 1), behind(step + 2))",
        replacement: "(behind(step), behind(step + 1))",
        course_test: "test_three_ranks_schedule_by_hand",
    },
    Pitfall {
        id: "c02",
        description: "a rank reduces into the shard it has just sent",
        package: COLLECTIVE,
        file: STEPS,
        function: "reduce_scatter_step",
        pattern: "(behind(step + 1), behind(step + 2))",
        replacement: "(behind(step + 1), behind(step + 1))",
        course_test: "test_hand_example_three_ranks_step_by_step",
    },
    Pitfall {
        id: "c03",
        description: "the all-gather starts from shard r - 1, not the rank's own",
        package: COLLECTIVE,
        file: STEPS,
        function: "all_gather_step",
        pattern: "(behind(step), behind(step + 1))",
        replacement: "(behind(step + 1), behind(step + 2))",
        course_test: "test_shard_c_ends_at_rank_c",
    },
    Pitfall {
        id: "c04",
        description: "the schedule counts ahead round the ring, against the direction it sends",
        package: COLLECTIVE,
        file: STEPS,
        function: "reduce_scatter_step",
        pattern: "(rank + 2 * n - back) % n",
        replacement: "(rank + back) % n",
        course_test: "test_every_rank_receives_what_its_left_neighbour_sends",
    },
    Pitfall {
        id: "c05",
        description: "the reduce-scatter runs N steps instead of N - 1",
        package: COLLECTIVE,
        file: STEPS,
        function: "ring_reduce_scatter",
        pattern: "for step in 0..n.saturating_sub(1)",
        replacement: "for step in 0..n",
        course_test: "test_hand_example_three_ranks_step_by_step",
    },
    Pitfall {
        id: "c06",
        description: "the reduce-scatter numbers its steps from 1 (every chunk one step off)",
        package: COLLECTIVE,
        file: STEPS,
        function: "ring_reduce_scatter",
        pattern: "for step in 0..n.saturating_sub(1)",
        replacement: "for step in 1..n",
        course_test: "test_hand_example_four_ranks",
    },
    Pitfall {
        id: "c07",
        description: "the all-gather stops one step short",
        package: COLLECTIVE,
        file: STEPS,
        function: "ring_all_gather",
        pattern: "for step in 0..n.saturating_sub(1)",
        replacement: "for step in 0..n.saturating_sub(2)",
        course_test: "test_all_reduce_equals_the_reference_on_every_rank",
    },
    Pitfall {
        id: "c08",
        description: "the received partial sum overwrites the rank's own instead of adding to it",
        package: COLLECTIVE,
        file: STEPS,
        function: "ring_reduce_scatter",
        pattern: "reduce_into(op, &mut target[at], piece);",
        replacement: "target[at].copy_from_slice(piece);",
        course_test: "test_hand_example_three_ranks_step_by_step",
    },
    Pitfall {
        id: "c09",
        description: "the received partial sum is never added in",
        package: COLLECTIVE,
        file: STEPS,
        function: "ring_reduce_scatter",
        pattern: "reduce_into(op, &mut target[at], piece);",
        replacement: "let _ = (&target, at, piece);",
        course_test: "test_reduce_scatter_and_all_gather_alone",
    },
    Pitfall {
        id: "c10",
        description: "each piece that arrives is added at the shard's start, not at its place",
        package: COLLECTIVE,
        file: STEPS,
        function: "ring_reduce_scatter",
        pattern: "&mut target[at]",
        replacement: "&mut target[..piece.len()]",
        course_test: "test_a_large_buffer_over_sockets_is_the_references_with_the_bytes_counted",
    },
    Pitfall {
        id: "c11",
        description: "shards of n / N elements, the remainder forgotten",
        package: COLLECTIVE,
        file: STEPS,
        function: "ring_reduce_scatter",
        pattern: "vec![T::zeroed(); shard_range(len, n, 0).len()]",
        replacement: "vec![T::zeroed(); len / n.max(1)]",
        course_test: "test_all_reduce_equals_the_reference_on_every_rank",
    },
    Pitfall {
        id: "c12",
        description: "the all-reduce stops after the reduce-scatter",
        package: COLLECTIVE,
        file: STEPS,
        function: "ring_all_reduce",
        pattern: "ring_reduce_scatter(link, rank, world_size, data, op)?; ring_all_gather(link, rank, world_size, data)",
        replacement: "ring_reduce_scatter(link, rank, world_size, data, op)",
        course_test: "test_all_reduce_equals_the_reference_on_every_rank",
    },
    Pitfall {
        id: "c13",
        description: "the all-reduce gathers before it reduces",
        package: COLLECTIVE,
        file: STEPS,
        function: "ring_all_reduce",
        pattern: "ring_reduce_scatter(link, rank, world_size, data, op)?; ring_all_gather(link, rank, world_size, data)",
        replacement: "ring_all_gather(link, rank, world_size, data)?; ring_reduce_scatter(link, rank, world_size, data, op)",
        course_test: "test_hand_example_four_ranks",
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chapter_has_at_least_twelve_tests_and_pitfalls_c01_up() {
        assert!(TESTS.len() >= 12 && PITFALLS.len() >= 12);
        let ids: Vec<&str> = PITFALLS.iter().map(|p| p.id).collect();
        let expected: Vec<String> = (1..=PITFALLS.len()).map(|i| format!("c{i:02}")).collect();
        assert_eq!(ids, expected);
    }
}
