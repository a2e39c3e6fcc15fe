//! [`Recorder`]: a communicator that passes every collective on to another and notes what
//! it was — which collective, how many elements of which type, what the rank sent for it,
//! and the memory meter's tag at the moment of the call (the stage of the step and the
//! model's unit) — so the plan can list a rank's traffic by purpose, and a measurement can
//! count what a rank sent between two moments.

use std::sync::{Arc, Mutex};

use tl_collective::Collective as Any;
use tl_collective::{Axis, CommStats, Communicator, Mesh, ReduceOp, Result, Slice, SliceMut};
use tl_tensor::memory::{self, Tag};

use super::collectives::Collective;

/// One collective a rank called.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Call {
    /// Which collective.
    pub collective: Any,
    /// Elements of the buffer (the whole buffer: the gathered output, the scattered input).
    pub elements: u64,
    /// Bytes per element.
    pub element_bytes: u64,
    /// Bytes this rank sent for it, headers included.
    pub bytes_sent: u64,
    /// The memory meter's tag scope when it was called.
    pub scope: Tag,
    /// Whether it was called during a backward sweep (a checkpoint's rerun included).
    pub in_backward: bool,
    /// The ranks it ran over, as ranks of the world the first recorder was made on: `None`
    /// for that world, the members of a group split from it otherwise.
    pub group: Option<Arc<[usize]>>,
    /// The calling rank in that world, and the world's size.
    pub world: (usize, usize),
}

/// The calls a [`Recorder`] noted, shared with whoever reads them.
pub(crate) type Calls = Arc<Mutex<Vec<Call>>>;

/// Passes every collective on to `inner` and notes it in `calls`.
pub(crate) struct Recorder {
    calls: Calls,
    inner: Box<dyn Communicator>,
    /// The group's members in the world ([`Call::group`]).
    group: Option<Arc<[usize]>>,
    /// [`Call::world`].
    world: (usize, usize),
}

impl Recorder {
    /// A recorder around `inner`, and the handle its calls can be read from.
    pub(crate) fn new(inner: Box<dyn Communicator>) -> (Self, Calls) {
        let calls = Calls::default();
        let recorder = Self {
            world: (inner.rank(), inner.world_size()),
            inner,
            calls: Arc::clone(&calls),
            group: None,
        };
        (recorder, calls)
    }

    /// Runs `call` on the inner communicator and notes it, if it succeeded.
    fn note<T>(
        &mut self,
        collective: Any,
        (elements, element_bytes): (usize, usize),
        call: impl FnOnce(&mut dyn Communicator) -> Result<T>,
    ) -> Result<T> {
        let before = self.inner.stats().bytes_sent;
        let out = call(self.inner.as_mut())?;
        self.calls.lock().expect("the plan's log").push(Call {
            collective,
            elements: elements as u64,
            element_bytes: element_bytes as u64,
            bytes_sent: self.inner.stats().bytes_sent - before,
            scope: memory::current_tag(),
            in_backward: tl_tensor::in_backward(),
            group: self.group.clone(),
            world: self.world,
        });
        Ok(out)
    }
}

impl Communicator for Recorder {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_reduce(&mut self, data: SliceMut<'_>, op: ReduceOp) -> Result<()> {
        let size = (data.len(), data.element_type().bytes());
        self.note(Any::AllReduce, size, |inner| inner.all_reduce(data, op))
    }

    fn reduce_scatter(
        &mut self,
        input: Slice<'_>,
        output: SliceMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        let size = (input.len(), input.element_type().bytes());
        self.note(Any::ReduceScatter, size, |inner| {
            inner.reduce_scatter(input, output, op)
        })
    }

    fn all_gather(&mut self, input: Slice<'_>, output: SliceMut<'_>) -> Result<()> {
        let size = (output.len(), output.element_type().bytes());
        self.note(Any::AllGather, size, |inner| {
            inner.all_gather(input, output)
        })
    }

