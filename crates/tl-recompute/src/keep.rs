//! [`keep_for_rerun`]: selective checkpointing. An op whose result costs much to compute and
//! little to store asks the checkpointed segment it runs in to keep that result; the rerun
//! during backward then takes it back instead of computing it again.
//!
//! Plain checkpointing reruns a whole segment. Some of that work buys little memory: the
//! fused attention of a transformer block spends about a quarter of the block's forward time
//! to produce one `[B, T, d]` tensor. Keeping that one tensor per checkpointed block costs
//! `N·d` values and saves the attention's forward pass in every rerun. Torch offers the same
//! trade as selective activation checkpointing, where a policy marks which ops' outputs to
//! save (torchtitan saves the attention's); here the op opts in at its call site.
//!
//! The rerun hands back the very value the forward pass computed, so the rerun — and every
//! gradient — is bit for bit what it would have been. Kept values are matched to calls by
//! order: the rerun performs the same calls in the same order, as rerunning requires anyway.
//!
//! Which results are kept can also be the caller's choice rather than the op's: an op names
//! its result with [`keep_named`] (or [`keep_product`], for a matrix product whose node the
//! rerun must record again), and the [`KeepPolicy`] in force when a checkpoint runs its
//! forward pass — set with [`keeping`] — says which names that checkpoint keeps. This is JAX's
//! `save_only_these_names` and PyTorch's selective-checkpoint policy: the model names its
//! results once, and the caller picks what to keep per run.
//!
//! How it works: every checkpoint pushes a frame on a per-thread stack for as long as its
//! segment runs — *recording* during the forward pass of a node, *replaying* (with what was
//! recorded) during its rerun, *plain* when it records no node at all. `keep_for_rerun`
//! looks only at the innermost frame, so a checkpoint nested inside a segment keeps its
//! own values and never disturbs the order of the enclosing segment's.

use std::any::Any;
use std::cell::RefCell;
use std::collections::VecDeque;

use tl_tensor::ops::given::with_given_product;
use tl_tensor::{Element, Tensor};

/// What one checkpointed segment's forward pass kept: the values in call order, and the
/// policy it ran under, which its rerun runs under again.
#[derive(Default)]
pub(crate) struct Kept {
    pub(crate) values: VecDeque<Box<dyn Any>>,
    pub(crate) policy: KeepPolicy,
}

/// Which named results ([`keep_named`], [`keep_product`]) a checkpointed segment keeps for
/// its rerun; [`keeping`] puts one in force. The default keeps none of them.
///
/// A checkpoint takes the policy in force when its forward pass runs, and its rerun runs
/// under that same policy wherever backward is called, so the rerun asks for exactly what
/// the forward pass kept. Results marked with [`keep_for_rerun`] are kept whatever the
/// policy: there the op itself has decided.
///
/// ```
/// use tl_recompute::KeepPolicy;
/// let policy = KeepPolicy::only(["wq", "attention"]);
/// assert!(policy.keeps("wq") && !policy.keeps("wk"));
/// assert!(!KeepPolicy::default().keeps("wq"));
/// assert!(KeepPolicy::everything().keeps("anything"));
/// assert_eq!(policy.names(), ["wq", "attention"]);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeepPolicy {
    everything: bool,
    names: Vec<String>,
}

impl KeepPolicy {
    /// Keeps no named result: the rerun recomputes everything (plain checkpointing). The
    /// same as [`KeepPolicy::default`].
    pub fn nothing() -> Self {
        Self::default()
    }

    /// Keeps every named result.
    pub fn everything() -> Self {
        Self {
            everything: true,
            names: Vec::new(),
        }
    }

    /// Keeps the results of these names, and no other.
    pub fn only<S: Into<String>>(names: impl IntoIterator<Item = S>) -> Self {
        Self {
            everything: false,
            names: names.into_iter().map(Into::into).collect(),
        }
    }

