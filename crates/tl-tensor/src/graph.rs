//! The autograd graph and the backward sweep.
//!
//! Each tensor that requires grad owns a [`GradNode`]: a leaf node accumulates the gradient
//! of a parameter, an op node holds its parents' nodes and the vector-Jacobian product (VJP)
//! of the op. Nodes point to nodes, never to tensor values, so the graph keeps alive only what
//! each VJP chose to save. `backward` *takes* every op's record when it runs it, so saved
//! activations are freed as the sweep goes, and a graph can be swept only once.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

use ndarray::{ArrayD, Zip};

use crate::memory::{self, Kind, Stage, Tag};
use crate::ops::elementwise::PARALLEL_MIN_LEN;
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

/// The backward of an op whose parents' gradients are computed one at a time: given the
/// output's gradient and the index of a parent that requires grad, that parent's gradient
/// (see [`Tensor::from_product_by_parent`](crate::Tensor::from_product_by_parent)). A
/// product is written so: a split sweep ([`Tensor::backward_input_from`]) asks for the
/// input's side now and the weight's side later, and each is computed only when asked.
///
/// [`Tensor::backward_input_from`]: crate::Tensor::backward_input_from
pub type ParentVjp<E> = Box<dyn Fn(&ArrayD<E>, usize) -> ArrayD<E>>;

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
        /// Whether the leaf is a parameter ([`Tensor::param`](crate::Tensor::param)) rather
        /// than an input that requires grad: a split sweep defers the parameters' gradients.
        param: bool,
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
    /// A function of values, one parent at a time, skipped for a meta gradient as
    /// `Values` is.
    ByParent(ParentVjp<E>),
}

/// A gradient a VJP hands back: values, or (for a meta gradient) the shape of its parent.
enum Returned<E: Element> {
    Values(ArrayD<E>),
    Meta,
    Buffer(Buffer<E>),
}