    fn broadcast(&mut self, data: SliceMut<'_>, root: usize) -> Result<()> {
        let size = (data.len(), data.element_type().bytes());
        self.note(Any::Broadcast { root }, size, |inner| {
            inner.broadcast(data, root)
        })
    }

    fn barrier(&mut self) -> Result<()> {
        self.note(Any::Barrier, (0, 0), |inner| inner.barrier())
    }

    fn stats(&self) -> CommStats {
        self.inner.stats()
    }

    fn send(&mut self, data: Slice<'_>, to: usize, tag: u32) -> Result<()> {
        let size = (data.len(), data.element_type().bytes());
        self.note(Any::Send, size, |inner| inner.send(data, to, tag))
    }

    fn recv(&mut self, data: SliceMut<'_>, from: usize, tag: u32) -> Result<()> {
        self.inner.recv(data, from, tag)
    }

    fn flush(&mut self) -> Result<()> {
        self.inner.flush()
    }

    /// The group, recorded into the same calls (the split's own exchange is set-up, not a
    /// step's traffic, and is not noted), each call naming the group's members.
    fn split(&mut self, members: &[usize]) -> Result<Box<dyn Communicator>> {
        let inner = self.inner.split(members)?;
        let in_world = match &self.group {
            Some(group) => members.iter().map(|&m| group[m]).collect(),
            None => members.into(),
        };
        Ok(Box::new(Recorder {
            calls: Arc::clone(&self.calls),
            inner,
            group: Some(in_world),
            world: self.world,
        }))
    }
}

