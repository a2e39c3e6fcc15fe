//! Point-to-point messages on the ring: buffered sends that never wait for their receive
//! (two neighbours sending each other more than a socket holds, then receiving), receives
//! matched by tag whatever the arrival order, messages mixed with collectives on the same
//! connections, the counts, and the typed errors of a program whose ranks disagree.
//!
//! The ranks are threads of this process, each with its own sockets (see `support`).

mod support;

use std::time::{Duration, Instant};

use proptest::prelude::*;
use support::thread_world;
use tl_collective::{
    CollectiveError, CommStats, Communicator, MAX_TAG, Phantom, RING_HEADER_BYTES, RingComm,
    Single, Slice, SliceMut,
};

const TIMEOUT: Duration = Duration::from_secs(20);

/// Values of the message `tag` from `rank`: distinct for every sender, tag and position.
fn payload(rank: usize, tag: u32, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (rank * 1_000_000 + tag as usize * 1_000 + i % 1_000) as f32)
        .collect()
}

/// More than a Unix socket's buffers hold (about 200 KiB each way), so that a send that
/// waited for its receive would deadlock.
const BIG: usize = 1 << 20;

#[test]
fn neighbours_send_each_other_more_than_a_socket_holds_then_receive() {
    for n in 2..=4 {
        let seen = thread_world(n, TIMEOUT, |mut comm: RingComm| {
            let rank = comm.rank();
            let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
            comm.send((&payload(rank, 1, BIG)[..]).into(), right, 1)
                .unwrap();
            comm.send((&payload(rank, 2, BIG)[..]).into(), left, 2)
                .unwrap();
            let mut from_left = vec![0.0f32; BIG];
            let mut from_right = vec![0.0f32; BIG];
            comm.recv((&mut from_left[..]).into(), left, 1).unwrap();
            comm.recv((&mut from_right[..]).into(), right, 2).unwrap();
            comm.flush().unwrap();
            assert_eq!(from_left, payload(left, 1, BIG), "rank {rank} of {n}");
            assert_eq!(from_right, payload(right, 2, BIG), "rank {rank} of {n}");
            assert_eq!(comm.messages_waiting(), 0);
            comm.stats()
        });
        let message = RING_HEADER_BYTES + 4 * BIG as u64;
        for stats in seen {
            assert_eq!(
                stats,
                CommStats {
                    collectives: 0,
                    bytes_sent: 2 * message,
                    sends: 2,
                    receives: 2,
                },
                "n {n}"
            );
        }
    }
}

#[test]
fn receives_match_by_tag_and_same_tag_messages_keep_their_order() {
    let got = thread_world(2, TIMEOUT, |mut comm: RingComm| {
        if comm.rank() == 0 {
            for tag in [3, 1, 2, 1] {
                let len = 10 + tag as usize;
                let mut values = payload(0, tag, len);
                values[0] += comm.stats().sends as f32; // tells the two tag-1 messages apart
                comm.send((&values[..]).into(), 1, tag).unwrap();
            }
            comm.flush().unwrap();
            Vec::new()
        } else {
            let mut got = Vec::new();
            for tag in [1, 2, 3, 1] {
                let mut into = vec![0.0f32; 10 + tag as usize];
                comm.recv((&mut into[..]).into(), 0, tag).unwrap();
                got.push(into[0] - payload(0, tag, 1)[0]);
            }
            assert_eq!(comm.messages_waiting(), 0);
            got
        }
    });
    // The sends were the 0th to 3rd: tag 1 first as the 1st, then as the 3rd.
    assert_eq!(got[1], [1.0, 2.0, 0.0, 3.0]);
}

#[test]
fn messages_and_collectives_share_the_connections_in_any_direction() {
    for n in [2, 3, 4] {
        thread_world(n, TIMEOUT, |mut comm: RingComm| {
            let rank = comm.rank();
            let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
            for round in 0..3u32 {
                // Sent before a collective, received after it: the neighbours read them out
                // of the way of the collective's header.
                comm.send((&payload(rank, round, BIG)[..]).into(), right, round)
                    .unwrap();
                comm.send((&payload(rank, 10 + round, 3)[..]).into(), left, 10 + round)
                    .unwrap();
                let mut sum = vec![rank as f64; 1000];
                comm.all_reduce_sum((&mut sum[..]).into()).unwrap();
                let expected = (0..n).sum::<usize>() as f64;
                assert!(sum.iter().all(|&x| x == expected), "n {n} round {round}");
                comm.barrier().unwrap();
                let mut from_left = vec![0.0f32; BIG];
                comm.recv((&mut from_left[..]).into(), left, round).unwrap();
                assert_eq!(from_left, payload(left, round, BIG));
                let mut from_right = [0.0f32; 3];
                comm.recv((&mut from_right[..]).into(), right, 10 + round)
                    .unwrap();
                assert_eq!(from_right[..], payload(right, 10 + round, 3)[..]);
            }
            comm.flush().unwrap();
            assert_eq!(comm.messages_waiting(), 0);
        });
    }
}

