//! The course's collective: N processes of one machine in a ring over Unix-domain sockets.
//!
//! See [`schedule`](crate::schedule) for the order of the steps (and so of the sums) and
//! `link.rs` for how a step streams. Each collective starts with a ring all-gather of a
//! 40-byte header (collective, element type, length, root, call number), so that ranks that
//! disagree all fail with the same [`CollectiveError::Mismatch`]; that costs N−1 small
//! hops of latency per call, nothing in bandwidth. `cost.rs` says what each rank sends.
//!
//! A sum in a 16-bit format ([`ReduceOp::SumIn`]) moves 16-bit words instead of the
//! elements' bytes (see `wire.rs`): both phases of its all-reduce pack the shard they send,
//! so the bytes counted are what a GPU's bf16 all-reduce sends. Packing costs a pass over
//! each shard and a buffer of one shard's words; the f32 and f64 paths send from the buffer
//! itself, copying nothing.

mod accept;
mod cost;
pub(crate) mod handshake;
pub(crate) mod header;
mod link;
mod messages;
pub(crate) mod rendezvous;
mod setup;
mod writer;

use std::ops::Range;

use tl_numerics::Format;

use crate::communicator::{CommStats, Communicator, check_root, check_scatter};
use crate::element::{Element, ReduceOp, Slice, SliceMut, check_op, prepare, reduce_name};
use crate::env::RingConfig;
use crate::error::{CallHeader, CollectiveError, Result};
use crate::group;
use crate::p2p::Inbox;
use crate::ring_steps::{
    RingLink, all_gather_step, reduce_scatter_step, ring_all_gather, ring_all_reduce,
    ring_reduce_scatter,
};
use crate::shard::shard_range;
use crate::wire::{self, Finish, Schedule};
pub use cost::{Collective, RING_HEADER_BYTES, ring_bytes_sent};
use header::exchange_headers;
use link::{Exchange, Link, ReduceExchange, Relay};
pub use rendezvous::{MAX_SOCKET_PATH, socket_path};

/// A rank of the hand-built ring (see the [crate docs](crate) for the environment a launcher
/// sets, and [`RingConfig`] to set it up by hand).
///
/// Sums run in the ring's fixed order ([`reference_all_reduce`](crate::reference_all_reduce)),
/// so every rank ends with the same bits, run after run.
///
/// A call this rank gets wrong by itself (a shard of the wrong length, a root outside the
/// world, a shape-only buffer, which has no values to send) fails before its header is
/// exchanged and closes the communicator, so that the neighbours fail at once too.
#[derive(Debug)]
pub struct RingComm {
    rank: usize,
    world_size: usize,
    /// `None` in a world of one.
    link: Option<Link>,
    seq: u64,
    closed: bool,
    refused: Vec<String>,
    /// The rendezvous directory, for rank 0 to remove after the first collective.
    rendezvous: Option<std::path::PathBuf>,
    /// The run's secret and timeout, for the rings of groups split from this one.
    secret: [u8; 32],
    timeout: std::time::Duration,
    /// Point-to-point messages that came before their receive.
    inbox: Inbox,
    /// Point-to-point messages sent and received.
    sends: u64,
    receives: u64,
}

impl RingComm {
    /// Joins the ring: listens on this rank's socket, connects to the right neighbour and
    /// accepts the left one, refusing (and reporting) any connection without the secret.
    ///
    /// # Errors
    /// [`CollectiveError::Timeout`] if the neighbours do not turn up within the config's
    /// timeout; [`CollectiveError::Refused`] if only strangers did; I/O errors on the
    /// rendezvous directory.
    pub fn connect(config: RingConfig) -> Result<Self> {
        let (link, refused) = if config.world_size == 1 {
            (None, Vec::new())
        } else {
            let (link, refused) = setup::connect(&config)?;
            (Some(link), refused)
        };
        Ok(RingComm {
            rank: config.rank,
            world_size: config.world_size,
            link,
            seq: 0,
            closed: false,
            refused,
            rendezvous: (config.rank == 0).then(|| config.rendezvous.clone()),
            secret: config.secret,
            timeout: config.timeout,
            inbox: Inbox::default(),
            sends: 0,
            receives: 0,
        })
    }

    /// Why each connection refused while the ring formed was refused.
    pub fn refused(&self) -> &[String] {
        &self.refused
    }

