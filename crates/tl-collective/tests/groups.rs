//! Process groups on the ring: a world split by a mesh into rings of its own, each summing
//! over its members only and sending what a ring of its size sends; splits the ranks
//! disagree on, failing on every rank; a phantom's split counting what the ring's does.
//!
//! The ranks are threads of this process, each with its own sockets, as in tl-parallel's
//! tests: the groups' rings are real rings, formed in directories of their own.

mod support;

use std::time::Duration;

use support::thread_world;
use tl_collective::{
    Axis, Collective, CollectiveError, CommStats, Communicator, Mesh, Phantom, RingComm,
    ring_bytes_sent,
};

const TIMEOUT: Duration = Duration::from_secs(20);

/// The sum over `members` of `rank + 0.25·i` at element `i`: what a group's all-reduce of
/// each member's `values(rank)` gives.
fn values(rank: usize, len: usize) -> Vec<f64> {
    (0..len).map(|i| rank as f64 + 0.25 * i as f64).collect()
}

fn group_sum(members: &[usize], len: usize) -> Vec<f64> {
    (0..len)
        .map(|i| members.iter().map(|&m| values(m, len)[i]).sum())
        .collect()
}

/// What one rank saw: the sums of its groups, and what its communicators sent.
#[derive(Debug)]
struct Seen {
    sums: Vec<(Axis, Vec<usize>, Vec<f64>)>,
    group_stats: Vec<(Axis, usize, usize, CommStats)>,
    world_after: Vec<f64>,
    world_stats: CommStats,
}

const LEN: usize = 11;

fn split_and_reduce(mesh: Mesh, mut comm: RingComm) -> Seen {
    let rank = comm.rank();
    let mut groups = mesh.split(&mut comm).unwrap();
    let mut seen = Seen {
        sums: Vec::new(),
        group_stats: Vec::new(),
        world_after: Vec::new(),
        world_stats: CommStats::default(),
    };
    for axis in Axis::ALL {
        let group = match axis {
            Axis::Data => &mut groups.dp,
            Axis::Tensor => &mut groups.tp,
            Axis::Pipeline => &mut groups.pp,
        };
        let mut buf = values(rank, LEN);
        group.all_reduce_sum((&mut buf).into()).unwrap();
        seen.sums.push((axis, mesh.members(axis, rank), buf));
        seen.group_stats
            .push((axis, group.rank(), group.world_size(), group.stats()));
    }
    // The world's ring still works, and sums over everyone.
    let mut buf = values(rank, LEN);
    comm.all_reduce_sum((&mut buf).into()).unwrap();
    seen.world_after = buf;
    seen.world_stats = comm.stats();
    seen
}

#[test]
fn each_group_of_a_mesh_sums_over_its_members_only() {
    for (dp, tp, pp) in [(2, 2, 1), (1, 4, 1), (2, 1, 2), (2, 2, 2)] {
        let mesh = Mesh::new(dp, tp, pp).unwrap();
        let n = mesh.world_size();
        let seen = thread_world(n, TIMEOUT, |comm| split_and_reduce(mesh, comm));
        for (rank, seen) in seen.iter().enumerate() {
            for (axis, members, sum) in &seen.sums {
                assert_eq!(members.len(), mesh.size(*axis));
                // Sums of small multiples of 0.25: exact in any order.
                assert_eq!(sum, &group_sum(members, LEN), "{mesh} rank {rank} {axis}");
            }
            let all: Vec<usize> = (0..n).collect();
            assert_eq!(seen.world_after, group_sum(&all, LEN), "{mesh} world");
            for &(axis, group_rank, size, stats) in &seen.group_stats {
                assert_eq!(group_rank, mesh.coords(rank).on(axis));
                assert_eq!(size, mesh.size(axis));
                // A ring of the group's size, its own counters: one all-reduce.
                let bytes = ring_bytes_sent(Collective::AllReduce, LEN as u64, 8, size, group_rank);
                assert_eq!(
                    stats,
                    CommStats {
                        collectives: 1,
                        bytes_sent: bytes,
                        ..CommStats::default()
                    },
                    "{mesh} rank {rank} {axis}"
                );
            }
        }
    }
}

#[test]
fn a_phantom_counts_a_split_and_its_groups_as_the_ring_does() {
    let mesh = Mesh::new(2, 2, 1).unwrap();
    let seen = thread_world(4, TIMEOUT, |comm| split_and_reduce(mesh, comm));
    for (rank, seen) in seen.iter().enumerate() {
        let mut phantom = Phantom::new(rank, 4).unwrap();
        let mut groups = mesh.split(&mut phantom).unwrap();
        for &(axis, _, _, ring_stats) in &seen.group_stats {
            let group = match axis {
                Axis::Data => &mut groups.dp,
                Axis::Tensor => &mut groups.tp,
                Axis::Pipeline => &mut groups.pp,
            };
            group
                .all_reduce_sum(tl_collective::SliceMut::shape::<f64>(LEN))
                .unwrap();
            assert_eq!(group.stats(), ring_stats, "rank {rank} {axis}");
        }
        phantom
            .all_reduce_sum(tl_collective::SliceMut::shape::<f64>(LEN))
            .unwrap();
        // Three splits' exchanges and the all-reduce, byte for byte.
        assert_eq!(phantom.stats(), seen.world_stats, "rank {rank} world");
    }
}

#[test]
fn groups_the_ranks_disagree_on_fail_on_every_rank_and_the_world_goes_on() {
    // Rank 0 pairs with rank 1; ranks 1 and 2 pair with each other.
    let outcomes = thread_world(3, TIMEOUT, |mut comm| {
        let members: &[usize] = if comm.rank() == 0 { &[0, 1] } else { &[1, 2] };
        let split = comm.split(members).map(|_| ());
        // Every rank took part in the exchange: the world's ring is intact.
        comm.barrier().unwrap();
        split
    });
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Err(CollectiveError::BadGroup { reason }) => {
                assert!(
                    reason.contains("partition the world"),
                    "rank {rank}: {reason}"
                );
            }
            other => panic!("rank {rank}: expected BadGroup, got {other:?}"),
        }
    }
}

#[test]
fn a_group_without_the_rank_is_refused_at_once_and_the_others_learn_of_it() {
    // Both name the group {1}: right for rank 1, not for rank 0.
    let outcomes = thread_world(2, TIMEOUT, |mut comm| comm.split(&[1]).map(|_| ()));
    match &outcomes[0] {
        Err(CollectiveError::BadGroup { reason }) => {
            assert!(reason.contains("does not hold rank 0"), "{reason}");
        }
        other => panic!("rank 0: expected BadGroup, got {other:?}"),
    }
    // Rank 0 closed its ring before the exchange: rank 1's exchange fails, it does not hang.
    assert!(
        matches!(
            outcomes[1],
            Err(CollectiveError::PeerExited { .. } | CollectiveError::Timeout { .. })
        ),
        "rank 1: {:?}",
        outcomes[1]
    );
}

#[test]
fn a_mesh_that_does_not_cover_the_world_is_refused_before_any_exchange() {
    let outcomes = thread_world(2, TIMEOUT, |mut comm| {
        let mesh = Mesh::new(1, 4, 1).unwrap();
        let err = mesh.split(&mut comm).unwrap_err();
        (err.to_string(), comm.stats().collectives)
    });
    for (text, collectives) in outcomes {
        assert_eq!(
            text,
            "device mesh: dp 1 × tp 4 × pp 1 is 4 ranks, but the world has 2"
        );
        assert_eq!(collectives, 0);
    }
}
