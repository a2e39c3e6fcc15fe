//! Tensors with reverse-mode automatic differentiation, and what a small Llama needs around
//! them: ops with VJPs, layers, losses, optimizers, a replayable random generator and a meter
//! of live tensor memory.
//!
//! The design follows micrograd's: each op records one node holding its parents and a
//! closure, the vector-Jacobian product; [`Tensor::backward`] visits the nodes in reverse
//! topological order and consumes each closure as it runs, so saved activations are released
//! during backward. See `docs/` in the repository for the tour.

pub mod alloc;
pub mod element;
mod error;
mod graph;
pub mod kernels;
pub mod losses;
pub mod memory;
pub mod meta;
mod mode;
pub mod nn;
pub mod ops;
pub mod optim;
mod order;
mod rng;
mod storage;
mod tensor;
pub mod testing;

pub use element::Element;
pub use error::{Result, TensorError};
pub use graph::{GradReadyHook, ParentVjp, TensorVjp, Vjp, WeightGradients, in_backward};
pub use meta::{MetaModeGuard, is_meta_mode, meta_mode, set_meta_mode};
pub use mode::{
    GradModeGuard, ModeSnapshot, ModeSnapshotGuard, NoGradGuard, enable_grad, is_grad_enabled,
    no_grad, set_grad_enabled,
};
pub use nn::Module;
pub use ops::matmul::{MatmulHook, matmul_hook, set_matmul_hook};
pub use ops::matmul_with::{PreparedRhs, ProductKernel};
pub use optim::Optimizer;
pub use order::topological_order;
pub use rng::{Generator, GeneratorState};
pub use tensor::{Tensor, WeakValue};

/// What an op applies to each block of its result as soon as the block is written, on the
/// thread that wrote it, while the block is in cache (see [`nn::RmsNorm::forward_then`] and
/// [`Tensor::swiglu_then`]). Only for ops whose VJP never reads their result, so that the
/// finisher changes what the result's readers see and not the gradients.
pub type Finisher<'a, E> = dyn Fn(&mut [E]) + Sync + 'a;

/// The `ndarray` this crate is built on, re-exported so users build arrays of the same version.
pub use ndarray;
