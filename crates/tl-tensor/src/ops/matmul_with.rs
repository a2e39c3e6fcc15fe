//! Matrix products whose inner sums follow another arithmetic than the element type's:
//! [`Tensor::matmul_with`] and the [`ProductKernel`] it takes.
//!
//! A plain product accumulates in the element type, in the order the GEMM library chooses.
//! Hardware with other accumulation rules (a tensor core adds blocks of products at once and
//! truncates) is emulated by a kernel that computes each output from its row and column by
//! those rules. This crate knows nothing of the rules: it lays the operands out for the
//! kernel, spreads the work over threads, and records the autograd node, whose two VJPs are
//! products by the same kernel, as they would be on that hardware.

use std::fmt;
use std::sync::Arc;

use ndarray::{ArrayD, ArrayView2, ArrayViewD, ArrayViewMut2, Axis, CowArray, IxDyn};
use rayon::prelude::*;

use super::{broadcast_shape, unbroadcast};
use crate::kernels::rows::contiguous;
use crate::kernels::split::PARALLEL_WORK;
use crate::ops::elementwise::{zeros_array_on_pool, zeros_on_pool};
use crate::{Element, Tensor};

/// The arithmetic of a matrix product's inner sums, for [`Tensor::matmul_with`] and the
/// fused attention kernel.
///
/// Every method computes `out = lhs · rhs` for contiguous row-major matrices (`lhs` m×k,
/// `rhs` k×n, `out` m×n), or with `accumulate`, `out = out + lhs · rhs` with each output's
/// old value as the accumulator the sum starts from (a tensor core's `D = C + A·B`). Each
/// output must depend on its row of `lhs`, its column of `rhs` (and its old value) only —
/// never on `m` — so that a product split by rows over threads gives the same bits as in one
/// piece.
pub trait ProductKernel: Send + Sync + fmt::Debug {
    /// The product of f32 matrices.
    #[allow(clippy::too_many_arguments)]
    fn product_f32(
        &self,
        m: usize,
        k: usize,
        n: usize,
        lhs: &[f32],
        rhs: &[f32],
        out: &mut [f32],
        accumulate: bool,
    );
    /// The product of f64 matrices.
    #[allow(clippy::too_many_arguments)]
    fn product_f64(
        &self,
        m: usize,
        k: usize,
        n: usize,
        lhs: &[f64],
        rhs: &[f64],
        out: &mut [f64],
        accumulate: bool,
    );

    /// `out = lhs · rhs` (or `out += …`) for f32 views of any strides. By default the
    /// operands (and, accumulating, `out`) are copied into row-major order for
    /// [`product_f32`](Self::product_f32), and the result written back; a kernel that packs
    /// its operands anyway reads the views directly.
    fn product_view_f32(
        &self,
        out: &mut ArrayViewMut2<'_, f32>,
        lhs: ArrayView2<'_, f32>,
        rhs: ArrayView2<'_, f32>,
        accumulate: bool,
    ) {
        through_copies(
            out,
            lhs,
            rhs,
            accumulate,
            |shape, lhs, rhs, out, accumulate| {
                let (m, k, n) = shape;
                self.product_f32(m, k, n, lhs, rhs, out, accumulate);
            },
        );
    }

    /// [`product_view_f32`](Self::product_view_f32) for f64 views.
    fn product_view_f64(
        &self,
        out: &mut ArrayViewMut2<'_, f64>,
        lhs: ArrayView2<'_, f64>,
        rhs: ArrayView2<'_, f64>,
        accumulate: bool,
    ) {
        through_copies(
            out,
            lhs,
            rhs,
            accumulate,
            |shape, lhs, rhs, out, accumulate| {
                let (m, k, n) = shape;
                self.product_f64(m, k, n, lhs, rhs, out, accumulate);
            },
        );
    }

    /// Whether the kernel spreads one product over the rayon pool itself (after packing its
    /// operands once), so that callers hand it whole products instead of blocks of rows.
    fn spreads_itself(&self) -> bool {
        false
    }

    /// `rhs` laid out once for several products that each read its leading rows and
    /// columns ([`PreparedRhs`]), or `None` (the default) for a kernel that gains nothing
    /// from it; the caller then multiplies by the views.
    fn prepare_rhs_f32<'a>(
        &self,
        _rhs: ArrayView2<'a, f32>,
    ) -> Option<Box<dyn PreparedRhs<f32> + 'a>> {
        None
    }
}