    /// Checks the ranks agree on the call, then runs `body`; any failure closes the
    /// communicator (and its sockets, so the neighbours fail at once too).
    fn collective(
        &mut self,
        header: CallHeader,
        body: impl FnOnce(&mut Link, usize, usize) -> Result<()>,
    ) -> Result<()> {
        if self.closed {
            return Err(CollectiveError::Closed);
        }
        self.seq += 1;
        let Some(link) = self.link.as_mut() else {
            return Ok(());
        };
        let (rank, n) = (self.rank, self.world_size);
        let outcome = exchange_headers(link, &mut self.inbox, rank, n, header)
            .and_then(|()| body(link, rank, n));
        if outcome.is_err() {
            self.closed = true;
            link.shutdown();
        } else if let Some(dir) = self.rendezvous.take() {
            // Every rank's header reached us, so every rank has formed its links and removed
            // its socket: the directory is empty and needed by nobody. Removed now, it cannot
            // outlive a launcher that is killed outright.
            rendezvous::remove_if_launchers(&dir);
        }
        outcome
    }

    fn header(
        &self,
        op: &'static str,
        element: &'static str,
        len: usize,
        root: usize,
    ) -> CallHeader {
        CallHeader {
            op,
            element,
            len,
            root,
            seq: self.seq,
        }
    }

    /// Fails and closes on a local misuse, so the neighbours do not wait for a call that will
    /// not come.
    fn local_check(&mut self, check: Result<()>) -> Result<()> {
        if check.is_err() {
            self.close();
        }
        check
    }

    /// Closes the communicator and its sockets.
    fn close(&mut self) {
        self.closed = true;
        if let Some(link) = &self.link {
            link.shutdown();
        }
    }

    /// [`Communicator::split`] on the ring: the group's first member makes a fresh private
    /// directory (as `tinyllm launch` makes the run's), the exchange tells the others where
    /// it is, and the group forms its own ring there, with a secret bound to its members.
    fn split_ring(&mut self, members: &[usize]) -> Result<RingComm> {
        if self.closed {
            return Err(CollectiveError::Closed);
        }
        let position = group::check_members(members, self.rank, self.world_size)
            .inspect_err(|_| self.close())?;
        let meeting = if position == 0 && members.len() > 1 {
            let dir = tempfile::Builder::new()
                .prefix(rendezvous::LAUNCHER_PREFIX)
                .tempdir()
                .map_err(|e| CollectiveError::io("make a group's rendezvous directory", e));
            Some(dir.inspect_err(|_| self.close())?)
        } else {
            None
        };
        let path = meeting.as_ref().map_or_else(Vec::new, |dir| {
            dir.path().as_os_str().as_encoded_bytes().to_vec()
        });
        let own = group::record(members, position, path).inspect_err(|_| self.close())?;
        let first = group::exchange(self, members, &own)?;
        // The first member's path, as its bytes on this machine.
        let dir = std::path::PathBuf::from(
            <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&first.path),
        );
        let config = RingConfig {
            rank: position,
            world_size: members.len(),
            rendezvous: dir,
            secret: group::group_secret(&self.secret, members),
            timeout: self.timeout,
        };
        let ring = RingComm::connect(config)?;
        // Formed: the directory is the group's rank 0's to remove, as a launcher's is.
        if let Some(dir) = meeting {
            let _ = dir.keep();
        }
        Ok(ring)
    }

    /// Refuses a shape-only buffer: it has no values to send. A local misuse like any other,
    /// it closes the communicator, so that a neighbour given real buffers fails at once
    /// instead of waiting for a header that will not come.
    fn refuse_shape(&mut self, op: &'static str) -> Result<()> {
        self.local_check(Err(CollectiveError::ShapeOnly { op }))
    }
}

/// The socket ring's [`RingLink`]: a step streams over the link's two connections, and
/// the received bytes are handed on in whole elements as they arrive (`PIECE` at a time),
/// so that a reduction runs while the rest of the shard is still on the wire.
struct Sockets<'a> {
    link: &'a mut Link,
    name: &'static str,
}

impl RingLink for Sockets<'_> {
    fn exchange<T: Element>(
        &mut self,
        out: &[T],
        into: &mut [T],
        arrived: &mut dyn FnMut(Range<usize>, &[T]),
    ) -> Result<()> {
        let size = std::mem::size_of::<T>();
        let mut flow = ReduceExchange {
            inner: Exchange::new(bytemuck::cast_slice(out), bytemuck::cast_slice_mut(into)),
            element: size,
            reduced: 0,
            reduce: |bytes: Range<usize>, received: &[u8]| {
                // `received` starts at a whole element of a `T` buffer: aligned.
                arrived(
                    bytes.start / size..bytes.end / size,
                    bytemuck::cast_slice(received),
                );
            },
        };
        self.link.pump(self.name, &mut flow)
    }
}

