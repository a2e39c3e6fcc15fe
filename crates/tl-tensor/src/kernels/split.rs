//! How one matrix product is spread over the rayon pool: a pure function of its shape.
//!
//! Tall products (the linear layers: 4096 rows of activations) are cut into blocks of rows,
//! one `gemm` call per rayon task. Measured on the 2-core AVX2 machine this runs at 88–95% of
//! the FMA peak where `gemm`'s own threading reaches 81–88%: rayon hands blocks to whichever
//! thread is free, while `gemm` divides its tiles evenly up front, so a thread that is
//! interrupted holds the other back. Products with fewer rows (the weight gradients `Xᵀ·G`,
//! 320 or 896 rows of a 4096-long inner dimension) are cut in two halves: at the capstone's
//! shapes that measured 112–156 GFLOP/s where `gemm`'s own split reached 83–147, and each half
//! re-packs the shared operand only once. Only products too short to halve usefully are left
//! to `gemm`'s own split.
//!
//! The plan depends on the shape only, never on the number of threads, so neither does the
//! result: the same blocks are computed the same way whichever thread takes them.

use gemm::Parallelism;
use ndarray::{ArrayView2, ArrayViewMut2, Axis};
use rayon::prelude::*;

use crate::Element;

/// Products with fewer multiply-adds than this stay on the calling thread: below it, handing
/// work to the pool costs more than it saves.
pub(crate) const PARALLEL_WORK: usize = 64 * 64 * 64;

/// Rows per block of a tall product: enough that re-packing the right operand for each block
/// costs little (≤ 1/512 of the block's work), few enough that 4096 rows make 8 blocks.
const ROW_BLOCK: usize = 512;

/// How one product runs on the current rayon pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Threads {
    /// One `gemm` call on the calling thread.
    One,
    /// One `gemm` call that splits its tiles over the pool itself.
    Gemm,
    /// One single-threaded `gemm` call per block of this many rows, blocks spread by rayon.
    RowBlocks(usize),
}

/// Products with fewer rows than this are split by `gemm`, not into halves.
const MIN_HALVED_ROWS: usize = 128;

/// The [`Threads`] for a product of `m×k` by `k×n` computed on its own.
pub(super) fn threads_for(m: usize, n: usize, k: usize) -> Threads {
    if m.saturating_mul(n).saturating_mul(k) < PARALLEL_WORK {
        Threads::One
    } else if m >= 2 * ROW_BLOCK {
        Threads::RowBlocks(ROW_BLOCK)
    } else if m >= MIN_HALVED_ROWS {
        Threads::RowBlocks(m.div_ceil(2))
    } else {
        Threads::Gemm
    }
}

/// Runs `kernel(out, lhs, rhs, parallelism)` over `out = lhs · rhs` as `threads` says: once,
/// or once per block of rows of `out` and `lhs` (with the whole `rhs`).
pub(super) fn spread<T: Send, E: Element>(
    out: &mut ArrayViewMut2<'_, T>,
    lhs: ArrayView2<'_, E>,
    rhs: ArrayView2<'_, E>,
    threads: Threads,
    kernel: impl Fn(&mut ArrayViewMut2<'_, T>, ArrayView2<'_, E>, ArrayView2<'_, E>, Parallelism) + Sync,
) {
    match threads {
        Threads::One => kernel(out, lhs, rhs, Parallelism::None),
        // 0 = as many threads as the current rayon pool has.
        Threads::Gemm => kernel(out, lhs, rhs, Parallelism::Rayon(0)),
        Threads::RowBlocks(rows) => out
            .axis_chunks_iter_mut(Axis(0), rows)
            .zip(lhs.axis_chunks_iter(Axis(0), rows))
            .collect::<Vec<_>>()
            .into_par_iter()
            .for_each(|(mut out, lhs)| kernel(&mut out, lhs, rhs, Parallelism::None)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;

    #[test]
    fn plan_follows_the_shape() {
        // A linear layer's forward: 4096 rows in 8 blocks of 512.
        assert_eq!(threads_for(4096, 896, 320), Threads::RowBlocks(512));
        // Its weight gradient Xᵀ·G: 320 rows in two halves; 1023 rows in 512 + 511.
        assert_eq!(threads_for(320, 896, 4096), Threads::RowBlocks(160));
        assert_eq!(threads_for(1023, 64, 64), Threads::RowBlocks(512));
        assert_eq!(threads_for(128, 64, 64), Threads::RowBlocks(64));
        // 63·64·64 multiply-adds, just under 64³: not worth a second thread.
        assert_eq!(threads_for(63, 64, 64), Threads::One);
        // Too few rows to halve: gemm splits it.
        assert_eq!(threads_for(127, 64, 64), Threads::Gemm);
    }

    #[test]
    fn row_blocks_cover_every_row_once() {
        // 1100 rows in blocks of 512 + 512 + 76. The stand-in kernel writes each row's index
        // (lhs is the column 0, 1, .., 1099) times its block's height, so a missed, repeated
        // or misaligned block shows.
        let lhs = Array2::from_shape_fn((1100, 1), |(i, _)| i as f64);
        let rhs = Array2::<f64>::ones((1, 3));
        let mut out = Array2::<f64>::from_elem((1100, 3), f64::NAN);
        let kernel = |out: &mut ArrayViewMut2<'_, f64>,
                      lhs: ArrayView2<'_, f64>,
                      _: ArrayView2<'_, f64>,
                      _: Parallelism| {
            let (dim, rows) = (out.dim(), out.nrows() as f64);
            out.assign(&(&lhs * rows).broadcast(dim).unwrap());
        };
        let blocks = Threads::RowBlocks(512);
        spread(&mut out.view_mut(), lhs.view(), rhs.view(), blocks, kernel);
        assert_eq!(out[[600, 2]], 307_200.0); // 600 · 512
        assert_eq!(out[[1099, 1]], 83_524.0); // 1099 · 76
        assert!(out.indexed_iter().all(|((i, _), &x)| {
            let rows = if i < 1024 { 512.0 } else { 76.0 };
            x == i as f64 * rows
        }));
    }
}
