//! Megatron-style tensor parallelism: each layer's weights split over the ranks of a
//! tensor-parallel group, which run the same batch and exchange activations inside every
//! layer.
//!
//! - [`group`]: [`TensorParallel`], the group's communicator and its kept errors, and
//!   [`ReduceIn`]: whether partial results are added in autocast's 16-bit format (as a
//!   GPU's all-reduce adds them) or in f32.
//! - [`mappings`]: the conjugate autograd ops every parallel layer is made of — copy-to and
//!   reduce-from, the sequence-parallel gather and reduce-scatter, the output gather.
//! - [`column`](mod@column) and [`row`]: [`ColumnParallelLinear`] and [`RowParallelLinear`], built
//!   from the whole layer's weights: of tl-tensor's `[in, out]` weight, rank `r` keeps
//!   columns `r·out/t..(r + 1)·out/t` or rows `r·in/t..(r + 1)·in/t`.
//! - [`embedding`]: [`VocabParallelEmbedding`], the table split over the vocabulary.
//! - [`cross_entropy`]: [`TensorParallel::vocab_parallel_cross_entropy`], the loss of
//!   logits split over the vocabulary.
//! - [`slice_param`] and [`slice_values`]: a rank's part of a whole parameter, or of its
//!   optimizer moments, along an axis; [`TensorParallel::gather_values`] puts the parts
//!   back together.
//!
//! Every op runs on [meta](tl_tensor::meta) tensors too, passing shape-only buffers to the
//! communicator: over a [`Phantom`](tl_collective::Phantom), a rank's step is planned to
//! the byte, on the meter and on the wire.

pub(crate) mod axis;
pub mod column;
pub mod cross_entropy;
pub mod embedding;
pub mod group;
pub mod mappings;
pub mod row;
mod slices;
mod views;

pub use column::ColumnParallelLinear;
pub use embedding::VocabParallelEmbedding;
pub use group::{ReduceIn, TensorParallel};
pub use row::RowParallelLinear;
pub use slices::{slice_param, slice_values};
