//! Matrix products with batch dimensions — and the override point that autocast uses.
//!
//! Every matmul in the library goes through [`Tensor::matmul`]. While a [`MatmulHook`] is
//! installed on a thread, `matmul` hands its operands to the hook instead of computing the
//! plain product; tl-precision's autocast installs one that rounds operands and result. This
//! crate itself knows nothing about number formats.

use std::cell::RefCell;
use std::sync::Arc;

use ndarray::{ArrayD, ArrayView2, ArrayViewD, Axis, Dimension, Ix2, IxDyn};

use super::{broadcast_shape, unbroadcast};
use crate::kernels::gemm::gemm_into;
use crate::{Element, Tensor};

/// A replacement for the product computed by [`Tensor::matmul`] on one thread.
///
/// Implementations compute their product with [`Tensor::matmul_plain`] (calling `matmul`
/// from inside the hook would call the hook again).
pub trait MatmulHook: Send + Sync {
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

/// The 2-D matrices of a batched view, in row-major order of the batch index.
fn matrices<'a, E: Element>(view: ArrayViewD<'a, E>, batch: &[usize]) -> Vec<ArrayView2<'a, E>> {
    ndarray::indices(IxDyn(batch))
        .into_iter()
        .map(|index| {
            let mut matrix = view.clone();
            for &i in index.slice() {
                matrix = matrix.index_axis_move(Axis(0), i);
            }
            matrix.into_dimensionality::<Ix2>().expect("two matrix axes")
        })
        .collect()
}

/// `lhs · rhs` over the last two axes, broadcasting the batch axes before them.
fn batched_product<E: Element>(
    lhs: ArrayViewD<'_, E>,
    rhs: ArrayViewD<'_, E>,
    batch: &[usize],
) -> ArrayD<E> {
    let (m, n) = (lhs.shape()[lhs.ndim() - 2], rhs.shape()[rhs.ndim() - 1]);
    let mut lhs_shape = batch.to_vec();
    lhs_shape.extend_from_slice(&lhs.shape()[lhs.ndim() - 2..]);
    let mut rhs_shape = batch.to_vec();
    rhs_shape.extend_from_slice(&rhs.shape()[rhs.ndim() - 2..]);
    let lhs = lhs.broadcast(IxDyn(&lhs_shape)).expect("batch axes broadcast");
    let rhs = rhs.broadcast(IxDyn(&rhs_shape)).expect("batch axes broadcast");
    let mut out_shape = batch.to_vec();
    out_shape.extend_from_slice(&[m, n]);
    let mut out = ArrayD::<E>::zeros(IxDyn(&out_shape));
    {
        let lhs_mats = matrices(lhs, batch);
        let rhs_mats = matrices(rhs, batch);
        let out_view = out.view_mut();
        let mut out_mats = out_view
            .into_shape_with_order((lhs_mats.len(), m, n))
            .expect("fresh output is contiguous");
        for ((mut out_mat, lhs_mat), rhs_mat) in out_mats
            .outer_iter_mut()
            .zip(lhs_mats)
            .zip(rhs_mats)
        {
            gemm_into(&mut out_mat, lhs_mat, rhs_mat, false);
        }
    }
    out
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
        let batch = broadcast_shape("matmul", &lhs_shape[..lhs_nd - 2], &rhs_shape[..rhs_nd - 2]);
        let value = batched_product(self.value().view(), rhs.value().view(), &batch);
        let (lhs_saved, rhs_saved) = (self.clone(), rhs.clone());
        Tensor::from_op(value, &[self, rhs], move |grad| {
            let lhs_grad = lhs_saved.requires_grad().then(|| {
                let rhs_value = rhs_saved.value();
                let full = batched_product(grad.view(), swap_last(rhs_value.view()), &batch);
                unbroadcast(full, &lhs_shape)
            });
            let rhs_grad = rhs_saved.requires_grad().then(|| {
                let lhs_value = lhs_saved.value();
                let full = batched_product(swap_last(lhs_value.view()), grad.view(), &batch);
                unbroadcast(full, &rhs_shape)
            });
            vec![lhs_grad, rhs_grad]
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::arr2;

    #[test]
    fn gradients_of_a_matrix_product() {
        // L = sum(A·B): dL/dA = 1·Bᵀ (row sums of B), dL/dB = Aᵀ·1 (column sums of A).
        let a = Tensor::<f64>::param(arr2(&[[1.0, 2.0], [3.0, 4.0]]).into_dyn());
        let b = Tensor::<f64>::param(arr2(&[[5.0, 6.0], [7.0, 8.0]]).into_dyn());
        let y = a.matmul(&b);
        assert_eq!(y.to_vec(), vec![19.0, 22.0, 43.0, 50.0]);
        y.sum_all().backward();
        assert_eq!(a.grad().unwrap(), arr2(&[[11.0, 15.0], [11.0, 15.0]]).into_dyn());
        assert_eq!(b.grad().unwrap(), arr2(&[[4.0, 4.0], [6.0, 6.0]]).into_dyn());
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
}