    /// Whether a result named `name` is kept.
    pub fn keeps(&self, name: &str) -> bool {
        self.everything || self.names.iter().any(|kept| kept == name)
    }

    /// The names kept, as given to [`KeepPolicy::only`] (empty for the other two).
    pub fn names(&self) -> &[String] {
        &self.names
    }
}

thread_local! {
    /// The policy the next checkpoint on this thread takes.
    static POLICY: RefCell<KeepPolicy> = RefCell::new(KeepPolicy::default());
}

/// Puts `policy` in force on this thread until the guard drops: every checkpoint whose
/// forward pass runs meanwhile keeps the named results the policy names.
///
/// ```
/// use tl_recompute::{KeepPolicy, checkpoint, keep_product, keeping};
/// use tl_tensor::{Tensor, memory};
///
/// let w = Tensor::<f64>::param(tl_tensor::ndarray::arr2(&[[2.0]]).into_dyn());
/// let x = Tensor::from_vec(vec![3.0], &[1, 1])?;
/// let weight = w.clone();
/// let segment = move |xs: &[Tensor<f64>]| keep_product("xw", || xs[0].matmul(&weight)).powi(2);
/// let run = |policy: KeepPolicy| {
///     let _policy = keeping(policy);
///     let before = memory::live_bytes();
///     let y = checkpoint(segment.clone(), &[x.clone()], &[w.clone()], &[]);
///     (y, memory::live_bytes() - before)
/// };
/// let (plain, plain_bytes) = run(KeepPolicy::nothing());
/// let (kept, kept_bytes) = run(KeepPolicy::only(["xw"]));
/// assert_eq!(kept_bytes, plain_bytes + 8, "the node holds x·w until backward");
/// kept.sum_all().backward(); // the rerun takes x·w back and still records its node
/// assert_eq!(w.grad().unwrap()[[0, 0]], 36.0);
/// # drop(plain);
/// # Ok::<(), tl_tensor::TensorError>(())
/// ```
pub fn keeping(policy: KeepPolicy) -> KeepingGuard {
    KeepingGuard {
        previous: Some(POLICY.with(|current| current.replace(policy))),
    }
}

/// The policy in force on this thread (see [`keeping`]).
pub fn keep_policy() -> KeepPolicy {
    POLICY.with(|current| current.borrow().clone())
}

/// Restores the keep policy that was in force before [`keeping`], when dropped.
#[must_use = "the policy is restored as soon as the guard is dropped"]
pub struct KeepingGuard {
    previous: Option<KeepPolicy>,
}

impl Drop for KeepingGuard {
    fn drop(&mut self) {
        if let Some(previous) = self.previous.take() {
            POLICY.with(|current| *current.borrow_mut() = previous);
        }
    }
}

enum Frame {
    /// The forward pass of a checkpoint node: results are kept.
    Recording(Kept),
    /// The node's rerun: kept results are handed back, front first.
    Replaying(Kept),
    /// A checkpoint that records no node (grad mode off, or nothing requires grad): nothing
    /// is kept or handed back, and an enclosing segment's frame is out of reach.
    Plain,
}

