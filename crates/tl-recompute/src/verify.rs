//! Verified mode: a checkpointed segment's rerun must reproduce the forward pass bit for bit.
//!
//! PyTorch's checkpoint only checks that recomputed tensors have the forward pass's shapes and
//! dtypes; a dropout generator left out of the replay, or a parameter changed between the
//! passes, silently yields the gradient of a different function. In verified mode the
//! checkpoint node keeps a 64-bit fingerprint of its forward output (not a copy, so the
//! memory saving is unchanged) and compares the rerun's output with it.
//!
//! A VJP cannot return an error, so a mismatch is reported in one of two ways:
//! - inside [`backward_verified`], it is collected, the backward pass runs to its end (passing
//!   no gradient through the failed segment), and the first mismatch comes back as `Err`; the
//!   gradients of that pass must then be discarded;
//! - in a plain `backward()`, it panics with the error's message, naming the segment.

use std::cell::RefCell;
use std::hash::{DefaultHasher, Hash, Hasher};

use tl_tensor::{Element, Tensor};

use crate::{RecomputeError, Result};

/// The shape and a 64-bit hash of the bits of a value: equal for bit-identical arrays, and
/// different for different ones except with probability about 2⁻⁶⁴.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Fingerprint {
    shape: Vec<usize>,
    hash: u64,
}

impl Fingerprint {
    /// A hash of the `f64` bits of every element in row-major order. Widening `f32` to `f64`
    /// is exact and keeps distinct values distinct, so one hash serves both types.
    /// `DefaultHasher::new()` has fixed keys: the forward pass and the rerun, in one process,
    /// hash alike.
    pub(crate) fn of<E: Element>(tensor: &Tensor<E>) -> Self {
        let mut hasher = DefaultHasher::new();
        for &x in tensor.value().iter() {
            x.to_f64().to_bits().hash(&mut hasher);
        }
        Self {
            shape: tensor.shape(),
            hash: hasher.finish(),
        }
    }

    /// `Err` naming `segment` unless `rerun` matches this fingerprint of the forward output.
    pub(crate) fn check(&self, rerun: &Fingerprint, segment: &str) -> Result<()> {
        let detail = if self.shape != rerun.shape {
            format!(
                "shape {:?} in forward, {:?} in the rerun",
                self.shape, rerun.shape
            )
        } else if self.hash != rerun.hash {
            format!(
                "shape {:?}, bit fingerprint {:016x} in forward, {:016x} in the rerun",
                self.shape, self.hash, rerun.hash
            )
        } else {
            return Ok(());
        };
        Err(RecomputeError::RecomputeMismatch {
            segment: segment.to_owned(),
            detail,
        })
    }
}

thread_local! {
    /// The mismatches found during the innermost `backward_verified` on this thread; `None`
    /// outside of one.
    static COLLECTED: RefCell<Option<Vec<RecomputeError>>> = const { RefCell::new(None) };
}

/// Reports a mismatch found by a checkpoint node's VJP: collected when a
/// [`backward_verified`] is running on this thread, a panic otherwise.
///
/// # Panics
/// Outside [`backward_verified`], always, with the error's message.
pub(crate) fn report(error: RecomputeError) {
    let unclaimed = COLLECTED.with(|slot| match slot.borrow_mut().as_mut() {
        Some(errors) => {
            errors.push(error);
            None
        }
        None => Some(error),
    });
    if let Some(error) = unclaimed {
        panic!("{error}");
    }
}

/// Puts the enclosing collection back when dropped, also when the backward pass panics.
struct CollectGuard {
    outer: Option<Vec<RecomputeError>>,
}

impl Drop for CollectGuard {
    fn drop(&mut self) {
        COLLECTED.with(|slot| *slot.borrow_mut() = self.outer.take());
    }
}

/// Backpropagates from the one-element `loss` like [`Tensor::backward`], and returns the
/// first checkpoint verification failure of that pass as an error instead of panicking.
///
/// Only checkpoints made in verified mode (see
/// [`CheckpointOptions`](crate::CheckpointOptions)) check anything; the others cost nothing
/// here. On `Err`, the backward pass has still run to its end, passing no gradient through the
/// segments that failed, and the gradients it accumulated are not those of the forward pass:
/// zero them before the next step.
///
/// # Errors
/// [`RecomputeError::RecomputeMismatch`] naming the first segment whose rerun differed.
///
/// # Panics
/// As [`Tensor::backward`].
///
/// ```
/// use tl_recompute::{backward_verified, checkpoint_with, CheckpointOptions};
/// use tl_tensor::{Generator, Tensor};
/// let w = Tensor::<f64>::param(tl_tensor::ndarray::arr1(&[1.0, 2.0]).into_dyn());
/// let noise = Generator::new(0);
/// let (weight, draws) = (w.clone(), noise.clone());
/// // The segment adds a random draw, but its generator is not given as an rng to replay.
/// let y = checkpoint_with(
///     move |_inputs| weight.add_scalar(draws.next_f64()),
///     &[],
///     &[w.clone()],
///     &[],
///     &CheckpointOptions::verified("noisy block"),
/// );
/// let error = backward_verified(&y.sum_all()).unwrap_err();
/// assert!(error.to_string().contains("noisy block"));
/// ```
pub fn backward_verified<E: Element>(loss: &Tensor<E>) -> Result<()> {
    let outer = COLLECTED.with(|slot| slot.borrow_mut().replace(Vec::new()));
    let guard = CollectGuard { outer };
    loss.backward();
    let errors = COLLECTED.with(|slot| slot.borrow_mut().take());
    drop(guard);
    match errors.unwrap_or_default().into_iter().next() {
        Some(error) => Err(error),
        None => Ok(()),
    }
}
