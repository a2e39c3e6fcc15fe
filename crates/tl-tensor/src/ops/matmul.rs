//! Matrix products with batch dimensions — and the override point that autocast uses.
//!
//! Every matmul in the library goes through [`Tensor::matmul`]. While a [`MatmulHook`] is
//! installed on a thread, `matmul` hands its operands to the hook instead of computing the
//! plain product; tl-precision's autocast installs one that rounds operands and result. This
//! crate itself knows nothing about number formats.

use std::any::Any;
use std::cell::RefCell;
use std::sync::Arc;

use ndarray::{ArrayD, ArrayViewD, IxDyn};

use super::{broadcast_shape, unbroadcast};
use crate::kernels::batched::batched_matmul;
use crate::{Element, Tensor};

/// A replacement for the product computed by [`Tensor::matmul`] on one thread.
///
/// Implementations compute their product with [`Tensor::matmul_plain`] (calling `matmul`
/// from inside the hook would call the hook again).
///
/// A hook is [`Any`], so the crate that installed it can recognise its own hook among those
/// installed and read its settings back (autocast's format is the installed hook's, not a
/// second piece of thread-local state). Since the hook is part of [`ModeSnapshot`](crate::ModeSnapshot),
/// whatever it carries follows a checkpoint's rerun and a worker thread.
pub trait MatmulHook: Any + Send + Sync {
    /// The product of two `f32` tensors.
    fn matmul_f32(&self, lhs: &Tensor<f32>, rhs: &Tensor<f32>) -> Tensor<f32>;
    /// The product of two `f64` tensors.
    fn matmul_f64(&self, lhs: &Tensor<f64>, rhs: &Tensor<f64>) -> Tensor<f64>;
}

thread_local! {
    static MATMUL_HOOK: RefCell<Option<Arc<dyn MatmulHook>>> = const { RefCell::new(None) };
}

/// Installs `hook` (or removes any, with `None`) for this thread and returns the one it
/// replaces, so the caller can put it back: the building block of an RAII guard.
pub fn set_matmul_hook(hook: Option<Arc<dyn MatmulHook>>) -> Option<Arc<dyn MatmulHook>> {
    MATMUL_HOOK.with(|slot| slot.replace(hook))
}

/// The hook installed on this thread, if any.
pub fn matmul_hook() -> Option<Arc<dyn MatmulHook>> {
    MATMUL_HOOK.with(|slot| slot.borrow().clone())
}

/// `lhs · rhs` over the last two axes, broadcasting the batch axes before them to `batch`
/// (as stride-0 views: a shared matrix is read in place, never copied per batch item).
fn batched_product<E: Element>(
    lhs: ArrayViewD<'_, E>,
    rhs: ArrayViewD<'_, E>,
    batch: &[usize],
) -> ArrayD<E> {
    let with_batch = |view: &ArrayViewD<'_, E>| {
        let mut shape = batch.to_vec();
        shape.extend_from_slice(&view.shape()[view.ndim() - 2..]);
        shape
    };
    let (lhs_shape, rhs_shape) = (with_batch(&lhs), with_batch(&rhs));
    let lhs = lhs
        .broadcast(IxDyn(&lhs_shape))
        .expect("batch axes broadcast");
    let rhs = rhs
        .broadcast(IxDyn(&rhs_shape))
        .expect("batch axes broadcast");
    batched_matmul(lhs, rhs)
}

/// The last two axes of a view swapped (a transposed matrix, no copy).
fn swap_last<'a, E: Element>(view: ArrayViewD<'a, E>) -> ArrayViewD<'a, E> {
    let mut view = view;
    let nd = view.ndim();
    view.swap_axes(nd - 2, nd - 1);
    view
}

