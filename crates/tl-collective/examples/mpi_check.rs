//! The MPI backend's tests, run as the ranks of `mpirun -np N`: every collective in both
//! modes against the sequential reference (bit for bit in the ring mode, to a tolerance in
//! the native one, identical on every rank in both; the sums in bf16 and fp16 bit for bit in
//! both, since they run the ring in both), and ranks that disagree. Exits non-zero (and so
//! does mpirun) on the first failure.
//!
//! ```text
//! cargo build -p tl-collective --features mpi --examples
//! mpirun --allow-run-as-root -np 4 --oversubscribe target/debug/examples/mpi_check
//! ```
//!
//! With `--hang`, the last rank stops answering (it sleeps past `TINYLLM_COMM_TIMEOUT_MS`
//! before a collective): every other rank's watchdog must end it with the error naming
//! the call and the ranks it waited for, with the watchdog's exit status.

use tl_collective::{
    Axis, Collective, CollectiveError, Communicator, Element, Mesh, MpiComm, MpiMode, ReduceOp,
    reference_all_reduce, ring_bytes_sent, shard_range,
};
use tl_numerics::{Format, Round};

fn values(seed: u64, len: usize) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
            unit * [1.0, 1e-3, 1e4, 1e-7][(state % 4) as usize]
        })
        .collect()
}

trait Value: Element + Into<f64> + Round {
    fn from_f64(x: f64) -> Self;
    fn bits(self) -> u64;
}

impl Value for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
}

impl Value for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }
    fn bits(self) -> u64 {
        self.to_bits()
    }
}

fn bits<T: Value>(xs: &[T]) -> Vec<u64> {
    xs.iter().map(|&x| x.bits()).collect()
}

/// Every rank holds the same bits as rank 0.
fn assert_same_on_every_rank<T: Value>(comm: &mut MpiComm, xs: &[T], what: &str) {
    let mut root_copy = xs.to_vec();
    comm.broadcast((&mut root_copy).into(), 0).unwrap();
    assert_eq!(
        bits(xs),
        bits(&root_copy),
        "{what}: rank {} differs from rank 0",
        comm.rank()
    );
}

fn check<T: Value>(comm: &mut MpiComm, len: usize) {
    let (rank, n, mode) = (comm.rank(), comm.world_size(), comm.mode());
    let what = format!("{mode:?} {} len {len}", T::NAME);
    let inputs: Vec<Vec<T>> = (0..n)
        .map(|q| {
            values((q * 1000 + len) as u64, len)
                .into_iter()
                .map(T::from_f64)
                .collect()
        })
        .collect();
    let refs: Vec<&[T]> = inputs.iter().map(Vec::as_slice).collect();
    let expected = reference_all_reduce(&refs, ReduceOp::Sum);
    let close = |got: &[T], want: &[T], i0: usize| {
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let magnitude: f64 = inputs.iter().map(|x| x[i0 + i].into().abs()).sum();
            let eps = if T::NAME == "f32" { 1e-6 } else { 1e-14 };
            let (g, w): (f64, f64) = (g.into(), w.into());
            assert!(
                (g - w).abs() <= eps * magnitude * n as f64,
                "{what}: element {i}: {g} vs {w}"
            );
        }
    };

    let mut buf = inputs[rank].clone();
    comm.all_reduce_sum((&mut buf).into()).unwrap();
    match mode {
        MpiMode::Ring => assert_eq!(bits(&buf), bits(&expected), "{what}: all_reduce_sum"),
        MpiMode::Native => close(&buf, &expected, 0),
    }
    assert_same_on_every_rank(comm, &buf, &what);

    let mut buf = inputs[rank].clone();
    comm.all_reduce((&mut buf).into(), ReduceOp::Max).unwrap();
    assert_eq!(
        bits(&buf),
        bits(&reference_all_reduce(&refs, ReduceOp::Max)),
        "{what}: max"
    );

    let own = shard_range(len, n, rank);
    let mut shard = vec![T::zeroed(); own.len()];
    comm.reduce_scatter_sum((&inputs[rank]).into(), (&mut shard).into())
        .unwrap();
    match mode {
        MpiMode::Ring => assert_eq!(
            bits(&shard),
            bits(&expected[own.clone()]),
            "{what}: reduce_scatter"
        ),
        MpiMode::Native => close(&shard, &expected[own.clone()], own.start),
    }

    let mut gathered = vec![T::zeroed(); len];
    comm.all_gather((&inputs[rank][own]).into(), (&mut gathered).into())
        .unwrap();
    let concatenated: Vec<T> = (0..n)
        .flat_map(|q| inputs[q][shard_range(len, n, q)].to_vec())
        .collect();
    assert_eq!(bits(&gathered), bits(&concatenated), "{what}: all_gather");

    let root = len % n;
    let mut buf = inputs[rank].clone();
    comm.broadcast((&mut buf).into(), root).unwrap();
    assert_eq!(bits(&buf), bits(&inputs[root]), "{what}: broadcast");

    for format in Format::SIXTEEN_BIT {
        check_sum_in(comm, &inputs, format, &what);
    }
}