thread_local! {
    static FRAMES: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

/// Computes `compute()` once per checkpointed segment instead of once per run of it.
///
/// - During the forward pass of a [`checkpoint`](crate::checkpoint)ed segment, the result is
///   computed, a clone of it is kept by the checkpoint node, and the result is returned.
/// - During that node's rerun, the kept clone is returned and `compute` is not called.
/// - Anywhere else (no checkpoint, or one that records no node), this is `compute()`.
///
/// The clone should be cheap and share storage (a [`Tensor`](tl_tensor::Tensor), an `Rc`):
/// what is kept stays alive from the forward pass until backward reaches the node, which is
/// the memory this trades for the saved work. If the rerun's calls no longer match the
/// forward pass's — a kept value of another type comes up — everything still kept is
/// dropped and computed afresh.
///
/// ```
/// use std::cell::Cell;
/// use std::rc::Rc;
/// use tl_recompute::{checkpoint, keep_for_rerun};
/// use tl_tensor::Tensor;
///
/// let w = Tensor::<f64>::param(tl_tensor::ndarray::arr2(&[[2.0]]).into_dyn());
/// let x = Tensor::from_vec(vec![3.0], &[1, 1])?;
/// let runs = Rc::new(Cell::new(0));
/// let (weight, counter) = (w.clone(), Rc::clone(&runs));
/// let segment = move |xs: &[Tensor<f64>]| {
///     let product = xs[0].matmul(&weight);
///     // Expensive, say: computed in the forward pass only, kept for the rerun.
///     let scale = keep_for_rerun(|| {
///         counter.set(counter.get() + 1);
///         10.0
///     });
///     product.mul_scalar(scale)
/// };
/// let y = checkpoint(segment, &[x], &[w.clone()], &[]);
/// y.sum_all().backward(); // the rerun
/// assert_eq!(runs.get(), 1);
/// assert_eq!(w.grad().unwrap()[[0, 0]], 30.0);
/// # Ok::<(), tl_tensor::TensorError>(())
/// ```
pub fn keep_for_rerun<T: Clone + 'static>(compute: impl FnOnce() -> T) -> T {
    if let Some(kept) = take_kept::<T>() {
        return kept;
    }
    let value = compute();
    record_kept(&value);
    value
}

/// [`keep_for_rerun`] for a result named `name`, kept only if the policy of the checkpoint
/// it runs in keeps that name ([`KeepPolicy`]); computed as usual otherwise.
///
/// ```
/// use tl_recompute::{KeepPolicy, checkpoint, keep_named, keeping};
/// use tl_tensor::Tensor;
/// use std::{cell::Cell, rc::Rc};
///
/// let w = Tensor::<f64>::param(tl_tensor::ndarray::arr2(&[[2.0]]).into_dyn());
/// let runs = Rc::new(Cell::new(0));
/// let (weight, counter) = (w.clone(), Rc::clone(&runs));
/// let segment = move |xs: &[Tensor<f64>]| {
///     let scale = keep_named("scale", || { counter.set(counter.get() + 1); 10.0 });
///     xs[0].matmul(&weight).mul_scalar(scale)
/// };
/// let x = Tensor::from_vec(vec![3.0], &[1, 1])?;
/// for (policy, computed) in [(KeepPolicy::nothing(), 2), (KeepPolicy::only(["scale"]), 1)] {
///     runs.set(0);
///     let y = { let _p = keeping(policy); checkpoint(segment.clone(), &[x.clone()], &[w.clone()], &[]) };
///     y.sum_all().backward(); // the rerun runs outside the guard, under the same policy
///     assert_eq!(runs.get(), computed);
/// }
/// # Ok::<(), tl_tensor::TensorError>(())
/// ```
pub fn keep_named<T: Clone + 'static>(name: &str, compute: impl FnOnce() -> T) -> T {
    if innermost_keeps(name) {
        keep_for_rerun(compute)
    } else {
        compute()
    }
}

/// A matrix product's result named `name`, kept as [`keep_named`] keeps one; in the rerun the
/// product runs again with its kept result given (tl-tensor's
/// [`with_given_product`](tl_tensor::ops::given::with_given_product)), so it records its node —
/// the VJP reads the rerun's operands — without multiplying.
///
/// `product` must compute one product (a linear layer's `x·W`, under autocast or not): the
/// first product it runs takes the kept result. The kept tensor shares the forward result's
/// storage, so keeping costs its bytes from the forward pass until backward reaches the
/// checkpoint, and nothing more.
///
/// # Panics
/// In a rerun that takes a kept result, as `with_given_product`: when `product` computes no
/// product, or one of another shape.
pub fn keep_product<E: Element>(name: &str, product: impl FnOnce() -> Tensor<E>) -> Tensor<E> {
    if !innermost_keeps(name) {
        return product();
    }
    if let Some(kept) = take_kept::<Tensor<E>>() {
        return with_given_product(kept, product);
    }
    let value = product();
    record_kept(&value.detach());
    value
}

