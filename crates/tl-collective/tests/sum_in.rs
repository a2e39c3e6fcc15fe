//! The sum in a 16-bit format ([`ReduceOp::SumIn`]) on the ring, its ranks run as threads:
//! the reference's bits on 1 to 4 ranks, the worked example of the docs, 2 bytes an element
//! on the wire (what a `Phantom` counts too), and ranks that disagree on the op.

mod support;

use std::time::Duration;

use support::{thread_world, values};
use tl_collective::{
    Collective, CollectiveError, Communicator, Element, Phantom, ReduceOp, RingComm, Single,
    reference_all_reduce, ring_bytes_sent, shard_range,
};
use tl_numerics::{Format, Round};

const TIMEOUT: Duration = Duration::from_secs(60);

fn bits<T: Element + Into<f64>>(xs: &[T]) -> Vec<u64> {
    xs.iter().map(|&x| x.into().to_bits()).collect()
}

/// Every rank's input of `len` values of `T`: the test values, rounded to `format` when
/// `representable` (what a rounded matmul output is), as they are otherwise (the op rounds
/// them first).
fn inputs<T: Element + From<f32>>(
    n: usize,
    len: usize,
    format: Format,
    representable: bool,
) -> Vec<Vec<T>> {
    (0..n)
        .map(|q| {
            values((q * 7919 + len) as u64, len)
                .into_iter()
                .map(|x| {
                    let x = T::from(x as f32);
                    if representable { x.round_to(format) } else { x }
                })
                .collect()
        })
        .collect()
}

/// The all-reduce and the reduce-scatter of `op` on this rank against the reference, bit
/// for bit, and what each sent.
fn check<T: Element + From<f32> + Into<f64>>(
    comm: &mut RingComm,
    format: Format,
    len: usize,
    representable: bool,
) {
    let (rank, n) = (comm.rank(), comm.world_size());
    let op = ReduceOp::SumIn(format);
    let inputs = inputs::<T>(n, len, format, representable);
    let refs: Vec<&[T]> = inputs.iter().map(Vec::as_slice).collect();
    let expected = reference_all_reduce(&refs, op);
    let what = format!("{format} {} len {len} on {n} ranks", T::NAME);
    for &x in &expected {
        assert_eq!(
            x.round_to(format).into().to_bits(),
            x.into().to_bits(),
            "{what}"
        );
    }

    let mut buf = inputs[rank].clone();
    let before = comm.stats().bytes_sent;
    comm.all_reduce((&mut buf).into(), op).unwrap();
    assert_eq!(bits(&buf), bits(&expected), "{what}: all_reduce");
    let sent = comm.stats().bytes_sent - before;
    let wire = ring_bytes_sent(Collective::AllReduce, len as u64, 2, n, rank);
    assert_eq!(sent, wire, "{what}: 2 bytes an element");

    let own = shard_range(len, n, rank);
    let mut shard = vec![T::zeroed(); own.len()];
    let before = comm.stats().bytes_sent;
    comm.reduce_scatter((&inputs[rank]).into(), (&mut shard).into(), op)
        .unwrap();
    assert_eq!(bits(&shard), bits(&expected[own]), "{what}: reduce_scatter");
    let sent = comm.stats().bytes_sent - before;
    let wire = ring_bytes_sent(Collective::ReduceScatter, len as u64, 2, n, rank);
    assert_eq!(sent, wire, "{what}: reduce_scatter's bytes");
}

#[test]
fn the_ring_sums_in_16_bits_as_the_reference_does_on_one_to_four_ranks() {
    for n in 1..=4 {
        thread_world(n, TIMEOUT, |mut comm| {
            for format in Format::SIXTEEN_BIT {
                for len in [0, 1, n + 1, 37 * n + 3, 100_003] {
                    for representable in [true, false] {
                        check::<f32>(&mut comm, format, len, representable);
                        check::<f64>(&mut comm, format, len, representable);
                    }
                }
            }
        });
    }
}

#[test]
fn the_worked_example_rounds_at_every_hop() {
    // Rank 1 holds 1, the others 2^-8 (half the bf16 spacing at 1); element c starts its
    // sum at rank c + 1. See `reference_all_reduce` and docs/mixed-precision.md.
    let small = 2f32.powi(-8);
    let results = thread_world(4, TIMEOUT, |mut comm| {
        let mut buf = vec![if comm.rank() == 1 { 1.0f32 } else { small }; 4];
        comm.all_reduce((&mut buf).into(), ReduceOp::SumIn(Format::Bf16))
            .unwrap();
        let mut exact = vec![if comm.rank() == 1 { 1.0f32 } else { small }; 4];
        comm.all_reduce_sum((&mut exact).into()).unwrap();
        (buf, exact)
    });
    for (buf, exact) in results {
        // 1 first: three ties to the even 1. 1 last: 1 + 3·2^-8, a tie to 1 + 2^-6.
        assert_eq!(buf, [1.0, 1.015625, 1.015625, 1.0]);
        // In f32 every order is exact; one rounding of it gives 1 + 2^-6 everywhere.
        assert_eq!(exact, [1.0 + 3.0 * small; 4]);
        let once: Vec<f32> = exact.iter().map(|x| x.round_to(Format::Bf16)).collect();
        assert_eq!(once, [1.015625; 4]);
    }
}

