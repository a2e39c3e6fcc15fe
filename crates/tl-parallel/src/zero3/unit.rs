//! ZeRO-3's gather and release around a unit: when a unit's whole weights are gathered
//! from the ranks' shards, and when they are released again (docs/course/L11.3.md § 2,
//! *ZeRO-3's gather and release*).
//!
//! The mechanics are the reference's ([`Core`]'s `gather`, `prefetch`, `release` and
//! `reduce`, and [`gathered_again_in_backward`]); what is here decides when each happens,
//! in forward, in a checkpointed unit's rerun, and in backward.

use tl_tensor::{Tensor, in_backward, is_grad_enabled};

use super::{Core, UnitRunner, gathered_again_in_backward};
use crate::ddp::GradElement;

impl<E: GradElement> UnitRunner<E> {
    /// Runs unit `unit`'s forward `f` with the unit's whole parameters there:
    /// all-gathered before `f`, released after it. Under grad mode the output passes an
    /// identity op whose VJP gathers them again before the unit's backward; the
    /// gradient-ready hooks reduce-scatter the unit's gradients and release it once its
    /// backward is done. Under no-grad only the gather and release happen.
    ///
    /// A checkpointed unit runs twice: its forward, without a graph, gathers and releases
    /// as any forward does; its rerun inside backward (grad mode on, [`in_backward`])
    /// gathers again and *keeps* the values, since the unit's backward follows at once and
    /// its identity op would only gather them a third time. See docs/course/L11.3.md § 2,
    /// *ZeRO-3's gather and release*.
    ///
    /// In order: gather the unit (`Core::gather`, a no-op if its values are there), start
    /// the prefetch of the unit that runs next (`Core::prefetch`: the one after it in a
    /// forward, the one before it in a rerun, as backward goes from the last unit to the
    /// first), run `f`, release the unit (`Core::release`) unless this is a rerun, and
    /// under grad mode return [`gathered_again_in_backward`]`(output)`, else `output`.
    ///
    /// Every rank must run the same units in the same order: each run is a collective.
    ///
    /// # Panics
    /// If `unit` is not the index of a unit.
    pub fn run_unit(&self, unit: usize, f: impl FnOnce() -> Tensor<E>) -> Tensor<E> {
        // A rerun inside backward is a checkpointed unit's.
        let rerun = is_grad_enabled() && in_backward();
        {
            let mut core = self.core.borrow_mut();
            core.gather(unit);
            core.prefetch(if rerun {
                unit.checked_sub(1)
            } else {
                Some(unit + 1)
            });
        }
        let output = f();
        if !rerun {
            self.core.borrow().release(unit);
        }
        if !is_grad_enabled() {
            return output;
        }
        gathered_again_in_backward(&self.core, output, unit)
    }
}

impl<E: GradElement> Core<E> {
    /// The gradient-ready hook of each parameter of unit `index`: notes that one more of the
    /// unit's parameters has its gradient complete in this backward sweep; on the unit's
    /// last, reduce-scatters the unit's gradients into this rank's shard (`Core::reduce`,
    /// which drops the full gradients) and releases the unit's whole values
    /// (`Core::release`), then starts counting afresh for the next sweep. A unit is
    /// reduced once per backward, never before all of its gradients are there. See
    /// docs/course/L11.3.md § 2, *ZeRO-3's gather and release*.
    pub(crate) fn gradient_ready(&mut self, index: usize) {
        let unit = &mut self.units[index];
        unit.ready += 1;
        let complete = unit.ready == unit.params.len();
        if complete {
            unit.ready = 0;
            self.reduce(index);
            self.release(index);
        }
    }
}