/// In a checkpoint node's forward pass, keeps a clone of `value`.
fn record_kept<T: Clone + 'static>(value: &T) {
    FRAMES.with(|frames| {
        if let Some(Frame::Recording(kept)) = frames.borrow_mut().last_mut() {
            kept.values.push_back(Box::new(value.clone()));
        }
    });
}

/// Whether the innermost frame is a checkpoint's forward pass or rerun whose policy keeps
/// `name`.
fn innermost_keeps(name: &str) -> bool {
    FRAMES.with(|frames| match frames.borrow().last() {
        Some(Frame::Recording(kept) | Frame::Replaying(kept)) => kept.policy.keeps(name),
        Some(Frame::Plain) | None => false,
    })
}

/// In a rerun, the next kept value if it is a `T`; a value of another type means the calls
/// went out of step, and everything still kept is dropped.
fn take_kept<T: 'static>() -> Option<T> {
    let next = FRAMES.with(|frames| match frames.borrow_mut().last_mut() {
        Some(Frame::Replaying(kept)) => kept.values.pop_front().map(|value| value.downcast::<T>()),
        _ => None,
    })?;
    match next {
        Ok(value) => Some(*value),
        Err(_) => {
            // Dropped outside the borrow: a kept value's destructor may run anything.
            let stale = FRAMES.with(|frames| match frames.borrow_mut().last_mut() {
                Some(Frame::Replaying(kept)) => std::mem::take(&mut kept.values),
                _ => VecDeque::new(),
            });
            drop(stale);
            None
        }
    }
}

/// A frame on the stack for as long as a checkpoint's segment runs; popped when dropped,
/// panics included.
pub(crate) struct FrameGuard {
    depth: usize,
    /// A rerun's frame puts its forward pass's policy in force: the one to restore.
    outer_policy: Option<KeepPolicy>,
}

impl FrameGuard {
    fn push(frame: Frame) -> Self {
        let depth = FRAMES.with(|frames| {
            let mut frames = frames.borrow_mut();
            frames.push(frame);
            frames.len()
        });
        Self {
            depth,
            outer_policy: None,
        }
    }

    /// The frame of a checkpoint node's forward pass, under the policy in force.
    pub(crate) fn recording() -> Self {
        Self::push(Frame::Recording(Kept {
            values: VecDeque::new(),
            policy: keep_policy(),
        }))
    }

    /// The frame of a node's rerun, handing back what its forward pass kept, under the
    /// forward pass's policy (in force on the thread too, for checkpoints nested inside).
    pub(crate) fn replaying(kept: Kept) -> Self {
        let outer = POLICY.with(|current| current.replace(kept.policy.clone()));
        let mut guard = Self::push(Frame::Replaying(kept));
        guard.outer_policy = Some(outer);
        guard
    }

    /// The frame of a checkpoint that records no node.
    pub(crate) fn plain() -> Self {
        Self::push(Frame::Plain)
    }

    /// Pops the frame and returns what it kept (what is left of it, for a replaying frame).
    pub(crate) fn finish(mut self) -> Kept {
        let frame = self.pop();
        std::mem::forget(self);
        match frame {
            Some(Frame::Recording(kept) | Frame::Replaying(kept)) => kept,
            Some(Frame::Plain) | None => Kept::default(),
        }
    }

    fn pop(&mut self) -> Option<Frame> {
        if let Some(outer) = self.outer_policy.take() {
            POLICY.with(|current| *current.borrow_mut() = outer);
        }
        FRAMES.with(|frames| {
            let mut frames = frames.borrow_mut();
            debug_assert_eq!(frames.len(), self.depth, "keep frames out of order");
            (frames.len() == self.depth).then(|| frames.pop()).flatten()
        })
    }
}