/// A right operand a [`ProductKernel`] has laid out once (packed, decomposed) for several
/// products that each read a leading block of it, as the fused attention's blocks of query
/// rows read the keys and values up to their last row. Each product gives the bits of the
/// kernel's product by the same block as a view.
pub trait PreparedRhs<E>: Send + Sync {
    /// `out = lhs · rhs[..k, ..n]` (or `out += …` with `accumulate`), `lhs` m×k, `out` m×n.
    fn product_into(
        &self,
        out: &mut ArrayViewMut2<'_, E>,
        lhs: ArrayView2<'_, E>,
        accumulate: bool,
    );
}

/// `out = lhs · rhs` (or `out += lhs · rhs` with `accumulate`) by `kernel` on the calling
/// thread, for views of any strides: the operands (and, accumulating, `out`) are copied into
/// row-major order for the kernel, and the result written back. For a kernel that already
/// runs one task per thread (the fused attention's heads).
///
/// # Panics
/// If the shapes do not chain: `lhs` is m×k, `rhs` k×n, `out` m×n.
pub fn kernel_product_into<E: Element>(
    kernel: &dyn ProductKernel,
    out: &mut ArrayViewMut2<'_, E>,
    lhs: ArrayView2<'_, E>,
    rhs: ArrayView2<'_, E>,
    accumulate: bool,
) {
    let ((m, k), n) = (lhs.dim(), rhs.ncols());
    assert!(
        rhs.nrows() == k && out.dim() == (m, n),
        "kernel_product_into: {m}×{k} by {:?} into {:?}",
        rhs.dim(),
        out.dim()
    );
    E::kernel_product_view(kernel, out, lhs, rhs, accumulate);
}

/// A product by a kernel on row-major slices, for views of any strides: the operands (and,
/// accumulating, `out`) copied into row-major order, the result written back.
fn through_copies<E: Element>(
    out: &mut ArrayViewMut2<'_, E>,
    lhs: ArrayView2<'_, E>,
    rhs: ArrayView2<'_, E>,
    accumulate: bool,
    product: impl FnOnce((usize, usize, usize), &[E], &[E], &mut [E], bool),
) {
    let ((m, k), n) = (lhs.dim(), rhs.ncols());
    let (lhs, rhs) = (contiguous(lhs), contiguous(rhs));
    let mut result = contiguous(out.view());
    product(
        (m, k, n),
        lhs.as_slice().expect("standard layout"),
        rhs.as_slice().expect("standard layout"),
        result.as_slice_mut().expect("standard layout"),
        accumulate,
    );
    out.assign(&result);
}

/// Matrices of this many rows or more are split by rows over threads.
const MIN_ROWS_PER_TASK: usize = 16;

/// `lhs · rhs` for contiguous row-major matrices by `kernel`, the rows spread over the rayon
/// pool when the product is large.
fn product<E: Element>(
    kernel: &dyn ProductKernel,
    (m, k, n): (usize, usize, usize),
    lhs: &[E],
    rhs: &[E],
    out: &mut [E],
    parallel: bool,
) {
    let threads = rayon::current_num_threads();
    let work = m.saturating_mul(n).saturating_mul(k);
    if !parallel || threads == 1 || work < PARALLEL_WORK || m < 2 * MIN_ROWS_PER_TASK || n == 0 {
        E::kernel_product(kernel, (m, k, n), lhs, rhs, out, false);
        return;
    }
    // Rows in about four pieces per thread: enough for the pool to balance.
    let rows = m.div_ceil(4 * threads).max(MIN_ROWS_PER_TASK);
    out.par_chunks_mut(rows * n)
        .zip(lhs.par_chunks(rows * k))
        .for_each(|(out, lhs)| {
            E::kernel_product(kernel, (out.len() / n, k, n), lhs, rhs, out, false)
        });
}

/// The batched product `[b.., m, k] · [b.., k, n]` of two views whose batch axes agree, by
/// `kernel`; each matrix is copied into row-major order first unless it is already.
fn batched<E: Element>(
    kernel: &dyn ProductKernel,
    lhs: ArrayViewD<'_, E>,
    rhs: ArrayViewD<'_, E>,
) -> ArrayD<E> {
    let nd = lhs.ndim();
    let (m, k, n) = (
        lhs.shape()[nd - 2],
        lhs.shape()[nd - 1],
        rhs.shape()[nd - 1],
    );
    let batch = lhs.shape()[..nd - 2].to_vec();
    let count: usize = batch.iter().product();
    let mut out_shape = batch.clone();
    out_shape.extend([m, n]);
    if kernel.spreads_itself() {
        return batched_views(kernel, lhs, rhs, &out_shape);
    }
    let mut out = zeros_on_pool(count * m * n);
    let lhs = lhs.as_standard_layout();
    let rhs = rhs.as_standard_layout();
    let (lhs, rhs) = (
        lhs.as_slice().expect("standard layout"),
        rhs.as_slice().expect("standard layout"),
    );
    if m * n > 0 {
        let items = out
            .chunks_mut(m * n)
            .zip(lhs.chunks(m * k.max(1)))
            .zip(rhs.chunks(k.max(1) * n));
        if count >= 4 {
            items
                .collect::<Vec<_>>()
                .into_par_iter()
                .for_each(|((out, lhs), rhs)| {
                    product(kernel, (m, k, n), &lhs[..m * k], &rhs[..k * n], out, false);
                });
        } else {
            for ((out, lhs), rhs) in items {
                product(kernel, (m, k, n), &lhs[..m * k], &rhs[..k * n], out, true);
            }
        }
    }
    ArrayD::from_shape_vec(IxDyn(&out_shape), out).expect("the product's shape")
}

