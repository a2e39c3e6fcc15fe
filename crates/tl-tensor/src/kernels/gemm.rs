//! General matrix multiply on strided 2-D views, through the `gemm` crate.
//!
//! Both cores are used, in a way chosen from the shape alone: a large product is cut into
//! blocks of rows or split by `gemm` itself (see `split.rs`), while a batch of many small
//! products runs one whole product per rayon task (see
//! [`batched_matmul`](super::batched::batched_matmul)).
//!
//! # Determinism
//! `gemm` accumulates every output element over the inner dimension in an order fixed by the
//! shape, the operands' strides and the machine's cache sizes — never by the number of
//! threads: threads only decide *which* thread computes a tile, and a tile's arithmetic is the
//! same on any of them. So a product is bit-identical under any rayon pool size. The tests
//! below pin this.

use std::mem::MaybeUninit;

use gemm::Parallelism;
use ndarray::{Array2, ArrayView2, ArrayViewMut2};

use super::split::{Threads, spread, threads_for};
use crate::Element;

/// `out = lhs · rhs` (or `out += lhs · rhs` with `accumulate`), for any strides of the three
/// views — a transposed operand is a view with swapped strides, never a copy. Large products
/// are split across the current rayon pool.
///
/// # Panics
/// If the shapes do not chain: `lhs` is m×k, `rhs` k×n, `out` m×n.
///
/// ```
/// use tl_tensor::kernels::gemm::gemm_into;
/// use tl_tensor::ndarray::{Array2, arr2};
/// let a = arr2(&[[1.0f32, 2.0], [3.0, 4.0]]);
/// let mut out = Array2::<f32>::zeros((2, 2));
/// gemm_into(&mut out.view_mut(), a.view(), a.t(), false); // a·aᵀ
/// assert_eq!(out, arr2(&[[5.0, 11.0], [11.0, 25.0]]));
/// ```
pub fn gemm_into<E: Element>(
    out: &mut ArrayViewMut2<'_, E>,
    lhs: ArrayView2<'_, E>,
    rhs: ArrayView2<'_, E>,
    accumulate: bool,
) {
    let (m, k) = lhs.dim();
    let n = rhs.ncols();
    gemm_with(out, lhs, rhs, accumulate, threads_for(m, n, k));
}

/// [`gemm_into`] on the calling thread only, whatever the size: for kernels that already
/// run one task per rayon thread (a fused attention computes one head per task) and would
/// only oversubscribe the pool by splitting each product again. Like every product here, its
/// bits depend on the operands' shapes and strides, never on the thread that runs it.
///
/// # Panics
/// If the shapes do not chain: `lhs` is m×k, `rhs` k×n, `out` m×n.
///
/// ```
/// use tl_tensor::kernels::gemm::gemm_serial_into;
/// use tl_tensor::ndarray::{Array2, arr2};
/// let a = arr2(&[[1.0f32, 2.0], [3.0, 4.0]]);
/// let mut out = Array2::<f32>::ones((2, 2));
/// gemm_serial_into(&mut out.view_mut(), a.view(), a.view(), true); // out += a·a
/// assert_eq!(out, arr2(&[[8.0, 11.0], [16.0, 23.0]]));
/// ```
pub fn gemm_serial_into<E: Element>(
    out: &mut ArrayViewMut2<'_, E>,
    lhs: ArrayView2<'_, E>,
    rhs: ArrayView2<'_, E>,
    accumulate: bool,
) {
    gemm_with(out, lhs, rhs, accumulate, Threads::One);
}

/// The product `lhs · rhs` in a fresh row-major array, split across the current rayon pool
/// when it is large. The array is not zero-filled first (vectors aside): `gemm` writes every
/// element.
///
/// # Panics
/// If the inner sizes differ.
///
/// ```
/// use tl_tensor::kernels::gemm::matmul;
/// use tl_tensor::ndarray::arr2;
/// let a = arr2(&[[1.0f64, 2.0], [3.0, 4.0]]);
/// assert_eq!(matmul(a.t(), a.view()), arr2(&[[10.0, 14.0], [14.0, 20.0]])); // aᵀ·a
/// ```
pub fn matmul<E: Element>(lhs: ArrayView2<'_, E>, rhs: ArrayView2<'_, E>) -> Array2<E> {
    let (m, k) = lhs.dim();
    let n = rhs.ncols();
    let mut out = Array2::uninit((m, n));
    gemm_overwrite(&mut out.view_mut(), lhs, rhs, threads_for(m, n, k));
    // SAFETY: `gemm_overwrite` initialised every element of `out` (its contract below).
    unsafe { out.assume_init() }
}

