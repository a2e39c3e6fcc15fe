//! Layers: the [`Module`] trait and the building blocks of a small Llama.

mod activation;
mod dropout;
mod embedding;
mod linear;
mod module;
mod rmsnorm;
mod sequential;

pub use activation::{Gelu, Relu, Silu, Tanh};
pub use dropout::{DROPOUT_MASK_LABEL, Dropout};
pub use embedding::Embedding;
pub use linear::Linear;
pub use module::Module;
pub use rmsnorm::RmsNorm;
pub use sequential::Sequential;