/// [`batched`] for a kernel that packs its operands and spreads one product over the pool
/// itself: each matrix is handed over as the view it is (no row-major copies), whole.
fn batched_views<E: Element>(
    kernel: &dyn ProductKernel,
    lhs: ArrayViewD<'_, E>,
    rhs: ArrayViewD<'_, E>,
    out_shape: &[usize],
) -> ArrayD<E> {
    let nd = out_shape.len();
    let (m, n) = (out_shape[nd - 2], out_shape[nd - 1]);
    let count: usize = out_shape[..nd - 2].iter().product();
    let mut out = zeros_array_on_pool(out_shape);
    let (lhs_items, rhs_items) = (matrices(lhs), matrices(rhs));
    let mut flat = out
        .view_mut()
        .into_shape_with_order((count, m, n))
        .expect("a fresh array");
    let outs: Vec<ArrayViewMut2<'_, E>> = flat.outer_iter_mut().collect();
    let run =
        |((mut out, lhs), rhs): ((ArrayViewMut2<'_, E>, ArrayView2<'_, E>), ArrayView2<'_, E>)| {
            E::kernel_product_view(kernel, &mut out, lhs, rhs, false);
        };
    let items = outs.into_iter().zip(lhs_items).zip(rhs_items);
    if count >= 4 {
        items.collect::<Vec<_>>().into_par_iter().for_each(run);
    } else {
        items.for_each(run);
    }
    out
}

/// The matrices of a `[b.., r, c]` view, batch index by batch index in row-major order.
fn matrices<'a, E>(view: ArrayViewD<'a, E>) -> Vec<ArrayView2<'a, E>> {
    let mut items = vec![view];
    while items[0].ndim() > 2 {
        items = items
            .into_iter()
            .flat_map(|item| {
                (0..item.shape()[0]).map(move |i| item.clone().index_axis_move(Axis(0), i))
            })
            .collect();
    }
    items
        .into_iter()
        .map(|item| item.into_dimensionality().expect("a matrix of the batch"))
        .collect()
}

/// A view with its last two axes swapped.
fn transposed<'a, E>(view: ArrayViewD<'a, E>) -> ArrayViewD<'a, E> {
    let mut view = view;
    let nd = view.ndim();
    view.swap_axes(nd - 2, nd - 1);
    view
}

/// `view` broadcast to `batch` followed by its own last two axes.
fn with_batch<'a, E>(view: &'a ArrayViewD<'_, E>, batch: &[usize]) -> ArrayViewD<'a, E> {
    let mut shape = batch.to_vec();
    shape.extend_from_slice(&view.shape()[view.ndim() - 2..]);
    view.broadcast(IxDyn(&shape)).expect("batch axes broadcast")
}

/// `view` with every axis before the last folded into rows: `[.., k] → [rows, k]`, without a
/// copy when it is in standard layout.
fn as_rows<'a, E: Element>(view: ArrayViewD<'a, E>) -> CowArray<'a, E, IxDyn> {
    let k = view.shape()[view.ndim() - 1];
    let rows = view.len() / k.max(1);
    if view.is_standard_layout() {
        return view
            .into_shape_with_order(IxDyn(&[rows, k]))
            .expect("a standard-layout view folds into rows")
            .into();
    }
    view.as_standard_layout()
        .into_owned()
        .into_shape_with_order(IxDyn(&[rows, k]))
        .expect("a standard-layout array folds into rows")
        .into()
}

