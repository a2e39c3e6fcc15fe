//! Grad mode: whether ops record themselves in the graph. Thread-local, changed only through
//! guards whose `Drop` puts the previous mode back (also on panic and early return).

use std::cell::Cell;
use std::sync::Arc;

use crate::meta::{MetaModeGuard, is_meta_mode, set_meta_mode};
use crate::ops::matmul::{self, MatmulHook};

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops on this thread record a graph for backward.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(Cell::get)
}

/// Restores the grad mode that was in force when it was made, when dropped.
#[must_use = "the mode is restored as soon as the guard is dropped"]
pub struct GradModeGuard {
    previous: bool,
}

/// The guard returned by [`no_grad`].
pub type NoGradGuard = GradModeGuard;

/// Sets the grad mode for the life of the returned guard.
pub fn set_grad_enabled(enabled: bool) -> GradModeGuard {
    let previous = GRAD_ENABLED.with(|mode| mode.replace(enabled));
    GradModeGuard { previous }
}

/// Turns graph recording off until the guard drops: inference, and the forward pass of a
/// checkpointed segment.
///
/// ```
/// use tl_tensor::{Tensor, no_grad, is_grad_enabled};
/// let w = Tensor::<f32>::param(ndarray::arr1(&[2.0]).into_dyn());
/// {
///     let _guard = no_grad();
///     assert!(!is_grad_enabled());
///     assert!(!(&w * 3.0).requires_grad());
/// }
/// assert!(is_grad_enabled());
/// ```
pub fn no_grad() -> NoGradGuard {
    set_grad_enabled(false)
}

/// Turns graph recording on until the guard drops (a checkpoint's rerun during backward).
pub fn enable_grad() -> GradModeGuard {
    set_grad_enabled(true)
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|mode| mode.set(self.previous));
    }
}

/// Every thread-local mode of tl-tensor (grad mode, meta mode and the matmul override), captured so a
/// worker thread can run Tensor-level code under the same modes as the thread that spawned it.
///
/// Modes are thread-local and do not follow work onto other threads by themselves.
///
/// ```
/// use tl_tensor::{ModeSnapshot, no_grad, is_grad_enabled};
/// let _off = no_grad();
/// let modes = ModeSnapshot::capture();
/// std::thread::scope(|s| {
///     s.spawn(|| {
///         assert!(is_grad_enabled()); // a fresh thread starts with the defaults
///         let _same = modes.enter();
///         assert!(!is_grad_enabled());
///     });
/// });
/// ```
#[derive(Clone)]
pub struct ModeSnapshot {
    grad_enabled: bool,
    meta: bool,
    matmul_hook: Option<Arc<dyn MatmulHook>>,
}

/// Restores the modes a thread had before [`ModeSnapshot::enter`], when dropped.
#[must_use = "the modes are restored as soon as the guard is dropped"]
pub struct ModeSnapshotGuard {
    _grad: GradModeGuard,
    _meta: MetaModeGuard,
    previous_hook: Option<Arc<dyn MatmulHook>>,
}

impl ModeSnapshot {
    /// Captures this thread's modes.
    pub fn capture() -> Self {
        Self {
            grad_enabled: is_grad_enabled(),
            meta: is_meta_mode(),
            matmul_hook: matmul::matmul_hook(),
        }
    }

    /// Puts the captured modes in force on the current thread until the guard drops.
    pub fn enter(&self) -> ModeSnapshotGuard {
        let grad = set_grad_enabled(self.grad_enabled);
        let meta = set_meta_mode(self.meta);
        let previous_hook = matmul::set_matmul_hook(self.matmul_hook.clone());
        ModeSnapshotGuard {
            _grad: grad,
            _meta: meta,
            previous_hook,
        }
    }
}

impl Drop for ModeSnapshotGuard {
    fn drop(&mut self) {
        matmul::set_matmul_hook(self.previous_hook.take());
    }
}
