//! Compute kernels below the Tensor API: plain arrays in, plain arrays out, no graph.
//! Parallelism lives here, where the thread-local modes of the Tensor API cannot be missed.

pub mod adamw;
pub mod attention;
pub mod batched;
pub mod bf16_dot;
pub mod exp;
pub mod finite;
pub mod gemm;
pub mod gemm_limit;
pub mod linear_cross_entropy;
pub mod rotary;
pub mod rows;
pub mod softmax_row;
pub(crate) mod split;
pub mod swiglu;
pub mod written;

#[cfg(test)]
mod test_values;
