//! Reductions: sums and means over all elements or over chosen axes.

use ndarray::{ArrayD, Axis, IxDyn};

use crate::{Element, Tensor};

/// Axes sorted and checked against `ndim`.
fn checked_axes(op: &str, axes: &[usize], ndim: usize) -> Vec<usize> {
    let mut sorted = axes.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    assert!(
        sorted.iter().all(|&a| a < ndim),
        "{op}: axes {axes:?} out of range for {ndim} dimensions"
    );
    sorted
}

/// The shape after reducing `axes`, with them kept as size 1.
fn kept_shape(shape: &[usize], axes: &[usize]) -> Vec<usize> {
    shape
        .iter()
        .enumerate()
        .map(|(i, &n)| if axes.contains(&i) { 1 } else { n })
        .collect()
}

impl<E: Element> Tensor<E> {
    /// The sum of all elements, as a 0-dimensional tensor. d/dx = 1.
    pub fn sum_all(&self) -> Tensor<E> {
        let shape = self.shape();
        let total = self.value().sum();
        Tensor::from_op(ArrayD::from_elem(IxDyn(&[]), total), &[self], move |grad| {
            let g = *grad.iter().next().expect("one element");
            vec![Some(ArrayD::from_elem(IxDyn(&shape), g))]
        })
    }

    /// The mean of all elements, as a 0-dimensional tensor. d/dx = 1/n.
    pub fn mean_all(&self) -> Tensor<E> {
        let n = E::from_f64(self.numel() as f64);
        self.sum_all().div_scalar(n)
    }

    /// Sums over `axes`; with `keep_dims` they stay as size 1, otherwise they are removed.
    ///
    /// # Panics
    /// If an axis is out of range.
    pub fn sum_axes(&self, axes: &[usize], keep_dims: bool) -> Tensor<E> {
        let shape = self.shape();
        let axes = checked_axes("sum_axes", axes, shape.len());
        let mut value = self.value().to_owned();
        for &axis in axes.iter().rev() {
            value = value.sum_axis(Axis(axis));
        }
        let kept = kept_shape(&shape, &axes);
        if keep_dims {
            value = value
                .into_shape_with_order(IxDyn(&kept))
                .expect("same element count");
        }
        Tensor::from_op(value, &[self], move |grad| {
            let grad = grad
                .into_shape_with_order(IxDyn(&kept))
                .expect("same element count");
            let expanded = grad
                .broadcast(IxDyn(&shape))
                .expect("kept axes broadcast back")
                .to_owned();
            vec![Some(expanded)]
        })
    }

    /// Means over `axes` (see [`sum_axes`](Self::sum_axes)).
    ///
    /// # Panics
    /// If an axis is out of range.
    pub fn mean_axes(&self, axes: &[usize], keep_dims: bool) -> Tensor<E> {
        let shape = self.shape();
        let count: usize = checked_axes("mean_axes", axes, shape.len())
            .iter()
            .map(|&a| shape[a])
            .product();
        self.sum_axes(axes, keep_dims)
            .div_scalar(E::from_f64(count as f64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::arr2;

    #[test]
    fn sum_over_an_axis_and_its_gradient() {
        let x = Tensor::<f64>::param(arr2(&[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]).into_dyn());
        let rows = x.sum_axes(&[1], false);
        assert_eq!(rows.to_vec(), vec![6.0, 15.0]);
        let kept = x.sum_axes(&[0], true);
        assert_eq!(kept.shape(), vec![1, 3]);
        // L = sum(rows · [1, 2]): each element of row i gets weight i + 1.
        let weights = Tensor::from_vec(vec![1.0, 2.0], &[2]).unwrap();
        (&rows * &weights).sum_all().backward();
        assert_eq!(
            x.grad().unwrap(),
            arr2(&[[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]).into_dyn()
        );
    }

    #[test]
    fn mean_divides_by_the_reduced_count() {
        let x = Tensor::<f64>::param(arr2(&[[1.0, 2.0], [3.0, 4.0]]).into_dyn());
        let m = x.mean_axes(&[0, 1], false);
        assert_eq!(m.item(), 2.5);
        m.backward();
        assert!(x.grad().unwrap().iter().all(|&g| g == 0.25));
    }
}