/// [`gemm_into`] with the threads given by the caller.
pub(super) fn gemm_with<E: Element>(
    out: &mut ArrayViewMut2<'_, E>,
    lhs: ArrayView2<'_, E>,
    rhs: ArrayView2<'_, E>,
    accumulate: bool,
    threads: Threads,
) {
    check_shapes(out.dim(), lhs, rhs);
    let out_strides = [out.strides()[0], out.strides()[1]];
    let kind = (accumulate, false);
    super::gemm_limit::noted(out_strides, &lhs, &rhs, kind, threads, || {
        spread(out, lhs, rhs, threads, |out, lhs, rhs, parallelism| {
            let strides = [out.strides()[0], out.strides()[1]];
            // SAFETY: `out` is a live, initialised view of the product's shape (`spread`
            // hands out matching blocks of `out` and `lhs`) whose strides are passed
            // unchanged, and a unique borrow, so it aliases neither operand.
            unsafe { gemm_raw(out.as_mut_ptr(), strides, lhs, rhs, accumulate, parallelism) }
        });
    });
}

/// `out = lhs · rhs` into an output that may be uninitialised: its previous contents are
/// never read, and on return every one of its elements is initialised to the product.
pub(super) fn gemm_overwrite<E: Element>(
    out: &mut ArrayViewMut2<'_, MaybeUninit<E>>,
    lhs: ArrayView2<'_, E>,
    rhs: ArrayView2<'_, E>,
    threads: Threads,
) {
    check_shapes(out.dim(), lhs, rhs);
    let out_strides = [out.strides()[0], out.strides()[1]];
    super::gemm_limit::noted(out_strides, &lhs, &rhs, (false, true), threads, || {
        spread(out, lhs, rhs, threads, |out, lhs, rhs, parallelism| {
            let (m, n) = out.dim();
            if !gemm_only_writes(m, n) {
                // A vector, or a target where the audit below does not hold: zeroing costs little.
                out.fill(MaybeUninit::new(E::zero()));
            }
            let strides = [out.strides()[0], out.strides()[1]];
            let out = out.as_mut_ptr().cast::<E>();
            // SAFETY: `MaybeUninit<E>` has the layout of `E`, so the cast pointer addresses the
            // same elements, a block of the product's shape (`spread` hands out matching blocks
            // of `out` and `lhs`), each valid for writes; `out` is a unique borrow aliasing
            // neither operand. If it was not zero-filled above, gemm only writes it
            // (`gemm_only_writes`), so no uninitialised value is read, and on return all its
            // elements hold the product.
            unsafe { gemm_raw(out, strides, lhs, rhs, false, parallelism) }
        });
    });
}

/// Whether `gemm::gemm` with `read_dst == false` stores every element of an m×n destination
/// without ever loading it or forming a reference to it, so the destination may start
/// uninitialised.
///
/// An audit of gemm 0.19 (gemm-common's `gemm_basic_generic` and what it calls): with
/// `read_dst == false` it sets `alpha = 0`; k = 0 then stores zeros; k ≤ 2 (gevv) and the
/// small horizontal kernels store `beta·acc`; the packed microkernels take their
/// `alpha_status == 0` branch, which stores `beta·acc` through raw pointers, for every tile of
/// the first block along k, and later blocks (alpha = 1) load only what that block stored,
/// after the threads of the first have joined. Two paths fall outside this: the
/// matrix-vector kernels (an m or n of 1), which view the destination as a `&mut` slice, and
/// the aarch64 AMX microkernel, which copies partial destination tiles before the
/// `alpha_status` test. `writes_every_element_without_reading_it` (below) runs every path on
/// a destination full of NaN, which any load would propagate into the result.
fn gemm_only_writes(m: usize, n: usize) -> bool {
    cfg!(target_arch = "x86_64") && m >= 2 && n >= 2
}

/// Panics unless `lhs` (m×k) and `rhs` (k×n) chain into an output of `out_dim` = (m, n).
fn check_shapes<E>(out_dim: (usize, usize), lhs: ArrayView2<'_, E>, rhs: ArrayView2<'_, E>) {
    let (m, k) = lhs.dim();
    let (k2, n) = rhs.dim();
    assert!(
        k == k2 && out_dim == (m, n),
        "gemm: cannot multiply {:?} by {:?} into {:?}",
        lhs.shape(),
        rhs.shape(),
        [out_dim.0, out_dim.1]
    );
}

