//! Meta mode: tensors with a shape and an element type but no values, so that a program
//! runs abstractly — every allocation and free of the real run, none of its arithmetic.
//!
//! A *meta* tensor is counted by the [memory meter](crate::memory) exactly as a real tensor
//! of its shape: made, saved for backward, freed as a backward sweep passes, accumulated
//! into a leaf's `.grad`, all at the moments the real program would. It holds no values, so
//! a step of a model far larger than this machine runs in milliseconds and a few megabytes
//! of shapes. `tinyllm plan` runs the trainer's own step this way (PyTorch's
//! `FakeTensorMode` and JAX's `eval_shape` are the same idea).
//!
//! # How a tensor becomes meta
//!
//! - Inside [`meta_mode`], every tensor made is meta: constructors ([`Tensor::zeros`],
//!   [`Tensor::param`], [`Tensor::from_array`], …) keep the shape and drop the values, and
//!   [`Tensor::param_with`] does not even call its initialiser.
//! - Outside it, [`Tensor::meta`] and [`Tensor::meta_param`] make one explicitly.
//! - An op with a meta input gives a meta output; so does any op run in meta mode.
//!
//! # What an op writes
//!
//! Every op states its output's shape before it computes anything, through
//! [`Tensor::from_op_shaped`]: the shape rule, then the kernel as a closure that meta mode
//! never calls. On real inputs the kernel's result is checked against the rule, so a wrong
//! rule fails every real test of the op. An op recorded with [`Tensor::from_op`] (a value
//! computed before the node exists) has no shape rule: it panics on a meta input, naming
//! itself, rather than guess.
//!
//! In backward, an op's VJP (a function of values) is not called for a meta gradient: its
//! parents receive meta gradients of their own shapes, allocated as the real VJP's results
//! would be, and the record, with everything the VJP saved, is dropped where the real sweep
//! drops it. An op whose backward does more than compute gradients — a checkpointed
//! segment's rerun, a ZeRO-3 gather — records a VJP over tensors instead
//! ([`Tensor::from_op_tensors`]), which runs in both modes.
//!
//! # Values a meta tensor reports
//!
//! Where a program reads values, a meta tensor gives one documented answer, the one that
//! lets a training step go its usual way: finite, no overflow, no clipping.
//!
//! | read | meta answer |
//! |---|---|
//! | [`Tensor::value`], [`Tensor::to_vec`], [`Tensor::grad`] | an empty array (as a released value) |
//! | [`Tensor::item`] | zero |
//! | [`kernels::finite::all_finite`](crate::kernels::finite::all_finite) of its values | true (no values, none infinite) |
//! | [`Tensor::argmax_axis`] | index 0 in every lane |
//! | [`optim::clip_grad_norm`](crate::optim::clip_grad_norm), [`optim::grad_sum_squares`](crate::optim::grad_sum_squares) | a norm of 0: nothing is clipped |
//! | an optimizer step | allocates its state as the real step would, updates nothing |
//!
//! [`Tensor::update_grad`] leaves a meta gradient as it is (scaling and clipping have
//! nothing to scale). [`Tensor::update_value`], which returns what its closure computes,
//! panics on a meta tensor: code that updates values checks [`Tensor::is_meta`] and skips
//! the update, as the optimizers here do.
//!
//! ```
//! use tl_tensor::{Tensor, memory, meta_mode};
//! let _meta = meta_mode();
//! let w = Tensor::<f32>::param_with(&[1 << 14, 1 << 14], || unreachable!("never called"));
//! let x = Tensor::<f32>::ones(&[8, 1 << 14]);
//! let before = memory::live_bytes();
//! let (loss, peak) = memory::measure_peak(|| {
//!     let loss = x.matmul(&w).sum_all(); // no multiplication happens
//!     loss.backward();
//!     loss
//! });
//! assert!(loss.is_meta() && w.grad_is_meta());
//! // The product (8 × 2¹⁴ floats), then w's gradient (2²⁸ floats), as a real run.
//! assert_eq!(memory::live_bytes() - before, 4 + (4 << 28));
//! assert_eq!(peak, 4 + (4 << 28) + 4 * 8 * (1 << 14));
//! ```

use std::cell::Cell;

thread_local! {
    static META_MODE: Cell<bool> = const { Cell::new(false) };
}

/// Whether meta mode is on for this thread: every tensor made is meta.
pub fn is_meta_mode() -> bool {
    META_MODE.with(Cell::get)
}

/// Restores the meta mode in force when it was made, when dropped.
#[must_use = "the mode is restored as soon as the guard is dropped"]
pub struct MetaModeGuard {
    previous: bool,
}

/// Sets meta mode on or off for the life of the returned guard.
pub fn set_meta_mode(on: bool) -> MetaModeGuard {
    let previous = META_MODE.with(|mode| mode.replace(on));
    MetaModeGuard { previous }
}

/// Turns meta mode on until the guard drops: every tensor made on this thread is meta (see
/// the [module docs](self)).
pub fn meta_mode() -> MetaModeGuard {
    set_meta_mode(true)
}

impl Drop for MetaModeGuard {
    fn drop(&mut self) {
        META_MODE.with(|mode| mode.set(self.previous));
    }
}

/// Whether an op on `inputs` computes values: not in meta mode, and no input meta. An op
/// that computes something beside its result (a lane's argmax, say) asks this, and leaves
/// the rest to [`Tensor::from_op_shaped`](crate::Tensor::from_op_shaped).
pub fn computes<E: crate::Element>(inputs: &[&crate::Tensor<E>]) -> bool {
    !is_meta_mode() && !inputs.iter().any(|input| input.is_meta())
}
