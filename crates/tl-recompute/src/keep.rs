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
//! Which results are kept can also be the caller's choice rather than the op's: see
//! [`policy`](crate::policy) (the policy a frame records under is part of what it keeps).
//!
//! How it works: every checkpoint pushes a frame on a per-thread stack for as long as its
//! segment runs — *recording* during the forward pass of a node, *replaying* (with what was
//! recorded) during its rerun, *plain* when it records no node at all. `keep_for_rerun`
//! looks only at the innermost frame, so a checkpoint nested inside a segment keeps its
//! own values and never disturbs the order of the enclosing segment's.

use std::any::Any;
use std::cell::RefCell;
use std::collections::VecDeque;

use crate::policy::KeepPolicy;

/// What one checkpointed segment's forward pass kept: the values in call order, and the
/// policy it ran under, which its rerun runs under again.
#[derive(Default)]
pub(crate) struct Kept {
    pub(crate) values: VecDeque<Box<dyn Any>>,
    pub(crate) policy: KeepPolicy,
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

/// In a checkpoint node's forward pass, keeps a clone of `value`.
pub(crate) fn record_kept<T: Clone + 'static>(value: &T) {
    FRAMES.with(|frames| {
        if let Some(Frame::Recording(kept)) = frames.borrow_mut().last_mut() {
            kept.values.push_back(Box::new(value.clone()));
        }
    });
}

/// Whether the innermost frame is a checkpoint's forward pass or rerun whose policy keeps
/// `name`.
pub(crate) fn innermost_keeps(name: &str) -> bool {
    FRAMES.with(|frames| match frames.borrow().last() {
        Some(Frame::Recording(kept) | Frame::Replaying(kept)) => kept.policy.keeps(name),
        Some(Frame::Plain) | None => false,
    })
}

/// In a rerun, the next kept value if it is a `T`; a value of another type means the calls
/// went out of step, and everything still kept is dropped.
pub(crate) fn take_kept<T: 'static>() -> Option<T> {
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
            policy: crate::policy::keep_policy(),
        }))
    }

    /// The frame of a node's rerun, handing back what its forward pass kept, under the
    /// forward pass's policy (in force on the thread too, for checkpoints nested inside).
    pub(crate) fn replaying(kept: Kept) -> Self {
        let outer = crate::policy::replace_policy(kept.policy.clone());
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
            crate::policy::replace_policy(outer);
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
}