/// What each of a rank's `calls` of one step was for, at `stage`, as the plan's tables name
/// it, with the bytes the rank sent for them; equal calls merged (in the order of their
/// first call). A model has `n_layers` blocks (the units: the embedding, each block, the
/// norm with the head).
pub(crate) fn by_purpose(
    calls: &[Call],
    stage: super::zero::ZeroStage,
    config: &crate::train::TrainConfig,
) -> Vec<(super::zero::CollectiveCalls, u64)> {
    use super::zero::{CollectiveCalls, STEP_EXTRAS, ZeroStage};
    use tl_tensor::memory::Stage;
    let n_layers = config.model.n_layers;
    // Calls over the tensor-parallel group of a split model: the model's own collectives
    // (inside its forward pass, its backward sweep and a checkpointed block's rerun), the
    // gains' gradients under sequence parallelism, and what makes the step's decisions
    // span the group. Every other call is the data-parallel group's or the world's.
    let tensor = config.parallel.tensor;
    let on_tensor_group = |call: &Call| {
        tensor > 1
            && call.group.as_deref().is_some_and(|members| {
                let (rank, world_size) = call.world;
                Mesh::for_world(world_size, tensor, 1)
                    .is_ok_and(|mesh| mesh.members(Axis::Tensor, rank) == members)
            })
    };
    // The last call of the gradient reduction carries what ends the step (DDP: the loss,
    // the overflow flag and the underflows ride on the last bucket).
    let buckets = |call: &Call| match stage {
        ZeroStage::Ddp | ZeroStage::Optimizer => {
            call.collective == Any::AllReduce
                && call.element_bytes == 4
                && call.scope.stage == Stage::Reduction
        }
        ZeroStage::Gradients => call.collective == Any::ReduceScatter,
        ZeroStage::Parameters => false,
    };
    // Calls over the pipeline group: what makes the step's decisions span the stages.
    let pipeline = config.parallel.pipeline;
    let on_pipeline_group = |call: &Call| {
        pipeline > 1
            && call.group.as_deref().is_some_and(|members| {
                let (rank, world_size) = call.world;
                Mesh::for_world(world_size, tensor, pipeline)
                    .is_ok_and(|mesh| mesh.members(Axis::Pipeline, rank) == members)
            })
    };
    let buckets = |call: &Call| buckets(call) && !on_tensor_group(call);
    let last_bucket = calls.iter().rposition(buckets);
    let unit = |call: &Call| match call.scope.owner {
        Some(0) => "embedding",
        Some(u) if u <= n_layers => "block",
        _ => "norm + head",
    };
    let mut merged: Vec<(CollectiveCalls, u64)> = Vec::new();
    for (index, call) in calls.iter().enumerate() {
        // A step broadcasts nothing and waits at no barrier; a trainer's start does.
        let collective = match call.collective {
            Any::AllReduce => Collective::AllReduce,
            Any::ReduceScatter => Collective::ReduceScatter,
            Any::AllGather => Collective::AllGather,
            Any::Send => Collective::Send,
            Any::Broadcast { .. } | Any::Barrier => continue,
        };
        let purpose = match collective {
            Collective::Send if call.scope.stage == Stage::Backward => {
                "gradients to the stage before"
            }
            Collective::Send => "activations to the next stage",
            _ if on_pipeline_group(call) => match call.element_bytes {
                // The last stage's loss, every rank's report; the clip norm's squares.
                8 if call.scope.stage == Stage::Update => "gradient norm (pipeline)",
                8 => "loss (pipeline)",
                _ => "overflow flag (pipeline)",
            },
            // After the step, over every rank of the run.
            _ if call.scope.label == crate::train::FP8_AMAXES_LABEL => "fp8 amaxes and counts",
            _ if on_tensor_group(call) => match (call.in_backward, call.scope.stage) {
                _ if call.scope.label == tl_parallel::labels::SEQUENCE_PARALLEL_GRADIENTS => {
                    "gains' gradients (tensor group)"
                }
                (_, Stage::Recompute) => "tensor-parallel, rerun",
                (false, Stage::Forward | Stage::Backward) => "tensor-parallel, forward",
                (true, _) => "tensor-parallel, backward",
                // One rank's overflow skips the step everywhere; the clip norm's sum of
                // squares adds the slices.
                _ if call.element_bytes == 8 => "gradient norm (tensor group)",
                _ => "overflow flag (tensor group)",
            },
            // The clip norm's sum of squares is added over the ranks during the update; the
            // trainer's check for a non-finite weight in any rank's shard comes after it.
            Collective::AllReduce if call.element_bytes == 8 => match call.scope.stage {
                tl_tensor::memory::Stage::Update => "gradient norm",
                _ => "non-finite weight check",
            },
            // ZeRO-2 and 3 add up what ends the step in a call of its own.
            Collective::AllReduce
                if matches!(stage, ZeroStage::Gradients | ZeroStage::Parameters) =>
            {
                debug_assert_eq!(call.elements, STEP_EXTRAS);
                "loss, overflow flag, underflows"
            }
            _ if Some(index) == last_bucket => "last gradient bucket",
            _ if buckets(call) => "gradient buckets",
            Collective::AllGather if stage != ZeroStage::Parameters => "updated weights",
            Collective::AllGather => match (unit(call), call.in_backward) {
                ("embedding", false) => "embedding weights, forward",
                ("embedding", true) => "embedding weights, backward",
                ("block", false) => "block weights, forward",
                ("block", true) => "block weights, backward",
                (_, false) => "norm + head weights, forward",
                (_, true) => "norm + head weights, backward",
            },
            _ => match unit(call) {
                "embedding" => "embedding gradients",
                "block" => "block gradients",
                _ => "norm + head gradients",
            },
        };
        let calls = CollectiveCalls {
            purpose,
            collective,
            elements: call.elements,
            element_bytes: call.element_bytes,
            calls: 1,
            group_ranks: call.group.as_deref().map_or(call.world.1, <[usize]>::len),
        };
        match merged
            .iter_mut()
            .find(|(m, _)| CollectiveCalls { calls: 1, ..*m } == calls)
        {
            Some((same, bytes)) => {
                same.calls += 1;
                *bytes += call.bytes_sent;
            }
            None => merged.push((calls, call.bytes_sent)),
        }
    }
    merged
}