#[test]
fn a_rank_sends_itself_f64_and_empty_messages() {
    thread_world(3, TIMEOUT, |mut comm: RingComm| {
        let rank = comm.rank();
        let values = [rank as f64, -0.5];
        comm.send((&values[..]).into(), rank, 4).unwrap();
        comm.send(Slice::F64(&[]), (rank + 1) % 3, 5).unwrap();
        let mut back = [0.0f64; 2];
        comm.recv((&mut back[..]).into(), rank, 4).unwrap();
        assert_eq!(back, values);
        comm.recv(SliceMut::F64(&mut []), (rank + 2) % 3, 5)
            .unwrap();
        // Only the empty message to the right neighbour moved: a frame header (counted as
        // its writer writes it, so surely once flushed).
        comm.flush().unwrap();
        assert_eq!(comm.stats().bytes_sent, RING_HEADER_BYTES);
        let mut never = [0.0f64; 1];
        let err = comm.recv((&mut never[..]).into(), rank, 4).unwrap_err();
        assert!(
            matches!(err, CollectiveError::MessageMismatch { .. }),
            "{err}"
        );
    });
}

#[test]
fn a_message_that_does_not_fit_its_receive_fails_naming_both() {
    let errors = thread_world(2, TIMEOUT, |mut comm: RingComm| {
        if comm.rank() == 0 {
            comm.send((&[1.0f32; 5][..]).into(), 1, 9).unwrap();
            comm.flush().unwrap();
            String::new()
        } else {
            let mut into = [0.0f64; 4];
            let err = comm.recv((&mut into[..]).into(), 0, 9).unwrap_err();
            assert!(matches!(comm.barrier(), Err(CollectiveError::Closed)));
            err.to_string()
        }
    });
    assert_eq!(
        errors[1],
        "the message of rank 0 with tag 9 does not fit its receive: it holds 5 f32 values and \
         the receive's buffer 4 f64"
    );
}

#[test]
fn a_peer_that_begins_a_collective_instead_of_sending_is_an_error_on_both() {
    let errors = thread_world(2, Duration::from_secs(5), |mut comm: RingComm| {
        let err = if comm.rank() == 0 {
            comm.all_reduce_sum((&mut [1.0f32; 3][..]).into())
                .unwrap_err()
        } else {
            comm.recv((&mut [0.0f32; 3][..]).into(), 0, 1).unwrap_err()
        };
        err.to_string()
    });
    assert!(
        errors[1].contains("rank 0 began all_reduce_sum (its call #0) instead of sending it"),
        "{}",
        errors[1]
    );
    // Rank 1 closed its sockets on finding out, so rank 0 learns at once.
    assert!(errors[0].contains("rank 1"), "{}", errors[0]);
}

#[test]
fn a_message_that_never_comes_times_out_naming_the_sender() {
    let bound = Duration::from_millis(300);
    let seen = thread_world(3, bound, |mut comm: RingComm| {
        let rank = comm.rank();
        let start = Instant::now();
        let outcome = if rank == 1 {
            comm.recv((&mut [0.0f32; 2][..]).into(), 2, 0)
        } else {
            // Ranks 0 and 2 wait too, on nothing, then go.
            std::thread::sleep(bound * 3);
            Ok(())
        };
        (outcome.err().map(|e| e.to_string()), start.elapsed())
    });
    let (error, took) = &seen[1];
    let error = error.as_deref().unwrap();
    assert!(
        error.contains("recv") && error.contains("waiting for rank 2"),
        "{error}"
    );
    assert!(*took >= bound && *took < bound * 3, "{took:?}");
}

#[test]
fn a_peer_that_exits_is_an_error_naming_it() {
    let errors = thread_world(2, TIMEOUT, |mut comm: RingComm| {
        if comm.rank() == 0 {
            drop(comm);
            String::new()
        } else {
            comm.recv((&mut [0.0f32; 2][..]).into(), 0, 0)
                .unwrap_err()
                .to_string()
        }
    });
    assert!(
        errors[1].contains("rank 0") && errors[1].contains("recv"),
        "{}",
        errors[1]
    );
}

