//! Differentiable ops, one file per family, each forward beside its VJP.

pub mod elementwise;
pub mod gated;
pub mod given;
pub mod index;
pub mod matmul;
pub mod matmul_with;
pub mod reduce;
pub mod shape;
pub mod softmax;
pub mod unary;

mod broadcast;

pub(crate) use broadcast::{broadcast_shape, unbroadcast};
