//! [`DryRun`]: tl-tensor's autograd engine with the arithmetic taken out — only sizes,
//! owners and the order of events are left.
//!
//! The plan does not guess where memory goes: it runs the training step's ops through this
//! replica, which follows the same rules as the real engine and its meter:
//!
//! - a value is counted from its allocation until its last handle drops; a VJP closure
//!   holds handles on what it saved, so saved activations live until backward runs the op;
//! - `backward` orders the nodes with tl-tensor's own `topological_order` (reverse
//!   post-order of a depth-first walk that explores an op's *last* parent first, one function
//!   for both sweeps, not a copy of it), keeps one in-flight gradient per node
//!   until the node runs, counts the incoming gradient while the VJP runs, frees what the
//!   VJP saved when it returns and only then allocates the gradients it hands to parents;
//! - a leaf's first gradient becomes its `.grad`; later ones are added in place and freed;
//! - a checkpoint node holds its inputs and, when backward reaches it, reruns its segment
//!   with the graph on and backpropagates through the rerun (counting the incoming gradient
//!   a second time, as tl-recompute does);
//! - a leaf with a gradient-ready hook (ZeRO-2's and ZeRO-3's, `zero.rs`) is finished, its
//!   hook run, as soon as the last op consuming it has run, and a gradient added into an
//!   existing one is dropped after the hook; a released value (ZeRO-3) is off the meter,
//!   whoever holds it, until it is restored.
//!
//! So the predicted timeline is the real one, event for event, as long as the replica's op
//! scripts (`ops.rs`, `model.rs`) mirror the model's code. A test compares the two.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::rc::Rc;

use tl_recompute::KeepPolicy;
use tl_tensor::memory::EventKind;

use super::kind::{Layer, Phase, Stage, TensorKind};
use super::zero::CollectiveCalls;

mod sweep;
mod zero;

pub(crate) use zero::{EXTRAS, Sharding, Zero2, Zero3, bucket_plan};

/// Where a counted byte belongs: a layer and a kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Tag {
    pub(crate) layer: Layer,
    pub(crate) kind: TensorKind,
}

/// A tag from its parts.
pub(crate) fn tag(layer: Layer, kind: TensorKind) -> Tag {
    Tag { layer, kind }
}

/// A handle on a simulated tensor: its value and, if it requires grad, its graph node.
///
/// Deliberately not `Clone`: sharing goes through [`DryRun::share`] and ending a handle
/// through [`DryRun::release`], as each `clone()` and drop of a `Tensor` does in the model.
#[derive(Debug)]
pub(crate) struct Handle {
    value: usize,
    pub(crate) node: Option<usize>,
    pub(crate) bytes: u64,
}

/// A checkpointed segment, rerun during backward: `Fn(dry_run, input) -> output`.
pub(crate) type Segment = Rc<dyn Fn(&mut DryRun, &Handle) -> Handle>;

/// What an op's VJP closure owns, and so frees when backward runs it.
pub(crate) enum Vjp {
    /// The handles the closure saved; it returns a gradient to every parent in the graph.
    Saved(Vec<Handle>),
    /// tl-recompute's checkpoint: the segment's inputs and how to rerun it. Gradients go to
    /// the inputs only (the parameters' arrive in their `.grad` during the rerun).
    Rerun(Rerun),
    /// ZeRO-3's identity op on a unit's output: saves nothing, and all-gathers the unit's
    /// values (unless they are there) before handing the gradient on.
    Gather(usize),
}

/// What a checkpoint node owns until backward reruns its segment.
pub(crate) struct Rerun {
    pub(crate) inputs: Vec<Handle>,
    /// What the segment's ops kept for the rerun (`keep_for_rerun`), in call order.
    pub(crate) kept: Vec<Handle>,
    pub(crate) segment: Segment,
    /// Autocast as it was during the forward pass.
    pub(crate) autocast: bool,
    /// The keep policy as it was during the forward pass.
    pub(crate) keep: KeepPolicy,
    pub(crate) layer: Layer,
}

