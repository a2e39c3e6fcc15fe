//! The MPI backend (feature `mpi`): rsmpi over Open MPI, for runs that span machines.
//!
//! [`MpiMode::Native`] calls MPI's own collectives (`MPI_Allreduce`,
//! `MPI_Reduce_scatter_block`, `MPI_Allgatherv`, `MPI_Bcast`), which pick their algorithm by
//! message size and topology, so sums may differ in the last bits between world sizes,
//! message sizes or MPI versions. [`MpiMode::Ring`] runs the ring of
//! [`schedule`](crate::reference_all_reduce) over `MPI_Sendrecv` instead: the same bits as
//! the socket ring on every rank and every run, whatever MPI's tuning.
//!
//! A sum in a 16-bit format ([`ReduceOp::SumIn`]) runs the ring in both modes: MPI has no
//! such reduction, and one written as a user-defined `MPI_Op` would round in whatever order
//! MPI's algorithm adds, while the op is defined by the ring's order (the reference's). Its
//! values travel as 16-bit words (`MPI_UINT16_T`), two bytes each, as on the socket ring.
//!
//! Point-to-point messages are MPI's own, on a duplicate of the communicator (so that a
//! collective's ring step, which receives any tag, never takes one), matched by MPI's tags:
//! a send is an `MPI_Isend` of
//! an owned copy of the frame header and the values (so it returns at once, as the ring's
//! buffered send does), completed by [`flush`](Communicator::flush), by a later send, or
//! when the communicator is dropped; a receive probes for the message, checks its frame
//! against the buffer, and receives it.
//!
//! Failures: with MPI's default error handler a dead rank aborts the whole job (mpirun
//! reports it). A rank that hangs, or a host whose link goes down, tells nobody: every call
//! is bounded by the backend's watchdog ([`mpi_watchdog`](crate::mpi_watchdog)), which
//! names the rank, its host, the call and the peers' hosts, and ends the rank. The bound is
//! `TINYLLM_COMM_TIMEOUT_MS`, else [`DEFAULT_MPI_TIMEOUT`](crate::DEFAULT_MPI_TIMEOUT). A
//! shape-only buffer is refused ([`CollectiveError::ShapeOnly`]) before the call's header
//! is gathered.
//!
//! Threads: MPI is initialised with `MPI_THREAD_MULTIPLE`, so that a communicator may run
//! its calls on a communication thread (tl-parallel's overlap of the gradients' reduction
//! with backward) while the main thread calls another (a tensor-parallel group's). Where the
//! library grants less, the communicator says so ([`Communicator::concurrent_calls`]) and
//! its calls stay on the thread that made it. The calls are MPI's blocking ones on every
//! thread: MPI's non-blocking all-reduce (Open MPI's libnbc) moved the capstone's 39 MiB
//! a step over a 1 Gbit/s link in 0.71 s against the blocking one's 0.49 s. A blocking call
//! spins while it waits; where ranks share cores, `--mca mpi_yield_when_idle 1` makes it
//! yield (docs/data-parallel.md has the figures).

use std::sync::Arc;

use mpi::collective::SystemOperation;
use mpi::datatype::{Equivalence, PartitionMut};
use mpi::environment::{Threading, Universe};
use mpi::point_to_point::send_receive_into;
use mpi::request::{Request, StaticScope};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::{Communicator as _, CommunicatorCollectives as _, Root as _};
use mpi::traits::{Destination as _, Source as _};
use tl_numerics::Format;

use crate::communicator::{CommStats, Communicator, check_root, check_scatter};
use crate::element::{Element, ReduceOp, Slice, SliceMut, check_op, prepare, reduce_name};
use crate::error::{CallHeader, CollectiveError, Result};
use crate::group;
use crate::mpi_watchdog::{DEFAULT_MPI_TIMEOUT, Watchdog, Watched};
use crate::p2p::{self, SEND_OP};
use crate::ring::header::{HEADER_LEN, decode, encode};
use crate::ring::header::{from_words, to_words};
use crate::ring_steps::{
    RingLink, all_gather_step, reduce_scatter_step, ring_all_gather, ring_reduce_scatter,
};
use crate::shard::shard_range;
use crate::wire::{self, Finish, Schedule};

