//! The autograd graph and the backward sweep.
//!
//! Each tensor that requires grad owns a [`GradNode`]: a leaf node accumulates the gradient
//! of a parameter, an op node holds its parents' nodes and the vector-Jacobian product (VJP)
//! of the op. Nodes point to nodes, never to tensor values, so the graph keeps alive only what
//! each VJP chose to save. `backward` *takes* every op's record when it runs it, so saved
//! activations are freed as the sweep goes, and a graph can be swept only once.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use ndarray::{ArrayD, Zip};

use crate::memory::{self, Kind, Stage, Tag};
use crate::storage::Buffer;
use crate::{Element, Tensor};

/// The vector-Jacobian product of an op: given the gradient of the output, the gradients of
/// each parent, in the order the parents were given (`None` for a parent that gets none).
pub type Vjp<E> = Box<dyn FnOnce(ArrayD<E>) -> Vec<Option<ArrayD<E>>>>;

/// The backward of an op written over tensors rather than values: given the output's
/// gradient as a constant tensor, the gradients of each parent (see
/// [`Tensor::from_op_tensors`](crate::Tensor::from_op_tensors)). It runs for meta gradients
/// too.
pub type TensorVjp<E> = Box<dyn FnOnce(Tensor<E>) -> Vec<Option<Tensor<E>>>>;

/// A callback a leaf runs each time a backward sweep has accumulated its gradient (see
/// [`Tensor::set_grad_ready_hook`](crate::Tensor::set_grad_ready_hook)).
pub type GradReadyHook = Rc<dyn Fn()>;

pub(crate) struct GradNode<E: Element> {
    pub(crate) shape: Vec<usize>,
    pub(crate) kind: NodeKind<E>,
}

pub(crate) enum NodeKind<E: Element> {
    /// A tensor made by the user that requires grad: gradients accumulate into `grad`, and
    /// `hook`, if set, runs right after each accumulation.
    Leaf {
        grad: RefCell<Option<Buffer<E>>>,
        hook: RefCell<Option<GradReadyHook>>,
        /// The model's unit that owns the parameter, for its gradient's tag.
        owner: Option<usize>,
    },
    /// The output of an op; `None` once backward has consumed it.
    Op(RefCell<Option<OpRecord<E>>>),
}

pub(crate) struct OpRecord<E: Element> {
    pub(crate) parents: Vec<Option<Rc<GradNode<E>>>>,
    pub(crate) vjp: Backward<E>,
    /// The meter's tag scope the op ran in: its backward runs in it too.
    pub(crate) scope: Tag,
}

/// How an op's backward is computed.
pub(crate) enum Backward<E: Element> {
    /// A function of values, skipped for a meta gradient (its parents get meta gradients of
    /// their own shapes).
    Values(Vjp<E>),
    /// A function of tensors, run for real and meta gradients alike.
    Tensors(TensorVjp<E>),
}

/// A gradient a VJP hands back: values, or (for a meta gradient) the shape of its parent.
enum Returned<E: Element> {
    Values(ArrayD<E>),
    Meta,
    Buffer(Buffer<E>),
}

impl<E: Element> GradNode<E> {
    /// A leaf owned by the meter's current owner.
    pub(crate) fn leaf(shape: Vec<usize>) -> Rc<Self> {
        Rc::new(Self {
            shape,
            kind: NodeKind::Leaf {
                grad: RefCell::new(None),
                hook: RefCell::new(None),
                owner: memory::current_tag().owner,
            },
        })
    }

    /// The tag of this leaf's accumulated gradient.
    pub(crate) fn gradient_tag(&self) -> Tag {
        let owner = match &self.kind {
            NodeKind::Leaf { owner, .. } => *owner,
            NodeKind::Op(_) => None,
        };
        Tag {
            kind: Kind::Gradients,
            owner,
            label: "",
            ..memory::current_tag()
        }
    }