/// `out (+)= lhs · rhs` through `gemm::gemm`, operands' strides passed as they are.
///
/// # Safety
/// `out` with `out_strides` (row, column; in elements) must address an m×n matrix (m = rows
/// of `lhs`, n = columns of `rhs`) valid for writes — and initialised, if `accumulate` —
/// that aliases neither operand, and `lhs.ncols() == rhs.nrows()`.
unsafe fn gemm_raw<E: Element>(
    out: *mut E,
    out_strides: [isize; 2],
    lhs: ArrayView2<'_, E>,
    rhs: ArrayView2<'_, E>,
    accumulate: bool,
    parallelism: Parallelism,
) {
    let ((m, k), n) = (lhs.dim(), rhs.ncols());
    if m == 0 || n == 0 {
        return;
    }
    let [out_rs, out_cs] = out_strides;
    let [lhs_rs, lhs_cs] = [lhs.strides()[0], lhs.strides()[1]];
    let [rhs_rs, rhs_cs] = [rhs.strides()[0], rhs.strides()[1]];
    // SAFETY: the operand pointers come from live ndarray views of shapes m×k and k×n whose
    // strides (in elements) are passed unchanged, so every element gemm reads lies inside
    // them (gemm handles negative strides by walking from the other end); the caller vouches
    // for `out`. E is f32 or f64, types gemm supports.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out,
            out_cs,
            out_rs,
            accumulate,
            lhs.as_ptr(),
            lhs_cs,
            lhs_rs,
            rhs.as_ptr(),
            rhs_cs,
            rhs_rs,
            E::one(),
            E::one(),
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array2, arr2};
    use rayon::ThreadPoolBuilder;

    /// Values in [-1, 1) from a fixed hash of the index, so products round in every bit.
    fn hashed(shape: (usize, usize), seed: usize) -> Array2<f32> {
        Array2::from_shape_fn(shape, |(i, j)| {
            let h = (i * 7919 + j * 104_729 + seed * 1_299_709) % 1_000_003;
            h as f32 / 500_001.5 - 1.0
        })
    }

    fn bits(array: &Array2<f32>) -> Vec<u32> {
        array.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn strided_operands_and_accumulation() {
        let a = arr2(&[[1.0f64, 2.0], [3.0, 4.0], [5.0, 6.0]]); // 3×2
        let b = arr2(&[[1.0f64, 0.0, 2.0], [0.0, 1.0, 3.0]]); // 2×3
        let mut out = Array2::<f64>::zeros((3, 3));
        gemm_into(&mut out.view_mut(), a.view(), b.view(), false);
        // Row 0: [1·1 + 2·0, 1·0 + 2·1, 1·2 + 2·3] = [1, 2, 8].
        assert_eq!(out.row(0).to_vec(), vec![1.0, 2.0, 8.0]);
        assert_eq!(out, a.dot(&b));
        // aᵀ·a through a transposed view, accumulated onto the previous result:
        // (aᵀa)₀₀ = 1 + 9 + 25 = 35, twice = 70.
        let mut acc = a.t().dot(&a);
        gemm_into(&mut acc.view_mut(), a.t(), a.view(), true);
        assert_eq!(acc[[0, 0]], 70.0);
        assert_eq!(acc, a.t().dot(&a) * 2.0);
    }

    #[test]
    fn large_product_matches_naive() {
        // Integer-valued entries: every partial sum is exact, so any summation order agrees.
        let (m, k, n) = (70, 90, 80);
        let a = Array2::from_shape_fn((m, k), |(i, j)| ((i * 7 + j * 3) % 11) as f64 - 5.0);
        let b = Array2::from_shape_fn((k, n), |(i, j)| ((i * 5 + j * 2) % 13) as f64 - 6.0);
        let naive = Array2::from_shape_fn((m, n), |(i, j)| {
            (0..k).map(|p| a[[i, p]] * b[[p, j]]).sum::<f64>()
        });
        assert_eq!(matmul(a.view(), b.view()), naive);
        assert_eq!(matmul(b.t(), a.t()), naive.t());
    }

    #[test]
    fn overwrite_ignores_stale_output_and_empty_inner_gives_zeros() {
        let a = Array2::<f32>::ones((2, 3));
        let mut out = Array2::from_elem((2, 2), f32::NAN);
        gemm_into(&mut out.view_mut(), a.view(), a.t(), false);
        assert_eq!(out, Array2::from_elem((2, 2), 3.0)); // 1 + 1 + 1
        // k = 0: the empty sum, 0, overwrites; accumulating it leaves the output as it was.
        let empty = Array2::<f32>::zeros((2, 0));
        gemm_into(&mut out.view_mut(), empty.view(), empty.t(), true);
        assert_eq!(out, Array2::from_elem((2, 2), 3.0));
        gemm_into(&mut out.view_mut(), empty.view(), empty.t(), false);
        assert_eq!(out, Array2::<f32>::zeros((2, 2)));
        assert_eq!(
            matmul(empty.view(), empty.t()),
            Array2::<f32>::zeros((2, 2))
        );
        // m = 0: nothing to compute, an empty result of the right shape.
        assert_eq!(matmul(empty.t(), a.view()).dim(), (0, 3));
    }

    #[test]
    fn writes_every_element_without_reading_it() {
        // One shape per path through gemm: k = 0, k = 1 and 2 (gevv), tiny (horizontal
        // kernels, which need a row-major lhs and column-major rhs), a vector result
        // (zero-filled first), and a product split across threads with k beyond one 512-deep
        // block — each with every layout of the operands, into a destination of NaN that any
        // load would carry into the result.
        let shapes = [
            (2, 3, 0),
            (3, 5, 1),
            (4, 3, 2),
            (8, 8, 7),
            (1, 9, 5),
            (9, 1, 5),
            (130, 90, 700),
        ];
        let pool = ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for (m, n, k) in shapes {
            let lhs = hashed((m, k), 3);
            let rhs = hashed((k, n), 4);
            let (lhs_t, rhs_t) = (
                lhs.t().as_standard_layout().into_owned(),
                rhs.t().as_standard_layout().into_owned(),
            );
            let naive = Array2::from_shape_fn((m, n), |(i, j)| {
                (0..k)
                    .map(|p| f64::from(lhs[[i, p]]) * f64::from(rhs[[p, j]]))
                    .sum::<f64>()
            });
            let layouts = [
                (lhs.view(), rhs.view()),
                (lhs.view(), rhs_t.t()),
                (lhs_t.t(), rhs.view()),
                (lhs_t.t(), rhs_t.t()),
            ];
            for (lhs, rhs) in layouts {
                let mut out = Array2::from_elem((m, n), MaybeUninit::new(f32::NAN));
                let threads = threads_for(m, n, k);
                pool.install(|| gemm_overwrite(&mut out.view_mut(), lhs, rhs, threads));
                // SAFETY: `out` was initialised (to NaN) when created.
                let out = unsafe { out.assume_init() };
                // Every element within f32 rounding of the exact sum (a NaN fails `<`).
                let close = out
                    .iter()
                    .zip(&naive)
                    .all(|(&o, &e)| (f64::from(o) - e).abs() < 1e-4);
                assert!(close, "{m}×{k}·{k}×{n}: {out:?}");
            }
        }
    }

    #[test]
    fn result_bits_do_not_depend_on_the_thread_count() {
        // 100 rows: split by gemm, and k above its 512 block, so the output is revisited
        // between blocks; the rhs is a transposed view. Same bits as on one thread.
        let lhs = hashed((100, 700), 1);
        let rhs_t = hashed((280, 700), 2);
        assert_eq!(threads_for(100, 280, 700), Threads::Gemm);
        let mut single = Array2::zeros((100, 280));
        gemm_with(
            &mut single.view_mut(),
            lhs.view(),
            rhs_t.t(),
            false,
            Threads::One,
        );
        // 1100 rows: blocks of 512, 512 and 76 rows spread by rayon.
        let tall = hashed((1100, 700), 3);
        assert_eq!(threads_for(1100, 280, 700), Threads::RowBlocks(512));
        // 300 rows: two halves of 150.
        let short = hashed((300, 700), 4);
        assert_eq!(threads_for(300, 280, 700), Threads::RowBlocks(150));
        let (mut tall_results, mut short_results) = (Vec::new(), Vec::new());
        for threads in [1, 2, 3] {
            let pool = ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let split = pool.install(|| matmul(lhs.view(), rhs_t.t()));
            assert_eq!(bits(&split), bits(&single), "{threads} threads");
            tall_results.push(bits(&pool.install(|| matmul(tall.view(), rhs_t.t()))));
            short_results.push(bits(&pool.install(|| matmul(short.view(), rhs_t.t()))));
        }
        assert!(tall_results.iter().all(|bits| *bits == tall_results[0]));
        assert!(short_results.iter().all(|bits| *bits == short_results[0]));
    }
}
