//! [`Tensor`]: an n-dimensional array with an optional place in the autograd graph.

use std::cell::{Ref, RefCell};
use std::fmt;
use std::rc::{Rc, Weak};

use ndarray::{ArrayD, IxDyn};

use crate::graph::{self, Backward, GradNode, GradReadyHook, NodeKind, OpRecord, TensorVjp};
use crate::memory::{self, Kind, Tag};
use crate::meta::is_meta_mode;
use crate::mode::is_grad_enabled;
use crate::storage::Buffer;
use crate::{Element, Result, TensorError};

/// An n-dimensional array of `E` (`f32` by default, or `f64`) that records the ops it goes
/// through, so gradients can flow back to the leaves that require them.
///
/// Cloning is cheap: clones share the same value and the same place in the graph. A tensor
/// stays on the thread that made it.
///
/// ```
/// use tl_tensor::Tensor;
/// let w = Tensor::<f64>::param(ndarray::arr1(&[3.0]).into_dyn());
/// let loss = (&w * &w).sum_all(); // d(w²)/dw = 2w
/// loss.backward();
/// assert_eq!(w.grad().unwrap()[[0]], 6.0);
/// ```
pub struct Tensor<E: Element = f32> {
    inner: Rc<Inner<E>>,
}

struct Inner<E: Element> {
    value: Rc<RefCell<Buffer<E>>>,
    /// `None`: a constant, no gradient flows into or through it.
    node: RefCell<Option<Rc<GradNode<E>>>>,
}

impl<E: Element> Clone for Tensor<E> {
    fn clone(&self) -> Self {
        Self {
            inner: Rc::clone(&self.inner),
        }
    }
}

/// A reference to a tensor's value that does not keep it alive, and that stops matching
/// as soon as the value is written in place: a key for caching something computed from a
/// value (a rounded copy of it, say) without holding on to the value or trusting a stale
/// result. Made by [`Tensor::downgrade`].
///
/// ```
/// use tl_tensor::Tensor;
/// let x = Tensor::<f64>::from_vec(vec![1.0, 2.0], &[2])?;
/// let weak = x.downgrade();
/// assert!(weak.refers_to(&x) && weak.refers_to(&x.detach())); // the same storage
/// assert!(weak.upgrade().is_some_and(|value| value.shares_storage(&x)));
/// x.update_value(|v| v[0] = 3.0);
/// assert!(!weak.refers_to(&x) && weak.upgrade().is_none()); // written since
/// # Ok::<(), tl_tensor::TensorError>(())
/// ```
pub struct WeakValue<E: Element> {
    value: Weak<RefCell<Buffer<E>>>,
    version: u64,
}

impl<E: Element> WeakValue<E> {
    /// Whether `tensor` holds this value, unchanged since the reference was taken.
    pub fn refers_to(&self, tensor: &Tensor<E>) -> bool {
        std::ptr::eq(self.value.as_ptr(), Rc::as_ptr(&tensor.inner.value))
            && tensor.inner.value.borrow().version() == self.version
    }

    /// A constant (outside the graph) holding the value, if it is still alive and
    /// unchanged since the reference was taken.
    pub fn upgrade(&self) -> Option<Tensor<E>> {
        let value = self.value.upgrade()?;
        if value.borrow().version() != self.version {
            return None;
        }
        Some(Tensor::on_storage(value, None))
    }
}

impl<E: Element> fmt::Debug for WeakValue<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeakValue")
            .field("alive", &(self.value.strong_count() > 0))
            .field("version", &self.version)
            .finish()
    }
}

impl<E: Element> Tensor<E> {
    /// A tensor holding `value`, or in [meta mode](crate::meta) its shape only; a leaf's
    /// storage (`node` given) is tagged as weights on the meter.
    fn with_node(value: ArrayD<E>, node: Option<Rc<GradNode<E>>>) -> Self {
        let tag = match node {
            Some(_) => weights_tag(),
            None => memory::current_tag(),
        };
        let buffer = if is_meta_mode() {
            Buffer::meta_tagged(value.shape(), tag)
        } else {
            Buffer::new_tagged(value, tag)
        };
        Self::on_storage(Rc::new(RefCell::new(buffer)), node)
    }

    /// A tensor on its own storage.
    pub(crate) fn from_buffer(buffer: Buffer<E>) -> Self {
        Self::on_storage(Rc::new(RefCell::new(buffer)), None)
    }

