//! The ring's steps: which shard each rank sends and receives at each step, and the
//! reduce-scatter, all-gather and all-reduce that follow them over a [`RingLink`]. This is
//! the part of tl-collective that chapter L11.2 has a learner write
//! ([docs/course/L11.2.md](../../docs/course/L11.2.md)); the sockets and MPI underneath
//! (the links) and everything built on top stay as they are, and call these functions.
//!
//! Ranks sit in a ring, each sending to `rank + 1` and receiving from `rank − 1` (mod N).
//! Reduce-scatter takes N − 1 steps: at step k rank r sends shard r − k − 1 and receives
//! shard r − k − 2, which it reduces into its own copy. So the partial sum of shard c
//! starts at rank c + 1, goes once round the ring, and ends, complete, at rank c, the owner
//! that [`shard_range`] names. All-gather takes N − 1 more steps: at step k rank r sends
//! shard r − k (complete) and receives shard r − k − 1. Each step moves one shard per rank,
//! so an all-reduce sends 2(N − 1)/N of the buffer per rank, the least any all-reduce can.

use std::ops::Range;

use crate::element::{Element, ReduceOp, reduce_into};
use crate::error::Result;
use crate::shard::{shard_range, split_pair};

/// What a ring step needs from the wire: one exchange with both neighbours at once. The
/// socket ring and MPI implement it; a learner's tests can implement it over channels.
pub trait RingLink {
    /// Sends `out` to the right neighbour (rank + 1) while as many elements as `into` holds
    /// arrive from the left one (rank − 1) into `into`. Each time a further run of whole
    /// elements has arrived, `arrived(range, piece)` is called with its place in `into`
    /// and its values: the runs come in order and cover `into` exactly once (one run, or
    /// several as the bytes stream in).
    ///
    /// # Errors
    /// The link's errors (a neighbour gone, a timeout); the collective then fails.
    fn exchange<T: Element>(
        &mut self,
        out: &[T],
        into: &mut [T],
        arrived: &mut dyn FnMut(Range<usize>, &[T]),
    ) -> Result<()>;
}

/// The shard rank `rank` of `world_size` sends at reduce-scatter step `step`
/// (0 ≤ step < N − 1), and the one it receives: `(r − step − 1, r − step − 2)`, mod N.
/// See docs/course/L11.2.md §2.1.
///
/// ```
/// use tl_collective::reduce_scatter_step;
///
/// // Four ranks, step 0: rank 1 sends shard 0 and receives shard 3.
/// assert_eq!(reduce_scatter_step(1, 0, 4), (0, 3));
/// // Step 2, the last: rank 1 sends shard 2 and receives shard 1, its own, now complete.
/// assert_eq!(reduce_scatter_step(1, 2, 4), (2, 1));
/// ```
pub fn reduce_scatter_step(rank: usize, step: usize, world_size: usize) -> (usize, usize) {
    let n = world_size;
    let behind = |back: usize| (rank + 2 * n - back) % n;
    (behind(step + 1), behind(step + 2))
}

/// The shard rank `rank` of `world_size` sends at all-gather step `step`
/// (0 ≤ step < N − 1), and the one it receives: `(r − step, r − step − 1)`, mod N. A rank
/// starts by sending the shard it owns, complete after the reduce-scatter. See
/// docs/course/L11.2.md §2.1.
///
/// ```
/// use tl_collective::all_gather_step;
///
/// assert_eq!(all_gather_step(1, 0, 4), (1, 0));
/// assert_eq!(all_gather_step(1, 2, 4), (3, 2));
/// ```
pub fn all_gather_step(rank: usize, step: usize, world_size: usize) -> (usize, usize) {
    let n = world_size;
    let behind = |back: usize| (rank + 2 * n - back) % n;
    (behind(step), behind(step + 1))
}

/// The ring's reduce-scatter of `data` (this rank's whole buffer, every rank's of the same
/// length) in place: afterwards `data[shard_range(len, N, rank)]` holds the reduction by
/// `op` of every rank's shard, summed in the ring's order, `x[c] ⊕ (… ⊕ (x[c+2] ⊕
/// x[c+1]))` for shard c; the rest of `data` holds partial sums. N − 1 steps, each sending
/// one shard ([`reduce_scatter_step`]) and reducing the shard received into this rank's
/// copy of it (not into the one just sent). Shards may differ in length by one
/// ([`shard_range`]). See docs/course/L11.2.md §2.1 and §3.
///
/// # Errors
/// The link's; the buffer is then partly reduced.
pub fn ring_reduce_scatter<T: Element, L: RingLink>(
    link: &mut L,
    rank: usize,
    world_size: usize,
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (n, len) = (world_size, data.len());
    let mut scratch = vec![T::zeroed(); shard_range(len, n, 0).len()];
    for step in 0..n.saturating_sub(1) {
        let (send, recv) = reduce_scatter_step(rank, step, n);
        let (send, recv) = (shard_range(len, n, send), shard_range(len, n, recv));
        let into = &mut scratch[..recv.len()];
        let (out, target) = split_pair(data, send, recv);
        link.exchange(out, into, &mut |at, piece| {
            reduce_into(op, &mut target[at], piece);
        })?;
    }
    Ok(())
}

/// The ring's all-gather in place: every rank starts with its own shard of `data`
/// (`shard_range(len, N, rank)`) filled and ends with every rank's, bit for bit as sent.
/// N − 1 steps ([`all_gather_step`]), each forwarding the shard received at the step
/// before. See docs/course/L11.2.md §2.1.
///
/// # Errors
/// The link's.
pub fn ring_all_gather<T: Element, L: RingLink>(
    link: &mut L,
    rank: usize,
    world_size: usize,
    data: &mut [T],
) -> Result<()> {
    let (n, len) = (world_size, data.len());
    for step in 0..n.saturating_sub(1) {
        let (send, recv) = all_gather_step(rank, step, n);
        let (send, recv) = (shard_range(len, n, send), shard_range(len, n, recv));
        let (out, into) = split_pair(data, send, recv);
        link.exchange(out, into, &mut |_, _| {})?;
    }
    Ok(())
}

/// The ring's all-reduce in place: a [`ring_reduce_scatter`], then a [`ring_all_gather`]
/// of the reduced shards. Every rank ends with the same bits, those of
/// [`reference_all_reduce`](crate::reference_all_reduce), having sent 2(N − 1) shards.
/// See docs/course/L11.2.md §2.
///
/// # Errors
/// The link's.
pub fn ring_all_reduce<T: Element, L: RingLink>(
    link: &mut L,
    rank: usize,
    world_size: usize,
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    ring_reduce_scatter(link, rank, world_size, data, op)?;
    ring_all_gather(link, rank, world_size, data)
}