/// Reduce-scatter in place: afterwards this rank's shard of `data` holds the reduction.
fn reduce_scatter_in_place<T: Element>(
    link: &mut Link,
    rank: usize,
    n: usize,
    data: &mut [T],
    op: ReduceOp,
    name: &'static str,
) -> Result<()> {
    if let ReduceOp::SumIn(format) = op {
        let finish = Finish::AddAndRound;
        return packed_phase(
            link,
            (rank, n),
            data,
            reduce_scatter_step,
            format,
            finish,
            name,
        );
    }
    ring_reduce_scatter(&mut Sockets { link, name }, rank, n, data, op)
}

/// One phase of a sum in `format` over the link ([`wire::packed_ring_phase`]): the received
/// words are finished (added and rounded, or unpacked) piece by piece as they arrive, as the
/// f32 path reduces them.
fn packed_phase<T: Element>(
    link: &mut Link,
    ring: (usize, usize),
    data: &mut [T],
    schedule: Schedule,
    format: Format,
    finish: Finish,
    name: &'static str,
) -> Result<()> {
    const WORD: usize = size_of::<u16>();
    wire::packed_ring_phase(data, ring, schedule, format, finish, |out, into, words| {
        let mut flow = ReduceExchange {
            inner: Exchange::new(bytemuck::cast_slice(out), bytemuck::cast_slice_mut(into)),
            element: WORD,
            reduced: 0,
            reduce: |bytes: Range<usize>, received: &[u8]| {
                // `received` starts at an even offset of a `u16` buffer: aligned.
                words(
                    bytes.start / WORD..bytes.end / WORD,
                    bytemuck::cast_slice(received),
                );
            },
        };
        link.pump(name, &mut flow)
    })
}

/// All-gather in place: every rank starts with its own shard of `data` filled. With a
/// `format`, the shards travel as 16-bit values of it (which they must hold).
fn all_gather_wire<T: Element>(
    link: &mut Link,
    rank: usize,
    n: usize,
    data: &mut [T],
    format: Option<Format>,
    name: &'static str,
) -> Result<()> {
    let Some(format) = format else {
        return all_gather_in_place(link, rank, n, data, name);
    };
    packed_phase(
        link,
        (rank, n),
        data,
        all_gather_step,
        format,
        Finish::Unpack,
        name,
    )
}

/// All-gather in place: every rank starts with its own shard of `data` filled.
fn all_gather_in_place<T: Element>(
    link: &mut Link,
    rank: usize,
    n: usize,
    data: &mut [T],
    name: &'static str,
) -> Result<()> {
    ring_all_gather(&mut Sockets { link, name }, rank, n, data)
}

impl RingComm {
    fn all_reduce_t<T: Element>(&mut self, data: &mut [T], op: ReduceOp) -> Result<()> {
        let name = reduce_name("all_reduce", op);
        let header = self.header(name, T::NAME, data.len(), 0);
        self.collective(header, |link, rank, n| {
            prepare(op, data);
            if op.format().is_none() {
                return ring_all_reduce(&mut Sockets { link, name }, rank, n, data, op);
            }
            reduce_scatter_in_place(link, rank, n, data, op, name)?;
            all_gather_wire(link, rank, n, data, op.format(), name)
        })?;
        if self.link.is_none() {
            prepare(op, data);
        }
        Ok(())
    }

    fn reduce_scatter_t<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let name = reduce_name("reduce_scatter", op);
        let header = self.header(name, T::NAME, input.len(), 0);
        self.collective(header, |link, rank, n| {
            // The reduction happens in place, so on a copy of the input.
            let mut work = input.to_vec();
            prepare(op, &mut work);
            reduce_scatter_in_place(link, rank, n, &mut work, op, name)?;
            output.copy_from_slice(&work[shard_range(input.len(), n, rank)]);
            Ok(())
        })?;
        if self.link.is_none() {
            output.copy_from_slice(input);
            prepare(op, output);
        }
        Ok(())
    }

    fn all_gather_t<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        let header = self.header("all_gather", T::NAME, output.len(), 0);
        let own = shard_range(output.len(), self.world_size, self.rank);
        output[own].copy_from_slice(input);
        self.collective(header, |link, rank, n| {
            all_gather_in_place(link, rank, n, output, "all_gather")
        })
    }

    fn broadcast_t<T: Element>(&mut self, data: &mut [T], root: usize) -> Result<()> {
        let header = self.header("broadcast", T::NAME, data.len(), root);
        self.collective(header, |link, rank, n| {
            let mut flow = Relay {
                buf: bytemuck::cast_slice_mut(data),
                receive: rank != root,
                send: (rank + 1) % n != root,
                out_done: 0,
                in_done: 0,
            };
            link.pump("broadcast", &mut flow)
        })
    }
}