    /// The storage, taken over when this is its only handle, or else a copy of it (a meta
    /// copy of a meta tensor).
    pub(crate) fn into_buffer(self) -> Buffer<E> {
        let value = match Rc::try_unwrap(self.inner) {
            Ok(inner) => inner.value,
            Err(shared) => Rc::clone(&shared.value),
        };
        match Rc::try_unwrap(value) {
            Ok(cell) => cell.into_inner(),
            Err(shared) => {
                let buffer = shared.borrow();
                if buffer.is_meta() {
                    Buffer::meta(buffer.shape())
                } else {
                    Buffer::new(buffer.array().clone())
                }
            }
        }
    }

    /// A constant of shape `shape` with no values: a [meta](crate::meta) tensor, counted on
    /// the memory meter as a real one of that shape.
    ///
    /// ```
    /// use tl_tensor::{Tensor, memory};
    /// let before = memory::live_bytes();
    /// let x = Tensor::<f32>::meta(&[1000, 1000]);
    /// assert!(x.is_meta() && x.value().is_empty());
    /// assert_eq!((x.shape(), memory::live_bytes() - before), (vec![1000, 1000], 4_000_000));
    /// ```
    pub fn meta(shape: &[usize]) -> Self {
        Self::from_buffer(Buffer::meta(shape))
    }

    /// A meta leaf that requires grad: a parameter with a shape and no values.
    pub fn meta_param(shape: &[usize]) -> Self {
        Self::on_storage(
            Rc::new(RefCell::new(Buffer::meta_tagged(shape, weights_tag()))),
            Some(GradNode::leaf(shape.to_vec(), true)),
        )
    }

    /// A parameter of shape `shape` holding `init()`; in [meta mode](crate::meta) a meta
    /// parameter, and `init` is not called.
    ///
    /// # Panics
    /// If `init` returns another shape.
    pub fn param_with(shape: &[usize], init: impl FnOnce() -> ArrayD<E>) -> Self {
        if is_meta_mode() {
            return Self::meta_param(shape);
        }
        let value = init();
        assert_eq!(
            value.shape(),
            shape,
            "param_with: the initialiser made another shape"
        );
        Self::param(value)
    }

    /// The tag of this tensor's storage on the memory meter (see [`memory`](crate::memory)).
    pub fn memory_tag(&self) -> Tag {
        self.inner.value.borrow().tag()
    }

    /// Whether this tensor is [meta](crate::meta): a shape with no values.
    pub fn is_meta(&self) -> bool {
        self.inner.value.borrow().is_meta()
    }

    /// Whether this leaf's accumulated gradient is meta (false without a gradient).
    pub fn grad_is_meta(&self) -> bool {
        match self.inner.node.borrow().as_deref() {
            Some(GradNode {
                kind: NodeKind::Leaf { grad, .. },
                ..
            }) => grad.borrow().as_ref().is_some_and(Buffer::is_meta),
            _ => false,
        }
    }

    /// Takes this leaf's accumulated gradient out as a constant tensor on the same storage
    /// (nothing is copied or allocated), leaving the leaf with none.
    pub fn take_grad(&self) -> Option<Tensor<E>> {
        match self.inner.node.borrow().as_deref() {
            Some(GradNode {
                kind: NodeKind::Leaf { grad, .. },
                ..
            }) => grad.borrow_mut().take().map(Self::from_buffer),
            _ => None,
        }
    }

    /// A tensor on existing storage (shared, not copied) with its own place in the graph.
    fn on_storage(value: Rc<RefCell<Buffer<E>>>, node: Option<Rc<GradNode<E>>>) -> Self {
        Self {
            inner: Rc::new(Inner {
                value,
                node: RefCell::new(node),
            }),
        }
    }

    /// A constant tensor (no gradient) holding `array` (in [meta mode](crate::meta), its
    /// shape).
    pub fn from_array(array: ArrayD<E>) -> Self {
        Self::with_node(array, None)
    }

    /// A leaf that requires grad — a trainable parameter — holding `array` (in [meta
    /// mode](crate::meta), its shape; see [`param_with`](Self::param_with) to skip making
    /// the values).
    pub fn param(array: ArrayD<E>) -> Self {
        let shape = array.shape().to_vec();
        Self::with_node(array, Some(GradNode::leaf(shape, true)))
    }

    /// A constant tensor of the given shape from row-major data.
    ///
    /// # Errors
    /// [`TensorError::DataLength`] when `data.len()` is not the product of `shape`.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let t = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    /// assert_eq!(t.shape(), vec![2, 3]);
    /// assert!(Tensor::<f32>::from_vec(vec![1.0], &[2, 3]).is_err());
    /// # Ok::<(), tl_tensor::TensorError>(())
    /// ```
    pub fn from_vec(data: Vec<E>, shape: &[usize]) -> Result<Self> {
        let len = data.len();
        let array =
            ArrayD::from_shape_vec(IxDyn(shape), data).map_err(|_| TensorError::DataLength {
                len,
                shape: shape.to_vec(),
            })?;
        Ok(Self::from_array(array))
    }