    pub(crate) fn op(shape: Vec<usize>, record: OpRecord<E>) -> Rc<Self> {
        Rc::new(Self {
            shape,
            kind: NodeKind::Op(RefCell::new(Some(record))),
        })
    }

    fn key(self: &Rc<Self>) -> usize {
        Rc::as_ptr(self) as usize
    }
}

impl<E: Element> Drop for GradNode<E> {
    /// Dismantles the graph behind an unswept node with a worklist: the default drop would
    /// recurse once per op (node → record → parent node → …) and overflow the stack on a
    /// deep graph that is dropped without a backward.
    fn drop(&mut self) {
        let NodeKind::Op(record) = &mut self.kind else {
            return;
        };
        let mut worklist: Vec<OpRecord<E>> = record.get_mut().take().into_iter().collect();
        while let Some(OpRecord { parents, vjp, .. }) = worklist.pop() {
            // The VJP's saved tensors point at these same parents: dropping it while the
            // parents are still held here only decrements their counts.
            drop(vjp);
            for parent in parents.into_iter().flatten() {
                // The last owner takes the parent's record out before the parent drops.
                if let Some(mut parent) = Rc::into_inner(parent)
                    && let NodeKind::Op(parent_record) = &mut parent.kind
                {
                    worklist.extend(parent_record.get_mut().take());
                }
            }
        }
    }
}

/// Nodes reachable from `root`, each before all nodes it consumes (root first), in the
/// one order every sweep of this engine uses.
fn topological_order<E: Element>(root: &Rc<GradNode<E>>) -> Vec<Rc<GradNode<E>>> {
    crate::order::topological_order(Rc::clone(root), GradNode::key, |node| match &node.kind {
        NodeKind::Leaf { .. } => Vec::new(),
        NodeKind::Op(record) => record
            .borrow()
            .as_ref()
            .expect("backward through a graph that a previous backward already freed")
            .parents
            .iter()
            .flatten()
            .cloned()
            .collect(),
    })
}

/// `acc += grad`; a meta gradient (`None`) on either side leaves a meta sum.
fn add_into<E: Element>(acc: &mut Buffer<E>, grad: Option<&ArrayD<E>>) {
    match grad {
        Some(grad) if !acc.is_meta() => acc.update(|acc| {
            Zip::from(acc).and(grad).for_each(|a, &g| *a += g);
        }),
        _ => acc.make_meta(),
    }
}

/// A buffer's values for [`add_into`]: `None` when it is meta.
fn values_of<E: Element>(buffer: &Buffer<E>) -> Option<&ArrayD<E>> {
    (!buffer.is_meta()).then(|| buffer.array())
}

/// Whether `node` is a leaf with a gradient-ready hook.
fn is_hooked<E: Element>(node: &GradNode<E>) -> bool {
    matches!(&node.kind, NodeKind::Leaf { hook, .. } if hook.borrow().is_some())
}

/// Edges from the ops of `order` into each hooked leaf: how many VJP results each still
/// waits for. Empty (and nothing walked) when no leaf of the graph has a hook.
fn hooked_consumers<E: Element>(order: &[Rc<GradNode<E>>]) -> HashMap<usize, usize> {
    let mut waiting = HashMap::new();
    if !order.iter().any(|node| is_hooked(node)) {
        return waiting;
    }
    for node in order {
        if let NodeKind::Op(record) = &node.kind
            && let Some(record) = record.borrow().as_ref()
        {
            for parent in record.parents.iter().flatten() {
                if is_hooked(parent) {
                    *waiting.entry(parent.key()).or_insert(0) += 1;
                }
            }
        }
    }
    waiting
}

/// Accumulates `grad` into the leaf `node` and runs its hook, if any.
fn finish_leaf<E: Element>(node: &GradNode<E>, grad: Buffer<E>) {
    let NodeKind::Leaf {
        grad: leaf_grad,
        hook,
        ..
    } = &node.kind
    else {
        unreachable!("only leaves accumulate");
    };
    {
        let mut slot = leaf_grad.borrow_mut();
        match slot.as_mut() {
            Some(acc) => add_into(acc, values_of(&grad)),
            None => {
                let mut grad = grad;
                grad.set_tag(node.gradient_tag());
                *slot = Some(grad);
            }
        }
    }
    // Cloned out first: the hook may replace itself or read the gradient.
    let hook = hook.borrow().clone();
    if let Some(hook) = hook {
        hook();
    }
}