impl<E: Element> Tensor<E> {
    /// The matrix product of [`matmul`](Self::matmul) — the same shapes and broadcasting —
    /// with every inner sum computed by `kernel`, forward and in both VJPs
    /// (`d lhs = grad · rhsᵀ`, `d rhs = lhsᵀ · grad`, each by `kernel`, then summed back
    /// over broadcast batch axes). No hook is consulted: this is what a hook calls.
    ///
    /// A `[.., m, k] · [k, n]` product (a linear layer) is one `[rows, k] · [k, n]` product
    /// over all rows, and its weight's gradient one `[k, rows] · [rows, n]` product.
    ///
    /// # Panics
    /// As [`matmul`](Self::matmul).
    pub fn matmul_with(&self, rhs: &Tensor<E>, kernel: &Arc<dyn ProductKernel>) -> Tensor<E> {
        let (lhs_shape, rhs_shape) = (self.shape(), rhs.shape());
        let (lhs_nd, rhs_nd) = (lhs_shape.len(), rhs_shape.len());
        assert!(
            lhs_nd >= 2 && rhs_nd >= 2 && lhs_shape[lhs_nd - 1] == rhs_shape[rhs_nd - 2],
            "matmul: cannot multiply shapes {lhs_shape:?} and {rhs_shape:?}"
        );
        if rhs_nd == 2 && lhs_nd > 2 {
            return self.rows_times_matrix_with(rhs, kernel);
        }
        let batch = broadcast_shape("matmul", &lhs_shape[..lhs_nd - 2], &rhs_shape[..rhs_nd - 2]);
        let mut out_shape = batch.clone();
        out_shape.extend([lhs_shape[lhs_nd - 2], rhs_shape[rhs_nd - 1]]);
        let forward_batch = batch.clone();
        let forward = move || {
            let (lhs, rhs) = (self.value(), rhs.value());
            let (lhs, rhs) = (lhs.view(), rhs.view());
            batched(
                kernel.as_ref(),
                with_batch(&lhs, &forward_batch),
                with_batch(&rhs, &forward_batch),
            )
        };
        let saved = (self.clone(), rhs.clone(), Arc::clone(kernel));
        Tensor::from_product_by_parent(&out_shape, forward, &[self, rhs], move |grad, parent| {
            let (lhs_saved, rhs_saved, kernel) = &saved;
            if parent == 0 {
                let rhs_value = rhs_saved.value();
                let rhs_view = rhs_value.view();
                let rhs_t = transposed(with_batch(&rhs_view, &batch));
                unbroadcast(batched(kernel.as_ref(), grad.view(), rhs_t), &lhs_shape)
            } else {
                let lhs_value = lhs_saved.value();
                let lhs_view = lhs_value.view();
                let lhs_t = transposed(with_batch(&lhs_view, &batch));
                unbroadcast(batched(kernel.as_ref(), lhs_t, grad.view()), &rhs_shape)
            }
        })
    }