/// The sum in `format`, in either mode: the ring's bits (the reference's) and its bytes, 2
/// an element, on inputs that are values of the format and on inputs that are not.
fn check_sum_in<T: Value>(comm: &mut MpiComm, inputs: &[Vec<T>], format: Format, what: &str) {
    let (rank, n) = (comm.rank(), comm.world_size());
    let op = ReduceOp::SumIn(format);
    let len = inputs[rank].len();
    for rounded in [true, false] {
        let inputs: Vec<Vec<T>> = inputs
            .iter()
            .map(|x| {
                x.iter()
                    .map(|&v| if rounded { v.round_to(format) } else { v })
                    .collect()
            })
            .collect();
        let refs: Vec<&[T]> = inputs.iter().map(Vec::as_slice).collect();
        let expected = reference_all_reduce(&refs, op);

        let mut buf = inputs[rank].clone();
        let before = comm.stats().bytes_sent;
        comm.all_reduce((&mut buf).into(), op).unwrap();
        assert_eq!(bits(&buf), bits(&expected), "{what}: all_reduce {format}");
        // The header's all-gather counts 40 bytes a peer, as the ring's does.
        let sent = comm.stats().bytes_sent - before;
        let wire = ring_bytes_sent(Collective::AllReduce, len as u64, 2, n, rank);
        assert_eq!(sent, wire, "{what}: all_reduce {format}'s bytes");
        assert_same_on_every_rank(comm, &buf, what);

        let own = shard_range(len, n, rank);
        let mut shard = vec![T::zeroed(); own.len()];
        comm.reduce_scatter((&inputs[rank]).into(), (&mut shard).into(), op)
            .unwrap();
        assert_eq!(
            bits(&shard),
            bits(&expected[own]),
            "{what}: reduce_scatter {format}"
        );
    }
}

/// Groups of a mesh (tensor-parallel pairs when the world is even): each group's
/// all-reduce sums over its members only, in both modes, and the world goes on after.
fn check_groups(comm: &mut MpiComm) {
    let (rank, n) = (comm.rank(), comm.world_size());
    let tp = if n.is_multiple_of(2) { 2 } else { 1 };
    let mesh = Mesh::for_world(n, tp, 1).unwrap();
    let mut groups = mesh.split(comm).unwrap();
    for (axis, group) in [(Axis::Tensor, &mut groups.tp), (Axis::Data, &mut groups.dp)] {
        let members = mesh.members(axis, rank);
        assert_eq!(group.world_size(), members.len(), "{axis}");
        assert_eq!(group.rank(), mesh.coords(rank).on(axis), "{axis}");
        let mut buf: Vec<f64> = (0..9).map(|i| (rank * 16 + i) as f64).collect();
        group.all_reduce_sum((&mut buf).into()).unwrap();
        let want: Vec<f64> = (0..9)
            .map(|i| members.iter().map(|&m| (m * 16 + i) as f64).sum())
            .collect();
        assert_eq!(buf, want, "rank {rank}: the {axis} group's sum");
    }
    // Ranks that disagree on their group: the same typed error everywhere.
    let members: Vec<usize> = if rank == 0 { vec![0] } else { (0..n).collect() };
    match comm.split(&members) {
        Err(CollectiveError::BadGroup { .. }) if n > 1 => {}
        Ok(_) if n == 1 => {}
        other => panic!(
            "rank {rank}: expected BadGroup, got {:?}",
            other.map(|_| ())
        ),
    }
    comm.barrier().unwrap();
}