/// tl-recompute's stack of keep frames: what `keep_for_rerun` does depends on the innermost.
pub(crate) enum KeepFrame {
    /// A checkpoint node's forward pass: marked results are kept.
    Recording(Vec<Handle>),
    /// Its rerun: the kept results are handed back, front first.
    Replaying(VecDeque<Handle>),
    /// A checkpoint that records no node: nothing kept or handed back.
    Plain,
}

/// A tensor's storage: freed when its last handle is released.
struct Value {
    bytes: u64,
    handles: u32,
    tag: Tag,
    /// Off the meter by `Tensor::release_value` (ZeRO-3) until restored.
    released: bool,
}

enum NodeKind {
    /// A parameter (`param`) or a checkpoint rerun's copy of its input; `grad` is the size
    /// of its `.grad` once backward reached it.
    Leaf { grad: Option<u64>, param: bool },
    /// An op's output; `vjp` is taken when backward runs it.
    Op {
        parents: Vec<usize>,
        vjp: Option<Vjp>,
    },
}

/// A node of the graph; a gradient flowing into it has `bytes`, the size of its output.
struct Node {
    bytes: u64,
    layer: Layer,
    kind: NodeKind,
}

/// The replica's memory meter, with the live bytes of every tag and the anatomy of the peak.
struct Meter {
    live: u64,
    peak: u64,
    by_tag: BTreeMap<Tag, u64>,
    by_kind: [u64; TensorKind::ALL.len()],
    peak_by_kind: [u64; TensorKind::ALL.len()],
    peak_phase: Option<Phase>,
    /// The highest live bytes since [`DryRun::start_window`].
    window_peak: u64,
}

/// The replica of one thread's tensors, graph and meter. See the module documentation.
pub(crate) struct DryRun {
    meter: Meter,
    values: Vec<Value>,
    nodes: Vec<Node>,
    /// Grad mode: ops record nodes only while it is on.
    pub(crate) grad_enabled: bool,
    /// Autocast: every matmul rounds copies of its operands.
    pub(crate) autocast: bool,
    /// tl-recompute's keep policy in force (`keeping`): which named results a checkpoint
    /// keeps for its rerun.
    pub(crate) keep: KeepPolicy,
    /// What the step is doing, stamped on the peak.
    pub(crate) phase: Phase,
    /// Every allocation and free, as `memory::record` lists them, while recording.
    events: Option<Vec<(EventKind, usize)>>,
    /// The keep frames of the checkpoints running now, innermost last.
    pub(crate) keep_frames: Vec<KeepFrame>,
    /// Autocast's memory of the last activation it rounded: the values of the activation
    /// and of its rounded copy (held weakly, as tl-precision holds them).
    last_rounded: Option<(usize, usize)>,
    /// Gradient-ready hooks, by leaf node.
    hooks: HashMap<usize, zero::Hook>,
    /// Backward sweeps running now (a checkpoint's rerun runs inside one).
    sweeps: u32,
    /// What ZeRO-2 or ZeRO-3 shards, when the step runs under one of them.
    pub(crate) sharding: Sharding,
    /// The collectives the rank has called, one entry per call, in order.
    calls: Vec<CollectiveCalls>,
}

impl DryRun {
    /// An empty thread: nothing allocated, grad mode on, autocast off.
    pub(crate) fn new() -> Self {
        Self {
            meter: Meter {
                live: 0,
                peak: 0,
                by_tag: BTreeMap::new(),
                by_kind: [0; TensorKind::ALL.len()],
                peak_by_kind: [0; TensorKind::ALL.len()],
                peak_phase: None,
                window_peak: 0,
            },
            values: Vec::new(),
            nodes: Vec::new(),
            grad_enabled: true,
            autocast: false,
            keep: KeepPolicy::nothing(),
            phase: Phase {
                step: 0,
                micro_batch: 0,
                accum: 0,
                stage: Stage::StepStart,
                layer: Layer::Embedding,
            },
            events: None,
            keep_frames: Vec::new(),
            last_rounded: None,
            hooks: HashMap::new(),
            sweeps: 0,
            sharding: Sharding::None,
            calls: Vec::new(),
        }
    }

    /// `tl_tensor::in_backward`: whether a backward sweep is running.
    pub(crate) fn in_backward(&self) -> bool {
        self.sweeps > 0
    }

