//! Reductions: sums and means over all elements or over chosen axes, and the maximum along
//! an axis.

use ndarray::{ArrayD, ArrayView1, Axis, IxDyn, Zip};

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

/// The position of the first maximal element of a lane; a NaN counts as the maximum (the
/// first one wins), so it propagates as PyTorch's `max` does.
fn first_argmax<E: Element>(lane: ArrayView1<'_, E>) -> usize {
    let mut best = 0;
    for (i, &x) in lane.iter().enumerate().skip(1) {
        let current = lane[best];
        if current.is_nan() {
            break;
        }
        if x > current || x.is_nan() {
            best = i;
        }
    }
    best
}

/// The position of the first maximum of every lane along `axis`, shaped like the other axes.
fn argmax_lanes<E: Element>(op: &str, array: &ArrayD<E>, axis: usize) -> ArrayD<usize> {
    let shape = array.shape();
    assert!(
        axis < shape.len() && shape[axis] > 0,
        "{op}: axis {axis} out of range or empty for shape {shape:?}"
    );
    Zip::from(array.lanes(Axis(axis))).map_collect(first_argmax)
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
        let total = || ArrayD::from_elem(IxDyn(&[]), self.value().sum());
        Tensor::from_op_shaped(&[], total, &[self], move |grad| {
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
        let kept = kept_shape(&shape, &axes);
        let out_shape: Vec<usize> = if keep_dims {
            kept.clone()
        } else {
            (0..shape.len())
                .filter(|a| !axes.contains(a))
                .map(|a| shape[a])
                .collect()
        };
        let kept_for_value = kept.clone();
        let value = || {
            let mut value = self.value().to_owned();
            for &axis in axes.iter().rev() {
                value = value.sum_axis(Axis(axis));
            }
            if keep_dims {
                value = value
                    .into_shape_with_order(IxDyn(&kept_for_value))
                    .expect("same element count");
            }
            value
        };
        Tensor::from_op_shaped(&out_shape, value, &[self], move |grad| {
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
    /// The maximum along `axis`; with `keep_dims` the axis stays as size 1.
    ///
    /// VJP: each lane's gradient goes to the first of its maximal elements; the others get 0
    /// (ties are broken by position, so the gradient is a subgradient there).
    ///
    /// # Panics
    /// If `axis` is out of range or has size 0.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let x = Tensor::<f64>::param(ndarray::arr2(&[[1.0, 5.0, 5.0], [4.0, 2.0, 0.0]]).into_dyn());
    /// let m = x.max_axis(1, false);
    /// assert_eq!(m.to_vec(), vec![5.0, 4.0]);
    /// m.sum_all().backward();
    /// assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[0.0, 1.0, 0.0, 1.0, 0.0, 0.0]);
    /// ```
    pub fn max_axis(&self, axis: usize, keep_dims: bool) -> Tensor<E> {
        let shape = self.shape();
        assert!(
            axis < shape.len() && shape[axis] > 0,
            "max_axis: axis {axis} out of range or empty for shape {shape:?}"
        );
        let mut out_shape = shape.clone();
        if keep_dims {
            out_shape[axis] = 1;
        } else {
            out_shape.remove(axis);
        }
        // The lanes' argmax is computed with the value, and kept for the VJP.
        let (value, argmax) = match crate::meta::computes(&[self]) {
            true => {
                let input = self.value();
                let argmax = argmax_lanes("max_axis", &input, axis);
                let value = Zip::from(input.lanes(Axis(axis)))
                    .and(&argmax)
                    .map_collect(|lane, &i| lane[i]);
                let value = if keep_dims {
                    value.insert_axis(Axis(axis))
                } else {
                    value
                };
                (Some(value), Some(argmax))
            }
            false => (None, None),
        };
        let value = || value.expect("computed for real inputs");
        Tensor::from_op_shaped(&out_shape, value, &[self], move |grad| {
            let argmax = argmax.expect("a values VJP runs on real gradients only");
            let grad = grad
                .into_shape_with_order(argmax.raw_dim())
                .expect("one gradient per lane");
            let mut full = ArrayD::zeros(IxDyn(&shape));
            Zip::from(full.lanes_mut(Axis(axis)))
                .and(&argmax)
                .and(&grad)
                .for_each(|mut lane, &i, &g| lane[i] = g);
            vec![Some(full)]
        })
    }

    /// The index of the first maximal element of every lane along `axis`, shaped like the
    /// other axes (greedy decoding, accuracy). Not differentiable: it reads the value only.
    ///
    /// # Panics
    /// If `axis` is out of range or has size 0.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let logits = Tensor::<f32>::from_vec(vec![0.1, 0.7, 0.2, 0.9, 0.0, 0.1], &[2, 3])?;
    /// assert_eq!(logits.argmax_axis(1).as_slice().unwrap(), &[1, 0]);
    /// # Ok::<(), tl_tensor::TensorError>(())
    /// ```
    ///
    /// A [meta](crate::meta) tensor's lanes all answer 0.
    pub fn argmax_axis(&self, axis: usize) -> ArrayD<usize> {
        if self.is_meta() {
            let mut shape = self.shape();
            assert!(
                axis < shape.len() && shape[axis] > 0,
                "argmax_axis: axis {axis} out of range or empty for shape {shape:?}"
            );
            shape.remove(axis);
            return ArrayD::zeros(IxDyn(&shape));
        }
        argmax_lanes("argmax_axis", &self.value(), axis)
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

    #[test]
    fn max_breaks_ties_by_position_and_propagates_nan() {
        let x = Tensor::<f64>::param(arr2(&[[2.0, 2.0], [f64::NAN, 3.0]]).into_dyn());
        let m = x.max_axis(1, true);
        assert_eq!(m.shape(), vec![2, 1]);
        let values = m.to_vec();
        assert_eq!(values[0], 2.0);
        assert!(values[1].is_nan());
        m.backward_with(arr2(&[[1.0], [1.0]]).into_dyn());
        assert_eq!(
            x.grad().unwrap(),
            arr2(&[[1.0, 0.0], [1.0, 0.0]]).into_dyn()
        );
    }

    #[test]
    fn max_along_a_middle_axis() {
        // x[i, j, k] = 10i + (5 if j == k else j): the maximum over j sits at j = k.
        let x = Tensor::<f64>::from_array(ArrayD::from_shape_fn(IxDyn(&[2, 3, 3]), |ix| {
            let (i, j, k) = (ix[0] as f64, ix[1], ix[2]);
            10.0 * i + if j == k { 5.0 } else { j as f64 }
        }));
        // Lane (i = 0, k): over j, k = 0: [5, 1, 2]; k = 1: [0, 5, 2]; k = 2: [0, 1, 5].
        // Lanes with i = 1 are the same plus 10.
        assert_eq!(x.argmax_axis(1).as_slice().unwrap(), &[0, 1, 2, 0, 1, 2]);
        assert_eq!(
            x.max_axis(1, false).to_vec(),
            vec![5.0, 5.0, 5.0, 15.0, 15.0, 15.0]
        );
    }

    #[test]
    #[should_panic(expected = "max_axis: axis 1 out of range or empty for shape [3, 0]")]
    fn max_of_an_empty_axis_panics() {
        Tensor::<f32>::zeros(&[3, 0]).max_axis(1, false);
    }
}