/// Point-to-point messages: every rank sends its neighbours more than MPI sends eagerly,
/// in both directions, before receiving; receives taken out of order by tag; a message that
/// does not fit its receive refused naming both.
fn check_messages(comm: &mut MpiComm) {
    let (rank, n) = (comm.rank(), comm.world_size());
    let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
    let message = |from: usize, tag: u32| -> Vec<f32> {
        (0..(1usize << 20) + tag as usize)
            .map(|i| (from * 1000 + tag as usize + i % 97) as f32)
            .collect()
    };
    comm.send((&message(rank, 1)[..]).into(), right, 1).unwrap();
    comm.send((&message(rank, 2)[..]).into(), left, 2).unwrap();
    comm.send((&message(rank, 3)[..]).into(), right, 3).unwrap();
    for (from, tag) in [(left, 3), (right, 2), (left, 1)] {
        let mut into = vec![0.0f32; message(from, tag).len()];
        comm.recv((&mut into[..]).into(), from, tag).unwrap();
        assert_eq!(
            into,
            message(from, tag),
            "rank {rank}: message {tag} of rank {from}"
        );
    }
    comm.flush().unwrap();
    let stats = comm.stats();
    assert_eq!((stats.sends, stats.receives), (3, 3));
    comm.send((&[1.0f64; 3][..]).into(), right, 4).unwrap();
    let mut wrong = [0.0f32; 3];
    match comm.recv((&mut wrong[..]).into(), left, 4) {
        Err(CollectiveError::MessageMismatch { from, tag: 4, .. }) => assert_eq!(from, left),
        other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
    }
    comm.flush().unwrap();
    comm.barrier().unwrap();
}

fn main() {
    let mut comm = MpiComm::init(MpiMode::Ring).expect("MPI");
    let n = comm.world_size();
    if std::env::args().any(|arg| arg == "--hang") {
        if comm.rank() == n - 1 {
            std::thread::sleep(comm.timeout() * 3);
        }
        comm.barrier().unwrap();
        panic!(
            "rank {}: the barrier returned without its last rank",
            comm.rank()
        );
    }
    check_messages(&mut comm);
    for mode in [MpiMode::Ring, MpiMode::Native] {
        comm.set_mode(mode);
        check_groups(&mut comm);
        for len in [
            0,
            1,
            n.saturating_sub(1),
            n + 1,
            37 * n + n / 2 + 1,
            786_433,
        ] {
            check::<f32>(&mut comm, len);
            check::<f64>(&mut comm, len);
        }
        assert_eq!(
            comm.all_reduce_max_f32(comm.rank() as f32).unwrap(),
            (n - 1) as f32
        );
        let total = comm.all_reduce_sum_f64(1.0).unwrap();
        assert_eq!(total, n as f64);
        comm.barrier().unwrap();
    }
    // A sum against a sum in bf16: the same typed error on every rank.
    let mut buf = vec![1.0f32; 6];
    let op = match comm.rank() {
        0 => ReduceOp::Sum,
        _ => ReduceOp::SumIn(Format::Bf16),
    };
    match comm.all_reduce((&mut buf).into(), op) {
        Err(CollectiveError::Mismatch { calls }) if n > 1 => {
            assert_eq!(
                (calls[0].op, calls[1].op),
                ("all_reduce_sum", "all_reduce_sum_bf16")
            );
        }
        Ok(()) if n == 1 => {}
        other => panic!("rank {}: expected a mismatch, got {other:?}", comm.rank()),
    }
    // A sum in fp8, made by every rank: refused on every rank after the header, so the
    // communicator goes on.
    let mut buf = vec![1.0f32; 6];
    match comm.all_reduce((&mut buf).into(), ReduceOp::SumIn(Format::E4M3)) {
        Err(CollectiveError::UnsupportedReduction { format, .. }) => {
            assert_eq!(format, Format::E4M3)
        }
        other => panic!("rank {}: expected a refusal, got {other:?}", comm.rank()),
    }
    comm.barrier().unwrap();
    // Lengths that disagree: the same typed error on every rank, and the communicator
    // still works afterwards (every rank stopped at the header).
    let mut buf = vec![0.0f64; if comm.rank() == 0 { 10 } else { 12 }];
    match comm.all_reduce_sum((&mut buf).into()) {
        Err(CollectiveError::Mismatch { calls }) if n > 1 => assert_eq!(calls[0].len, 10),
        Ok(()) if n == 1 => {}
        other => panic!("rank {}: expected a mismatch, got {other:?}", comm.rank()),
    }
    comm.barrier().unwrap();
    if comm.rank() == 0 {
        println!("mpi_check: {n} ranks, ring and native modes, messages: ok");
    }
}