    /// Notes one collective call on `elements` elements of `element_bytes` bytes.
    pub(crate) fn call(
        &mut self,
        purpose: &'static str,
        collective: super::collectives::Collective,
        elements: u64,
        element_bytes: u64,
    ) {
        self.calls.push(CollectiveCalls {
            purpose,
            collective,
            elements,
            element_bytes,
            calls: 1,
        });
    }

    /// The collectives called since the last call, runs of equal calls merged (in the
    /// order of their first call).
    pub(crate) fn take_calls(&mut self) -> Vec<CollectiveCalls> {
        let mut merged: Vec<CollectiveCalls> = Vec::new();
        for call in std::mem::take(&mut self.calls) {
            match merged
                .iter_mut()
                .find(|m| CollectiveCalls { calls: 1, ..**m } == call)
            {
                Some(same) => same.calls += 1,
                None => merged.push(call),
            }
        }
        merged
    }

    /// A communication buffer of `bytes` (tl-parallel's `Metered::zeros`), in `layer`.
    pub(crate) fn buffer(&mut self, bytes: u64, layer: Layer) -> Handle {
        self.constant(bytes, tag(layer, TensorKind::CommBuffers))
    }

    /// Another handle on a parameter that does not count as one: the parameter outlives
    /// every use of it (the replica never releases a parameter).
    fn alias(handle: &Handle) -> Handle {
        Handle {
            value: handle.value,
            node: handle.node,
            bytes: handle.bytes,
        }
    }

    /// `Tensor::release_value`: the value's bytes leave the meter; its handles stay.
    pub(crate) fn release_value(&mut self, handle: &Handle) {
        let value = &mut self.values[handle.value];
        assert!(!value.released, "release: the value is released already");
        value.released = true;
        let (tag, bytes) = (value.tag, value.bytes);
        self.refund(tag, bytes);
    }

    /// `Tensor::restore_value`: the value's bytes are back on the meter.
    pub(crate) fn restore_value(&mut self, handle: &Handle) {
        let value = &mut self.values[handle.value];
        assert!(value.released, "restore: the value is not released");
        value.released = false;
        let (tag, bytes) = (value.tag, value.bytes);
        self.charge(tag, bytes);
    }

    /// Whether the value is released.
    pub(crate) fn is_released(&self, handle: &Handle) -> bool {
        self.values[handle.value].released
    }

    /// Starts listing allocations and frees (dropping any listed before).
    #[cfg(test)]
    pub(crate) fn start_events(&mut self) {
        self.events = Some(Vec::new());
    }

    /// The allocations and frees listed since [`start_events`](Self::start_events).
    #[cfg(test)]
    pub(crate) fn take_events(&mut self) -> Vec<(EventKind, usize)> {
        self.events.take().unwrap_or_default()
    }

    fn note(&mut self, kind: EventKind, bytes: u64) {
        // The meter ignores empty buffers.
        if bytes == 0 {
            return;
        }
        if let Some(events) = &mut self.events {
            events.push((kind, bytes as usize));
        }
    }

    fn charge(&mut self, tag: Tag, bytes: u64) {
        self.note(EventKind::Alloc, bytes);
        self.count(tag, bytes);
    }

    /// Counts `bytes` under `tag` without an allocation event (a buffer changing role).
    fn count(&mut self, tag: Tag, bytes: u64) {
        let meter = &mut self.meter;
        meter.live += bytes;
        *meter.by_tag.entry(tag).or_default() += bytes;
        meter.by_kind[tag.kind.index()] += bytes;
        meter.window_peak = meter.window_peak.max(meter.live);
        if meter.live > meter.peak {
            meter.peak = meter.live;
            meter.peak_by_kind = meter.by_kind;
            meter.peak_phase = Some(self.phase);
        }
    }

    fn refund(&mut self, tag: Tag, bytes: u64) {
        self.note(EventKind::Free, bytes);
        self.uncount(tag, bytes);
    }

    /// Takes `bytes` off `tag` without a free event.
    fn uncount(&mut self, tag: Tag, bytes: u64) {
        let meter = &mut self.meter;
        meter.live -= bytes;
        *meter.by_tag.get_mut(&tag).expect("refund of a charged tag") -= bytes;
        meter.by_kind[tag.kind.index()] -= bytes;
    }

