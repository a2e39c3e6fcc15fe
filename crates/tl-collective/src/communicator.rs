//! The [`Communicator`] trait every backend implements, and its counters.

use crate::element::{ReduceOp, Slice, SliceMut};
use crate::error::{CollectiveError, Result};
use crate::shard::shard_range;

/// Counters of a communicator, for tests and reports ("no collective during the first
/// micro-batches", "bytes sent per step"). Take two readings and subtract.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommStats {
    /// Collective calls made (including barriers and the scalar helpers).
    pub collectives: u64,
    /// Bytes this rank wrote to its peers, headers included (0 for [`Single`](crate::Single);
    /// for MPI's own collectives, the bytes the bandwidth-optimal algorithm would send, since
    /// MPI does not say what it sent; for [`Phantom`](crate::Phantom), what the ring's rank
    /// would have written). A sum in a 16-bit format ([`ReduceOp::SumIn`]) sends its values
    /// as 16-bit words, so it counts 2 bytes an element, as a GPU's bf16 all-reduce sends.
    /// A point-to-point message to another rank counts its 40-byte frame header and its
    /// values on every backend (on the ring as its writer thread writes them: all of them
    /// once [`flush`](Communicator::flush) returns); one to itself moves nothing.
    pub bytes_sent: u64,
    /// Point-to-point messages sent ([`send`](Communicator::send), counted when called).
    pub sends: u64,
    /// Point-to-point messages received ([`recv`](Communicator::recv)).
    pub receives: u64,
}

impl std::ops::Sub for CommStats {
    type Output = CommStats;

    /// What was counted between an earlier reading (`earlier`) and this one.
    fn sub(self, earlier: CommStats) -> CommStats {
        CommStats {
            collectives: self.collectives - earlier.collectives,
            bytes_sent: self.bytes_sent - earlier.bytes_sent,
            sends: self.sends - earlier.sends,
            receives: self.receives - earlier.receives,
        }
    }
}

/// A group of `world_size()` processes that run collectives together: every rank must make
/// the same calls, in the same order, with the same lengths (a disagreement is detected and
/// reported on every rank as [`CollectiveError::Mismatch`]).
///
/// A communicator is [`Send`]: a rank may hand it to a communication thread that runs its
/// calls while the rank computes (the overlap of the gradients' reduction with backward),
/// one call at a time and in the order the rank made them.
///
/// Buffers are type-erased [`Slice`]/[`SliceMut`] views of `&[f32]`/`&[f64]`, made with
/// `.into()`, so that the trait is object-safe and a run can hold a `Box<dyn Communicator>`
/// whatever the backend.
///
/// Sharded collectives use [`shard_range`]: the input of [`all_gather`](Self::all_gather)
/// and the output of [`reduce_scatter`](Self::reduce_scatter) are this rank's shard of the
/// full buffer.
///
/// ```
/// use tl_collective::{Communicator, Single};
///
/// let mut comm: Box<dyn Communicator> = Box::new(Single::new());
/// let mut grads = vec![1.0f32, 2.0, 3.0];
/// comm.all_reduce_sum((&mut grads).into())?;
/// assert_eq!(grads, [1.0, 2.0, 3.0]);
/// assert_eq!(comm.all_reduce_sum_f64(0.5)?, 0.5);
/// # Ok::<(), tl_collective::CollectiveError>(())
/// ```
pub trait Communicator: Send {
    /// This process's rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Whether this communicator's calls may run on another thread at the same time as
    /// other communicators of this process run theirs on the thread that made them (a
    /// tensor-parallel group's beside a data-parallel one's): true of the socket ring, whose
    /// groups own their sockets; for MPI, whether the library granted
    /// `MPI_THREAD_MULTIPLE`. When false, a rank keeps every call on its own thread.
    fn concurrent_calls(&self) -> bool {
        true
    }

    /// Number of processes in the group.
    fn world_size(&self) -> usize;

