//! The communicator of a world of one process.

use crate::communicator::{CommStats, Communicator, check_root, check_scatter};
use crate::element::{ReduceOp, Slice, SliceMut, check_op, copy_values, prepare_view, reduce_name};
use crate::error::Result;
use crate::group;
use crate::p2p::{self, Inbox};

/// A world of one: every collective is a copy or nothing at all. What a run without a
/// launcher uses, so that the same training code runs on one process and on many.
///
/// A sum in a 16-bit format ([`ReduceOp::SumIn`]) of one rank's values is those values
/// rounded to the format: that is what it does to a buffer.
///
/// A message it sends itself ([`send`](Communicator::send) to rank 0) waits in it until
/// received.
///
/// It takes shape-only buffers ([`Slice::Shape`]) too, checking their lengths and element
/// types as it checks real ones: a copy from or to one copies nothing.
#[derive(Debug, Default)]
pub struct Single {
    stats: CommStats,
    /// Messages it sent itself, until received.
    inbox: Inbox,
}

impl Single {
    /// A world of one process (rank 0).
    pub fn new() -> Self {
        Single::default()
    }

    fn count(&mut self) {
        self.stats.collectives += 1;
    }
}

impl Communicator for Single {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_reduce(&mut self, mut data: SliceMut<'_>, op: ReduceOp) -> Result<()> {
        self.count();
        check_op(op, reduce_name("all_reduce", op))?;
        prepare_view(op, &mut data);
        Ok(())
    }

    fn reduce_scatter(
        &mut self,
        input: Slice<'_>,
        output: SliceMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        self.count();
        let name = reduce_name("reduce_scatter", op);
        check_op(op, name)?;
        check_scatter(
            name,
            input.len(),
            output.len(),
            (input.element(), output.element()),
            1,
            0,
        )?;
        let mut output = output;
        copy_values(input, output.reborrow());
        prepare_view(op, &mut output);
        Ok(())
    }

    fn all_gather(&mut self, input: Slice<'_>, output: SliceMut<'_>) -> Result<()> {
        self.count();
        let op = "all_gather";
        check_scatter(
            op,
            output.len(),
            input.len(),
            (input.element(), output.element()),
            1,
            0,
        )?;
        copy_values(input, output);
        Ok(())
    }

    fn broadcast(&mut self, _data: SliceMut<'_>, root: usize) -> Result<()> {
        self.count();
        check_root(root, 1)
    }

    fn barrier(&mut self) -> Result<()> {
        self.count();
        Ok(())
    }

    fn stats(&self) -> CommStats {
        self.stats
    }

    fn send(&mut self, data: Slice<'_>, to: usize, tag: u32) -> Result<()> {
        p2p::check_peer(p2p::SEND_OP, 0, to, 1, tag, false)?;
        self.stats.sends += 1;
        p2p::to_self(&mut self.inbox, 0, &data, tag);
        Ok(())
    }

    fn recv(&mut self, mut data: SliceMut<'_>, from: usize, tag: u32) -> Result<()> {
        p2p::check_peer("recv", 0, from, 1, tag, false)?;
        let message = self
            .inbox
            .take(0, tag)
            .ok_or_else(|| p2p::never_sent(0, tag))?;
        self.stats.receives += 1;
        p2p::deliver(0, tag, &message, &mut data)
    }

    fn split(&mut self, members: &[usize]) -> Result<Box<dyn Communicator>> {
        let position = group::check_members(members, 0, 1)?;
        group::exchange(
            self,
            members,
            &group::record(members, position, Vec::new())?,
        )?;
        Ok(Box::new(Single::new()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::CollectiveError;

    #[test]
    fn sharded_collectives_copy_and_count() {
        let mut comm = Single::new();
        let input = [1.0f64, 2.0, 3.0];
        let mut out = [0.0f64; 3];
        comm.reduce_scatter_sum((&input[..]).into(), (&mut out[..]).into())
            .unwrap();
        assert_eq!(out, input);
        let mut gathered = [0.0f64; 3];
        comm.all_gather((&out[..]).into(), (&mut gathered[..]).into())
            .unwrap();
        assert_eq!(gathered, input);
        assert_eq!(comm.all_reduce_max_f32(-2.5).unwrap(), -2.5);
        assert_eq!(comm.stats().collectives, 3);
        assert_eq!(comm.stats().bytes_sent, 0);
    }

    #[test]
    fn wrong_lengths_and_roots_are_errors() {
        let mut comm = Single::new();
        let mut out = [0.0f32; 2];
        let err = comm
            .reduce_scatter_sum((&[1.0f32, 2.0, 3.0][..]).into(), (&mut out[..]).into())
            .unwrap_err();
        assert!(matches!(err, CollectiveError::BadBuffer { .. }), "{err}");
        let err = comm.broadcast((&mut out[..]).into(), 1).unwrap_err();
        assert!(matches!(
            err,
            CollectiveError::InvalidRank { what: "root", .. }
        ));
    }

    #[test]
    fn shape_only_buffers_are_checked_like_real_ones_and_copy_nothing() {
        let mut comm = Single::new();
        comm.all_reduce_sum(SliceMut::shape::<f32>(1 << 40))
            .unwrap();
        comm.broadcast(SliceMut::shape::<f64>(3), 0).unwrap();
        // A real output of a shape-only input keeps its values.
        let mut out = [7.0f32; 3];
        comm.all_gather(Slice::shape::<f32>(3), (&mut out[..]).into())
            .unwrap();
        assert_eq!(out, [7.0; 3]);
        comm.reduce_scatter_sum((&[1.0f32; 3][..]).into(), SliceMut::shape::<f32>(3))
            .unwrap();
        assert_eq!(comm.stats().collectives, 4);

        let err = comm
            .all_gather(Slice::shape::<f64>(3), (&mut out[..]).into())
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "all_gather: input is f64 but output is f32"
        );
        let err = comm
            .reduce_scatter_sum(Slice::shape::<f32>(4), SliceMut::shape::<f32>(3))
            .unwrap_err();
        assert!(matches!(err, CollectiveError::BadBuffer { .. }), "{err}");
        let err = comm.broadcast(SliceMut::shape::<f32>(3), 1).unwrap_err();
        assert!(matches!(err, CollectiveError::InvalidRank { .. }), "{err}");
    }
}
