//! Keep policies: which named results of a checkpointed segment are kept for its rerun, as
//! the caller chooses rather than the op.
//!
//! An op names its result with [`keep_named`] (or [`keep_product`], for a matrix product whose
//! node the rerun must record again), and the [`KeepPolicy`] in force when a checkpoint runs
//! its forward pass — set with [`keeping`] — says which names that checkpoint keeps. This is
//! JAX's `save_only_these_names` and PyTorch's selective-checkpoint policy: the model names its
//! results once, and the caller picks what to keep per run. The frames that carry what is
//! kept, and the policy each recorded under, are `keep.rs`'s.
//!
//! Beyond chapter L11.1: a learner's workspace keeps this file as written (xtask's
//! `LearnerCrate::kept`), and it is not part of the grade (`.cargo/mutants.toml`).

use std::cell::RefCell;

use tl_tensor::ops::given::with_given_product;
use tl_tensor::{Element, Tensor};

use crate::keep::{innermost_keeps, keep_for_rerun, record_kept, take_kept};

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

/// Puts `policy` in force on this thread and returns the one it replaces: for a checkpoint's
/// rerun, which runs under its forward pass's policy and then restores the thread's.
pub(crate) fn replace_policy(policy: KeepPolicy) -> KeepPolicy {
    POLICY.with(|current| current.replace(policy))
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
/// [`with_given_product`]), so it records its node —
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

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::collections::VecDeque;
    use std::rc::Rc;

    use super::*;
    use crate::keep::{FrameGuard, Kept};

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