/// Which algorithms [`MpiComm`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MpiMode {
    /// MPI's own collectives: fastest, but the summation order is MPI's. A sum in a 16-bit
    /// format, which MPI does not have, runs the ring all the same.
    Native,
    /// The ring over MPI point-to-point: the socket ring's summation order, deterministic.
    Ring,
}

/// A rank of an MPI job (`mpirun -np N program`).
pub struct MpiComm {
    /// `MPI_COMM_WORLD`, or a group split from it. Declared before the universe: a group's
    /// communicator is freed before MPI is finalised.
    world: SimpleCommunicator,
    /// A duplicate of `world` for the point-to-point messages.
    messages: SimpleCommunicator,
    // Dropping the universe finalises MPI, so it lives as long as the last communicator
    // (the world's and the groups split from it share it).
    _universe: Arc<Universe>,
    mode: MpiMode,
    rank: usize,
    world_size: usize,
    stats: CommStats,
    /// Sends not known to be complete, oldest first.
    in_flight: Vec<InFlight>,
    /// Bounds every call (shared by the world and its groups).
    watchdog: Watchdog,
    /// The host of each rank of the world, by world rank.
    hosts: Arc<Vec<String>>,
    /// Whether MPI granted `MPI_THREAD_MULTIPLE`.
    multiple: bool,
    /// The world rank of each of this communicator's ranks.
    members: Vec<usize>,
}

/// An `MPI_Isend` under way and the buffer it reads, which must outlive it.
struct InFlight {
    request: Option<Request<'static, [u8], StaticScope>>,
    buffer: *mut [u8],
    /// The receiving rank.
    to: usize,
}

impl InFlight {
    /// Starts sending `bytes` to `to` with `tag`.
    fn start(world: &SimpleCommunicator, bytes: Vec<u8>, to: usize, tag: u32) -> Self {
        let buffer: &'static mut [u8] = Box::leak(bytes.into_boxed_slice());
        let pointer: *mut [u8] = buffer;
        // SAFETY: `pointer` is the leaked box, alive until `finish` frees it, which happens
        // only once the request (the only other reference to it) has completed.
        let shared: &'static [u8] = unsafe { &*pointer };
        let request = world.process_at_rank(to as i32).immediate_send_with_tag(
            StaticScope,
            shared,
            tag as i32,
        );
        InFlight {
            request: Some(request),
            buffer: pointer,
            to,
        }
    }

    /// Whether the send completed (without waiting).
    fn done(&mut self) -> bool {
        match self.request.take().map(Request::test) {
            Some(Ok(_)) | None => true,
            Some(Err(request)) => {
                self.request = Some(request);
                false
            }
        }
    }

    /// Waits for the send to complete.
    fn wait(&mut self) {
        if let Some(request) = self.request.take() {
            request.wait();
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.wait();
        // SAFETY: the request has completed, so nothing reads the buffer any more; it was
        // made by `Box::leak` in `start` and is freed only here.
        drop(unsafe { Box::from_raw(self.buffer) });
    }
}

impl Drop for MpiComm {
    /// Completes the sends under way while the communicator and MPI are still alive (the
    /// fields drop after this, the communicator first).
    fn drop(&mut self) {
        let destinations = self.destinations();
        let _watched = self.watch("sent its last messages", &destinations);
        self.in_flight.clear();
    }
}

// SAFETY: MPI's handles (the communicators, the requests of the sends under way) are plain
// values that any thread may pass to MPI once MPI is initialised with MPI_THREAD_MULTIPLE.
// Where it granted less, `concurrent_calls` answers false, and tl-parallel keeps the
// communicator on the thread that made it; nothing else in tinyllm moves one. The buffers
// of the sends under way are owned by their `InFlight` and freed only once MPI is done.
unsafe impl Send for MpiComm {}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("mode", &self.mode)
            .finish()
    }
}

