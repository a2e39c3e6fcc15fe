//! The phantom against the ring it stands for: the ring's ranks (threads of this test) make a
//! script of calls and read their counters after each; a `Phantom` of every rank, given the
//! same calls on real buffers and on shape-only ones, must read the same counters after each
//! call, and fail with the same errors. And the ring refuses shape-only buffers without
//! leaving a neighbour waiting.

mod support;

use std::time::Duration;

use support::thread_world;
use tl_collective::{
    CollectiveError, CommStats, Communicator, Element, ElementType, Phantom, ReduceOp, RingComm,
    RingConfig, Slice, SliceMut, shard_range,
};
use tl_numerics::Format;

/// Far longer than any call here takes: a rank that waits this long has hung, and the
/// error says so ([`CollectiveError::Timeout`]) instead of the test hanging.
const TIMEOUT: Duration = Duration::from_secs(60);

/// One call of the script.
#[derive(Clone, Copy, Debug)]
enum Call {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
    Broadcast { root: usize },
    Barrier,
    MaxF32,
    SumF64,
}

/// A call, its element type and its full buffer's length.
#[derive(Clone, Copy, Debug)]
struct Step {
    call: Call,
    element: ElementType,
    len: usize,
}

/// Every collective for lengths 0, 1 and two odd ones (7, 13: uneven shards on 2, 3 and 4
/// ranks, and empty shards for lengths below the world size), f32 and f64, broadcasts from
/// every root, with barriers and the scalar helpers between.
fn script(world_size: usize) -> Vec<Step> {
    let mut steps = Vec::new();
    for element in [ElementType::F32, ElementType::F64] {
        for len in [0, 1, 7, 13] {
            let mut calls = vec![
                Call::AllReduce(ReduceOp::Sum),
                Call::AllReduce(ReduceOp::Max),
                Call::ReduceScatter(ReduceOp::Sum),
                Call::ReduceScatter(ReduceOp::Max),
                Call::AllGather,
            ];
            // Sums in a 16-bit format: 2 bytes an element on the ring's wire.
            for format in Format::SIXTEEN_BIT {
                calls.push(Call::AllReduce(ReduceOp::SumIn(format)));
                calls.push(Call::ReduceScatter(ReduceOp::SumIn(format)));
            }
            calls.extend((0..world_size).map(|root| Call::Broadcast { root }));
            calls.extend([Call::Barrier, Call::MaxF32, Call::SumF64]);
            steps.extend(calls.into_iter().map(|call| Step { call, element, len }));
        }
    }
    steps
}

fn view<T: Element>(xs: &[T], shape: bool) -> Slice<'_> {
    if shape {
        Slice::shape::<T>(xs.len())
    } else {
        xs.into()
    }
}

fn view_mut<T: Element>(xs: &mut [T], shape: bool) -> SliceMut<'_> {
    if shape {
        SliceMut::shape::<T>(xs.len())
    } else {
        xs.into()
    }
}

/// Makes `call` on buffers of `len` elements of `T` (shape-only ones if `shape`).
fn perform_t<T: Element>(
    comm: &mut dyn Communicator,
    call: Call,
    len: usize,
    shape: bool,
) -> tl_collective::Result<()> {
    let own = shard_range(len, comm.world_size(), comm.rank()).len();
    let mut full = vec![T::zeroed(); len];
    let mut shard = vec![T::zeroed(); own];
    match call {
        Call::AllReduce(op) => comm.all_reduce(view_mut(&mut full, shape), op),
        Call::ReduceScatter(op) => {
            comm.reduce_scatter(view(&full, shape), view_mut(&mut shard, shape), op)
        }
        Call::AllGather => comm.all_gather(view(&shard, shape), view_mut(&mut full, shape)),
        Call::Broadcast { root } => comm.broadcast(view_mut(&mut full, shape), root),
        Call::Barrier => comm.barrier(),
        Call::MaxF32 => comm.all_reduce_max_f32(1.5).map(drop),
        Call::SumF64 => comm.all_reduce_sum_f64(1.5).map(drop),
    }
}