thread_local! {
    /// How many backward sweeps are running on this thread (a VJP may start another, as a
    /// checkpointed segment's rerun does).
    static SWEEPS: Cell<usize> = const { Cell::new(0) };
}

/// Whether a backward sweep is running on this thread: true inside a VJP, so inside the
/// forward rerun of a checkpointed segment, and false in an ordinary forward pass.
///
/// ```
/// use std::cell::Cell;
/// use std::rc::Rc;
/// use tl_tensor::{Tensor, in_backward};
/// let x = Tensor::<f32>::param(tl_tensor::ndarray::arr1(&[2.0]).into_dyn());
/// let seen = Rc::new(Cell::new(false));
/// let inside = Rc::clone(&seen);
/// let y = Tensor::from_op_shared(&x, &[&x], move |g| {
///     inside.set(in_backward());
///     vec![Some(g)]
/// });
/// assert!(!in_backward());
/// y.sum_all().backward();
/// assert!(seen.get() && !in_backward());
/// ```
pub fn in_backward() -> bool {
    SWEEPS.with(Cell::get) > 0
}

/// Counts one running sweep while alive, also when a VJP panics.
struct Sweep;

impl Sweep {
    fn start() -> Self {
        SWEEPS.with(|n| n.set(n.get() + 1));
        Self
    }
}

impl Drop for Sweep {
    fn drop(&mut self) {
        SWEEPS.with(|n| n.set(n.get() - 1));
    }
}

/// Backpropagates `grad_out` from `root`, accumulating into the leaves' gradients.
///
/// A leaf with a gradient-ready hook is finished as soon as the last op that consumes it has
/// run, rather than at its own place in the order (the depth-first order puts a layer's
/// parameters after everything below the layer): its gradient is complete then, and the
/// hook can release or reduce it while the sweep goes on through the rest of the graph.
/// The sums are the same, only their hand-over is earlier. Without hooks nothing changes.
pub(crate) fn backward<E: Element>(root: &Rc<GradNode<E>>, grad_out: Buffer<E>) {
    assert_eq!(
        grad_out.shape(),
        root.shape.as_slice(),
        "backward: the output gradient's shape must match the tensor's"
    );
    let _sweep = Sweep::start();
    let _stage = memory::stage_scope(Stage::Backward);
    let order = topological_order(root);
    let mut waiting = hooked_consumers(&order);
    let mut pending: HashMap<usize, Buffer<E>> = HashMap::new();
    pending.insert(root.key(), grad_out);
    // Consume the order front to back, dropping each node's entry as soon as it has run.
    for node in order {
        let Some(grad) = pending.remove(&node.key()) else {
            continue;
        };
        match &node.kind {
            NodeKind::Leaf { .. } => finish_leaf(&node, grad),
            NodeKind::Op(record) => {
                let record = record
                    .borrow_mut()
                    .take()
                    .expect("backward through a graph that a previous backward already freed");
                let OpRecord {
                    parents,
                    vjp,
                    scope,
                } = record;
                // The op's backward, and the gradients it makes, belong where its forward ran
                // (its unit, its micro-batch), in the backward stage.
                let _scope = memory::tag_scope(Tag {
                    stage: Stage::Backward,
                    ..scope
                });
                let flight = in_flight();
                let (parent_grads, incoming) = run_vjp(vjp, grad, &parents);
                assert_eq!(
                    parent_grads.len(),
                    parents.len(),
                    "a VJP must return one entry per parent"
                );
                for (parent, parent_grad) in parents.iter().zip(parent_grads) {
                    let Some(parent) = parent else {
                        continue;
                    };
                    if let Some(parent_grad) = parent_grad {
                        let entry = pending.get_mut(&parent.key());
                        match (parent_grad, entry) {
                            (Returned::Values(values), Some(acc)) => {
                                check_shape(values.shape(), parent);
                                add_into(acc, Some(&values));
                            }
                            (Returned::Values(values), None) => {
                                check_shape(values.shape(), parent);
                                pending.insert(parent.key(), Buffer::new_tagged(values, flight));
                            }
                            (Returned::Meta, Some(acc)) => add_into(acc, None),
                            (Returned::Meta, None) => {
                                let meta = Buffer::meta_tagged(&parent.shape, flight);
                                pending.insert(parent.key(), meta);
                            }
                            (Returned::Buffer(buffer), Some(acc)) => {
                                check_shape(buffer.shape(), parent);
                                add_into(acc, values_of(&buffer));
                            }
                            (Returned::Buffer(mut buffer), None) => {
                                check_shape(buffer.shape(), parent);
                                buffer.set_tag(flight);
                                pending.insert(parent.key(), buffer);
                            }
                        }
                    }
                    if !waiting.is_empty()
                        && let Some(count) = waiting.get_mut(&parent.key())
                    {
                        *count -= 1;
                        if *count == 0 {
                            waiting.remove(&parent.key());
                            if let Some(grad) = pending.remove(&parent.key()) {
                                finish_leaf(parent, grad);
                            }
                        }
                    }
                }
                drop(incoming);
                // `parents` and the VJP's saved values drop here.
            }
        }
    }
}