    /// Reduces `data` elementwise over all ranks, in place: every rank ends with the same
    /// values.
    ///
    /// # Errors
    /// [`CollectiveError::Mismatch`] if the ranks' calls disagree (a different op counts:
    /// [`ReduceOp::Sum`] against [`ReduceOp::SumIn`], or two formats); a peer that exited or
    /// a timeout; [`CollectiveError::Closed`] after an earlier failure;
    /// [`CollectiveError::UnsupportedReduction`] for a sum in an fp8 format.
    fn all_reduce(&mut self, data: SliceMut<'_>, op: ReduceOp) -> Result<()>;

    /// Reduces `input` (the full buffer, same length on every rank) elementwise over all
    /// ranks and writes this rank's shard of the result ([`shard_range`]) to `output`.
    ///
    /// # Errors
    /// [`CollectiveError::BadBuffer`] if `output` is not this rank's shard long or the
    /// element types differ; otherwise as [`all_reduce`](Self::all_reduce).
    fn reduce_scatter(
        &mut self,
        input: Slice<'_>,
        output: SliceMut<'_>,
        op: ReduceOp,
    ) -> Result<()>;

    /// Concatenates every rank's shard: `input` is this rank's shard ([`shard_range`]) of
    /// `output`, which every rank receives whole.
    ///
    /// # Errors
    /// [`CollectiveError::BadBuffer`] if `input` is not this rank's shard of `output` or the
    /// element types differ; otherwise as [`all_reduce`](Self::all_reduce).
    fn all_gather(&mut self, input: Slice<'_>, output: SliceMut<'_>) -> Result<()>;

    /// Copies `data` of rank `root` to every rank.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidRank`] for a root outside the world; otherwise as
    /// [`all_reduce`](Self::all_reduce).
    fn broadcast(&mut self, data: SliceMut<'_>, root: usize) -> Result<()>;

    /// Returns once every rank has entered the barrier.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    fn barrier(&mut self) -> Result<()>;

    /// The counters so far.
    fn stats(&self) -> CommStats;

    /// This rank's group of a split of the world into groups, as `MPI_Comm_split` makes
    /// them: a communicator over `members` (ranks of this communicator; the order gives
    /// their ranks in the group) whose collectives involve only them.
    ///
    /// A collective of the whole communicator: every rank calls it at the same point, each
    /// with the members of its own group, and the groups must partition the world (each
    /// rank in exactly one). The ranks first all-gather what each says of its group and
    /// check that the members of every group agree; then each group forms on its own — its
    /// own ring (sockets in a fresh private directory, the run's secret), its own MPI
    /// communicator, a [`Single`](crate::Single) for a group of one, a
    /// [`Phantom`](crate::Phantom) of the group's size for a phantom. The new communicator
    /// counts its own [`stats`](Self::stats); the exchange counts as one all-gather here.
    ///
    /// ```
    /// use tl_collective::{Communicator, Phantom, SliceMut};
    ///
    /// // Rank 5 of 8 in tensor-parallel pairs {0,1}, {2,3}, {4,5}, {6,7}: rank 1 of a pair.
    /// let mut world = Phantom::new(5, 8)?;
    /// let mut pair = world.split(&[4, 5])?;
    /// assert_eq!((pair.rank(), pair.world_size()), (1, 2));
    /// pair.all_reduce_sum(SliceMut::shape::<f32>(1000))?;
    /// // One header and one of the two shards each way.
    /// assert_eq!(pair.stats().bytes_sent, 40 + 2 * 500 * 4);
    /// # Ok::<(), tl_collective::CollectiveError>(())
    /// ```
    ///
    /// # Errors
    /// [`CollectiveError::BadGroup`] if `members` does not hold this rank, names a rank twice
    /// or one outside the world (found alone; on a ring it closes this communicator, so the
    /// others fail too), or if the members of a group disagree on it (found by every member
    /// after the exchange); the errors of the exchange and of forming the group.
    fn split(&mut self, members: &[usize]) -> Result<Box<dyn Communicator>>;

    /// Sends `data` to rank `to`, labelled `tag`, and returns once the values are copied out
    /// (a buffered send, as `MPI_Bsend`): it never waits for the matching
    /// [`recv`](Self::recv). The bytes go out while this rank waits in any later call of
    /// this communicator; [`flush`](Self::flush) waits until they have all gone.
    ///
    /// Only the two ranks take part, not the world. A rank may send itself a message. On
    /// the ring only the ranks next to this one are reachable: a pipeline's neighbours.
    ///
    /// ```
    /// use tl_collective::{Communicator, Single};
    ///
    /// let mut comm = Single::new();
    /// comm.send((&[1.0f32, 2.0][..]).into(), 0, 7)?;
    /// let mut got = [0.0f32; 2];
    /// comm.recv((&mut got[..]).into(), 0, 7)?;
    /// assert_eq!(got, [1.0, 2.0]);
    /// assert_eq!((comm.stats().sends, comm.stats().receives), (1, 1));
    /// # Ok::<(), tl_collective::CollectiveError>(())
    /// ```
    ///
    /// # Errors
    /// [`CollectiveError::InvalidRank`] for a destination outside the world;
    /// [`CollectiveError::NotNeighbour`] on the ring for a rank not next to this one;
    /// [`CollectiveError::BadBuffer`] for a tag over [`MAX_TAG`](crate::MAX_TAG);
    /// [`CollectiveError::ShapeOnly`] on a backend that moves bytes; a peer that exited
    /// while earlier messages went out; [`CollectiveError::Closed`]. The default, for a
    /// communicator that does not send messages, is [`CollectiveError::BadBuffer`].
    fn send(&mut self, data: Slice<'_>, to: usize, tag: u32) -> Result<()> {
        let _ = (data, to, tag);
        Err(CollectiveError::BadBuffer {
            op: "send",
            reason: "this communicator has no point-to-point messages".into(),
        })
    }

    /// Receives into `data` the message rank `from` sent with `tag`, waiting for it.
    /// Messages are matched by sender and tag, not by arrival: those that come first are
    /// kept for their own receive. Two with the same sender and tag arrive in the order they
    /// were sent.
    ///
    /// # Errors
    /// [`CollectiveError::MessageMismatch`] if the message holds another element type or
    /// length than `data`, or the sender began a collective instead; a receive from this
    /// rank itself of a message it has not sent; [`CollectiveError::Timeout`] when no byte
    /// came within the communicator's timeout; otherwise as [`send`](Self::send).
    fn recv(&mut self, data: SliceMut<'_>, from: usize, tag: u32) -> Result<()> {
        let _ = (data, from, tag);
        Err(CollectiveError::BadBuffer {
            op: "recv",
            reason: "this communicator has no point-to-point messages".into(),
        })
    }

    /// Waits until every message this rank sent has left it (been taken by the peer's end
    /// of the connection, or by MPI).
    ///
    /// # Errors
    /// A peer that exited, or a timeout, while messages were still going out.
    fn flush(&mut self) -> Result<()> {
        Ok(())
    }

    /// [`all_reduce`](Self::all_reduce) with [`ReduceOp::Sum`].
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    fn all_reduce_sum(&mut self, data: SliceMut<'_>) -> Result<()> {
        self.all_reduce(data, ReduceOp::Sum)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) with [`ReduceOp::Sum`].
    ///
    /// # Errors
    /// As [`reduce_scatter`](Self::reduce_scatter).
    fn reduce_scatter_sum(&mut self, input: Slice<'_>, output: SliceMut<'_>) -> Result<()> {
        self.reduce_scatter(input, output, ReduceOp::Sum)
    }

    /// The maximum of one value over all ranks (NaN if any rank has NaN): the global
    /// "did any rank overflow" decision of a loss scaler.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    fn all_reduce_max_f32(&mut self, x: f32) -> Result<f32> {
        let mut buf = [x];
        self.all_reduce(SliceMut::F32(&mut buf), ReduceOp::Max)?;
        Ok(buf[0])
    }

    /// The sum of one f64 over all ranks: the global squared gradient norm of clipping.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    fn all_reduce_sum_f64(&mut self, x: f64) -> Result<f64> {
        let mut buf = [x];
        self.all_reduce(SliceMut::F64(&mut buf), ReduceOp::Sum)?;
        Ok(buf[0])
    }
}

/// Checks the local shapes of a `reduce_scatter` (the output is this rank's shard).
pub(crate) fn check_scatter(
    op: &'static str,
    full: usize,
    shard: usize,
    elements: (&'static str, &'static str),
    world_size: usize,
    rank: usize,
) -> Result<()> {
    if elements.0 != elements.1 {
        return Err(CollectiveError::BadBuffer {
            op,
            reason: format!("input is {} but output is {}", elements.0, elements.1),
        });
    }
    let expected = shard_range(full, world_size, rank).len();
    if shard != expected {
        return Err(CollectiveError::BadBuffer {
            op,
            reason: format!(
                "the shard of rank {rank} of {full} elements over {world_size} ranks has \
                 {expected} elements, got {shard}"
            ),
        });
    }
    Ok(())
}

/// Checks a root.
pub(crate) fn check_root(root: usize, world_size: usize) -> Result<()> {
    if root >= world_size {
        return Err(CollectiveError::InvalidRank {
            what: "root",
            value: root,
            world_size,
        });
    }
    Ok(())
}