impl Drop for FrameGuard {
    fn drop(&mut self) {
        // Kept values are dropped outside the borrow of the stack.
        drop(self.pop());
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use super::*;

    fn counted(calls: &Rc<Cell<u32>>, value: u32) -> u32 {
        keep_for_rerun(|| {
            calls.set(calls.get() + 1);
            value
        })
    }

    #[test]
    fn outside_a_checkpoint_every_call_computes() {
        let calls = Rc::new(Cell::new(0));
        assert_eq!(counted(&calls, 7) + counted(&calls, 8), 15);
        assert_eq!(calls.get(), 2);
    }

    #[test]
    fn a_recording_frame_keeps_clones_in_call_order_and_a_replay_hands_them_back() {
        let calls = Rc::new(Cell::new(0));
        let recording = FrameGuard::recording();
        assert_eq!((counted(&calls, 1), counted(&calls, 2)), (1, 2));
        let kept = recording.finish();
        assert_eq!(kept.values.len(), 2);
        assert_eq!(calls.get(), 2);

        let replay = FrameGuard::replaying(kept);
        // The values of the forward pass come back, whatever the rerun would compute.
        assert_eq!((counted(&calls, 10), counted(&calls, 20)), (1, 2));
        assert_eq!(calls.get(), 2, "nothing recomputed");
        // Past the kept values, calls compute again.
        assert_eq!(counted(&calls, 30), 30);
        assert!(replay.finish().values.is_empty());
    }

    #[test]
    fn a_value_of_another_type_drops_the_rest_and_computes() {
        let recording = FrameGuard::recording();
        keep_for_rerun(|| 1_u32);
        keep_for_rerun(|| 2_u32);
        let kept = recording.finish();
        let replay = FrameGuard::replaying(kept);
        assert_eq!(keep_for_rerun(|| "fresh"), "fresh");
        assert_eq!(keep_for_rerun(|| 9_u32), 9, "the stale 2 was dropped too");
        drop(replay);
    }

    #[test]
    fn an_inner_frame_hides_the_outer_one_and_guards_pop_in_order() {
        let outer = FrameGuard::recording();
        keep_for_rerun(|| 1_u8);
        {
            let _plain = FrameGuard::plain();
            keep_for_rerun(|| 2_u8);
            let inner = FrameGuard::recording();
            keep_for_rerun(|| 3_u8);
            assert_eq!(inner.finish().values.len(), 1);
        }
        keep_for_rerun(|| 4_u8);
        let kept: Vec<u8> = outer
            .finish()
            .values
            .into_iter()
            .map(|value| *value.downcast::<u8>().unwrap())
            .collect();
        assert_eq!(kept, [1, 4]);
        FRAMES.with(|frames| assert!(frames.borrow().is_empty()));
    }

    #[test]
    fn a_panic_inside_a_segment_pops_its_frame() {
        let result = std::panic::catch_unwind(|| {
            let _recording = FrameGuard::recording();
            keep_for_rerun(|| 1_u8);
            panic!("segment failed");
        });
        assert!(result.is_err());
        FRAMES.with(|frames| assert!(frames.borrow().is_empty()));
        assert_eq!(keep_for_rerun(|| 5_u8), 5);
    }

    #[test]
    fn a_named_result_is_kept_only_where_the_frames_policy_names_it() {
        let calls = Rc::new(Cell::new(0));
        let named = |name: &str, value: u32| {
            keep_named(name, || {
                calls.set(calls.get() + 1);
                value
            })
        };
        // Outside a checkpoint, and in a frame under the default policy: computed, not kept.
        assert_eq!(named("a", 1), 1);
        let recording = FrameGuard::recording();
        named("a", 2);
        assert!(recording.finish().values.is_empty());

        let _policy = keeping(KeepPolicy::only(["a"]));
        let recording = FrameGuard::recording();
        assert_eq!((named("a", 3), named("b", 4), named("a", 5)), (3, 4, 5));
        {
            let _plain = FrameGuard::plain();
            named("a", 6); // a frame that records nothing hides the policy
        }
        let kept = recording.finish();
        assert_eq!(kept.values.len(), 2, "the two results named a");
        assert_eq!(kept.policy, KeepPolicy::only(["a"]));
        let replay = FrameGuard::replaying(kept);
        calls.set(0);
        assert_eq!((named("a", 30), named("b", 40), named("a", 50)), (3, 40, 5));
        assert_eq!(calls.get(), 1, "only b computed again");
        drop(replay);
    }

    #[test]
    fn a_rerun_runs_under_its_forward_passs_policy_and_restores_the_threads() {
        let recording = {
            let _policy = keeping(KeepPolicy::only(["a"]));
            FrameGuard::recording()
        };
        keep_named("a", || 1_u8);
        let kept = recording.finish();
        let _later = keeping(KeepPolicy::only(["z"]));
        let replay = FrameGuard::replaying(kept);
        assert_eq!(keep_policy(), KeepPolicy::only(["a"]));
        assert_eq!(keep_named("a", || 9_u8), 1);
        drop(replay);
        assert_eq!(keep_policy(), KeepPolicy::only(["z"]));
        let replay = FrameGuard::replaying(Kept {
            values: VecDeque::new(),
            policy: KeepPolicy::everything(),
        });
        assert!(replay.finish().values.is_empty());
        assert_eq!(
            keep_policy(),
            KeepPolicy::only(["z"]),
            "finish restores it too"
        );
    }

    #[test]
    fn a_guard_restores_the_policy_before_it() {
        assert_eq!(keep_policy(), KeepPolicy::nothing());
        {
            let _outer = keeping(KeepPolicy::everything());
            {
                let _inner = keeping(KeepPolicy::only(["x"]));
                assert_eq!(keep_policy(), KeepPolicy::only(["x"]));
            }
            assert_eq!(keep_policy(), KeepPolicy::everything());
        }
        assert_eq!(keep_policy(), KeepPolicy::nothing());
    }

    #[test]
    fn a_kept_product_is_given_back_to_the_reruns_product_which_records_its_node() {
        let w = Tensor::<f64>::param(tl_tensor::ndarray::arr2(&[[2.0, 1.0]]).into_dyn());
        let x = Tensor::<f64>::from_vec(vec![3.0], &[1, 1]).unwrap();
        let products = Cell::new(0);
        let product = || {
            keep_product("xw", || {
                products.set(products.get() + 1);
                x.matmul(&w)
            })
        };
        let _policy = keeping(KeepPolicy::only(["xw"]));
        let recording = FrameGuard::recording();
        let forward = {
            let _off = tl_tensor::no_grad();
            product()
        };
        let kept = recording.finish();
        assert_eq!(kept.values.len(), 1);
        let replay = FrameGuard::replaying(kept);
        let rerun = product();
        drop(replay);
        assert_eq!(products.get(), 2, "the closure ran, to record the node");
        assert!(rerun.shares_storage(&forward), "but did not multiply");
        rerun.sum_all().backward();
        assert_eq!(
            w.grad().unwrap().iter().copied().collect::<Vec<_>>(),
            [3.0, 3.0]
        );
        // Not named by the policy: a plain product, nothing kept.
        let recording = FrameGuard::recording();
        keep_product("other", || x.matmul(&w));
        assert!(recording.finish().values.is_empty());
    }

    #[test]
    fn policies_say_what_they_keep() {
        let (nothing, everything) = (KeepPolicy::nothing(), KeepPolicy::everything());
        assert!(everything.keeps("anything") && !nothing.keeps("anything"));
        assert_ne!(everything, nothing);
        assert_eq!(KeepPolicy::default(), nothing);
        assert_eq!(KeepPolicy::only(["a", "b"]).names(), ["a", "b"]);
        assert!(everything.names().is_empty() && nothing.names().is_empty());
    }
}