#[test]
fn a_16_bit_sum_sends_half_the_bytes_of_an_f32_one() {
    let len = 1000;
    let sent = thread_world(4, TIMEOUT, |mut comm| {
        let mut buf = vec![0.5f32; len];
        let start = comm.stats().bytes_sent;
        comm.all_reduce_sum((&mut buf).into()).unwrap();
        let after_f32 = comm.stats().bytes_sent;
        comm.all_reduce((&mut buf).into(), ReduceOp::SumIn(Format::Fp16))
            .unwrap();
        (after_f32 - start, comm.stats().bytes_sent - after_f32)
    });
    for (rank, (f32_bytes, fp16_bytes)) in sent.into_iter().enumerate() {
        // Shards of 250: 1500 elements sent, after three 40-byte headers.
        assert_eq!((f32_bytes, fp16_bytes), (120 + 1500 * 4, 120 + 1500 * 2));
        let mut phantom = Phantom::new(rank, 4).unwrap();
        phantom
            .all_reduce(
                tl_collective::SliceMut::shape::<f64>(len),
                ReduceOp::SumIn(Format::Bf16),
            )
            .unwrap();
        assert_eq!(
            phantom.stats().bytes_sent,
            fp16_bytes,
            "whatever the element type"
        );
    }
}

#[test]
fn ranks_that_disagree_on_the_op_all_fail_with_a_mismatch() {
    for other in [ReduceOp::Sum, ReduceOp::SumIn(Format::Fp16)] {
        let errors = thread_world(3, TIMEOUT, |mut comm| {
            let op = match comm.rank() {
                0 => other,
                _ => ReduceOp::SumIn(Format::Bf16),
            };
            let mut buf = vec![1.0f32; 5];
            comm.all_reduce((&mut buf).into(), op).unwrap_err()
        });
        for (rank, error) in errors.into_iter().enumerate() {
            let CollectiveError::Mismatch { calls } = error else {
                panic!("rank {rank}: {error}");
            };
            assert_eq!(calls[1].op, "all_reduce_sum_bf16");
            assert_eq!(
                calls[0].op,
                if other == ReduceOp::Sum {
                    "all_reduce_sum"
                } else {
                    "all_reduce_sum_fp16"
                }
            );
        }
    }
    // A reduce-scatter too.
    let errors = thread_world(2, TIMEOUT, |mut comm| {
        let op = [ReduceOp::Sum, ReduceOp::SumIn(Format::Bf16)][comm.rank()];
        let mut shard = vec![0.0f64; 2];
        comm.reduce_scatter((&[1.0f64; 4][..]).into(), (&mut shard).into(), op)
            .unwrap_err()
    });
    for error in errors {
        assert!(matches!(error, CollectiveError::Mismatch { .. }), "{error}");
    }
}

#[test]
fn an_fp8_sum_is_refused_on_every_backend() {
    for format in Format::FP8 {
        let op = ReduceOp::SumIn(format);
        let errors = thread_world(2, TIMEOUT, |mut comm| {
            let mut buf = vec![1.0f32; 4];
            let refused = comm.all_reduce((&mut buf).into(), op).unwrap_err();
            // A local misuse closes the ring rank, as any other does.
            let closed = comm.barrier().unwrap_err();
            (refused, closed)
        });
        for (refused, closed) in errors {
            assert!(
                matches!(refused, CollectiveError::UnsupportedReduction { format: f, .. } if f == format),
                "{refused}"
            );
            assert!(matches!(closed, CollectiveError::Closed), "{closed}");
        }
        let comms: [Box<dyn Communicator>; 2] = [
            Box::new(Single::new()),
            Box::new(Phantom::new(0, 2).unwrap()),
        ];
        for mut comm in comms {
            let mut buf = vec![1.0f64; 4];
            let error = comm.all_reduce((&mut buf).into(), op).unwrap_err();
            assert_eq!(
                error.to_string(),
                format!(
                    "all_reduce_sum_{format}: no sum in {format} (only bf16 and fp16 have a 16-bit sum)"
                )
            );
        }
    }
}

#[test]
fn a_world_of_one_and_a_phantom_round_their_values_to_the_format() {
    let op = ReduceOp::SumIn(Format::Bf16);
    let mut single = Single::new();
    let mut buf = vec![1.01f32, -3.0];
    single.all_reduce((&mut buf).into(), op).unwrap();
    assert_eq!(buf, [1.0078125, -3.0]);
    let mut phantom = Phantom::new(1, 2).unwrap();
    let mut shard = vec![0.0f64; 1];
    phantom
        .reduce_scatter((&[5.0f64, 1.01][..]).into(), (&mut shard).into(), op)
        .unwrap();
    assert_eq!(shard, [1.0078125]);
}