impl MpiComm {
    /// Initialises MPI and joins `MPI_COMM_WORLD`.
    ///
    /// # Errors
    /// [`CollectiveError::Mpi`] if MPI was already initialised in this process.
    pub fn init(mode: MpiMode) -> Result<Self> {
        let (universe, granted) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| CollectiveError::Mpi("MPI is already initialised".into()))?;
        let world = universe.world();
        let (rank, world_size) = (world.rank() as usize, world.size() as usize);
        let timeout = crate::env::timeout_from_env()?.unwrap_or(DEFAULT_MPI_TIMEOUT);
        let watchdog = Watchdog::start(timeout);
        let hosts = {
            let _watched = watchdog.arm(format!(
                "rank {rank} of {world_size} waited for the others to join the job"
            ));
            Arc::new(gather_hosts(&world))
        };
        Ok(MpiComm {
            _universe: Arc::new(universe),
            messages: world.duplicate(),
            world,
            mode,
            rank,
            world_size,
            stats: CommStats::default(),
            in_flight: Vec::new(),
            watchdog,
            hosts,
            multiple: granted == Threading::Multiple,
            members: (0..world_size).collect(),
        })
    }

    /// How long a call may take before the rank gives up.
    pub fn timeout(&self) -> std::time::Duration {
        self.watchdog.timeout()
    }

    /// The host each of this communicator's ranks runs on (MPI's processor name).
    pub fn hosts(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|&w| self.hosts[w].clone())
            .collect()
    }

    /// Watches a call that waits for `peers` (ranks of this communicator) until the guard
    /// drops: see [`mpi_watchdog`](crate::mpi_watchdog).
    fn watch(&self, call: &str, peers: &[usize]) -> Watched {
        let host = |rank: usize| &self.hosts[self.members[rank]];
        let mut waited: Vec<String> = Vec::new();
        for &peer in peers {
            let named = format!("{peer} on {}", host(peer));
            if !waited.contains(&named) {
                waited.push(named);
            }
        }
        let group = if self.world_size == self.hosts.len() {
            String::new()
        } else {
            format!(" (world rank {})", self.members[self.rank])
        };
        self.watchdog.arm(format!(
            "rank {} of {}{group} on {} {call}, waiting for rank{} {}",
            self.rank,
            self.world_size,
            host(self.rank),
            if waited.len() == 1 { "" } else { "s" },
            waited.join(", ")
        ))
    }

    /// Every other rank of this communicator: who a collective waits for.
    fn others(&self) -> Vec<usize> {
        (0..self.world_size).filter(|&r| r != self.rank).collect()
    }

    /// The ranks the sends under way go to.
    fn destinations(&self) -> Vec<usize> {
        let mut to: Vec<usize> = self.in_flight.iter().map(|send| send.to).collect();
        to.sort_unstable();
        to.dedup();
        to
    }

    /// Watches collective `op` (its `seq`-th call on this communicator).
    fn watch_collective(&self, op: &str) -> Watched {
        let others = self.others();
        self.watch(
            &format!("was in {op} (call {} of its group)", self.stats.collectives),
            &others,
        )
    }

    /// The mode in use.
    pub fn mode(&self) -> MpiMode {
        self.mode
    }

    /// Switches the algorithms for the following calls (every rank must switch alike).
    pub fn set_mode(&mut self, mode: MpiMode) {
        self.mode = mode;
    }

    /// Whether the job was started by an MPI launcher (Open MPI's or a PMI one).
    pub fn launched_by_mpirun() -> bool {
        ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
            .iter()
            .any(|v| std::env::var_os(v).is_some())
    }

    /// Checks that every rank makes the same call (an all-gather of five words each).
    fn agree(
        &mut self,
        op: &'static str,
        element: &'static str,
        len: usize,
        root: usize,
    ) -> Result<()> {
        let header = CallHeader {
            op,
            element,
            len,
            root,
            seq: self.stats.collectives,
        };
        self.stats.collectives += 1;
        if self.world_size == 1 {
            return Ok(());
        }
        let own = to_words(&header);
        let mut all = vec![0u64; 5 * self.world_size];
        self.world.all_gather_into(&own[..], &mut all[..]);
        self.stats.bytes_sent += (40 * (self.world_size - 1)) as u64;
        let calls: Vec<CallHeader> = all.chunks(5).map(from_words).collect();
        if calls.iter().any(|c| *c != calls[0]) {
            return Err(CollectiveError::Mismatch { calls });
        }
        Ok(())
    }

    fn optimal_bytes<T>(&mut self, len: usize, passes: usize) {
        let n = self.world_size;
        let bytes = len * size_of::<T>() * passes * (n - 1) / n;
        self.stats.bytes_sent += bytes as u64;
    }

    fn all_reduce_t<T: Element + Equivalence>(
        &mut self,
        data: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let name = reduce_name("all_reduce", op);
        self.agree(name, T::NAME, data.len(), 0)?;
        check_op(op, name)?;
        prepare(op, data);
        if self.world_size == 1 || data.is_empty() {
            return Ok(());
        }
        match self.mode_for(op) {
            MpiMode::Native => {
                let input = data.to_vec();
                self.world.all_reduce_into(&input[..], data, system_op(op));
                self.optimal_bytes::<T>(data.len(), 2);
            }
            MpiMode::Ring => {
                self.ring_reduce_scatter(data, op)?;
                self.ring_all_gather(data, op.format())?;
            }
        }
        Ok(())
    }

    fn reduce_scatter_t<T: Element + Equivalence>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let name = reduce_name("reduce_scatter", op);
        self.agree(name, T::NAME, input.len(), 0)?;
        check_op(op, name)?;
        let (n, rank, len) = (self.world_size, self.rank, input.len());
        if n == 1 {
            output.copy_from_slice(input);
            prepare(op, output);
            return Ok(());
        }
        match self.mode_for(op) {
            MpiMode::Native => {
                // MPI_Reduce_scatter_block wants equal blocks: pad every shard to the longest.
                let block = shard_range(len, n, 0).len();
                let mut padded = vec![T::zeroed(); block * n];
                for q in 0..n {
                    let shard = shard_range(len, n, q);
                    padded[q * block..q * block + shard.len()].copy_from_slice(&input[shard]);
                }
                let mut mine = vec![T::zeroed(); block];
                if block > 0 {
                    self.world
                        .reduce_scatter_block_into(&padded[..], &mut mine[..], system_op(op));
                }
                output.copy_from_slice(&mine[..output.len()]);
                self.optimal_bytes::<T>(len, 1);
            }
            MpiMode::Ring => {
                let mut work = input.to_vec();
                prepare(op, &mut work);
                self.ring_reduce_scatter(&mut work, op)?;
                output.copy_from_slice(&work[shard_range(len, n, rank)]);
            }
        }
        Ok(())
    }

    fn all_gather_t<T: Element + Equivalence>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<()> {
        self.agree("all_gather", T::NAME, output.len(), 0)?;
        let (n, rank, len) = (self.world_size, self.rank, output.len());
        match self.mode {
            MpiMode::Native if n > 1 => {
                let counts: Vec<mpi::Count> = (0..n)
                    .map(|q| shard_range(len, n, q).len() as mpi::Count)
                    .collect();
                let displs: Vec<mpi::Count> = (0..n)
                    .map(|q| shard_range(len, n, q).start as mpi::Count)
                    .collect();
                let mut partition = PartitionMut::new(output, counts, displs);
                self.world.all_gather_varcount_into(input, &mut partition);
                self.optimal_bytes::<T>(len, 1);
            }
            _ => {
                output[shard_range(len, n, rank)].copy_from_slice(input);
                if n > 1 {
                    self.ring_all_gather(output, None)?;
                }
            }
        }
        Ok(())
    }

    fn broadcast_t<T: Element + Equivalence>(&mut self, data: &mut [T], root: usize) -> Result<()> {
        self.agree("broadcast", T::NAME, data.len(), root)?;
        if self.world_size > 1 && !data.is_empty() {
            // A broadcast only copies, so MPI's algorithm is deterministic in either mode.
            self.world.process_at_rank(root as i32).broadcast_into(data);
            if self.rank == root {
                self.stats.bytes_sent += std::mem::size_of_val(data) as u64;
            }
        }
        Ok(())
    }

    /// The algorithms a call of `op` runs: the ring for a sum in a 16-bit format, the
    /// communicator's mode otherwise.
    fn mode_for(&self, op: ReduceOp) -> MpiMode {
        match op {
            ReduceOp::SumIn(_) => MpiMode::Ring,
            ReduceOp::Sum | ReduceOp::Max => self.mode,
        }
    }

    fn ring_reduce_scatter<T: Element + Equivalence>(
        &mut self,
        data: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if let ReduceOp::SumIn(format) = op {
            // As on the socket ring: the shard sent packed, the one received added and
            // rounded from its 16-bit words.
            return self.packed_phase(data, reduce_scatter_step, format, Finish::AddAndRound);
        }
        let (n, rank) = (self.world_size, self.rank);
        ring_reduce_scatter(&mut self.sendrecv(), rank, n, data, op)
    }

    /// The ring's all-gather of `data`'s shards, as 16-bit words of `format` if given (the
    /// shards must hold its values).
    fn ring_all_gather<T: Element + Equivalence>(
        &mut self,
        data: &mut [T],
        format: Option<Format>,
    ) -> Result<()> {
        if let Some(format) = format {
            return self.packed_phase(data, all_gather_step, format, Finish::Unpack);
        }
        let (n, rank) = (self.world_size, self.rank);
        ring_all_gather(&mut self.sendrecv(), rank, n, data)
    }

    /// The ring's steps over `MPI_Sendrecv` with the two neighbours.
    fn sendrecv(&mut self) -> SendRecv<'_> {
        let (n, rank) = (self.world_size, self.rank);
        SendRecv {
            world: &self.world,
            right: ((rank + 1) % n) as i32,
            left: ((rank + n - 1) % n) as i32,
            bytes_sent: &mut self.stats.bytes_sent,
        }
    }

    /// One phase of a sum in `format` over `MPI_Sendrecv` ([`wire::packed_ring_phase`]):
    /// each step's words are finished once the whole shard has arrived.
    fn packed_phase<T: Element>(
        &mut self,
        data: &mut [T],
        schedule: Schedule,
        format: Format,
        finish: Finish,
    ) -> Result<()> {
        let (n, rank) = (self.world_size, self.rank);
        let right = self.world.process_at_rank(((rank + 1) % n) as i32);
        let left = self.world.process_at_rank(((rank + n - 1) % n) as i32);
        let stats = &mut self.stats;
        wire::packed_ring_phase(
            data,
            (rank, n),
            schedule,
            format,
            finish,
            |out, into, words| {
                stats.bytes_sent += size_of_val(out) as u64;
                send_receive_into(out, &right, &mut *into, &left);
                words(0..into.len(), into);
                Ok(())
            },
        )
    }
}