    /// Live bytes now.
    pub(crate) fn live(&self) -> u64 {
        self.meter.live
    }

    /// The highest live bytes since the last [`reset_peak`](Self::reset_peak), when it was
    /// reached and what was alive then, by kind.
    pub(crate) fn peak(&self) -> (u64, Option<Phase>, [u64; TensorKind::ALL.len()]) {
        let meter = &self.meter;
        (meter.peak, meter.peak_phase, meter.peak_by_kind)
    }

    /// Starts a new peak from the live bytes, as `memory::reset_peak` does.
    pub(crate) fn reset_peak(&mut self) {
        self.meter.peak = self.meter.live;
        self.meter.peak_by_kind = self.meter.by_kind;
        self.meter.peak_phase = Some(self.phase);
    }

    /// Starts watching the highest live bytes from now on, beside the peak (which it leaves
    /// alone): how much a stretch of the step allocates above where it began.
    pub(crate) fn start_window(&mut self) {
        self.meter.window_peak = self.meter.live;
    }

    /// The highest live bytes since [`DryRun::start_window`].
    pub(crate) fn window_peak(&self) -> u64 {
        self.meter.window_peak
    }

    /// Live bytes now, by tag (empty tags left out).
    pub(crate) fn live_by_tag(&self) -> BTreeMap<Tag, u64> {
        let mut live = self.meter.by_tag.clone();
        live.retain(|_, bytes| *bytes > 0);
        live
    }

    /// A constant tensor of `bytes`, not in the graph (`Tensor::from_array`).
    pub(crate) fn constant(&mut self, bytes: u64, tag: Tag) -> Handle {
        self.charge(tag, bytes);
        self.values.push(Value {
            bytes,
            handles: 1,
            tag,
            released: false,
        });
        Handle {
            value: self.values.len() - 1,
            node: None,
            bytes,
        }
    }

    /// A trainable parameter of `bytes` (`Tensor::param`); its handle is never released.
    pub(crate) fn param(&mut self, bytes: u64, layer: Layer) -> Handle {
        let mut handle = self.constant(bytes, tag(layer, TensorKind::Weights));
        handle.node = Some(self.leaf(bytes, layer, true));
        handle
    }

    fn leaf(&mut self, bytes: u64, layer: Layer, param: bool) -> usize {
        self.nodes.push(Node {
            bytes,
            layer,
            kind: NodeKind::Leaf { grad: None, param },
        });
        self.nodes.len() - 1
    }

    /// Another handle on the same tensor (`Tensor::clone`, or `detach`: the value is shared).
    pub(crate) fn share(&mut self, handle: &Handle) -> Handle {
        self.values[handle.value].handles += 1;
        Handle {
            value: handle.value,
            node: handle.node,
            bytes: handle.bytes,
        }
    }

    /// Drops a handle; the value is freed with its last handle.
    pub(crate) fn release(&mut self, handle: Handle) {
        let value = &mut self.values[handle.value];
        value.handles -= 1;
        if value.handles == 0 && !value.released {
            let (tag, bytes) = (value.tag, value.bytes);
            self.refund(tag, bytes);
        }
    }

    fn release_vjp(&mut self, vjp: Vjp) {
        match vjp {
            Vjp::Saved(saved) => saved.into_iter().for_each(|h| self.release(h)),
            Vjp::Rerun(Rerun { inputs, kept, .. }) => {
                inputs.into_iter().for_each(|h| self.release(h));
                kept.into_iter().for_each(|h| self.release(h));
            }
            Vjp::Gather(_) => {}
        }
    }

    /// `keep_for_rerun` after computing: in a checkpoint node's forward pass, the node keeps
    /// another handle on `result`.
    pub(crate) fn keep_for_rerun(&mut self, result: &Handle) {
        if matches!(self.keep_frames.last(), Some(KeepFrame::Recording(_))) {
            let kept = self.share(result);
            if let Some(KeepFrame::Recording(frame)) = self.keep_frames.last_mut() {
                frame.push(kept);
            }
        }
    }

