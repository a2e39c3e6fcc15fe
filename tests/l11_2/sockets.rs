//! The steps inside the real thing: `RingComm`, ranks on threads joined by Unix sockets,
//! whose collectives call the ring's steps.

use std::time::Duration;

use tl_collective::{
    Collective, CollectiveError, Communicator, ReduceOp, RingComm, RingConfig,
    reference_all_reduce, ring_bytes_sent,
};

/// Runs `rank_program` on a ring of `n` ranks over sockets, one thread each.
fn sockets<T: Send>(n: usize, rank_program: impl Fn(RingComm) -> T + Sync) -> Vec<T> {
    let dir = tempfile::tempdir().expect("a rendezvous directory");
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (dir, rank_program) = (dir.path(), &rank_program);
                s.spawn(move || {
                    let config = RingConfig::new(rank, n, dir, [7; 32])
                        .expect("a rank")
                        .timeout(Duration::from_secs(20));
                    rank_program(RingComm::connect(config).expect("the ring forms"))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank"))
            .collect()
    })
}

#[test]
fn test_a_large_buffer_over_sockets_is_the_references_with_the_bytes_counted() {
    // 300,001 floats: each step's shard arrives in several pieces of the socket's reads.
    let (n, len) = (3, 300_001);
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|r| {
            (0..len)
                .map(|i| ((i * 31 + r * 7) % 1001) as f32 * 0.125 - 60.0)
                .collect()
        })
        .collect();
    let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
    let want = reference_all_reduce(&refs, ReduceOp::Sum);
    let results = sockets(n, |mut comm| {
        let mut data = inputs[comm.rank()].clone();
        comm.all_reduce((&mut data[..]).into(), ReduceOp::Sum)
            .unwrap();
        (comm.rank(), data, comm.stats().bytes_sent)
    });
    for (rank, data, sent) in results {
        assert!(data == want, "rank {rank} differs from the reference");
        let planned = ring_bytes_sent(Collective::AllReduce, len as u64, 4, n, rank);
        assert_eq!(sent, planned, "rank {rank}");
    }
}

#[test]
fn test_a_rank_that_exits_makes_the_others_fail_with_a_named_error() {
    let results = sockets(3, |mut comm| {
        if comm.rank() == 2 {
            return None; // leaves: its sockets close
        }
        let mut data = vec![1.0f32; 1000];
        Some(comm.all_reduce((&mut data[..]).into(), ReduceOp::Sum))
    });
    for result in results.into_iter().flatten() {
        let error = result.expect_err("a collective with a rank gone fails");
        assert!(
            matches!(
                error,
                CollectiveError::PeerExited { .. } | CollectiveError::Timeout { .. }
            ),
            "{error}"
        );
    }
}