impl Communicator for RingComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&mut self, data: SliceMut<'_>, op: ReduceOp) -> Result<()> {
        let check = check_op(op, reduce_name("all_reduce", op));
        self.local_check(check)?;
        match data {
            SliceMut::F32(xs) => self.all_reduce_t(xs, op),
            SliceMut::F64(xs) => self.all_reduce_t(xs, op),
            SliceMut::Shape { .. } => self.refuse_shape(reduce_name("all_reduce", op)),
        }
    }

    fn reduce_scatter(
        &mut self,
        input: Slice<'_>,
        output: SliceMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        let name = reduce_name("reduce_scatter", op);
        let check = check_op(op, name).and_then(|()| {
            check_scatter(
                name,
                input.len(),
                output.len(),
                (input.element(), output.element()),
                self.world_size,
                self.rank,
            )
        });
        self.local_check(check)?;
        match (input, output) {
            (Slice::F32(x), SliceMut::F32(y)) => self.reduce_scatter_t(x, y, op),
            (Slice::F64(x), SliceMut::F64(y)) => self.reduce_scatter_t(x, y, op),
            (Slice::Shape { .. }, _) | (_, SliceMut::Shape { .. }) => self.refuse_shape(name),
            (x, y) => Err(CollectiveError::mismatched_types(
                name,
                x.element(),
                y.element(),
            )),
        }
    }

    fn all_gather(&mut self, input: Slice<'_>, output: SliceMut<'_>) -> Result<()> {
        let check = check_scatter(
            "all_gather",
            output.len(),
            input.len(),
            (input.element(), output.element()),
            self.world_size,
            self.rank,
        );
        self.local_check(check)?;
        match (input, output) {
            (Slice::F32(x), SliceMut::F32(y)) => self.all_gather_t(x, y),
            (Slice::F64(x), SliceMut::F64(y)) => self.all_gather_t(x, y),
            (Slice::Shape { .. }, _) | (_, SliceMut::Shape { .. }) => {
                self.refuse_shape("all_gather")
            }
            (x, y) => Err(CollectiveError::mismatched_types(
                "all_gather",
                x.element(),
                y.element(),
            )),
        }
    }

    fn broadcast(&mut self, data: SliceMut<'_>, root: usize) -> Result<()> {
        let check = check_root(root, self.world_size);
        self.local_check(check)?;
        match data {
            SliceMut::F32(xs) => self.broadcast_t(xs, root),
            SliceMut::F64(xs) => self.broadcast_t(xs, root),
            SliceMut::Shape { .. } => self.refuse_shape("broadcast"),
        }
    }

    fn barrier(&mut self) -> Result<()> {
        // The header all-gather alone: once it is done, every rank has entered.
        let header = self.header("barrier", "-", 0, 0);
        self.collective(header, |_, _, _| Ok(()))
    }

    fn stats(&self) -> CommStats {
        CommStats {
            collectives: self.seq,
            bytes_sent: self.link.as_ref().map_or(0, Link::total_sent),
            sends: self.sends,
            receives: self.receives,
        }
    }

    fn send(&mut self, data: Slice<'_>, to: usize, tag: u32) -> Result<()> {
        self.send_message(data, to, tag)
    }

    fn recv(&mut self, data: SliceMut<'_>, from: usize, tag: u32) -> Result<()> {
        self.recv_message(data, from, tag)
    }

    fn flush(&mut self) -> Result<()> {
        self.flush_messages()
    }

    fn split(&mut self, members: &[usize]) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.split_ring(members)?))
    }
}

impl Drop for RingComm {
    /// Sends what is still queued (within the timeout; a peer that is gone is no error
    /// here), and rank 0 removes a launcher's (or a split's) rendezvous directory if no
    /// collective did: a group that never communicated leaves nothing behind.
    fn drop(&mut self) {
        if !self.closed {
            let _ = self.flush_messages();
        }
        if let Some(dir) = self.rendezvous.take() {
            rendezvous::remove_if_launchers(&dir);
        }
    }
}
