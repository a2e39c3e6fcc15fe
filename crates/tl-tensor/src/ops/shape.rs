//! Shape ops: reshape, transpose and permute. They move no arithmetic, only layout; their
//! VJPs apply the inverse layout change to the gradient.

use ndarray::IxDyn;

use crate::{Element, Tensor};

impl<E: Element> Tensor<E> {
    /// The same elements, in row-major order, under a new shape.
    ///
    /// # Panics
    /// If the element counts differ.
    pub fn reshape(&self, shape: &[usize]) -> Tensor<E> {
        let old_shape = self.shape();
        assert_eq!(
            old_shape.iter().product::<usize>(),
            shape.iter().product::<usize>(),
            "reshape: cannot view shape {old_shape:?} as {shape:?}"
        );
        let value = || {
            self.value()
                .as_standard_layout()
                .into_owned()
                .into_shape_with_order(IxDyn(shape))
                .expect("element counts checked")
        };
        Tensor::from_op_shaped(shape, value, &[self], move |grad| {
            let grad = grad
                .as_standard_layout()
                .into_owned()
                .into_shape_with_order(IxDyn(&old_shape))
                .expect("element counts checked");
            vec![Some(grad)]
        })
    }

    /// Reorders the axes: output axis `i` is input axis `axes[i]`.
    ///
    /// # Panics
    /// If `axes` is not a permutation of `0..ndim`.
    pub fn permute(&self, axes: &[usize]) -> Tensor<E> {
        let ndim = self.ndim();
        let mut seen = vec![false; ndim];
        let valid = axes.len() == ndim
            && axes
                .iter()
                .all(|&a| a < ndim && !std::mem::replace(&mut seen[a], true));
        assert!(
            valid,
            "permute: {axes:?} is not a permutation of {ndim} axes"
        );
        let old_shape = self.shape();
        let out_shape: Vec<usize> = axes.iter().map(|&a| old_shape[a]).collect();
        let value = || {
            self.value()
                .view()
                .permuted_axes(IxDyn(axes))
                .as_standard_layout()
                .into_owned()
        };
        let mut inverse = vec![0; ndim];
        for (i, &a) in axes.iter().enumerate() {
            inverse[a] = i;
        }
        Tensor::from_op_shaped(&out_shape, value, &[self], move |grad| {
            let grad = grad
                .permuted_axes(IxDyn(&inverse))
                .as_standard_layout()
                .into_owned();
            vec![Some(grad)]
        })
    }

    /// Swaps two axes.
    ///
    /// # Panics
    /// If an axis is out of range.
    pub fn transpose(&self, axis_a: usize, axis_b: usize) -> Tensor<E> {
        let ndim = self.ndim();
        assert!(
            axis_a < ndim && axis_b < ndim,
            "transpose: axes ({axis_a}, {axis_b}) out of range for {ndim} dimensions"
        );
        let mut axes: Vec<usize> = (0..ndim).collect();
        axes.swap(axis_a, axis_b);
        self.permute(&axes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::arr2;

    #[test]
    fn transpose_moves_elements_and_gradients() {
        let x = Tensor::<f64>::param(arr2(&[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]).into_dyn());
        let t = x.transpose(0, 1);
        assert_eq!(t.shape(), vec![3, 2]);
        assert_eq!(t.to_vec(), vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        let weights = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]).unwrap();
        (&t * &weights).sum_all().backward();
        assert_eq!(
            x.grad().unwrap(),
            arr2(&[[1.0, 3.0, 5.0], [2.0, 4.0, 6.0]]).into_dyn()
        );
    }

    #[test]
    #[should_panic(expected = "reshape: cannot view shape [2, 3] as [4]")]
    fn reshape_checks_the_count() {
        Tensor::<f32>::zeros(&[2, 3]).reshape(&[4]);
    }
}
