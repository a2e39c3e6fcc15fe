//! Matrix products over batch axes: `[.., m, k] · [.., k, n] → [.., m, n]`.
//!
//! Attention multiplies many small matrices at once (80 heads of 512×32 by 32×512 in the
//! capstone); splitting each of those across threads would spend more time synchronising
//! than multiplying, so a large batch gives each rayon task whole products instead.

use gemm::Parallelism;
use ndarray::{Array3, ArrayD, ArrayView2, ArrayViewD, Axis, Dimension, Ix2, IxDyn};
use rayon::prelude::*;

use super::gemm::{PARALLEL_WORK, gemm_with, parallelism_for};
use crate::Element;

/// From this many matrices on, a batch is spread over the pool one product per task; fewer
/// would leave a thread idle (3 products on 2 threads), so each is split internally instead.
const BATCH_PARALLEL_MIN: usize = 4;

/// How a batch of `count` products of `m×k` by `k×n` is spread over threads: a pure function
/// of the shape, so the same shapes always take the same path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Schedule {
    /// One product per rayon task, each on a single thread.
    AcrossBatch,
    /// One product after another, each split across the pool (if large enough).
    WithinProduct,
}

/// The [`Schedule`] for `count` products of `m×k` by `k×n`.
pub(super) fn schedule(count: usize, m: usize, n: usize, k: usize) -> Schedule {
    let work = count.saturating_mul(m).saturating_mul(n).saturating_mul(k);
    if count >= BATCH_PARALLEL_MIN && work >= PARALLEL_WORK {
        Schedule::AcrossBatch
    } else {
        Schedule::WithinProduct
    }
}

/// The batched product of two operands whose batch axes already agree (broadcast operands
/// are stride-0 views, never copies): `lhs` is `[b.., m, k]`, `rhs` is `[b.., k, n]`, the
/// result `[b.., m, n]` in row-major order. Transposed operands are views with swapped
/// strides, handed to `gemm` as they are.
///
/// # Panics
/// If an operand has fewer than two axes, the batch axes differ or the inner sizes differ.
///
/// ```
/// use tl_tensor::kernels::batched::batched_matmul;
/// use tl_tensor::ndarray::{ArrayD, IxDyn};
/// let lhs = ArrayD::<f32>::ones(IxDyn(&[3, 2, 4]));
/// let rhs = ArrayD::<f32>::ones(IxDyn(&[3, 4, 5]));
/// let out = batched_matmul(lhs.view(), rhs.view());
/// assert_eq!(out.shape(), &[3, 2, 5]);
/// assert!(out.iter().all(|&x| x == 4.0)); // a sum of 4 ones
/// ```
pub fn batched_matmul<E: Element>(lhs: ArrayViewD<'_, E>, rhs: ArrayViewD<'_, E>) -> ArrayD<E> {
    let (lhs_nd, rhs_nd) = (lhs.ndim(), rhs.ndim());
    assert!(
        lhs_nd >= 2
            && lhs_nd == rhs_nd
            && lhs.shape()[..lhs_nd - 2] == rhs.shape()[..rhs_nd - 2]
            && lhs.shape()[lhs_nd - 1] == rhs.shape()[rhs_nd - 2],
        "batched_matmul: cannot multiply {:?} by {:?}",
        lhs.shape(),
        rhs.shape()
    );
    let batch = lhs.shape()[..lhs_nd - 2].to_vec();
    let (m, k, n) = (
        lhs.shape()[lhs_nd - 2],
        lhs.shape()[lhs_nd - 1],
        rhs.shape()[rhs_nd - 1],
    );
    let count = batch.iter().product::<usize>();
    let mut out = Array3::<E>::zeros((count, m, n));
    let products = out
        .outer_iter_mut()
        .zip(matrices(lhs, &batch))
        .zip(matrices(rhs, &batch));
    match schedule(count, m, n, k) {
        Schedule::AcrossBatch => {
            products
                .collect::<Vec<_>>()
                .into_par_iter()
                .for_each(|((mut out, lhs), rhs)| {
                    gemm_with(&mut out, lhs, rhs, false, Parallelism::None);
                })
        }
        Schedule::WithinProduct => {
            let parallelism = parallelism_for(m, n, k);
            for ((mut out, lhs), rhs) in products {
                gemm_with(&mut out, lhs, rhs, false, parallelism);
            }
        }
    }
    let mut out_shape = batch.to_vec();
    out_shape.extend_from_slice(&[m, n]);
    out.into_shape_with_order(IxDyn(&out_shape))
        .expect("a fresh row-major array takes any shape of its size")
}

