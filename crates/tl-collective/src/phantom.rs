//! A communicator that is one rank of a ring without the ring: for planning.
//!
//! A plan of memory and communication runs the trainer's own step on shape-only tensors,
//! rank by rank, in one process, instead of keeping a second model of the step that must
//! change with it. The step's collectives then need a communicator that is rank `r` of a
//! world of `N` without the other `N − 1` processes: [`Phantom::new(r, N)`](Phantom::new).
//! It moves no data, waits for nobody, and counts its [`CommStats`] exactly as rank `r` of a
//! [`RingComm`](crate::RingComm) of `N` would: one collective per call, and the bytes
//! [`ring_bytes_sent`] gives (the 40-byte headers gathered round the ring before every call,
//! the payload of the ring's schedule, 2 bytes an element for a sum in a 16-bit format as the
//! ring packs it, nothing in a world of one). It checks its arguments as
//! the ring does and fails with the same errors; after one, like a ring rank, it is closed.
//!
//! It stands for cost, not values. It takes shape-only buffers ([`SliceMut::shape`]) and real
//! ones; with real ones it behaves as if every rank held what this one holds, as far as that
//! is cheap: an all-reduce and a broadcast leave the buffer as it is (rounded to the format,
//! for a sum in a 16-bit format, whose result always is a value of it; so
//! [`all_reduce_max_f32(x)`](Communicator::all_reduce_max_f32) and
//! [`all_reduce_sum_f64(x)`](Communicator::all_reduce_sum_f64) return `x`, not a sum over
//! ranks), a reduce-scatter copies this rank's shard of the input to the output, an
//! all-gather writes the input into this rank's shard of the output and leaves the other
//! shards as they were; a point-to-point receive leaves the buffer as it was, since no rank
//! is here to send it anything, and a send counts its frame header and values as the ring's
//! would (and like the ring's, reaches only the ranks next to this one). Nothing it does is proportional to the world size, so rank 1023 of
//! 1024 costs what rank 1 of 2 does.
//!
//! ```
//! use tl_collective::{Communicator, Phantom, SliceMut};
//!
//! // The gradient all-reduce of a 7-billion-parameter model on each rank of a ring of 8.
//! let world_size = 8;
//! for rank in 0..world_size {
//!     let mut comm = Phantom::new(rank, world_size)?;
//!     comm.all_reduce_sum(SliceMut::shape::<f32>(7_000_000_000))?;
//!     // 8 shards of 875,000,000 floats: each rank sends 14 of the 16 (its own and its
//!     // right neighbour's stay), and 7 headers of 40 bytes.
//!     assert_eq!(comm.stats().bytes_sent, 7 * 40 + 14 * 875_000_000 * 4);
//! }
//! # Ok::<(), tl_collective::CollectiveError>(())
//! ```

use crate::communicator::{CommStats, Communicator, check_root, check_scatter};
use crate::element::{
    ElementType, ReduceOp, Slice, SliceMut, check_op, copy_values, prepare_view, reduce_name,
};
use crate::env::check_world;
use crate::error::{CollectiveError, Result};
use crate::group;
use crate::p2p::{self, SEND_OP};
use crate::ring::{Collective, ring_bytes_sent};
use crate::shard::shard_range;

/// Rank `rank` of a ring of `world_size` that moves no data and counts what the ring's rank
/// would send (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct Phantom {
    rank: usize,
    world_size: usize,
    stats: CommStats,
    closed: bool,
}

impl Phantom {
    /// Rank `rank` of a ring of `world_size`.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidRank`] for a world size of 0 or over
    /// [`MAX_WORLD_SIZE`](crate::MAX_WORLD_SIZE), or a rank outside it: the errors of
    /// [`RingConfig::new`](crate::RingConfig::new).
    pub fn new(rank: usize, world_size: usize) -> Result<Self> {
        check_world(rank, world_size)?;
        Ok(Phantom {
            rank,
            world_size,
            stats: CommStats::default(),
            closed: false,
        })
    }

    /// Counts one call of `collective` over `elements` elements of `wire_bytes` bytes each
    /// on the wire, as the ring would once the call's arguments have passed its local
    /// checks.
    fn collective(
        &mut self,
        collective: Collective,
        elements: usize,
        wire_bytes: usize,
    ) -> Result<()> {
        if self.closed {
            return Err(CollectiveError::Closed);
        }
        self.stats.collectives += 1;
        self.stats.bytes_sent += ring_bytes_sent(
            collective,
            elements as u64,
            wire_bytes as u64,
            self.world_size,
            self.rank,
        );
        Ok(())
    }

    /// A failed local check closes the phantom, as it closes a ring rank.
    fn local_check(&mut self, check: Result<()>) -> Result<()> {
        if check.is_err() {
            self.closed = true;
        }
        check
    }
}