impl<E: Element> Tensor<E> {
    /// The matrix product over the last two axes, with the axes before them broadcast as a
    /// batch: `[.., m, k] · [.., k, n] → [.., m, n]`.
    ///
    /// While a [`MatmulHook`] is installed on this thread (autocast), the hook computes the
    /// product instead.
    ///
    /// # Panics
    /// If either operand has fewer than 2 axes, the inner sizes differ, or the batch axes do
    /// not broadcast.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let a = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2])?;
    /// let b = Tensor::<f32>::from_vec(vec![1.0, 0.0, 0.0, 1.0], &[2, 2])?;
    /// assert_eq!(a.matmul(&b).to_vec(), vec![1.0, 2.0, 3.0, 4.0]);
    /// # Ok::<(), tl_tensor::TensorError>(())
    /// ```
    pub fn matmul(&self, rhs: &Tensor<E>) -> Tensor<E> {
        match matmul_hook() {
            Some(hook) => E::dispatch_matmul(hook.as_ref(), self, rhs),
            None => self.matmul_plain(rhs),
        }
    }

    /// The plain product of [`matmul`](Self::matmul), bypassing any installed hook: what a
    /// hook calls to compute its own product.
    ///
    /// VJPs: `d lhs = grad · rhsᵀ`, `d rhs = lhsᵀ · grad`, each summed back over broadcast
    /// batch axes.
    ///
    /// # Panics
    /// As [`matmul`](Self::matmul).
    pub fn matmul_plain(&self, rhs: &Tensor<E>) -> Tensor<E> {
        let (lhs_shape, rhs_shape) = (self.shape(), rhs.shape());
        let (lhs_nd, rhs_nd) = (lhs_shape.len(), rhs_shape.len());
        assert!(
            lhs_nd >= 2 && rhs_nd >= 2 && lhs_shape[lhs_nd - 1] == rhs_shape[rhs_nd - 2],
            "matmul: cannot multiply shapes {lhs_shape:?} and {rhs_shape:?}"
        );
        if rhs_nd == 2 && lhs_nd > 2 {
            return self.rows_times_matrix(rhs);
        }
        let batch = broadcast_shape("matmul", &lhs_shape[..lhs_nd - 2], &rhs_shape[..rhs_nd - 2]);
        let mut out_shape = batch.clone();
        out_shape.extend([lhs_shape[lhs_nd - 2], rhs_shape[rhs_nd - 1]]);
        let forward_batch = batch.clone();
        let value =
            move || batched_product(self.value().view(), rhs.value().view(), &forward_batch);
        let (lhs_saved, rhs_saved) = (self.clone(), rhs.clone());
        Tensor::from_product_by_parent(&out_shape, value, &[self, rhs], move |grad, parent| {
            if parent == 0 {
                let rhs_value = rhs_saved.value();
                let full = batched_product(grad.view(), swap_last(rhs_value.view()), &batch);
                unbroadcast(full, &lhs_shape)
            } else {
                let lhs_value = lhs_saved.value();
                let full = batched_product(swap_last(lhs_value.view()), grad.view(), &batch);
                unbroadcast(full, &rhs_shape)
            }
        })
    }
}

impl<E: Element> Tensor<E> {
    /// `[.., m, k] · [k, n]` — a linear layer on a batch of sequences — as one `[rows, k] ·
    /// [k, n]` product over the rows of every batch item: the batch axes are folded into the
    /// rows of a view, so nothing is copied and the weight's gradient comes out of a single
    /// product, with no per-item partial sums to add up.
    fn rows_times_matrix(&self, rhs: &Tensor<E>) -> Tensor<E> {
        let lhs_shape = self.shape();
        let n = rhs.shape()[1];
        let mut out_shape = lhs_shape[..lhs_shape.len() - 1].to_vec();
        out_shape.push(n);
        let value = || {
            as_rows(&self.value(), |lhs| {
                batched_matmul(lhs, rhs.value().view())
                    .into_shape_with_order(IxDyn(&out_shape))
                    .expect("a fresh product is in standard layout")
            })
        };
        let (lhs_saved, rhs_saved) = (self.clone(), rhs.clone());
        Tensor::from_product_by_parent(&out_shape, value, &[self, rhs], move |grad, parent| {
            as_rows(grad, |grad| {
                if parent == 0 {
                    batched_matmul(grad.view(), swap_last(rhs_saved.value().view()))
                        .into_shape_with_order(IxDyn(&lhs_shape))
                        .expect("a fresh product is in standard layout")
                } else {
                    as_rows(&lhs_saved.value(), |lhs| {
                        batched_matmul(swap_last(lhs), grad.view())
                    })
                }
            })
        })
    }
}

