//! Matrix products over batch axes: `[.., m, k] · [.., k, n] → [.., m, n]`.
//!
//! Attention multiplies many small matrices at once (80 heads of 512×32 by 32×512 in the
//! capstone); splitting each of those across threads would spend more time synchronising
//! than multiplying, so a large batch gives each rayon task whole products instead.

use ndarray::{
    ArrayD, ArrayView2, ArrayViewD, ArrayViewMut2, ArrayViewMutD, Axis, Dimension, Ix2, IxDyn,
};
use rayon::prelude::*;

use super::gemm::{gemm_overwrite, gemm_with};
use super::split::{PARALLEL_WORK, Threads, threads_for};
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
    /// One product after another, each spread over the pool as `threads_for` says.
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
    let out_shape = product_shape(&lhs, &rhs);
    let mut out = ArrayD::<E>::uninit(IxDyn(&out_shape));
    run_products(&mut out.view_mut(), lhs, rhs, gemm_overwrite);
    // SAFETY: `run_products` hands every matrix of `out` to `gemm_overwrite`, which
    // initialises every element of the matrix it is given (when it returns early, for m = 0
    // or n = 0, `out` has no elements).
    unsafe { out.assume_init() }
}

/// [`batched_matmul`] into a given output, `out = lhs · rhs` (or `out += lhs · rhs` with
/// `accumulate`), for any strides of `out`.
///
/// # Panics
/// As [`batched_matmul`], and if `out` is not shaped `[b.., m, n]`.
///
/// ```
/// use tl_tensor::kernels::batched::batched_matmul_into;
/// use tl_tensor::ndarray::{ArrayD, IxDyn};
/// let ones = ArrayD::<f64>::ones(IxDyn(&[2, 3, 3]));
/// let mut out = ArrayD::<f64>::ones(IxDyn(&[2, 3, 3]));
/// batched_matmul_into(&mut out.view_mut(), ones.view(), ones.view(), true);
/// assert!(out.iter().all(|&x| x == 4.0)); // 1 + (1 + 1 + 1)
/// ```
pub fn batched_matmul_into<E: Element>(
    out: &mut ArrayViewMutD<'_, E>,
    lhs: ArrayViewD<'_, E>,
    rhs: ArrayViewD<'_, E>,
    accumulate: bool,
) {
    let out_shape = product_shape(&lhs, &rhs);
    assert!(
        out.shape() == out_shape,
        "batched_matmul_into: the product of {:?} by {:?} does not fit {:?}",
        lhs.shape(),
        rhs.shape(),
        out.shape()
    );
    run_products(out, lhs, rhs, |out, lhs, rhs, threads| {
        gemm_with(out, lhs, rhs, accumulate, threads);
    });
}

/// The shape `[b.., m, n]` of the product of `[b.., m, k]` by `[b.., k, n]`.
fn product_shape<E>(lhs: &ArrayViewD<'_, E>, rhs: &ArrayViewD<'_, E>) -> Vec<usize> {
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
    let mut shape = lhs.shape()[..lhs_nd - 1].to_vec();
    shape.push(rhs.shape()[rhs_nd - 1]);
    shape
}

/// Calls `product(out_i, lhs_i, rhs_i, threads)` for every matrix i of the batch, spread
/// over threads as [`schedule`] says. Shapes are already checked.
fn run_products<T: Send, E: Element>(
    out: &mut ArrayViewMutD<'_, T>,
    lhs: ArrayViewD<'_, E>,
    rhs: ArrayViewD<'_, E>,
    product: impl Fn(&mut ArrayViewMut2<'_, T>, ArrayView2<'_, E>, ArrayView2<'_, E>, Threads) + Sync,
) {
    let nd = lhs.ndim();
    let batch = lhs.shape()[..nd - 2].to_vec();
    let (m, k, n) = (
        lhs.shape()[nd - 2],
        lhs.shape()[nd - 1],
        rhs.shape()[nd - 1],
    );
    if m == 0 || n == 0 {
        return; // nothing to write (and no matrix chunk of size zero to split `out` into)
    }
    let count = batch.iter().product::<usize>();
    let products = matrices_mut(out, batch.len())
        .zip(matrices(lhs, &batch))
        .zip(matrices(rhs, &batch));
    match schedule(count, m, n, k) {
        Schedule::AcrossBatch => products
            .collect::<Vec<_>>()
            .into_par_iter()
            .for_each(|((mut out, lhs), rhs)| product(&mut out, lhs, rhs, Threads::One)),
        Schedule::WithinProduct => {
            let threads = threads_for(m, n, k);
            for ((mut out, lhs), rhs) in products {
                product(&mut out, lhs, rhs, threads);
            }
        }
    }
}

/// The 2-D matrices of a batched mutable view with `batch_ndim` batch axes, in row-major
/// order of the batch index: disjoint, so each can go to its own thread.
fn matrices_mut<'a, T>(
    view: &'a mut ArrayViewMutD<'_, T>,
    batch_ndim: usize,
) -> impl Iterator<Item = ArrayViewMut2<'a, T>> {
    let mut chunk = vec![1; batch_ndim];
    chunk.extend_from_slice(&view.shape()[batch_ndim..]);
    view.exact_chunks_mut(IxDyn(&chunk))
        .into_iter()
        .map(move |mut matrix| {
            for _ in 0..batch_ndim {
                matrix = matrix.index_axis_move(Axis(0), 0);
            }
            matrix
                .into_dimensionality::<Ix2>()
                .expect("two matrix axes")
        })
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
        // m = 0 and n = 0: products with no elements.
        let ones = |shape: &[usize]| ArrayD::<f32>::ones(IxDyn(shape));
        let out = batched_matmul(ones(&[5, 0, 3]).view(), ones(&[5, 3, 4]).view());
        assert_eq!(out.shape(), &[5, 0, 4]);
        let out = batched_matmul(ones(&[5, 2, 3]).view(), ones(&[5, 3, 0]).view());
        assert_eq!(out.shape(), &[5, 2, 0]);
    }

    #[test]
    fn into_a_strided_output_overwrites_or_accumulates() {
        // Output as a transposed view of a [2, 3, 4] array (strides of [2, 4, 3] swapped):
        // each element of lhs · rhs is a sum of 5 products 1·2 = 10.
        let lhs = ArrayD::<f64>::ones(IxDyn(&[2, 4, 5]));
        let rhs = ArrayD::<f64>::from_elem(IxDyn(&[2, 5, 3]), 2.0);
        let mut storage = ArrayD::<f64>::from_elem(IxDyn(&[2, 3, 4]), f64::NAN);
        let mut out = storage.view_mut().permuted_axes(IxDyn(&[0, 2, 1]));
        batched_matmul_into(&mut out, lhs.view(), rhs.view(), false);
        batched_matmul_into(&mut out, lhs.view(), rhs.view(), true);
        assert!(storage.iter().all(|&x| x == 20.0), "{storage:?}");
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