    /// Whether a result named `name` is kept here (`keep_named`, `keep_product`): the
    /// innermost frame is a checkpoint's forward pass or rerun, and the policy names it.
    pub(crate) fn frame_keeps(&self, name: &str) -> bool {
        matches!(
            self.keep_frames.last(),
            Some(KeepFrame::Recording(_) | KeepFrame::Replaying(_))
        ) && self.keep.keeps(name)
    }

    /// `keep_for_rerun` before computing: in a rerun, the result the forward pass kept.
    pub(crate) fn take_kept(&mut self) -> Option<Handle> {
        match self.keep_frames.last_mut() {
            Some(KeepFrame::Replaying(kept)) => kept.pop_front(),
            _ => None,
        }
    }

    /// `Tensor::from_op`: allocates the output, then records a node owning `vjp` if grad
    /// mode is on and a parent requires grad; otherwise the closure is dropped at once.
    pub(crate) fn record(&mut self, bytes: u64, tag: Tag, parents: &[&Handle], vjp: Vjp) -> Handle {
        let output = self.constant(bytes, tag);
        self.record_on(output, parents, vjp)
    }

    /// `Tensor::from_op_shared`: as [`record`](Self::record) with `output` as the op's
    /// value, which is shared, not allocated.
    pub(crate) fn record_on(
        &mut self,
        mut output: Handle,
        parents: &[&Handle],
        vjp: Vjp,
    ) -> Handle {
        let (bytes, layer) = (output.bytes, self.values[output.value].tag.layer);
        let parent_nodes: Vec<usize> = parents.iter().filter_map(|p| p.node).collect();
        if !self.grad_enabled || parent_nodes.is_empty() {
            self.release_vjp(vjp);
            output.node = None;
            return output;
        }
        self.nodes.push(Node {
            bytes,
            layer,
            kind: NodeKind::Op {
                parents: parent_nodes,
                vjp: Some(vjp),
            },
        });
        output.node = Some(self.nodes.len() - 1);
        output
    }

    /// Autocast's `cast` of a product's operand: a rounded copy tagged `copy_tag`, or, when
    /// `x` is the last activation rounded and that copy is still alive, a new cast node on
    /// the copy's storage (tl-precision's `rounded_operand`). Leaves are never remembered.
    pub(crate) fn rounded_operand(&mut self, x: &Handle, copy_tag: Tag) -> Handle {
        if let Some((source, rounded)) = self.last_rounded
            && source == x.value
            && self.values[rounded].handles > 0
        {
            let copy = Handle {
                value: rounded,
                node: None,
                bytes: x.bytes,
            };
            let copy = self.share(&copy);
            return self.record_on(copy, &[x], Vjp::Saved(Vec::new()));
        }
        let copy = self.layout(x, copy_tag);
        let is_leaf = x
            .node
            .is_none_or(|node| matches!(self.nodes[node].kind, NodeKind::Leaf { .. }));
        if !is_leaf {
            self.last_rounded = Some((x.value, copy.value));
        }
        copy
    }

    /// tl-precision's `mark_rounded`: `x` is its own rounded copy for the next products.
    pub(crate) fn mark_rounded(&mut self, x: &Handle) {
        self.last_rounded = Some((x.value, x.value));
    }

    /// Whether `handle` is a parameter (a leaf that is not a rerun's input copy).
    pub(crate) fn is_param(&self, handle: &Handle) -> bool {
        handle
            .node
            .is_some_and(|node| matches!(self.nodes[node].kind, NodeKind::Leaf { param: true, .. }))
    }

    /// Whether a parameter holds a gradient.
    pub(crate) fn has_grad(&self, param: &Handle) -> bool {
        match param.node.map(|node| &self.nodes[node].kind) {
            Some(NodeKind::Leaf { grad, .. }) => grad.is_some(),
            _ => false,
        }
    }

    /// `Tensor::zero_grad`: frees a leaf's gradient.
    pub(crate) fn zero_grad(&mut self, param: &Handle) {
        let node = param.node.expect("a parameter has a leaf node");
        let layer = self.nodes[node].layer;
        if let NodeKind::Leaf { grad, .. } = &mut self.nodes[node].kind
            && let Some(bytes) = grad.take()
        {
            self.refund(tag(layer, TensorKind::Gradients), bytes);
        }
    }
}
