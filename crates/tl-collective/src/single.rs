//! The communicator of a world of one process.

use crate::communicator::{CommStats, Communicator, check_root, check_scatter};
use crate::element::{ReduceOp, Slice, SliceMut};
use crate::error::{CollectiveError, Result};

/// A world of one: every collective is a copy or nothing at all. What a run without a
/// launcher uses, so that the same training code runs on one process and on many.
#[derive(Debug, Default)]
pub struct Single {
    stats: CommStats,
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

fn copy(op: &'static str, input: Slice<'_>, output: SliceMut<'_>) -> Result<()> {
    match (input, output) {
        (Slice::F32(src), SliceMut::F32(dst)) => dst.copy_from_slice(src),
        (Slice::F64(src), SliceMut::F64(dst)) => dst.copy_from_slice(src),
        (src, dst) => {
            return Err(CollectiveError::BadBuffer {
                op,
                reason: format!("input is {} but output is {}", src.element(), dst.element()),
            });
        }
    }
    Ok(())
}

impl Communicator for Single {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_reduce(&mut self, _data: SliceMut<'_>, _op: ReduceOp) -> Result<()> {
        self.count();
        Ok(())
    }

    fn reduce_scatter(
        &mut self,
        input: Slice<'_>,
        output: SliceMut<'_>,
        _op: ReduceOp,
    ) -> Result<()> {
        self.count();
        let op = "reduce_scatter";
        check_scatter(
            op,
            input.len(),
            output.len(),
            (input.element(), output.element()),
            1,
            0,
        )?;
        copy(op, input, output)
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
        copy(op, input, output)
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