/// `f` of `array` seen as a matrix: its last axis the columns, every axis before it folded
/// into the rows. A view for an array in standard layout, a copy for any other.
fn as_rows<E: Element, T>(array: &ArrayD<E>, f: impl FnOnce(ArrayViewD<'_, E>) -> T) -> T {
    let (leading, width) = array.shape().split_at(array.ndim() - 1);
    let rows = leading.iter().product::<usize>();
    let standard = array.as_standard_layout();
    let matrix = standard
        .view()
        .into_shape_with_order(IxDyn(&[rows, width[0]]))
        .expect("a standard-layout array folds into rows");
    f(matrix)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Generator;
    use crate::testing::{assert_gradients, random_array};
    use ndarray::{Dimension, arr2};
    use rayon::ThreadPoolBuilder;

    /// The batched product by definition: for each output element, a sum over the inner axis
    /// of the operands' elements at the batch index, a size-1 batch axis reading index 0.
    fn naive_matmul(lhs: &ArrayD<f64>, rhs: &ArrayD<f64>) -> ArrayD<f64> {
        let (lhs_nd, rhs_nd) = (lhs.ndim(), rhs.ndim());
        let batch = broadcast_shape(
            "naive",
            &lhs.shape()[..lhs_nd - 2],
            &rhs.shape()[..rhs_nd - 2],
        );
        let (m, k, n) = (
            lhs.shape()[lhs_nd - 2],
            lhs.shape()[lhs_nd - 1],
            rhs.shape()[rhs_nd - 1],
        );
        let mut out_shape = batch.clone();
        out_shape.extend([m, n]);
        // The operand's index for output index `out`: batch axes aligned from the right.
        let source = |operand: &ArrayD<f64>, out: &[usize], row: usize, col: usize| {
            let skip = batch.len() + 2 - operand.ndim();
            let mut index: Vec<usize> = (skip..batch.len())
                .map(|axis| {
                    if operand.shape()[axis - skip] == 1 {
                        0
                    } else {
                        out[axis]
                    }
                })
                .collect();
            index.extend([row, col]);
            operand[IxDyn(&index)]
        };
        ArrayD::from_shape_fn(IxDyn(&out_shape), |index| {
            let out = index.slice();
            let (i, j) = (out[batch.len()], out[batch.len() + 1]);
            (0..k)
                .map(|p| source(lhs, out, i, p) * source(rhs, out, p, j))
                .sum()
        })
    }

    /// Small integers, so every product and sum is exact and any summation order agrees.
    fn integers(shape: &[usize], rng: &Generator) -> ArrayD<f64> {
        ArrayD::from_shape_simple_fn(IxDyn(shape), || rng.below(7) as f64 - 3.0)
    }

    #[test]
    fn gradients_of_a_matrix_product() {
        // L = sum(A·B): dL/dA = 1·Bᵀ (row sums of B), dL/dB = Aᵀ·1 (column sums of A).
        let a = Tensor::<f64>::param(arr2(&[[1.0, 2.0], [3.0, 4.0]]).into_dyn());
        let b = Tensor::<f64>::param(arr2(&[[5.0, 6.0], [7.0, 8.0]]).into_dyn());
        let y = a.matmul(&b);
        assert_eq!(y.to_vec(), vec![19.0, 22.0, 43.0, 50.0]);
        y.sum_all().backward();
        assert_eq!(
            a.grad().unwrap(),
            arr2(&[[11.0, 15.0], [11.0, 15.0]]).into_dyn()
        );
        assert_eq!(
            b.grad().unwrap(),
            arr2(&[[4.0, 4.0], [6.0, 6.0]]).into_dyn()
        );
    }

    #[test]
    fn batch_axes_broadcast() {
        // A batch of 3 matrices times one shared matrix: the shared one's gradient sums
        // over the batch.
        let a = Tensor::<f64>::param(ArrayD::ones(IxDyn(&[3, 2, 4])));
        let w = Tensor::<f64>::param(ArrayD::ones(IxDyn(&[4, 5])));
        let y = a.matmul(&w);
        assert_eq!(y.shape(), vec![3, 2, 5]);
        assert!(y.to_vec().iter().all(|&v| v == 4.0));
        y.sum_all().backward();
        assert!(w.grad().unwrap().iter().all(|&g| g == 6.0));
        assert!(a.grad().unwrap().iter().all(|&g| g == 5.0));
    }

    struct Doubling;
    impl MatmulHook for Doubling {
        fn matmul_f32(&self, lhs: &Tensor<f32>, rhs: &Tensor<f32>) -> Tensor<f32> {
            lhs.matmul_plain(rhs).mul_scalar(2.0)
        }
        fn matmul_f64(&self, lhs: &Tensor<f64>, rhs: &Tensor<f64>) -> Tensor<f64> {
            lhs.matmul_plain(rhs).mul_scalar(2.0)
        }
    }

    #[test]
    fn an_installed_hook_computes_the_product() {
        let a = Tensor::<f32>::ones(&[1, 1]);
        let previous = set_matmul_hook(Some(Arc::new(Doubling)));
        assert!(previous.is_none());
        assert_eq!(a.matmul(&a).item(), 2.0);
        set_matmul_hook(previous);
        assert_eq!(a.matmul(&a).item(), 1.0);
    }

    #[test]
    fn random_shapes_match_the_naive_product_forward_and_backward() {
        let rng = Generator::new(11);
        for _ in 0..40 {
            let size = |low: u64| (low + rng.below(5)) as usize;
            let (m, k, n) = (size(0), size(0), size(1));
            // Up to two batch axes each, every axis of size d or 1 (broadcast), or absent.
            let batch: Vec<usize> = (0..rng.below(3)).map(|_| size(1)).collect();
            let operand_batch = || -> Vec<usize> {
                let kept = rng.below(batch.len() as u64 + 1) as usize;
                let axes = &batch[batch.len() - kept..];
                axes.iter()
                    .map(|&d| if rng.below(3) == 0 { 1 } else { d })
                    .collect()
            };
            let mut lhs_shape = operand_batch();
            lhs_shape.extend([m, k]);
            let mut rhs_shape = operand_batch();
            rhs_shape.extend([k, n]);
            let (lhs, rhs) = (integers(&lhs_shape, &rng), integers(&rhs_shape, &rng));
            let a = Tensor::param(lhs.clone());
            let b = Tensor::param(rhs.clone());
            let y = a.matmul(&b);
            let expected = naive_matmul(&lhs, &rhs);
            assert_eq!(y.to_array(), expected, "{lhs_shape:?} · {rhs_shape:?}");
            // With L = Σ Y ⊙ G: dL/dA = G·Bᵀ and dL/dB = Aᵀ·G, summed over broadcast axes.
            let grad_out = integers(expected.shape(), &rng);
            y.backward_with(grad_out.clone());
            let swap = |x: &ArrayD<f64>| {
                let mut view = x.view();
                view.swap_axes(x.ndim() - 2, x.ndim() - 1);
                view.to_owned()
            };
            let lhs_grad = unbroadcast(naive_matmul(&grad_out, &swap(&rhs)), &lhs_shape);
            let rhs_grad = unbroadcast(naive_matmul(&swap(&lhs), &grad_out), &rhs_shape);
            assert_eq!(
                a.grad().unwrap(),
                lhs_grad,
                "d lhs of {lhs_shape:?} · {rhs_shape:?}"
            );
            assert_eq!(
                b.grad().unwrap(),
                rhs_grad,
                "d rhs of {lhs_shape:?} · {rhs_shape:?}"
            );
        }
    }

    #[test]
    fn size_one_batch_axis_broadcasts_against_a_batch() {
        // [3, 2, 4] · [1, 4, 5]: the one rhs matrix serves all 3 lhs matrices, and its
        // gradient sums their contributions; likewise [1, 2, 4] · [3, 4, 5].
        let rng = Generator::new(5);
        assert_gradients(
            |x| x[0].matmul(&x[1]),
            &[
                random_array(&[3, 2, 4], &rng),
                random_array(&[1, 4, 5], &rng),
            ],
        );
        assert_gradients(
            |x| x[0].matmul(&x[1]),
            &[
                random_array(&[1, 2, 4], &rng),
                random_array(&[3, 4, 5], &rng),
            ],
        );
        let a = Tensor::<f64>::param(ArrayD::ones(IxDyn(&[1, 2, 4])));
        let b = Tensor::<f64>::param(ArrayD::ones(IxDyn(&[3, 4, 5])));
        let y = a.matmul(&b);
        assert_eq!(y.shape(), vec![3, 2, 5]);
        y.sum_all().backward();
        // Each lhs element meets 5 columns in each of 3 batch items: 15.
        assert!(a.grad().unwrap().iter().all(|&g| g == 15.0));
    }

    #[test]
    fn empty_inner_axis_gives_zeros_and_empty_rows_give_nothing() {
        let a = Tensor::<f32>::param(ArrayD::zeros(IxDyn(&[2, 0])));
        let b = Tensor::<f32>::param(ArrayD::zeros(IxDyn(&[0, 3])));
        let y = a.matmul(&b);
        assert_eq!(y.to_vec(), vec![0.0; 6]);
        y.sum_all().backward();
        assert_eq!(a.grad().unwrap().shape(), &[2, 0]);
        assert_eq!(b.grad().unwrap().shape(), &[0, 3]);
        let rows = Tensor::<f32>::zeros(&[4, 0, 3]).matmul(&Tensor::ones(&[3, 2]));
        assert_eq!(rows.shape(), vec![4, 0, 2]);
    }

    #[test]
    fn values_and_gradients_are_bit_identical_at_any_thread_count() {
        // A batch shared out one product per thread, one product split by gemm, and one cut
        // into blocks of rows (forward and d lhs; its d rhs has 96 rows, split by gemm).
        let run = |lhs_shape: &[usize], rhs_shape: &[usize]| {
            let rng = Generator::new(3);
            let a = Tensor::<f32>::param(random_array(lhs_shape, &rng).mapv(|x| x as f32));
            let b = Tensor::<f32>::param(random_array(rhs_shape, &rng).mapv(|x| x as f32));
            let y = a.matmul(&b);
            let grad_out = random_array(&y.shape(), &rng).mapv(|x| x as f32);
            y.backward_with(grad_out);
            [
                y.to_vec(),
                a.grad().unwrap().into_raw_vec_and_offset().0,
                b.grad().unwrap().into_raw_vec_and_offset().0,
            ]
            .map(|values| values.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
        };
        for (lhs_shape, rhs_shape) in [
            (&[8, 64, 48][..], &[8, 48, 64][..]),
            (&[200, 300], &[300, 150]),
            (&[1100, 96], &[96, 80]),
        ] {
            let results: Vec<_> = [1, 2]
                .map(|threads| {
                    let pool = ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    pool.install(|| run(lhs_shape, rhs_shape))
                })
                .into();
            assert!(results[0] == results[1], "{lhs_shape:?} · {rhs_shape:?}");
        }
    }
}
