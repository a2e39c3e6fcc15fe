//! Tensor parallelism on the in-process ring (t ranks on threads) against one process
//! running the whole model: outputs, every gradient (the ranks' slices assembled), the
//! collectives each rank makes and the bytes it sends, and the same step on meta tensors
//! over a `Phantom`, allocation for allocation.
//!
//! - `mlp`: a column-parallel layer, tanh or SwiGLU, a row-parallel layer;
//! - `vocabulary`: the vocabulary-parallel embedding, head and cross-entropy;
//! - `meta`: both on meta tensors over a `Phantom`, against the ring;
//! - `autocast`: the partial sums under bf16 autocast, in bf16 at each hop or in f32;
//! - `errors`: sizes that do not split, a collective that fails in backward;
//! - `recorder`: a communicator that logs its calls, as PyTorch's `CommDebugMode` does;
//! - `slices`: a rank's part of a parameter or a moment, cut and gathered back whole;
//! - `step`: a data-parallel step beside the group: a global clip norm and overflow skip.

#[path = "tensor_parallel/autocast.rs"]
mod autocast;
mod common;
#[path = "tensor_parallel/errors.rs"]
mod errors;
#[path = "tensor_parallel/meta.rs"]
mod meta;
#[path = "tensor_parallel/mlp.rs"]
mod mlp;
#[path = "tensor_parallel/recorder.rs"]
mod recorder;
#[path = "tensor_parallel/slices.rs"]
mod slices;
#[path = "tensor_parallel/step.rs"]
mod step;
#[path = "tensor_parallel/vocabulary.rs"]
mod vocabulary;

use tl_collective::CommStats;
use tl_tensor::ndarray::{ArrayD, IxDyn};
use tl_tensor::{Element, Tensor};

const SEED: u64 = 11;
/// Sequence length: rows of the batch, split over 2 or 4 ranks under sequence parallelism.
const ROWS: usize = 8;
const IN: usize = 8;
const HIDDEN: usize = 16;
const OUT: usize = 4;

/// Largest difference over the largest magnitude of the reference: the ranks add partial
/// products in another order than one process does, so the gradients differ by rounding.
fn relative_error(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths");
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    let worst = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (g, w)| m.max((g - w).abs()));
    assert!(scale > 0.0, "a reference of zeros proves nothing");
    worst / scale
}

fn values<E: Element>(tensor: &Tensor<E>) -> Vec<f64> {
    tensor.to_vec().into_iter().map(Element::to_f64).collect()
}

fn grad<E: Element>(tensor: &Tensor<E>) -> Vec<f64> {
    let grad = tensor.grad().expect("a gradient");
    grad.iter().map(|&g| g.to_f64()).collect()
}

/// `[rows, cols]` from `f(row, col)`, as a parameter when `param`.
fn matrix<E: Element>(
    rows: std::ops::Range<usize>,
    cols: usize,
    f: impl Fn(usize, usize) -> f64,
) -> ArrayD<E> {
    let data = rows
        .clone()
        .flat_map(|r| (0..cols).map(move |c| (r, c)))
        .map(|(r, c)| E::from_f64(f(r, c)))
        .collect();
    ArrayD::from_shape_vec(IxDyn(&[rows.len(), cols]), data).unwrap()
}

fn input<E: Element>(rows: std::ops::Range<usize>) -> Tensor<E> {
    Tensor::param(matrix(rows, IN, |r, c| {
        ((r * 13 + c * 7) as f64 * 0.37).sin()
    }))
}

/// The loss `Σ y ⊙ w` with fixed, uneven weights: a sum, so that under sequence
/// parallelism the ranks' losses over their rows add up to the whole one.
fn loss_weights<E: Element>(rows: std::ops::Range<usize>) -> Tensor<E> {
    Tensor::from_array(matrix(rows, OUT, |r, c| {
        ((r * 5 + c * 3) as f64 * 0.71).cos()
    }))
}

/// Columns `part` of `parts` of each rank's `[rows, parts·w]` slices, assembled into the
/// whole `[rows, t·w]` in rank order.
fn assemble_columns(slices: &[Vec<f64>], rows: usize, part: usize, parts: usize) -> Vec<f64> {
    let width = slices[0].len() / rows / parts;
    (0..rows)
        .flat_map(|i| {
            slices.iter().flat_map(move |s| {
                let start = i * parts * width + part * width;
                s[start..start + width].iter().copied()
            })
        })
        .collect()
}

fn concatenated(slices: &[Vec<f64>]) -> Vec<f64> {
    slices.concat()
}

/// Tolerance of a comparison with the one-process run, relative to the tensor's largest
/// magnitude. The ranks add partial products in another order (and the GEMM blocks a
/// narrower matrix otherwise), so results differ by rounding only. Measured worst cases
/// over t = 2 and 4, with and without sequence parallelism, tanh and SwiGLU: 2.85 ε in both
/// f64 (6.3e-16) and f32 (3.4e-7), for a column weight's gradient; the vocabulary model
/// 1.8 ε (f64) and 1.4 ε (f32). The bound allows 8 ε: a missing reduction or a bias added t
/// times is off by order 1.
fn tolerance<E: Element>() -> f64 {
    8.0 * E::epsilon().to_f64()
}

/// What a counter grew by between two readings.
fn delta(before: CommStats, after: CommStats) -> CommStats {
    after - before
}