/// The 2-D matrices of a batched view, in row-major order of the batch index.
fn matrices<'a, E: Element>(
    view: ArrayViewD<'a, E>,
    batch: &[usize],
) -> impl Iterator<Item = ArrayView2<'a, E>> {
    ndarray::indices(IxDyn(batch))
        .into_iter()
        .map(move |index| {
            let mut matrix = view.clone();
            for &i in index.slice() {
                matrix = matrix.index_axis_move(Axis(0), i);
            }
            matrix
                .into_dimensionality::<Ix2>()
                .expect("two matrix axes")
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::gemm::matmul;
    use ndarray::{Array, Array2, s};
    use rayon::ThreadPoolBuilder;

    fn hashed(shape: &[usize], seed: usize) -> ArrayD<f32> {
        let mut index = 0;
        ArrayD::from_shape_simple_fn(IxDyn(shape), || {
            index += 1;
            let h = (index * 7919 + seed * 1_299_709) % 1_000_003;
            h as f32 / 500_001.5 - 1.0
        })
    }

    #[test]
    fn schedule_depends_on_the_shape_alone() {
        // Attention: 80 heads of 512×32 by 32×512 — one whole product per task.
        assert_eq!(schedule(80, 512, 512, 32), Schedule::AcrossBatch);
        // A linear layer: a single 4096×320 by 320×896 product, split by gemm.
        assert_eq!(schedule(1, 4096, 896, 320), Schedule::WithinProduct);
        // Too few products to share out evenly, or too little work to share at all.
        assert_eq!(schedule(3, 512, 512, 512), Schedule::WithinProduct);
        assert_eq!(schedule(80, 2, 2, 2), Schedule::WithinProduct);
    }

    #[test]
    fn across_batch_matches_each_product_bit_for_bit_at_any_thread_count() {
        // 8 products of 64×48 by 48×72: 8·64·72·48 = 1,769,472 multiply-adds, shared out
        // one product per task. The rhs is a transposed view of a [8, 72, 48] array.
        let lhs = hashed(&[8, 64, 48], 1);
        let rhs_t = hashed(&[8, 72, 48], 2);
        let rhs = rhs_t.view().permuted_axes(IxDyn(&[0, 2, 1]));
        assert_eq!(schedule(8, 64, 72, 48), Schedule::AcrossBatch);
        let expected: Vec<Array2<f32>> = (0..8)
            .map(|b| {
                let lhs = lhs.slice(s![b, .., ..]);
                let rhs = rhs.slice(s![b, .., ..]);
                matmul(lhs, rhs)
            })
            .collect();
        for threads in [1, 2] {
            let pool = ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let out = pool.install(|| batched_matmul(lhs.view(), rhs.view()));
            assert_eq!(out.shape(), &[8, 64, 72]);
            for (b, expected) in expected.iter().enumerate() {
                let got = out.slice(s![b, .., ..]);
                assert!(
                    got.iter()
                        .zip(expected)
                        .all(|(g, e)| g.to_bits() == e.to_bits()),
                    "batch item {b} at {threads} threads"
                );
            }
        }
    }

    #[test]
    fn broadcast_operand_is_read_in_place() {
        // [2, 3] rows of ones times one shared 3×2 matrix, broadcast over a batch of 4 as a
        // stride-0 view: each output row is the column sums [1+3+5, 2+4+6] = [9, 12].
        let shared = Array::from_shape_vec((3, 2), vec![1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let shared = shared.into_dyn();
        let rhs = shared.broadcast(IxDyn(&[4, 3, 2])).unwrap();
        assert_eq!(rhs.strides()[0], 0);
        let lhs = ArrayD::<f64>::ones(IxDyn(&[4, 2, 3]));
        let out = batched_matmul(lhs.view(), rhs);
        assert_eq!(out.shape(), &[4, 2, 2]);
        assert!(
            out.outer_iter()
                .all(|m| m.iter().copied().eq([9.0, 12.0, 9.0, 12.0]))
        );
    }

    #[test]
    fn empty_batch_and_empty_matrices_give_empty_or_zero_results() {
        let out = batched_matmul(
            ArrayD::<f32>::zeros(IxDyn(&[0, 2, 3])).view(),
            ArrayD::<f32>::zeros(IxDyn(&[0, 3, 4])).view(),
        );
        assert_eq!(out.shape(), &[0, 2, 4]);
        // k = 0 in every one of 5 products: sums of nothing, zeros.
        let out = batched_matmul(
            ArrayD::<f32>::ones(IxDyn(&[5, 2, 0])).view(),
            ArrayD::<f32>::ones(IxDyn(&[5, 0, 4])).view(),
        );
        assert_eq!(out, ArrayD::<f32>::zeros(IxDyn(&[5, 2, 4])));
    }

    #[test]
    #[should_panic(expected = "batched_matmul: cannot multiply [2, 2, 3] by [3, 3, 4]")]
    fn mismatched_batch_axes_panic() {
        batched_matmul(
            ArrayD::<f32>::zeros(IxDyn(&[2, 2, 3])).view(),
            ArrayD::<f32>::zeros(IxDyn(&[3, 3, 4])).view(),
        );
    }
}