    /// [`matmul_with`](Self::matmul_with) of `[.., m, k] · [k, n]`, the batch folded into rows.
    fn rows_times_matrix_with(
        &self,
        rhs: &Tensor<E>,
        kernel: &Arc<dyn ProductKernel>,
    ) -> Tensor<E> {
        let lhs_shape = self.shape();
        let n = rhs.shape()[1];
        let mut out_shape = lhs_shape[..lhs_shape.len() - 1].to_vec();
        out_shape.push(n);
        let value = || {
            let value = self.value();
            let rows = as_rows(value.view());
            batched(kernel.as_ref(), rows.view(), rhs.value().view())
                .into_shape_with_order(IxDyn(&out_shape))
                .expect("a fresh product is in standard layout")
        };
        let saved = (self.clone(), rhs.clone(), Arc::clone(kernel));
        Tensor::from_product_by_parent(&out_shape, value, &[self, rhs], move |grad, parent| {
            let (lhs_saved, rhs_saved, kernel) = &saved;
            let grad_rows = as_rows(grad.view());
            if parent == 0 {
                let rhs_value = rhs_saved.value();
                batched(
                    kernel.as_ref(),
                    grad_rows.view(),
                    transposed(rhs_value.view()),
                )
                .into_shape_with_order(IxDyn(&lhs_shape))
                .expect("a fresh product is in standard layout")
            } else {
                let lhs_value = lhs_saved.value();
                let lhs_rows = as_rows(lhs_value.view());
                let mut lhs_t = lhs_rows.view();
                lhs_t.swap_axes(0, 1);
                batched(kernel.as_ref(), lhs_t, grad_rows.view())
            }
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::Generator;
    use crate::testing::random_array;

    /// A kernel that sums each output in plain f64 order, and counts nothing: with integer
    /// operands every order gives the same result, so it must equal the plain product.
    #[derive(Debug)]
    pub(crate) struct Naive {
        /// Whether it says it spreads itself: `matmul_with` then hands it each matrix of a
        /// batch as the view it is (`batched_views`), with no row-major copies.
        pub(crate) on_views: bool,
    }

    fn naive<E: Element>(
        m: usize,
        k: usize,
        n: usize,
        lhs: &[E],
        rhs: &[E],
        out: &mut [E],
        accumulate: bool,
    ) {
        for i in 0..m {
            for j in 0..n {
                let mut sum = if accumulate {
                    out[i * n + j]
                } else {
                    E::zero()
                };
                for p in 0..k {
                    sum += lhs[i * k + p] * rhs[p * n + j];
                }
                out[i * n + j] = sum;
            }
        }
    }

    impl ProductKernel for Naive {
        fn product_f32(
            &self,
            m: usize,
            k: usize,
            n: usize,
            lhs: &[f32],
            rhs: &[f32],
            out: &mut [f32],
            accumulate: bool,
        ) {
            naive(m, k, n, lhs, rhs, out, accumulate);
        }
        fn product_f64(
            &self,
            m: usize,
            k: usize,
            n: usize,
            lhs: &[f64],
            rhs: &[f64],
            out: &mut [f64],
            accumulate: bool,
        ) {
            naive(m, k, n, lhs, rhs, out, accumulate);
        }
        fn spreads_itself(&self) -> bool {
            self.on_views
        }
    }

    fn integers(shape: &[usize], rng: &Generator) -> ArrayD<f64> {
        ArrayD::from_shape_simple_fn(IxDyn(shape), || rng.below(7) as f64 - 3.0)
    }

    #[test]
    fn values_and_gradients_equal_the_plain_products_on_every_shape() {
        // Through row-major copies, and on the views themselves (a batch broadcast from a
        // size-1 axis included, and the transposed operands of both VJPs).
        let kernels: [Arc<dyn ProductKernel>; 2] = [false, true]
            .map(|on_views| -> Arc<dyn ProductKernel> { Arc::new(Naive { on_views }) });
        for kernel in &kernels {
            plain_products_on_every_shape(kernel);
        }
    }

    fn plain_products_on_every_shape(kernel: &Arc<dyn ProductKernel>) {
        let rng = Generator::new(3);
        let shapes: [(&[usize], &[usize]); 5] = [
            (&[3, 4], &[4, 5]),
            (&[2, 3, 4], &[4, 5]),
            (&[2, 3, 4], &[2, 4, 5]),
            (&[2, 1, 3, 4], &[3, 4, 2]),
            (&[5, 40, 7], &[7, 3]),
        ];
        for (ls, rs) in shapes {
            let (a, b) = (integers(ls, &rng), integers(rs, &rng));
            let upstream_shape = {
                let plain = Tensor::<f64>::from_array(a.clone())
                    .matmul_plain(&Tensor::from_array(b.clone()));
                plain.shape()
            };
            let upstream = integers(&upstream_shape, &rng);
            let run = |with: bool| {
                let (x, y) = (
                    Tensor::<f64>::param(a.clone()),
                    Tensor::<f64>::param(b.clone()),
                );
                let z = if with {
                    x.matmul_with(&y, kernel)
                } else {
                    x.matmul_plain(&y)
                };
                z.backward_with(upstream.clone());
                (z.to_vec(), x.grad().unwrap(), y.grad().unwrap())
            };
            assert_eq!(run(true), run(false), "{ls:?} · {rs:?}");
        }
        // f32 too.
        let a = random_array(&[64, 33], &rng).mapv(|x| (x * 8.0).round() as f32);
        let b = random_array(&[33, 9], &rng).mapv(|x| (x * 8.0).round() as f32);
        let (x, y) = (Tensor::from_array(a), Tensor::from_array(b));
        assert_eq!(
            x.matmul_with(&y, kernel).to_vec(),
            x.matmul_plain(&y).to_vec()
        );
    }

    #[test]
    fn the_split_over_threads_does_not_change_a_bit() {
        let kernel: Arc<dyn ProductKernel> = Arc::new(Naive { on_views: false });
        let rng = Generator::new(5);
        let a = random_array(&[300, 64], &rng).mapv(|x| x as f32);
        let b = random_array(&[64, 80], &rng).mapv(|x| x as f32);
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let (x, y) = (Tensor::from_array(a.clone()), Tensor::from_array(b.clone()));
                let bits: Vec<u32> = x
                    .matmul_with(&y, &kernel)
                    .to_vec()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                bits
            })
        };
        let one = on(1);
        assert_eq!(one, on(3));
    }
}
