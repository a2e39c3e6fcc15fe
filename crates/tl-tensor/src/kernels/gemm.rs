//! General matrix multiply on strided 2-D views, through the `gemm` crate.
//!
//! Two ways to use both cores, chosen by the shape alone (see [`batched_matmul`]): one large
//! product is split by `gemm` itself across the rayon pool, while a batch of many small
//! products runs one whole product per rayon task, each on a single thread.
//!
//! # Determinism
//! `gemm` accumulates every output element over the inner dimension in an order fixed by the
//! shape, the operands' strides and the machine's cache sizes — never by the number of
//! threads: threads only decide *which* thread computes a tile, and a tile's arithmetic is the
//! same on any of them. So a product is bit-identical under any rayon pool size, whether it
//! is split internally or computed on one thread. The tests below pin this.

use gemm::Parallelism;
use ndarray::{Array2, ArrayView2, ArrayViewMut2};

use crate::Element;

/// Products with fewer multiply-adds than this stay on the calling thread: below it, handing
/// work to the pool costs more than it saves. `gemm` applies its own, finer threshold above.
pub(super) const PARALLEL_WORK: usize = 64 * 64 * 64;

/// The parallelism for one product of `m×k` by `k×n` computed on its own.
pub(super) fn parallelism_for(m: usize, n: usize, k: usize) -> Parallelism {
    if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_WORK {
        // 0 = as many threads as the current rayon pool has.
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    }
}

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
    gemm_with(out, lhs, rhs, accumulate, parallelism_for(m, n, k));
}

/// The product `lhs · rhs` in a fresh row-major array, split across the current rayon pool
/// when it is large.
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
    let mut out = Array2::zeros((lhs.nrows(), rhs.ncols()));
    gemm_into(&mut out.view_mut(), lhs, rhs, false);
    out
}

/// [`gemm_into`] with the parallelism given by the caller.
pub(super) fn gemm_with<E: Element>(
    out: &mut ArrayViewMut2<'_, E>,
    lhs: ArrayView2<'_, E>,
    rhs: ArrayView2<'_, E>,
    accumulate: bool,
    parallelism: Parallelism,
) {
    let (m, k) = lhs.dim();
    let (k2, n) = rhs.dim();
    assert!(
        k == k2 && out.dim() == (m, n),
        "gemm: cannot multiply {:?} by {:?} into {:?}",
        lhs.shape(),
        rhs.shape(),
        out.shape()
    );
    if m == 0 || n == 0 {
        return;
    }
    let [out_rs, out_cs] = [out.strides()[0], out.strides()[1]];
    let [lhs_rs, lhs_cs] = [lhs.strides()[0], lhs.strides()[1]];
    let [rhs_rs, rhs_cs] = [rhs.strides()[0], rhs.strides()[1]];
    // SAFETY: the three pointers come from live ndarray views whose shapes were checked
    // above to be m×k, k×n and m×n, and whose strides (in elements) are passed unchanged, so
    // every element gemm reads or writes lies inside its view (gemm handles negative strides
    // by walking from the other end). `out` is a unique borrow, so it aliases neither operand.
    // E is f32 or f64, types gemm supports. With `accumulate == false`, gemm overwrites `out`
    // (k = 0 included: it writes zeros) — `out` is initialised anyway, being an ndarray view.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
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
    fn result_bits_do_not_depend_on_the_thread_count() {
        // Large enough for gemm to split it (and k above its 512 block, so the output is
        // revisited between blocks); the rhs is a transposed view.
        let lhs = hashed((300, 700), 1);
        let rhs_t = hashed((280, 700), 2);
        let single = {
            let mut out = Array2::zeros((300, 280));
            gemm_with(
                &mut out.view_mut(),
                lhs.view(),
                rhs_t.t(),
                false,
                Parallelism::None,
            );
            bits(&out)
        };
        for threads in [1, 2, 3] {
            let pool = ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let split = pool.install(|| matmul(lhs.view(), rhs_t.t()));
            assert_eq!(bits(&split), single, "{threads} threads");
        }
    }
}