/// Every rank's host (MPI's processor name), by rank: an all-gather of fixed-size names.
fn gather_hosts(world: &SimpleCommunicator) -> Vec<String> {
    const NAME: usize = 256;
    let own = mpi::environment::processor_name().unwrap_or_else(|_| "an unnamed host".into());
    let mut padded = [0u8; NAME];
    let len = own.len().min(NAME);
    padded[..len].copy_from_slice(&own.as_bytes()[..len]);
    let mut all = vec![0u8; NAME * world.size() as usize];
    world.all_gather_into(&padded[..], &mut all[..]);
    all.chunks(NAME)
        .map(|name| {
            let end = name.iter().position(|&b| b == 0).unwrap_or(NAME);
            String::from_utf8_lossy(&name[..end]).into_owned()
        })
        .collect()
}

fn system_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum => SystemOperation::sum(),
        // MPI_MAX with a NaN is implementation-defined: use MpiMode::Ring where NaN matters.
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::SumIn(_) => unreachable!("a sum in a 16-bit format runs the ring"),
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    /// Whether MPI granted `MPI_THREAD_MULTIPLE` (Open MPI does).
    fn concurrent_calls(&self) -> bool {
        self.multiple
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&mut self, data: SliceMut<'_>, op: ReduceOp) -> Result<()> {
        let _watched = self.watch_collective(reduce_name("all_reduce", op));
        match data {
            SliceMut::F32(xs) => self.all_reduce_t(xs, op),
            SliceMut::F64(xs) => self.all_reduce_t(xs, op),
            SliceMut::Shape { .. } => Err(CollectiveError::ShapeOnly {
                op: reduce_name("all_reduce", op),
            }),
        }
    }

    fn reduce_scatter(
        &mut self,
        input: Slice<'_>,
        output: SliceMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        let name = reduce_name("reduce_scatter", op);
        let _watched = self.watch_collective(name);
        let elements = (input.element(), output.element());
        check_scatter(
            name,
            input.len(),
            output.len(),
            elements,
            self.world_size,
            self.rank,
        )?;
        match (input, output) {
            (Slice::F32(x), SliceMut::F32(y)) => self.reduce_scatter_t(x, y, op),
            (Slice::F64(x), SliceMut::F64(y)) => self.reduce_scatter_t(x, y, op),
            (Slice::Shape { .. }, _) | (_, SliceMut::Shape { .. }) => {
                Err(CollectiveError::ShapeOnly { op: name })
            }
            (x, y) => Err(CollectiveError::mismatched_types(
                name,
                x.element(),
                y.element(),
            )),
        }
    }

    fn all_gather(&mut self, input: Slice<'_>, output: SliceMut<'_>) -> Result<()> {
        let name = "all_gather";
        let _watched = self.watch_collective(name);
        let elements = (input.element(), output.element());
        check_scatter(
            name,
            output.len(),
            input.len(),
            elements,
            self.world_size,
            self.rank,
        )?;
        match (input, output) {
            (Slice::F32(x), SliceMut::F32(y)) => self.all_gather_t(x, y),
            (Slice::F64(x), SliceMut::F64(y)) => self.all_gather_t(x, y),
            (Slice::Shape { .. }, _) | (_, SliceMut::Shape { .. }) => {
                Err(CollectiveError::ShapeOnly { op: name })
            }
            (x, y) => Err(CollectiveError::mismatched_types(
                name,
                x.element(),
                y.element(),
            )),
        }
    }

    fn broadcast(&mut self, data: SliceMut<'_>, root: usize) -> Result<()> {
        check_root(root, self.world_size)?;
        let _watched = self.watch_collective("broadcast");
        match data {
            SliceMut::F32(xs) => self.broadcast_t(xs, root),
            SliceMut::F64(xs) => self.broadcast_t(xs, root),
            SliceMut::Shape { .. } => Err(CollectiveError::ShapeOnly { op: "broadcast" }),
        }
    }

    fn barrier(&mut self) -> Result<()> {
        let _watched = self.watch_collective("barrier");
        self.agree("barrier", "-", 0, 0)?;
        self.world.barrier();
        Ok(())
    }

    fn stats(&self) -> CommStats {
        self.stats
    }

    fn send(&mut self, data: Slice<'_>, to: usize, tag: u32) -> Result<()> {
        p2p::check_peer(SEND_OP, self.rank, to, self.world_size, tag, false)?;
        let values = data
            .bytes()
            .ok_or(CollectiveError::ShapeOnly { op: SEND_OP })?;
        let frame = p2p::frame(&data, tag, self.stats.sends);
        let mut bytes = Vec::with_capacity(HEADER_LEN + values.len());
        bytes.extend_from_slice(&encode(&frame));
        bytes.extend_from_slice(values);
        if to != self.rank {
            self.stats.bytes_sent += bytes.len() as u64;
        }
        self.stats.sends += 1;
        // Completed sends free their buffers here, so a long run holds only those under way.
        self.in_flight.retain_mut(|send| !send.done());
        self.in_flight
            .push(InFlight::start(&self.messages, bytes, to, tag));
        Ok(())
    }

    fn recv(&mut self, mut data: SliceMut<'_>, from: usize, tag: u32) -> Result<()> {
        p2p::check_peer("recv", self.rank, from, self.world_size, tag, false)?;
        if data.is_shape() {
            return Err(CollectiveError::ShapeOnly { op: "recv" });
        }
        let _watched = self.watch(&format!("was receiving message {tag}"), &[from]);
        let (message, status) = self
            .messages
            .process_at_rank(from as i32)
            .matched_probe_with_tag(tag as i32);
        let count = status.count(u8::equivalent_datatype()).max(0) as usize;
        let mut bytes = vec![0u8; count];
        message.matched_receive_into(&mut bytes[..]);
        if count < HEADER_LEN {
            return Err(CollectiveError::MessageMismatch {
                from,
                tag,
                reason: format!("it is {count} bytes, shorter than a frame header"),
            });
        }
        let frame = decode(&bytes[..HEADER_LEN]);
        p2p::check_fits(from, tag, frame.element, frame.len, &data)?;
        let into = data.bytes_mut().expect("checked: not shape-only");
        if into.len() != count - HEADER_LEN {
            return Err(CollectiveError::MessageMismatch {
                from,
                tag,
                reason: format!(
                    "its frame says {} bytes of values but {} came",
                    into.len(),
                    count - HEADER_LEN
                ),
            });
        }
        into.copy_from_slice(&bytes[HEADER_LEN..]);
        self.stats.receives += 1;
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        let destinations = self.destinations();
        let _watched = self.watch("was completing its sends", &destinations);
        self.in_flight.clear();
        Ok(())
    }

    /// `MPI_Comm_split` with the group's first member as its colour and the place in the
    /// group as the key, after the exchange that checks the ranks agree.
    fn split(&mut self, members: &[usize]) -> Result<Box<dyn Communicator>> {
        let position = group::check_members(members, self.rank, self.world_size)?;
        let _watched = self.watch_collective("split");
        group::exchange(
            self,
            members,
            &group::record(members, position, Vec::new())?,
        )?;
        let color = Color::with_value(members[0] as i32);
        let group = self
            .world
            .split_by_color_with_key(color, position as i32)
            .ok_or_else(|| CollectiveError::Mpi("MPI_Comm_split gave no communicator".into()))?;
        let (rank, world_size) = (group.rank() as usize, group.size() as usize);
        Ok(Box::new(MpiComm {
            messages: group.duplicate(),
            world: group,
            _universe: Arc::clone(&self._universe),
            mode: self.mode,
            rank,
            world_size,
            stats: CommStats::default(),
            in_flight: Vec::new(),
            watchdog: self.watchdog.clone(),
            hosts: Arc::clone(&self.hosts),
            multiple: self.multiple,
            members: members.iter().map(|&m| self.members[m]).collect(),
        }))
    }
}

/// MPI's [`RingLink`]: one `MPI_Sendrecv` a step, the shard's bytes as `MPI_BYTE`s, handed
/// on whole once they have arrived.
struct SendRecv<'a> {
    world: &'a SimpleCommunicator,
    right: i32,
    left: i32,
    bytes_sent: &'a mut u64,
}

impl RingLink for SendRecv<'_> {
    fn exchange<T: Element>(
        &mut self,
        out: &[T],
        into: &mut [T],
        arrived: &mut dyn FnMut(std::ops::Range<usize>, &[T]),
    ) -> Result<()> {
        *self.bytes_sent += std::mem::size_of_val(out) as u64;
        let (right, left) = (
            self.world.process_at_rank(self.right),
            self.world.process_at_rank(self.left),
        );
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut *into);
        send_receive_into(bytemuck::cast_slice::<T, u8>(out), &right, bytes, &left);
        arrived(0..into.len(), into);
        Ok(())
    }
}