impl<E: Element> GradNode<E> {
    /// A leaf owned by the meter's current owner: a parameter's, or (`param` false) an
    /// input's that requires grad.
    pub(crate) fn leaf(shape: Vec<usize>, param: bool) -> Rc<Self> {
        Rc::new(Self {
            shape,
            kind: NodeKind::Leaf {
                param,
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
            let zip = Zip::from(acc).and(grad);
            if grad.len() >= PARALLEL_MIN_LEN {
                zip.par_for_each(|a, &g| *a += g);
            } else {
                zip.for_each(|a, &g| *a += g);
            }
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
///
/// Inside [`split`] (a split sweep's first half, and any sweep a VJP starts during it, as
/// a checkpointed segment's rerun does) only the input's half runs now; the rest is handed
/// to the split's collector (see [`Deferred`]).
pub(crate) fn backward<E: Element>(root: &Rc<GradNode<E>>, grad_out: Buffer<E>) {
    assert_eq!(
        grad_out.shape(),
        root.shape.as_slice(),
        "backward: the output gradient's shape must match the tensor's"
    );
    let _sweep = Sweep::start();
    let _stage = memory::stage_scope(Stage::Backward);
    let order = topological_order(root);
    let mut sweep = Sweeping {
        waiting: hooked_consumers(&order),
        pending: HashMap::from([(root.key(), grad_out)]),
    };
    if !is_splitting() {
        // Consume the order front to back, dropping each node's entry as soon as it has run.
        for node in order {
            sweep.run(&node);
        }
        return;
    }
    let inputs = reaching_inputs(&order);
    let mut halves = HashMap::new();
    for node in &order {
        if inputs.contains(&node.key()) {
            sweep.run_input_half(node, &inputs, &mut halves);
        }
    }
    let deferred = Deferred {
        order,
        inputs,
        halves,
        sweep,
    };
    defer(Box::new(move || deferred.run()));
}

/// A sweep's state: the gradients waiting for their node, and how many results each hooked
/// leaf still waits for.
struct Sweeping<E: Element> {
    pending: HashMap<usize, Buffer<E>>,
    waiting: HashMap<usize, usize>,
}

impl<E: Element> Sweeping<E> {
    /// Runs `node` whole, if a gradient reached it: a leaf accumulates it, an op hands each
    /// parent its gradient.
    fn run(&mut self, node: &Rc<GradNode<E>>) {
        let Some((
            grad,
            OpRecord {
                parents,
                vjp,
                scope,
            },
        )) = self.reach(node)
        else {
            return;
        };
        // The op's backward, and the gradients it makes, belong where its forward ran (its
        // unit, its micro-batch), in the backward stage.
        let _scope = backward_scope(scope);
        let flight = in_flight();
        let (parent_grads, incoming) = run_vjp(vjp, grad, &parents, |_| true);
        for (parent, parent_grad) in parents.iter().zip(parent_grads) {
            if let Some(parent) = parent {
                self.hand(parent, parent_grad, flight);
            }
        }
        drop(incoming);
        // `parents` and the VJP's saved values drop here.
    }

    /// Runs the input's half of `node`, on the path from an input to the output, if a
    /// gradient reached it: its parents on such a path get their gradients now; what goes
    /// to the others (towards the parameters only) is kept in `halves`, computed already or,
    /// for a [`Backward::ByParent`] VJP, still to compute.
    fn run_input_half(
        &mut self,
        node: &Rc<GradNode<E>>,
        inputs: &HashSet<usize>,
        halves: &mut HashMap<usize, Half<E>>,
    ) {
        let Some((
            grad,
            OpRecord {
                parents,
                vjp,
                scope,
            },
        )) = self.reach(node)
        else {
            return;
        };
        let _scope = backward_scope(scope);
        let flight = in_flight();
        let now = |i: usize| {
            parents[i]
                .as_ref()
                .is_some_and(|p| inputs.contains(&p.key()))
        };
        let rest = (0..parents.len()).any(|i| parents[i].is_some() && !now(i));
        if let Backward::ByParent(vjp) = vjp {
            let parent_grads = by_parent(&vjp, &grad, &parents, now);
            // What the VJP saved (the forward's operands) lives on only for the other half.
            let later = if rest {
                let vjp = Backward::ByParent(vjp);
                Some(Later::Compute(Box::new(Pending { vjp, grad, scope })))
            } else {
                drop(vjp);
                None
            };
            for (i, parent_grad) in parent_grads.into_iter().enumerate() {
                if let (true, Some(parent)) = (now(i), &parents[i]) {
                    self.hand(parent, parent_grad, flight);
                }
            }
            if let Some(later) = later {
                halves.insert(node.key(), Half { parents, later });
            }
            return;
        }
        let (parent_grads, incoming) = run_vjp(vjp, grad, &parents, |_| true);
        let mut computed = Vec::new();
        for (i, parent_grad) in parent_grads.into_iter().enumerate() {
            let Some(parent) = &parents[i] else {
                continue;
            };
            if now(i) {
                self.hand(parent, parent_grad, flight);
            } else {
                // Kept as storage, so the meter counts it while it waits.
                computed.push((i, parent_grad.map(|g| g.into_buffer(parent, flight))));
            }
        }
        drop(incoming);
        if rest {
            halves.insert(
                node.key(),
                Half {
                    parents,
                    later: Later::Computed(computed),
                },
            );
        }
    }

    /// The gradient waiting for `node` and, for an op, its record to run; a leaf takes its
    /// gradient here. `None` when nothing more is to be done: no gradient reached the node,
    /// or it was a leaf.
    fn reach(&mut self, node: &Rc<GradNode<E>>) -> Option<(Buffer<E>, OpRecord<E>)> {
        let grad = self.pending.remove(&node.key())?;
        match &node.kind {
            NodeKind::Leaf { .. } => {
                finish_leaf(node, grad);
                None
            }
            NodeKind::Op(record) => Some((grad, take_record(record))),
        }
    }

    /// Adds a VJP's result for `parent` to the gradient waiting for it, and finishes a
    /// hooked leaf once its last result is in. Values are counted on the meter only when
    /// they start a gradient of their own, not when they are added into one.
    fn hand(&mut self, parent: &Rc<GradNode<E>>, grad: Option<Returned<E>>, flight: Tag) {
        if let Some(grad) = grad {
            let entry = self.pending.get_mut(&parent.key());
            match (grad, entry) {
                (Returned::Values(values), Some(acc)) => {
                    check_shape(values.shape(), parent);
                    add_into(acc, Some(&values));
                }
                (Returned::Meta, Some(acc)) => add_into(acc, None),
                (Returned::Buffer(buffer), Some(acc)) => {
                    check_shape(buffer.shape(), parent);
                    add_into(acc, values_of(&buffer));
                }
                (grad, None) => {
                    let buffer = grad.into_buffer(parent, flight);
                    self.pending.insert(parent.key(), buffer);
                }
            }
        }
        self.result_in(parent);
    }

    /// One of `parent`'s consumers has run: a hooked leaf whose last one it was is finished.
    fn result_in(&mut self, parent: &Rc<GradNode<E>>) {
        if !self.waiting.is_empty()
            && let Some(count) = self.waiting.get_mut(&parent.key())
        {
            *count -= 1;
            if *count == 0 {
                self.waiting.remove(&parent.key());
                if let Some(grad) = self.pending.remove(&parent.key()) {
                    finish_leaf(parent, grad);
                }
            }
        }
    }
}

/// An op's record, taken out of its node for its backward.
fn take_record<E: Element>(record: &RefCell<Option<OpRecord<E>>>) -> OpRecord<E> {
    record
        .borrow_mut()
        .take()
        .expect("backward through a graph that a previous backward already freed")
}

/// The meter's scope of an op's backward: its forward's, in the backward stage.
fn backward_scope(scope: Tag) -> memory::TagScope {
    memory::tag_scope(Tag {
        stage: Stage::Backward,
        ..scope
    })
}

/// The nodes of `order` on a path from an input to its root: the leaves that require grad
/// but are not parameters, and every op with such a node among its parents.
fn reaching_inputs<E: Element>(order: &[Rc<GradNode<E>>]) -> HashSet<usize> {
    let mut reaching = HashSet::new();
    // Back to front: each node after everything it consumes.
    for node in order.iter().rev() {
        let reaches = match &node.kind {
            NodeKind::Leaf { param, .. } => !param,
            NodeKind::Op(record) => record
                .borrow()
                .as_ref()
                .expect("a node in the order has its record")
                .parents
                .iter()
                .flatten()
                .any(|parent| reaching.contains(&parent.key())),
        };
        if reaches {
            reaching.insert(node.key());
        }
    }
    reaching
}

/// What an op on an input's path still owes the parameters' side after the input's half.
struct Half<E: Element> {
    parents: Vec<Option<Rc<GradNode<E>>>>,
    later: Later<E>,
}

enum Later<E: Element> {
    /// The results for the parents off the input's path, computed with the rest (one per
    /// parent that requires grad, in order; `None` where the VJP gave none).
    Computed(Vec<(usize, Option<Buffer<E>>)>),
    /// A by-parent VJP, with the output's gradient and the forward's scope, to run for
    /// those parents.
    Compute(Box<Pending<E>>),
}

/// A by-parent VJP's second run: the VJP, the output's gradient, and the forward's scope.
struct Pending<E: Element> {
    vjp: Backward<E>,
    grad: Buffer<E>,
    scope: Tag,
}

/// The weights' half of a split sweep: the nodes off the inputs' paths and what the ops
/// on them still owe those nodes, swept in the order of the whole sweep. So every
/// gradient gets its terms in the order an unsplit sweep adds them, and the saved values
/// the weights' side needs stay alive until it runs.
struct Deferred<E: Element> {
    order: Vec<Rc<GradNode<E>>>,
    inputs: HashSet<usize>,
    halves: HashMap<usize, Half<E>>,
    sweep: Sweeping<E>,
}

impl<E: Element> Deferred<E> {
    fn run(self) {
        let Self {
            order,
            inputs,
            mut halves,
            mut sweep,
        } = self;
        let _sweep = Sweep::start();
        let _stage = memory::stage_scope(Stage::Backward);
        for node in order {
            if !inputs.contains(&node.key()) {
                sweep.run(&node);
                continue;
            }
            let Some(Half { parents, later }) = halves.remove(&node.key()) else {
                continue;
            };
            let off_path = |i: usize| parents[i].as_ref().filter(|p| !inputs.contains(&p.key()));
            match later {
                Later::Computed(computed) => {
                    for (i, grad) in computed {
                        let parent = off_path(i).expect("kept for a parent off the path");
                        let flight = grad.as_ref().map_or_else(in_flight, Buffer::tag);
                        sweep.hand(parent, grad.map(Returned::Buffer), flight);
                    }
                }
                Later::Compute(pending) => {
                    let Pending { vjp, grad, scope } = *pending;
                    let _scope = backward_scope(scope);
                    let flight = in_flight();
                    let Backward::ByParent(vjp) = vjp else {
                        unreachable!("only a by-parent VJP is run in halves");
                    };
                    let wanted = |i: usize| off_path(i).is_some();
                    let parent_grads = by_parent(&vjp, &grad, &parents, wanted);
                    drop(vjp);
                    for (i, parent_grad) in parent_grads.into_iter().enumerate() {
                        if let Some(parent) = off_path(i) {
                            sweep.hand(parent, parent_grad, flight);
                        }
                    }
                    drop(grad);
                }
            }
        }
    }
}

/// A sweep's second half, to run later.
type SecondHalf = Box<dyn FnOnce()>;

thread_local! {
    /// While a split sweep's first half runs on this thread: the second halves of the
    /// sweeps it made (its own and those its VJPs started), in the order they were made.
    static SPLIT: RefCell<Option<Vec<SecondHalf>>> = const { RefCell::new(None) };
}

fn is_splitting() -> bool {
    SPLIT.with(|split| split.borrow().is_some())
}

fn defer(work: SecondHalf) {
    SPLIT.with(|split| {
        split
            .borrow_mut()
            .as_mut()
            .expect("deferred only while splitting")
            .push(work);
    });
}

/// Runs `first` as the first half of a split sweep: every backward sweep inside it
/// computes only what the inputs' gradients need, and what it leaves for the parameters
/// comes back as [`WeightGradients`]. Restores the previous state on return and on panic.
pub(crate) fn split(first: impl FnOnce()) -> WeightGradients {
    struct Restore(Option<Vec<SecondHalf>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            SPLIT.with(|split| *split.borrow_mut() = previous);
        }
    }
    let previous = SPLIT.with(|split| split.borrow_mut().replace(Vec::new()));
    let restore = Restore(previous);
    first();
    let work = SPLIT
        .with(|split| split.borrow_mut().take())
        .unwrap_or_default();
    drop(restore);
    WeightGradients { work }
}

/// The second half of a split backward (see
/// [`Tensor::backward_input_from`](crate::Tensor::backward_input_from)): the parameters'
/// gradients, not computed yet. [`run`](Self::run) computes them and accumulates them
/// into the parameters' `.grad`; dropping it instead frees what it held (the activations
/// the weights' gradients would have needed) and the parameters get nothing.
#[must_use = "the parameters get their gradients only when it runs"]
pub struct WeightGradients {
    work: Vec<SecondHalf>,
}

impl WeightGradients {
    /// Computes the parameters' gradients and accumulates them, each sweep's in the order
    /// its first half ran (a checkpointed segment's rerun before the sweep that ran it).
    pub fn run(self) {
        for work in self.work {
            work();
        }
    }
}

impl std::fmt::Debug for WeightGradients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightGradients")
            .field("sweeps", &self.work.len())
            .finish()
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

impl<E: Element> Returned<E> {
    /// The gradient as storage tagged `flight` (meta storage of `parent`'s shape for a
    /// meta gradient).
    fn into_buffer(self, parent: &GradNode<E>, flight: Tag) -> Buffer<E> {
        match self {
            Returned::Values(values) => {
                check_shape(values.shape(), parent);
                Buffer::new_tagged(values, flight)
            }
            Returned::Meta => Buffer::meta_tagged(&parent.shape, flight),
            Returned::Buffer(mut buffer) => {
                check_shape(buffer.shape(), parent);
                buffer.set_tag(flight);
                buffer
            }
        }
    }
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

/// What holds the incoming gradient until an op's results are placed.
enum Held<E: Element> {
    /// Its values went into a VJP; its bytes are still counted, until this drops.
    Incoming { _counted: Incoming },
    /// The gradient itself, which a by-parent VJP read.
    Gradient { _gradient: Buffer<E> },
}

/// Runs one op's backward on `grad`: the gradient for each parent (a by-parent VJP only for
/// the parents `wanted`), and the incoming gradient's hold on the meter (to drop once the
/// results are placed). A values VJP is skipped for a meta gradient, every parent in the
/// graph getting a meta gradient; a tensors VJP runs either way.
fn run_vjp<E: Element>(
    vjp: Backward<E>,
    grad: Buffer<E>,
    parents: &[Option<Rc<GradNode<E>>>],
    wanted: impl Fn(usize) -> bool,
) -> (Vec<Option<Returned<E>>>, Option<Held<E>>) {
    let (returned, held) = match vjp {
        Backward::Values(vjp) => {
            // The values leave the buffer (which counts them off) and are counted again
            // until the results are placed: the same events for a meta gradient.
            let (bytes, tag) = (grad.bytes(), grad.tag());
            let values = (!grad.is_meta()).then(|| grad.into_array());
            memory::on_alloc_tagged(bytes, tag);
            let incoming = Incoming { bytes, tag };
            let returned: Vec<_> = match values {
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
            (returned, Some(Held::Incoming { _counted: incoming }))
        }
        Backward::Tensors(vjp) => {
            let returned = vjp(Tensor::from_buffer(grad))
                .into_iter()
                .map(|grad| grad.map(|grad| Returned::Buffer(grad.into_buffer())))
                .collect();
            (returned, None)
        }
        Backward::ByParent(vjp) => {
            let returned = by_parent(&vjp, &grad, parents, wanted);
            // As a values VJP is consumed by its call: what it saved is freed before the
            // results are placed.
            drop(vjp);
            (returned, Some(Held::Gradient { _gradient: grad }))
        }
    };
    assert_eq!(
        returned.len(),
        parents.len(),
        "a VJP must return one entry per parent"
    );
    (returned, held)
}

/// A by-parent VJP's gradients for the parents that require grad and are `wanted` (meta
/// gradients for a meta `grad`), in the parents' order.
fn by_parent<E: Element>(
    vjp: &ParentVjp<E>,
    grad: &Buffer<E>,
    parents: &[Option<Rc<GradNode<E>>>],
    wanted: impl Fn(usize) -> bool,
) -> Vec<Option<Returned<E>>> {
    (parents.iter().enumerate())
        .map(|(i, parent)| {
            let parent = parent.as_ref().filter(|_| wanted(i))?;
            Some(match grad.is_meta() {
                true => Returned::Meta,
                false => {
                    let values = vjp(grad.array(), i);
                    check_shape(values.shape(), parent);
                    Returned::Values(values)
                }
            })
        })
        .collect()
}