/// The tag of a gradient a sweep carries, made in the current scope.
pub(crate) fn in_flight() -> Tag {
    Tag {
        kind: Kind::GradientsInFlight,
        label: "",
        ..memory::current_tag()
    }
}

/// What a VJP returned for a parent must have the parent's shape.
fn check_shape<E: Element>(shape: &[usize], parent: &GradNode<E>) {
    assert_eq!(
        shape,
        parent.shape.as_slice(),
        "a VJP returned a gradient of the wrong shape for its parent"
    );
}

/// The incoming gradient, kept on the meter until the VJP's results are in (it is alive
/// while the VJP runs, and a VJP may hand it back as one of its results). Counted off the
/// meter when dropped.
struct Incoming {
    bytes: usize,
    tag: Tag,
}

impl Drop for Incoming {
    fn drop(&mut self) {
        memory::on_free_tagged(self.bytes, self.tag);
    }
}

/// Runs one op's backward on `grad`: the gradient for each parent, and the incoming
/// gradient's hold on the meter (to drop once the results are placed). A values VJP is
/// skipped for a meta gradient, every parent in the graph getting a meta gradient; a
/// tensors VJP runs either way.
fn run_vjp<E: Element>(
    vjp: Backward<E>,
    grad: Buffer<E>,
    parents: &[Option<Rc<GradNode<E>>>],
) -> (Vec<Option<Returned<E>>>, Option<Incoming>) {
    match vjp {
        Backward::Values(vjp) => {
            // The values leave the buffer (which counts them off) and are counted again
            // until the results are placed: the same events for a meta gradient.
            let (bytes, tag) = (grad.bytes(), grad.tag());
            let values = (!grad.is_meta()).then(|| grad.into_array());
            memory::on_alloc_tagged(bytes, tag);
            let incoming = Incoming { bytes, tag };
            let returned = match values {
                Some(values) => vjp(values)
                    .into_iter()
                    .map(|grad| grad.map(Returned::Values))
                    .collect(),
                None => {
                    drop(vjp);
                    parents
                        .iter()
                        .map(|parent| parent.as_ref().map(|_| Returned::Meta))
                        .collect()
                }
            };
            (returned, Some(incoming))
        }
        Backward::Tensors(vjp) => {
            let returned = vjp(Tensor::from_buffer(grad))
                .into_iter()
                .map(|grad| grad.map(|grad| Returned::Buffer(grad.into_buffer())))
                .collect();
            (returned, None)
        }
    }
}
