//! A communicator that logs its calls.

use std::sync::{Arc, Mutex};

use tl_collective::{Collective, CommStats, Communicator, ReduceOp, Slice, SliceMut};

/// Collectives called, with the elements of the whole buffer (for a reduce-scatter its
/// input, for an all-gather its output), in order.
pub(super) type Calls = Vec<(Collective, usize)>;

#[derive(Clone, Default)]
pub(super) struct Log(Arc<Mutex<Calls>>);

impl Log {
    /// The calls since the last take.
    pub(super) fn take(&self) -> Calls {
        std::mem::take(&mut self.0.lock().unwrap())
    }

    fn push(&self, collective: Collective, elements: usize) {
        self.0.lock().unwrap().push((collective, elements));
    }
}

pub(super) struct Recorder {
    inner: Box<dyn Communicator>,
    log: Log,
}

impl Recorder {
    pub(super) fn new(inner: Box<dyn Communicator>) -> (Self, Log) {
        let log = Log::default();
        (
            Self {
                inner,
                log: log.clone(),
            },
            log,
        )
    }
}

impl Communicator for Recorder {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&mut self, data: SliceMut<'_>, op: ReduceOp) -> tl_collective::Result<()> {
        self.log.push(Collective::AllReduce, data.len());
        self.inner.all_reduce(data, op)
    }
    fn reduce_scatter(
        &mut self,
        input: Slice<'_>,
        output: SliceMut<'_>,
        op: ReduceOp,
    ) -> tl_collective::Result<()> {
        self.log.push(Collective::ReduceScatter, input.len());
        self.inner.reduce_scatter(input, output, op)
    }
    fn all_gather(&mut self, input: Slice<'_>, output: SliceMut<'_>) -> tl_collective::Result<()> {
        self.log.push(Collective::AllGather, output.len());
        self.inner.all_gather(input, output)
    }
    fn broadcast(&mut self, data: SliceMut<'_>, root: usize) -> tl_collective::Result<()> {
        self.log.push(Collective::Broadcast { root }, data.len());
        self.inner.broadcast(data, root)
    }
    fn barrier(&mut self) -> tl_collective::Result<()> {
        self.log.push(Collective::Barrier, 0);
        self.inner.barrier()
    }
    fn stats(&self) -> CommStats {
        self.inner.stats()
    }
    fn split(&mut self, members: &[usize]) -> tl_collective::Result<Box<dyn Communicator>> {
        self.inner.split(members)
    }
}