    /// A 0-dimensional constant.
    pub fn scalar(value: E) -> Self {
        Self::from_array(ArrayD::from_elem(IxDyn(&[]), value))
    }

    /// A constant filled with `value`.
    pub fn full(shape: &[usize], value: E) -> Self {
        Self::from_array(ArrayD::from_elem(IxDyn(shape), value))
    }

    /// A constant of zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        Self::full(shape, E::zero())
    }

    /// A constant of ones.
    pub fn ones(shape: &[usize]) -> Self {
        Self::full(shape, E::one())
    }

    /// Records the output of an op: `value`, computed from `parents`, with `vjp` mapping the
    /// output's gradient to one gradient per parent (in order; `None` where there is none).
    ///
    /// This is the one way an op enters the graph. A node is recorded only when grad mode is
    /// on and some parent requires grad; otherwise the result is a constant and `vjp` is
    /// dropped unused. A VJP must return gradients shaped like their parents.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// // y = 3x, so dL/dx = 3 · dL/dy
    /// let x = Tensor::<f64>::param(ndarray::arr1(&[1.0, 2.0]).into_dyn());
    /// let value = x.value().mapv(|v| 3.0 * v);
    /// let y = Tensor::from_op(value, &[&x], |grad_out| vec![Some(grad_out * 3.0)]);
    /// y.sum_all().backward();
    /// assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[3.0, 3.0]);
    /// ```
    ///
    /// # Panics
    /// If a parent is [meta](crate::meta): an op that computes its value before its node
    /// exists has no shape rule to run without values. Such an op records itself with
    /// [`from_op_shaped`](Self::from_op_shaped) instead.
    pub fn from_op(
        value: ArrayD<E>,
        parents: &[&Tensor<E>],
        vjp: impl FnOnce(ArrayD<E>) -> Vec<Option<ArrayD<E>>> + 'static,
    ) -> Self {
        assert!(
            !parents.iter().any(|parent| parent.is_meta()),
            "an op recorded with from_op got a meta input: it has no shape rule (record it \
             with from_op_shaped)"
        );
        let output = Self::from_array(value);
        output.attach_op(parents, Backward::Values(Box::new(vjp)));
        output
    }

    /// Records the output of an op of shape `shape` whose value is `compute()`: the way
    /// every op of this crate enters the graph. When a parent is [meta](crate::meta), or
    /// meta mode is on, the output is a meta tensor of `shape` and `compute` is not called;
    /// otherwise `compute()`'s shape must be `shape`, so a wrong shape rule fails on real
    /// inputs. The VJP is as for [`from_op`](Self::from_op).
    ///
    /// # Panics
    /// If `compute()` returns an array of another shape.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let x = Tensor::<f64>::param(ndarray::arr1(&[1.0, 2.0]).into_dyn());
    /// let triple = |x: &Tensor<f64>| {
    ///     Tensor::from_op_shaped(&x.shape(), || x.value().mapv(|v| 3.0 * v), &[x], |g| {
    ///         vec![Some(g * 3.0)]
    ///     })
    /// };
    /// assert_eq!(triple(&x).to_vec(), vec![3.0, 6.0]);
    /// let m = Tensor::<f64>::meta_param(&[2]);
    /// let y = triple(&m); // nothing computed
    /// assert!(y.is_meta() && y.requires_grad());
    /// y.sum_all().backward();
    /// assert!(m.grad_is_meta());
    /// ```
    pub fn from_op_shaped(
        shape: &[usize],
        compute: impl FnOnce() -> ArrayD<E>,
        parents: &[&Tensor<E>],
        vjp: impl FnOnce(ArrayD<E>) -> Vec<Option<ArrayD<E>>> + 'static,
    ) -> Self {
        let output = if !crate::meta::computes(parents) {
            Self::meta(shape)
        } else {
            let value = compute();
            assert_eq!(
                value.shape(),
                shape,
                "an op's kernel made a result of another shape than its shape rule says"
            );
            Self::from_array(value)
        };
        output.attach_op(parents, Backward::Values(Box::new(vjp)));
        output
    }

    /// Records an op whose backward is written over tensors: `vjp` gets the output's
    /// gradient as a constant tensor (meta for a meta output) and returns one gradient per
    /// parent, shaped like it. Unlike a values VJP it runs in meta mode too, so an op whose
    /// backward does more than arithmetic — reruns a checkpointed segment, gathers a
    /// sharded parameter — does it in a meta run as in a real one. The output shares
    /// `value`'s storage, as with [`from_op_shared`](Self::from_op_shared).
    ///
    /// A returned tensor that nothing else holds becomes the parent's gradient as it is; one
    /// still held elsewhere is copied.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let x = Tensor::<f64>::param(ndarray::arr1(&[1.0, 2.0]).into_dyn());
    /// let y = Tensor::from_op_tensors(&x.detach(), &[&x], |grad| vec![Some(grad.mul_scalar(2.0))]);
    /// y.sum_all().backward();
    /// assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[2.0, 2.0]);
    /// ```
    pub fn from_op_tensors(
        value: &Tensor<E>,
        parents: &[&Tensor<E>],
        vjp: impl FnOnce(Tensor<E>) -> Vec<Option<Tensor<E>>> + 'static,
    ) -> Self {
        let output = value.detach();
        let vjp: TensorVjp<E> = Box::new(vjp);
        output.attach_op(parents, Backward::Tensors(vjp));
        output
    }

    /// [`Tensor::from_op`] for an op whose output is a value that `value` already holds: the
    /// new tensor shares that storage, as [`Tensor::detach`] does, instead of allocating its
    /// own. For an op that can hand back a result it computed before (a checkpointed
    /// segment's rerun reusing its forward pass's result, see tl-recompute's
    /// `keep_for_rerun`).
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let x = Tensor::<f64>::param(ndarray::arr1(&[1.0, 2.0]).into_dyn());
    /// let known = Tensor::from_array(x.value().mapv(|v| 3.0 * v)); // 3x, computed earlier
    /// let y = Tensor::from_op_shared(&known, &[&x], |grad_out| vec![Some(grad_out * 3.0)]);
    /// assert!(y.shares_storage(&known));
    /// y.sum_all().backward();
    /// assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[3.0, 3.0]);
    /// ```
    pub fn from_op_shared(
        value: &Tensor<E>,
        parents: &[&Tensor<E>],
        vjp: impl FnOnce(ArrayD<E>) -> Vec<Option<ArrayD<E>>> + 'static,
    ) -> Self {
        let output = value.detach();
        output.attach_op(parents, Backward::Values(Box::new(vjp)));
        output
    }

    /// [`Tensor::from_op`] for an elementwise op that may overwrite its input: `input` is
    /// consumed, and if nothing else holds its value (no clone, no `detach`, no saved
    /// handle), `apply` rewrites that storage and the output takes it over, so no memory is
    /// allocated and the values are passed over once. Otherwise `apply` runs on a copy and
    /// the input is left as it was.
    ///
    /// The input's node stays the output's parent, so gradients flow through it as through
    /// any op; the VJP receives the output's gradient. This is how an op rounds a result it
    /// has just computed (autocast's rounding of a product) without a second buffer.
    ///
    /// ```
    /// use tl_tensor::{Tensor, memory};
    /// let x = Tensor::<f64>::param(ndarray::arr1(&[1.0, 2.0]).into_dyn());
    /// let y = x.mul_scalar(2.0); // a fresh result only this code holds
    /// let before = memory::live_bytes();
    /// let z = Tensor::from_op_in_place(y, |v| v.mapv_inplace(|v| v + 1.0), |grad| vec![Some(grad)]);
    /// assert_eq!(memory::live_bytes(), before, "written in place");
    /// assert_eq!(z.to_vec(), vec![3.0, 5.0]);
    /// z.sum_all().backward();
    /// assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[2.0, 2.0]);
    /// ```
    pub fn from_op_in_place(
        input: Tensor<E>,
        apply: impl FnOnce(&mut ArrayD<E>),
        vjp: impl FnOnce(ArrayD<E>) -> Vec<Option<ArrayD<E>>> + 'static,
    ) -> Self {
        let sole_holder =
            Rc::strong_count(&input.inner) == 1 && Rc::strong_count(&input.inner.value) == 1;
        let output = match (sole_holder, input.is_meta()) {
            (true, _) => input.detach(),
            (false, false) => Self::from_array(input.to_array()),
            (false, true) => Self::meta(&input.shape()),
        };
        if !output.is_meta() {
            output.update_value(apply);
        }
        output.attach_op(&[&input], Backward::Values(Box::new(vjp)));
        output
    }

    /// A weak reference to this tensor's value as it is now: see [`WeakValue`].
    pub fn downgrade(&self) -> WeakValue<E> {
        WeakValue {
            value: Rc::downgrade(&self.inner.value),
            version: self.inner.value.borrow().version(),
        }
    }

    /// Makes this fresh constant the output of an op: records its node when grad mode is on
    /// and some parent requires grad, and otherwise drops `vjp` unused. Either way after the
    /// output's storage exists, so the memory meter sees the output allocated before what
    /// an unused `vjp` held is freed.
    pub(crate) fn attach_op(&self, parents: &[&Tensor<E>], vjp: Backward<E>) {
        if !is_grad_enabled() || !parents.iter().any(|p| p.requires_grad()) {
            return;
        }
        let record = OpRecord {
            parents: parents.iter().map(|p| p.node()).collect(),
            vjp,
            scope: memory::current_tag(),
        };
        *self.inner.node.borrow_mut() = Some(GradNode::op(self.shape(), record));
    }

    pub(crate) fn node(&self) -> Option<Rc<GradNode<E>>> {
        self.inner.node.borrow().clone()
    }

    /// The shape, outermost dimension first (the value's shape even while it is
    /// [released](Self::release_value)).
    pub fn shape(&self) -> Vec<usize> {
        self.inner.value.borrow().shape().to_vec()
    }

    /// The number of dimensions (of the shape, released or not).
    pub fn ndim(&self) -> usize {
        self.inner.value.borrow().shape().len()
    }

    /// The number of elements of the shape (released or not: see
    /// [`release_value`](Self::release_value)).
    pub fn numel(&self) -> usize {
        self.inner.value.borrow().shape().iter().product()
    }

    /// A borrow of the value. Do not hold it across an op that updates this tensor in place.
    ///
    /// While the value is [released](Self::release_value), and for a [meta](crate::meta)
    /// tensor, this is an empty 1-D array.
    pub fn value(&self) -> Ref<'_, ArrayD<E>> {
        Ref::map(self.inner.value.borrow(), Buffer::array)
    }

    /// A copy of the value as an array.
    pub fn to_array(&self) -> ArrayD<E> {
        self.value().clone()
    }

    /// The elements in row-major order.
    pub fn to_vec(&self) -> Vec<E> {
        self.value().iter().copied().collect()
    }

    /// The one element of a one-element tensor; zero for a one-element [meta](crate::meta)
    /// tensor.
    ///
    /// # Panics
    /// If the tensor does not hold exactly one element.
    pub fn item(&self) -> E {
        if self.is_meta() {
            assert_eq!(
                self.numel(),
                1,
                "item: the tensor has shape {:?}, not one element",
                self.shape()
            );
            return E::zero();
        }
        let value = self.value();
        assert_eq!(
            value.len(),
            1,
            "item: the tensor has shape {:?}, not one element",
            value.shape()
        );
        *value.iter().next().expect("one element")
    }

    /// Whether gradients flow into this tensor (a parameter, or the output of an op recorded
    /// in the graph).
    pub fn requires_grad(&self) -> bool {
        self.inner.node.borrow().is_some()
    }

    /// Whether this tensor is a leaf: not the output of a recorded op.
    pub fn is_leaf(&self) -> bool {
        !matches!(
            self.inner.node.borrow().as_deref(),
            Some(GradNode {
                kind: NodeKind::Op(_),
                ..
            })
        )
    }

    /// Makes a leaf require grad or stop requiring it (dropping any gradient it has).
    ///
    /// # Panics
    /// On the output of a recorded op: only leaves can be switched.
    pub fn set_requires_grad(&self, requires_grad: bool) {
        assert!(
            self.is_leaf(),
            "set_requires_grad: only a leaf can be switched; use detach() on an op's output"
        );
        let node = requires_grad.then(|| GradNode::leaf(self.shape(), false));
        *self.inner.node.borrow_mut() = node;
    }

    /// A constant sharing this tensor's value, cut from the graph.
    pub fn detach(&self) -> Self {
        Self::on_storage(Rc::clone(&self.inner.value), None)
    }

    /// A fresh leaf sharing this tensor's value, requiring grad: the starting point of a
    /// graph separate from the one this tensor belongs to.
    pub fn detach_leaf(&self) -> Self {
        let leaf = GradNode::leaf(self.shape(), false);
        Self::on_storage(Rc::clone(&self.inner.value), Some(leaf))
    }

    /// Whether two handles are the same tensor (not merely equal values).
    pub fn same(&self, other: &Tensor<E>) -> bool {
        Rc::ptr_eq(&self.inner, &other.inner)
    }

    /// Whether two tensors share one value's storage (e.g. a tensor and its `detach`).
    pub fn shares_storage(&self, other: &Tensor<E>) -> bool {
        Rc::ptr_eq(&self.inner.value, &other.inner.value)
    }

    /// The gradient accumulated into this leaf, if any (a copy).
    ///
    /// Gradients of intermediate results are not kept: they return `None`.
    pub fn grad(&self) -> Option<ArrayD<E>> {
        self.with_grad(|grad| grad.cloned())
    }

    /// Runs `f` on the accumulated gradient without copying it.
    pub fn with_grad<T>(&self, f: impl FnOnce(Option<&ArrayD<E>>) -> T) -> T {
        match self.inner.node.borrow().as_deref() {
            Some(GradNode {
                kind: NodeKind::Leaf { grad, .. },
                ..
            }) => f(grad.borrow().as_ref().map(Buffer::array)),
            _ => f(None),
        }
    }

    /// Updates the accumulated gradient in place (unscaling, clipping); no-op without one,
    /// and for a [meta](crate::meta) gradient, which has no values to update.
    pub fn update_grad(&self, f: impl FnOnce(&mut ArrayD<E>)) {
        if let Some(GradNode {
            kind: NodeKind::Leaf { grad, .. },
            ..
        }) = self.inner.node.borrow().as_deref()
            && let Some(buffer) = grad.borrow_mut().as_mut()
            && !buffer.is_meta()
        {
            buffer.update(f);
        }
    }

    /// Replaces the accumulated gradient of a leaf that requires grad.
    ///
    /// # Panics
    /// If the tensor is not such a leaf, or `grad`'s shape differs from the tensor's.
    pub fn set_grad(&self, new_grad: Option<ArrayD<E>>) {
        let node = self.inner.node.borrow();
        let Some(GradNode {
            kind: NodeKind::Leaf { grad, .. },
            shape,
        }) = node.as_deref()
        else {
            panic!("set_grad: only a leaf that requires grad holds a gradient");
        };
        if let Some(new_grad) = &new_grad {
            assert_eq!(
                new_grad.shape(),
                shape.as_slice(),
                "set_grad: gradient shape must match the tensor's"
            );
        }
        let tag = node.as_deref().expect("a leaf").gradient_tag();
        *grad.borrow_mut() = new_grad.map(|array| Buffer::new_tagged(array, tag));
    }

    /// Replaces the accumulated gradient of a leaf that requires grad with `new_grad`'s
    /// storage (taken over if nothing else holds it, copied otherwise; meta stays meta).
    ///
    /// # Panics
    /// As [`set_grad`](Self::set_grad).
    pub fn set_grad_tensor(&self, new_grad: Option<Tensor<E>>) {
        let node = self.inner.node.borrow();
        let Some(GradNode {
            kind: NodeKind::Leaf { grad, .. },
            shape,
        }) = node.as_deref()
        else {
            panic!("set_grad_tensor: only a leaf that requires grad holds a gradient");
        };
        if let Some(new_grad) = &new_grad {
            assert_eq!(
                new_grad.shape(),
                *shape,
                "set_grad_tensor: gradient shape must match the tensor's"
            );
        }
        let tag = node.as_deref().expect("a leaf").gradient_tag();
        *grad.borrow_mut() = new_grad.map(|new_grad| {
            let mut buffer = new_grad.into_buffer();
            buffer.set_tag(tag);
            buffer
        });
    }

    /// Sets (or, with `None`, clears) the callback this leaf runs during every backward
    /// sweep right after its gradient has been accumulated, replacing any earlier one.
    ///
    /// A sweep writes a leaf's gradient exactly once, when it reaches the leaf in its
    /// topological order, i.e. after every use of the leaf in that graph has contributed:
    /// when the hook runs, the leaf's share of this sweep is complete. A leaf used inside a
    /// checkpointed segment receives its gradient during the segment's own inner sweep,
    /// which runs in the middle of the outer one, and the hook fires from there. A leaf that
    /// several sweeps reach (two segments, or a segment and the outer graph) fires once per
    /// sweep. The hook may read or replace the gradient ([`with_grad`](Self::with_grad),
    /// [`set_grad`](Self::set_grad)), but must not start a backward of its own.
    ///
    /// The hook belongs to the leaf's place in the graph: clones share it, while
    /// [`detach_leaf`](Self::detach_leaf) and [`set_requires_grad`](Self::set_requires_grad)
    /// make a new leaf without one. Without a hook a sweep costs what it did before.
    ///
    /// # Panics
    /// If the tensor is not a leaf that requires grad.
    ///
    /// ```
    /// use std::cell::Cell;
    /// use std::rc::Rc;
    /// use tl_tensor::Tensor;
    /// let w = Tensor::<f64>::param(ndarray::arr1(&[3.0]).into_dyn());
    /// let seen = Rc::new(Cell::new(None));
    /// let (probe, handle) = (Rc::clone(&seen), w.clone());
    /// w.set_grad_ready_hook(Some(Rc::new(move || probe.set(handle.grad().map(|g| g[0])))));
    /// (&w * &w).sum_all().backward(); // both uses are in before the hook runs: 2w = 6
    /// assert_eq!(seen.get(), Some(6.0));
    /// ```
    pub fn set_grad_ready_hook(&self, new_hook: Option<GradReadyHook>) {
        let node = self.inner.node.borrow();
        let Some(GradNode {
            kind: NodeKind::Leaf { hook, .. },
            ..
        }) = node.as_deref()
        else {
            panic!("set_grad_ready_hook: only a leaf that requires grad has one");
        };
        *hook.borrow_mut() = new_hook;
    }

    /// Drops the accumulated gradient (the next backward starts from zero).
    pub fn zero_grad(&self) {
        if let Some(GradNode {
            kind: NodeKind::Leaf { grad, .. },
            ..
        }) = self.inner.node.borrow().as_deref()
        {
            *grad.borrow_mut() = None;
        }
    }

    /// Updates the value in place (optimizer steps). The number of elements must not change.
    ///
    /// Updating a value that a recorded op saved for its backward changes that backward;
    /// optimizers update parameters between steps, when no graph is alive.
    pub fn update_value<T>(&self, f: impl FnOnce(&mut ArrayD<E>) -> T) -> T {
        self.inner.value.borrow_mut().update(f)
    }

    /// Frees the value's storage, keeping the tensor, its shape and its place in the graph:
    /// ZeRO-3 holds a parameter's values only while a layer computes with them.
    ///
    /// Meanwhile [`shape`](Self::shape), [`ndim`](Self::ndim) and [`numel`](Self::numel)
    /// stay those of the value, [`value`](Self::value) is an empty 1-D array (an op on the
    /// tensor fails on shapes), and the bytes are off the memory meter. Every handle on the
    /// same storage (clones, [`detach`](Self::detach)) sees the release. The gradient is
    /// not touched. [`restore_value`](Self::restore_value) puts values back.
    ///
    /// Only valid while no recorded op still needs the value for its backward (an op that
    /// saved this tensor would find it empty): release a parameter after the backward that
    /// used it, or before the forward that will; a checkpointed segment, which saves only
    /// its inputs, may release its parameters in between if it restores them before its
    /// rerun.
    ///
    /// # Panics
    /// If the value is released already, or borrowed.
    ///
    /// ```
    /// use tl_tensor::{Tensor, memory};
    /// let w = Tensor::<f32>::param(tl_tensor::ndarray::ArrayD::ones(vec![2, 3]));
    /// let before = memory::live_bytes();
    /// w.release_value();
    /// assert_eq!(memory::live_bytes(), before - 24);
    /// assert_eq!((w.shape(), w.numel(), w.value().len()), (vec![2, 3], 6, 0));
    /// w.restore_value(tl_tensor::ndarray::ArrayD::zeros(vec![2, 3]));
    /// assert_eq!((memory::live_bytes(), w.to_vec()), (before, vec![0.0; 6]));
    /// ```
    pub fn release_value(&self) {
        self.inner.value.borrow_mut().release();
    }

    /// Puts values back into storage freed by [`release_value`](Self::release_value); they
    /// count on the memory meter again.
    ///
    /// # Panics
    /// If the value is not released, or `array`'s shape is not [`shape`](Self::shape).
    pub fn restore_value(&self, array: ArrayD<E>) {
        self.inner.value.borrow_mut().restore(array);
    }

    /// [`restore_value`](Self::restore_value) for a released [meta](crate::meta) tensor:
    /// counts its shape's bytes on the meter again.
    ///
    /// # Panics
    /// If the value is not released, or the tensor is not meta.
    pub fn restore_meta(&self) {
        self.inner.value.borrow_mut().restore_meta();
    }

    /// Whether the value is released (see [`release_value`](Self::release_value)).
    pub fn is_released(&self) -> bool {
        self.inner.value.borrow().is_released()
    }

    /// Backpropagates from a one-element tensor (a loss), starting from a gradient of 1.
    ///
    /// Gradients accumulate (`+=`) into every leaf that requires grad, across calls, until
    /// [`zero_grad`](Self::zero_grad). The graph is consumed: saved values are freed as the
    /// sweep reaches them.
    ///
    /// # Panics
    /// If the tensor does not hold exactly one element, does not require grad, or its graph
    /// was already consumed by a previous backward.
    pub fn backward(&self) {
        let shape = self.shape();
        assert_eq!(
            self.numel(),
            1,
            "backward: call it on a one-element loss (shape {shape:?}) or use backward_with"
        );
        let seed = if self.is_meta() {
            Buffer::meta_tagged(&shape, graph::in_flight())
        } else {
            Buffer::new_tagged(
                ArrayD::from_elem(IxDyn(&shape), E::one()),
                graph::in_flight(),
            )
        };
        self.sweep(seed);
    }

    /// Runs the backward sweep from this tensor's node with `seed` as its gradient.
    fn sweep(&self, seed: Buffer<E>) {
        let node = self
            .node()
            .expect("backward: the tensor does not require grad (no parameter reaches it)");
        graph::backward(&node, seed);
    }

    /// The first half of a split backward from a one-element loss: as
    /// [`backward`](Self::backward), but only the gradients of the inputs — leaves that
    /// require grad and are not parameters ([`param`](Self::param)), such as a pipeline
    /// stage's received activation — are computed now. The parameters' gradients are
    /// returned as [`WeightGradients`](crate::WeightGradients), to compute later: the
    /// zero-bubble schedules' `I` and `W` (Qi et al., 2023).
    ///
    /// The split is exact: once [`run`](crate::WeightGradients::run), every gradient is
    /// the one `backward` gives, bit for bit, each sum of terms added in the same order.
    /// What is deferred is real work: a product's weight gradient is computed only in the
    /// second half (see [`from_product_by_parent`](Self::from_product_by_parent)), and the
    /// activations it needs stay alive until then. Other ops compute their parameters' share
    /// in the first half and keep it until the second. A checkpointed segment's rerun inside
    /// the first half is split in the same way.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let x = Tensor::<f64>::from_vec(vec![1.0, 2.0], &[1, 2])?;
    /// x.set_requires_grad(true); // an input
    /// let w = Tensor::<f64>::param(tl_tensor::ndarray::arr2(&[[3.0], [4.0]]).into_dyn());
    /// let weights = x.matmul(&w).sum_all().backward_input();
    /// assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[3.0, 4.0]);
    /// assert!(w.grad().is_none(), "not yet");
    /// weights.run();
    /// assert_eq!(w.grad().unwrap().as_slice().unwrap(), &[1.0, 2.0]);
    /// # Ok::<(), tl_tensor::TensorError>(())
    /// ```
    ///
    /// # Panics
    /// As [`backward`](Self::backward).
    pub fn backward_input(&self) -> crate::WeightGradients {
        graph::split(|| self.backward())
    }

    /// [`backward_input`](Self::backward_input) from `grad_out`, as
    /// [`backward_from`](Self::backward_from).
    ///
    /// # Panics
    /// As [`backward_from`](Self::backward_from).
    pub fn backward_input_from(&self, grad_out: &Tensor<E>) -> crate::WeightGradients {
        graph::split(|| self.backward_from(grad_out))
    }

    /// [`backward_with`](Self::backward_with) from a gradient held by a tensor (a copy of
    /// its value is the seed); from a [meta](crate::meta) gradient, or on a meta tensor, a
    /// meta sweep.
    ///
    /// # Panics
    /// As [`backward_with`](Self::backward_with).
    pub fn backward_from(&self, grad_out: &Tensor<E>) {
        let seed = if self.is_meta() || grad_out.is_meta() {
            Buffer::meta_tagged(&grad_out.shape(), graph::in_flight())
        } else {
            Buffer::new_tagged(grad_out.to_array(), graph::in_flight())
        };
        self.sweep(seed);
    }

    /// Backpropagates from this tensor, starting from `grad_out` (same shape as the tensor).
    ///
    /// # Panics
    /// As [`backward`](Self::backward), or if `grad_out`'s shape differs from the tensor's.
    pub fn backward_with(&self, grad_out: ArrayD<E>) {
        let seed = if self.is_meta() {
            Buffer::meta_tagged(grad_out.shape(), graph::in_flight())
        } else {
            Buffer::new_tagged(grad_out, graph::in_flight())
        };
        self.sweep(seed);
    }
}

/// The tag of a parameter's values: weights, owned by the current owner.
fn weights_tag() -> Tag {
    Tag {
        kind: Kind::Weights,
        label: "",
        ..memory::current_tag()
    }
}

impl<E: Element> fmt::Debug for Tensor<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &E::NAME)
            .field("shape", &self.shape())
            .field("requires_grad", &self.requires_grad())
            .field("value", &*self.value())
            .finish()
    }
}