fn perform(comm: &mut dyn Communicator, step: Step, shape: bool) -> tl_collective::Result<()> {
    match step.element {
        ElementType::F32 => perform_t::<f32>(comm, step.call, step.len, shape),
        ElementType::F64 => perform_t::<f64>(comm, step.call, step.len, shape),
    }
}

/// The counters before the script and after each of its calls.
fn counters(comm: &mut dyn Communicator, steps: &[Step], shape: bool) -> Vec<CommStats> {
    let mut seen = vec![comm.stats()];
    for &step in steps {
        perform(comm, step, shape).unwrap_or_else(|e| panic!("{step:?}: {e}"));
        seen.push(comm.stats());
    }
    seen
}

#[test]
fn a_phantom_counts_what_its_ring_rank_counts_call_by_call() {
    for world_size in 2..=4 {
        let steps = script(world_size);
        let rings = thread_world(world_size, TIMEOUT, |mut comm| {
            counters(&mut comm, &steps, false)
        });
        for (rank, ring) in rings.iter().enumerate() {
            // The script sends something on every rank: a phantom that counted nothing
            // could not pass.
            assert!(ring.last().unwrap().bytes_sent > 0);
            for shape in [false, true] {
                let mut phantom = Phantom::new(rank, world_size).unwrap();
                let seen = counters(&mut phantom, &steps, shape);
                for (i, (phantom, ring)) in seen.iter().zip(ring).enumerate() {
                    let call = i.checked_sub(1).map(|i| steps[i]);
                    assert_eq!(
                        phantom, ring,
                        "rank {rank} of {world_size}, shape-only {shape}, after {call:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn a_phantom_of_a_world_of_one_counts_calls_and_no_bytes_as_the_ring_does() {
    let steps = script(1);
    let dir = support::rendezvous();
    let config = RingConfig::new(0, 1, dir.path(), [1; 32]).unwrap();
    let ring = counters(&mut RingComm::connect(config).unwrap(), &steps, false);
    for shape in [false, true] {
        let seen = counters(&mut Phantom::new(0, 1).unwrap(), &steps, shape);
        assert_eq!(seen, ring);
    }
    let last = ring.last().unwrap();
    assert_eq!((last.collectives, last.bytes_sent), (steps.len() as u64, 0));
}

/// Calls this rank gets wrong by itself, on a world of two with 7-element buffers (shards of
/// 4 and 3), f32 unless a call says otherwise.
fn misuses(comm: &mut dyn Communicator, shape: bool) -> Vec<String> {
    let own = shard_range(7, 2, comm.rank()).len();
    let full32 = vec![0.0f32; 7];
    let (mut out32, mut out64) = (vec![0.0f32; 7], vec![0.0f64; 7]);
    let mut long = vec![0.0f32; own + 1];
    let (shard32, shard64) = (vec![0.0f32; own], vec![0.0f64; own]);
    let mut shard64_out = vec![0.0f64; own];
    let results = [
        // The output shard one element too long.
        comm.reduce_scatter_sum(view(&full32, shape), view_mut(&mut long, shape)),
        // f32 in, f64 out.
        comm.reduce_scatter(
            view(&full32, shape),
            view_mut(&mut shard64_out, shape),
            ReduceOp::Max,
        ),
        // The input shard one element too long.
        comm.all_gather(view(&long, shape), view_mut(&mut out32, shape)),
        // f64 in, f32 out, and the other way round.
        comm.all_gather(view(&shard64, shape), view_mut(&mut out32, shape)),
        comm.all_gather(view(&shard32, shape), view_mut(&mut out64, shape)),
        // Roots outside the world.
        comm.broadcast(view_mut(&mut out32, shape), 2),
        comm.broadcast(view_mut(&mut out32, shape), usize::MAX),
        // And then a correct call, on a communicator closed by the errors.
        comm.barrier(),
    ];
    results
        .into_iter()
        .map(|result| format!("{:?}", result.expect_err("a misuse")))
        .collect()
}

#[test]
fn a_phantom_refuses_what_the_ring_refuses_with_the_same_errors() {
    let rings = thread_world(2, TIMEOUT, |mut comm| {
        (misuses(&mut comm, false), comm.stats())
    });
    for (rank, (ring, ring_stats)) in rings.iter().enumerate() {
        assert_eq!(ring.last().map(String::as_str), Some("Closed"));
        assert_eq!(*ring_stats, CommStats::default());
        for shape in [false, true] {
            let mut phantom = Phantom::new(rank, 2).unwrap();
            assert_eq!(&misuses(&mut phantom, shape), ring, "shape-only {shape}");
            assert_eq!(phantom.stats(), CommStats::default());
        }
    }
}

/// Every entry point given a shape-only buffer; the counters after.
fn shape_only_calls(comm: &mut RingComm) -> (Vec<String>, CommStats) {
    let own = shard_range(5, comm.world_size(), comm.rank()).len();
    let (full, mut shard) = (vec![0.0f32; 5], vec![0.0f32; own]);
    let results = [
        comm.all_reduce_sum(SliceMut::shape::<f32>(5)),
        comm.all_reduce(SliceMut::shape::<f64>(5), ReduceOp::Max),
        comm.reduce_scatter_sum(Slice::shape::<f32>(5), (&mut shard).into()),
        comm.reduce_scatter_sum((&full).into(), SliceMut::shape::<f32>(own)),
        comm.all_gather(Slice::shape::<f32>(own), SliceMut::shape::<f32>(5)),
        comm.broadcast(SliceMut::shape::<f64>(5), 0),
    ];
    let errors = results
        .into_iter()
        .map(|result| result.expect_err("refused").to_string())
        .collect();
    (errors, comm.stats())
}

#[test]
fn the_ring_refuses_shape_only_buffers_before_any_header_and_closes() {
    let expected = [
        "all_reduce_sum",
        "all_reduce_max",
        "reduce_scatter_sum",
        "reduce_scatter_sum",
        "all_gather",
        "broadcast",
    ]
    .map(|op| {
        format!(
            "{op}: a shape-only buffer has no values to send (only Single and Phantom take one)"
        )
    });
    let runs = thread_world(2, TIMEOUT, |mut comm| {
        let refused = shape_only_calls(&mut comm);
        // A refusal closes the ring, as every local misuse does: a neighbour given real
        // buffers must not wait for a header that will not come.
        let mut real = vec![1.0f32; 3];
        let after = comm.all_reduce_sum((&mut real).into());
        (refused, after)
    });
    for ((errors, stats), after) in runs {
        assert_eq!(errors, expected);
        assert_eq!(stats, CommStats::default(), "no header was sent");
        assert!(matches!(after, Err(CollectiveError::Closed)), "{after:?}");
    }

    // A world of one, with no sockets at all, refuses too.
    let dir = support::rendezvous();
    let config = RingConfig::new(0, 1, dir.path(), [1; 32]).unwrap();
    let (errors, stats) = shape_only_calls(&mut RingComm::connect(config).unwrap());
    assert_eq!(errors, expected);
    assert_eq!(stats, CommStats::default());
}

#[test]
fn a_neighbour_with_real_buffers_fails_at_once_when_one_rank_passes_a_shape() {
    // Rank 0 keeps its communicator (and so its sockets) until rank 1's call has ended: only
    // the refusal itself can tell rank 1, and without it rank 1 would wait out the timeout.
    let both_done = std::sync::Barrier::new(2);
    let runs = thread_world(2, Duration::from_secs(5), |mut comm| {
        let mut real = vec![1.0f32; 5];
        let result = if comm.rank() == 0 {
            comm.all_reduce_sum(SliceMut::shape::<f32>(5))
        } else {
            comm.all_reduce_sum((&mut real).into())
        };
        both_done.wait();
        result
    });
    assert!(
        matches!(
            runs[0],
            Err(CollectiveError::ShapeOnly {
                op: "all_reduce_sum"
            })
        ),
        "{:?}",
        runs[0]
    );
    // The refusing rank closed its sockets: its neighbour learns at once that it left, and
    // does not wait out the timeout.
    assert!(
        matches!(runs[1], Err(CollectiveError::PeerExited { rank: 0, .. })),
        "{:?}",
        runs[1]
    );
}