#[test]
fn misuses_are_refused_before_anything_moves() {
    thread_world(4, TIMEOUT, |mut comm: RingComm| {
        let rank = comm.rank();
        let opposite = (rank + 2) % 4;
        let err = comm.send((&[1.0f32][..]).into(), opposite, 0).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "send: rank {rank} of a ring of 4 is joined to ranks {} and {} only, not to \
                 rank {opposite}",
                (rank + 3) % 4,
                (rank + 1) % 4
            )
        );
        // The refusal closed this rank's ring, as a collective's would.
        assert!(matches!(comm.barrier(), Err(CollectiveError::Closed)));
    });
    thread_world(2, TIMEOUT, |mut comm: RingComm| {
        let err = comm.send(Slice::shape::<f32>(3), 1 - comm.rank(), 0);
        assert!(matches!(
            err,
            Err(CollectiveError::ShapeOnly { op: "send" })
        ));
    });
    let mut single = Single::new();
    let err = single.send((&[1.0f32][..]).into(), 1, 0).unwrap_err();
    assert_eq!(err.to_string(), "invalid destination: 1 (world size 1)");
    let err = single
        .send((&[1.0f32][..]).into(), 0, MAX_TAG + 1)
        .unwrap_err();
    assert!(err.to_string().contains("tag 32768 is over 32767"), "{err}");
}

#[test]
fn a_phantom_counts_what_the_rings_rank_sends() {
    let seen = thread_world(3, TIMEOUT, |mut comm: RingComm| {
        let rank = comm.rank();
        comm.send((&[0.0f32; 100][..]).into(), (rank + 1) % 3, 0)
            .unwrap();
        comm.send((&[0.0f64; 7][..]).into(), (rank + 2) % 3, 1)
            .unwrap();
        comm.send((&[0.0f32; 9][..]).into(), rank, 2).unwrap();
        comm.recv((&mut [0.0f32; 100][..]).into(), (rank + 2) % 3, 0)
            .unwrap();
        comm.recv((&mut [0.0f64; 7][..]).into(), (rank + 1) % 3, 1)
            .unwrap();
        comm.recv((&mut [0.0f32; 9][..]).into(), rank, 2).unwrap();
        comm.flush().unwrap();
        comm.stats()
    });
    for (rank, real) in seen.into_iter().enumerate() {
        let mut phantom = Phantom::new(rank, 3).unwrap();
        phantom
            .send(Slice::shape::<f32>(100), (rank + 1) % 3, 0)
            .unwrap();
        phantom
            .send(Slice::shape::<f64>(7), (rank + 2) % 3, 1)
            .unwrap();
        phantom.send(Slice::shape::<f32>(9), rank, 2).unwrap();
        for (from, tag, shape) in [
            ((rank + 2) % 3, 0, SliceMut::shape::<f32>(100)),
            ((rank + 1) % 3, 1, SliceMut::shape::<f64>(7)),
            (rank, 2, SliceMut::shape::<f32>(9)),
        ] {
            phantom.recv(shape, from, tag).unwrap();
        }
        assert_eq!(phantom.stats(), real, "rank {rank}");
    }
}

/// One message of a random exchange: from rank `from` to its right (or left) neighbour.
#[derive(Clone, Debug)]
struct Sent {
    from: usize,
    rightward: bool,
    tag: u32,
    len: usize,
}

fn exchange() -> impl Strategy<Value = (usize, Vec<Sent>, u64)> {
    (2usize..=4).prop_flat_map(|n| {
        let sent = (0..n, any::<bool>(), 0u32..6, 0usize..70_000).prop_map(
            |(from, rightward, tag, len)| Sent {
                from,
                rightward,
                tag,
                len,
            },
        );
        (Just(n), prop::collection::vec(sent, 1..12), any::<u64>())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Any set of messages between neighbours, sent first and received in a shuffled order
    /// (same-tag messages of one sender in their order), arrives whole and in place.
    #[test]
    fn any_exchange_between_neighbours_arrives((n, sent, seed) in exchange()) {
        let to = |s: &Sent| if s.rightward { (s.from + 1) % n } else { (s.from + n - 1) % n };
        thread_world(n, TIMEOUT, |mut comm: RingComm| {
            let rank = comm.rank();
            for (i, s) in sent.iter().enumerate().filter(|(_, s)| s.from == rank) {
                let values = payload(rank * 100 + i, s.tag, s.len);
                comm.send((&values[..]).into(), to(s), s.tag).unwrap();
            }
            let mut mine: Vec<(usize, &Sent)> =
                sent.iter().enumerate().filter(|(_, s)| to(s) == rank).collect();
            // A shuffle that keeps each (sender, tag)'s messages in order: sort by a key
            // drawn per (sender, tag) pair, stably.
            mine.sort_by_key(|(_, s)| (s.from as u64 * 7 + u64::from(s.tag)).wrapping_mul(seed | 1) >> 7);
            for (i, s) in mine {
                let mut into = vec![0.0f32; s.len];
                comm.recv((&mut into[..]).into(), s.from, s.tag).unwrap();
                assert_eq!(into, payload(s.from * 100 + i, s.tag, s.len));
            }
            comm.flush().unwrap();
            assert_eq!(comm.messages_waiting(), 0);
        });
    }
}