impl Communicator for Phantom {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&mut self, mut data: SliceMut<'_>, op: ReduceOp) -> Result<()> {
        let check = check_op(op, reduce_name("all_reduce", op));
        self.local_check(check)?;
        let wire_bytes = op.wire_bytes(data.element_type());
        self.collective(Collective::AllReduce, data.len(), wire_bytes)?;
        prepare_view(op, &mut data);
        Ok(())
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
        let wire_bytes = op.wire_bytes(input.element_type());
        self.collective(Collective::ReduceScatter, input.len(), wire_bytes)?;
        let own = shard_range(input.len(), self.world_size, self.rank);
        let mut output = output;
        copy_values(input.part(own), output.reborrow());
        prepare_view(op, &mut output);
        Ok(())
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
        let wire_bytes = output.element_type().bytes();
        self.collective(Collective::AllGather, output.len(), wire_bytes)?;
        let own = shard_range(output.len(), self.world_size, self.rank);
        copy_values(input, output.part(own));
        Ok(())
    }

    fn broadcast(&mut self, data: SliceMut<'_>, root: usize) -> Result<()> {
        let check = check_root(root, self.world_size);
        self.local_check(check)?;
        let wire_bytes = data.element_type().bytes();
        self.collective(Collective::Broadcast { root }, data.len(), wire_bytes)
    }

    fn barrier(&mut self) -> Result<()> {
        // The element size of an empty payload does not matter.
        self.collective(Collective::Barrier, 0, ElementType::F32.bytes())
    }

    fn stats(&self) -> CommStats {
        self.stats
    }

    fn send(&mut self, data: Slice<'_>, to: usize, tag: u32) -> Result<()> {
        if self.closed {
            return Err(CollectiveError::Closed);
        }
        let check = p2p::check_peer(SEND_OP, self.rank, to, self.world_size, tag, true);
        self.local_check(check)?;
        self.stats.sends += 1;
        if to != self.rank {
            self.stats.bytes_sent += crate::RING_HEADER_BYTES + data.byte_len() as u64;
        }
        Ok(())
    }

    fn recv(&mut self, _data: SliceMut<'_>, from: usize, tag: u32) -> Result<()> {
        if self.closed {
            return Err(CollectiveError::Closed);
        }
        let check = p2p::check_peer("recv", self.rank, from, self.world_size, tag, true);
        self.local_check(check)?;
        self.stats.receives += 1;
        Ok(())
    }

    /// A phantom of the group: rank `position` of `members.len()`, counting what that rank
    /// of the group's ring would send. The split's own exchange is counted here as the
    /// all-gather it is; the members' agreement cannot be checked, as no other rank is here.
    fn split(&mut self, members: &[usize]) -> Result<Box<dyn Communicator>> {
        let checked = group::check_members(members, self.rank, self.world_size);
        // A local misuse closes the phantom, as it closes a ring rank.
        self.closed |= checked.is_err();
        let position = checked?;
        group::exchange_shape(self)?;
        Ok(Box::new(Phantom::new(position, members.len())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worlds_and_ranks_outside_the_limits_are_refused() {
        let err = Phantom::new(2, 2).unwrap_err();
        assert_eq!(err.to_string(), "invalid rank: 2 (world size 2)");
        let err = Phantom::new(0, 0).unwrap_err();
        assert_eq!(err.to_string(), "invalid world size: 0 (world size 0)");
        let too_many = crate::MAX_WORLD_SIZE + 1;
        assert!(matches!(
            Phantom::new(0, too_many),
            Err(CollectiveError::InvalidRank { what: "world size", value, .. }) if value == too_many
        ));
        assert!(Phantom::new(crate::MAX_WORLD_SIZE - 1, crate::MAX_WORLD_SIZE).is_ok());
    }

    #[test]
    fn real_buffers_keep_this_ranks_values() {
        // Rank 1 of 3, 7 elements: shards 0..3, 3..5, 5..7.
        let mut comm = Phantom::new(1, 3).unwrap();
        let input: Vec<f64> = (0..7).map(f64::from).collect();
        let mut shard = [0.0f64; 2];
        comm.reduce_scatter_sum((&input).into(), (&mut shard[..]).into())
            .unwrap();
        assert_eq!(shard, [3.0, 4.0]);
        let mut gathered = [-1.0f64; 7];
        comm.all_gather((&shard[..]).into(), (&mut gathered[..]).into())
            .unwrap();
        assert_eq!(gathered, [-1.0, -1.0, -1.0, 3.0, 4.0, -1.0, -1.0]);
        let mut data = input.clone();
        comm.all_reduce_sum((&mut data).into()).unwrap();
        comm.broadcast((&mut data).into(), 2).unwrap();
        assert_eq!(data, input);
        assert_eq!(comm.all_reduce_max_f32(-2.5).unwrap(), -2.5);
        assert_eq!(comm.all_reduce_sum_f64(0.25).unwrap(), 0.25);
        assert_eq!(comm.stats().collectives, 6);
    }

    #[test]
    fn an_error_closes_the_phantom_and_uncounted_calls_count_nothing() {
        let mut comm = Phantom::new(0, 2).unwrap();
        comm.barrier().unwrap();
        let before = comm.stats();
        assert_eq!(before.bytes_sent, 40);
        let err = comm.broadcast(SliceMut::shape::<f32>(4), 2).unwrap_err();
        assert!(matches!(
            err,
            CollectiveError::InvalidRank {
                what: "root",
                value: 2,
                world_size: 2
            }
        ));
        assert!(matches!(comm.barrier(), Err(CollectiveError::Closed)));
        assert_eq!(comm.stats(), before);
    }

    #[test]
    fn rank_1023_of_1024_counts_seven_billion_floats_without_holding_them() {
        let mut comm = Phantom::new(1023, 1024).unwrap();
        comm.all_reduce_sum(SliceMut::shape::<f32>(7_000_000_000))
            .unwrap();
        // 7e9 = 1024 · 6,835,937 + 512: shards 0..512 hold 6,835,938 floats, the rest
        // 6,835,937. Rank 1023 keeps its own (6,835,937) and its right neighbour's, rank 0's
        // (6,835,938), out of 2 · 7e9: 13,986,328,125 floats, 4 bytes each, and 1023 headers.
        assert_eq!(
            comm.stats(),
            CommStats {
                collectives: 1,
                bytes_sent: 1023 * 40 + 13_986_328_125 * 4,
                ..CommStats::default()
            }
        );
    }
}
