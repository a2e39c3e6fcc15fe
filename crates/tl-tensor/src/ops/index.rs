//! Ops that pick or place elements by position: slicing along an axis, concatenation, masked
//! filling (the causal mask) and row gathering (the embedding lookup). Their VJPs route the
//! gradient back to the positions it came from, and nowhere else.

use ndarray::{ArrayD, Axis, IxDyn, Slice, Zip};

use crate::{Element, Tensor};

impl<E: Element> Tensor<E> {
    /// The slice `start..start + len` along `axis`; the other axes are kept whole.
    ///
    /// VJP: the gradient lands in the slice's place, zeros elsewhere.
    ///
    /// # Panics
    /// If `axis` is out of range or the slice runs past the end of the axis.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let x = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    /// assert_eq!(x.narrow(1, 1, 2).to_vec(), vec![2.0, 3.0, 5.0, 6.0]);
    /// # Ok::<(), tl_tensor::TensorError>(())
    /// ```
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Tensor<E> {
        let shape = self.shape();
        assert!(
            axis < shape.len() && start + len <= shape[axis],
            "narrow: cannot take {start}..{} along axis {axis} of shape {shape:?}",
            start + len
        );
        let range = Slice::from(start..start + len);
        let mut out_shape = shape.clone();
        out_shape[axis] = len;
        let value = || self.value().slice_axis(Axis(axis), range).to_owned();
        Tensor::from_op_shaped(&out_shape, value, &[self], move |grad| {
            let mut full = ArrayD::zeros(IxDyn(&shape));
            full.slice_axis_mut(Axis(axis), range).assign(&grad);
            vec![Some(full)]
        })
    }

    /// Joins tensors end to end along `axis`; every other axis must agree.
    ///
    /// VJP: the gradient is cut back into the pieces' extents along `axis`.
    ///
    /// # Panics
    /// If `tensors` is empty, `axis` is out of range, or the shapes differ off `axis`.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let a = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[1, 2])?;
    /// let b = Tensor::<f32>::from_vec(vec![3.0, 4.0, 5.0, 6.0], &[2, 2])?;
    /// let ab = Tensor::concat(&[&a, &b], 0);
    /// assert_eq!(ab.shape(), vec![3, 2]);
    /// assert_eq!(ab.to_vec(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    /// # Ok::<(), tl_tensor::TensorError>(())
    /// ```
    pub fn concat(tensors: &[&Tensor<E>], axis: usize) -> Tensor<E> {
        assert!(!tensors.is_empty(), "concat: no tensors to join");
        let shapes: Vec<Vec<usize>> = tensors.iter().map(|t| t.shape()).collect();
        let first = &shapes[0];
        let agree = axis < first.len()
            && shapes.iter().all(|s| {
                s.len() == first.len()
                    && s.iter()
                        .zip(first)
                        .enumerate()
                        .all(|(i, (a, b))| i == axis || a == b)
            });
        assert!(
            agree,
            "concat: cannot join shapes {shapes:?} along axis {axis}"
        );
        let mut out_shape = first.clone();
        out_shape[axis] = shapes.iter().map(|s| s[axis]).sum();
        let value = || {
            let values: Vec<_> = tensors.iter().map(|t| t.value()).collect();
            let views: Vec<_> = values.iter().map(|v| v.view()).collect();
            ndarray::concatenate(Axis(axis), &views).expect("shapes checked to agree")
        };
        let wanted: Vec<bool> = tensors.iter().map(|t| t.requires_grad()).collect();
        Tensor::from_op_shaped(&out_shape, value, tensors, move |grad| {
            let mut start = 0;
            shapes
                .iter()
                .zip(wanted)
                .map(|(shape, wanted)| {
                    let range = Slice::from(start..start + shape[axis]);
                    start += shape[axis];
                    wanted.then(|| grad.slice_axis(Axis(axis), range).to_owned())
                })
                .collect()
        })
    }

    /// `value` where `mask` is true, the tensor's element elsewhere. The mask broadcasts to
    /// the tensor's shape (a `[T, T]` causal mask over `[B, H, T, T]` scores).
    ///
    /// VJP: the gradient passes where the mask is false and is 0 where it is true (a filled
    /// element does not depend on the input).
    ///
    /// # Panics
    /// If the mask does not broadcast to the tensor's shape.
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// use ndarray::{arr2, ArrayD};
    /// let scores = Tensor::<f32>::zeros(&[2, 2]);
    /// let causal: ArrayD<bool> = arr2(&[[false, true], [false, false]]).into_dyn();
    /// let masked = scores.masked_fill(&causal, f32::NEG_INFINITY);
    /// assert_eq!(masked.to_vec(), vec![0.0, f32::NEG_INFINITY, 0.0, 0.0]);
    /// ```
    pub fn masked_fill(&self, mask: &ArrayD<bool>, value: E) -> Tensor<E> {
        let shape = self.shape();
        let broadcast = mask.broadcast(IxDyn(&shape)).unwrap_or_else(|| {
            panic!(
                "masked_fill: mask of shape {:?} does not broadcast to shape {shape:?}",
                mask.shape()
            )
        });
        let filled = || {
            let mut filled = self.to_array();
            Zip::from(&mut filled)
                .and(&broadcast)
                .for_each(|x, &masked| {
                    if masked {
                        *x = value;
                    }
                });
            filled
        };
        let saved_mask = mask.clone();
        Tensor::from_op_shaped(&shape.clone(), filled, &[self], move |mut grad| {
            let mask = saved_mask;
            let broadcast = mask.broadcast(IxDyn(&shape)).expect("checked in forward");
            Zip::from(&mut grad).and(&broadcast).for_each(|g, &masked| {
                if masked {
                    *g = E::zero();
                }
            });
            vec![Some(grad)]
        })
    }

    /// Rows `ids` of a `[V, D]` table, as a `[ids.len(), D]` tensor: the embedding lookup.
    ///
    /// VJP: each output row's gradient is added into the table row it came from, so a
    /// token that occurs several times gets the sum of its occurrences' gradients.
    ///
    /// # Panics
    /// If the tensor is not 2-D, or an id is not below V (naming the id).
    ///
    /// ```
    /// use tl_tensor::Tensor;
    /// let table = Tensor::<f64>::param(ndarray::arr2(&[[1.0, 2.0], [3.0, 4.0]]).into_dyn());
    /// let rows = table.gather_rows(&[1, 1, 0]);
    /// assert_eq!(rows.to_vec(), vec![3.0, 4.0, 3.0, 4.0, 1.0, 2.0]);
    /// rows.sum_all().backward();
    /// assert_eq!(table.grad().unwrap().as_slice().unwrap(), &[1.0, 1.0, 2.0, 2.0]);
    /// ```
    pub fn gather_rows(&self, ids: &[usize]) -> Tensor<E> {
        let shape = self.shape();
        assert!(
            shape.len() == 2,
            "gather_rows: the table must be [V, D], got shape {shape:?}"
        );
        let (vocab, width) = (shape[0], shape[1]);
        if let Some(&bad) = ids.iter().find(|&&id| id >= vocab) {
            panic!("gather_rows: id {bad} out of range for a table of {vocab} rows");
        }
        let value = || {
            let mut value = ArrayD::zeros(IxDyn(&[ids.len(), width]));
            let table = self.value();
            for (mut row, &id) in value.outer_iter_mut().zip(ids) {
                row.assign(&table.index_axis(Axis(0), id));
            }
            value
        };
        let saved_ids = ids.to_vec();
        Tensor::from_op_shaped(&[ids.len(), width], value, &[self], move |grad| {
            let ids = saved_ids;
            let mut table_grad = ArrayD::<E>::zeros(IxDyn(&shape));
            for (row, &id) in grad.outer_iter().zip(&ids) {
                let mut target = table_grad.index_axis_mut(Axis(0), id);
                target += &row;
            }
            vec![Some(table_grad)]
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{arr1, arr2};

    #[test]
    fn narrow_scatters_its_gradient_into_zeros() {
        let x = Tensor::<f64>::param(arr1(&[1.0, 2.0, 3.0, 4.0]).into_dyn());
        let middle = x.narrow(0, 1, 2);
        assert_eq!(middle.to_vec(), vec![2.0, 3.0]);
        let weights = Tensor::from_vec(vec![10.0, 20.0], &[2]).unwrap();
        (&middle * &weights).sum_all().backward();
        assert_eq!(
            x.grad().unwrap().as_slice().unwrap(),
            &[0.0, 10.0, 20.0, 0.0]
        );
    }

    #[test]
    fn concat_splits_its_gradient_and_skips_constants() {
        let a = Tensor::<f64>::param(arr2(&[[1.0], [2.0]]).into_dyn());
        let constant = Tensor::<f64>::from_array(arr2(&[[3.0, 4.0], [5.0, 6.0]]).into_dyn());
        let joined = Tensor::concat(&[&a, &constant], 1);
        assert_eq!(joined.to_vec(), vec![1.0, 3.0, 4.0, 2.0, 5.0, 6.0]);
        let weights = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
        (&joined * &weights).sum_all().backward();
        // a sits in column 0 of the joined tensor: it gets weights[:, 0] = [1, 4].
        assert_eq!(a.grad().unwrap(), arr2(&[[1.0], [4.0]]).into_dyn());
    }

    #[test]
    fn masked_fill_broadcasts_the_mask_and_blocks_the_gradient() {
        let x = Tensor::<f64>::param(ArrayD::from_elem(IxDyn(&[2, 2, 2]), 1.0));
        let mask = arr2(&[[false, true], [false, false]]).into_dyn();
        let y = x.masked_fill(&mask, -9.0);
        assert_eq!(y.to_vec(), vec![1.0, -9.0, 1.0, 1.0, 1.0, -9.0, 1.0, 1.0]);
        y.sum_all().backward();
        let grad = x.grad().unwrap();
        assert_eq!(
            grad.as_slice().unwrap(),
            &[1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
        );
    }

    #[test]
    #[should_panic(expected = "masked_fill: mask of shape [3] does not broadcast to shape [2, 2]")]
    fn masked_fill_names_a_mask_that_does_not_fit() {
        Tensor::<f32>::zeros(&[2, 2]).masked_fill(&ArrayD::from_elem(IxDyn(&[3]), true), 0.0);
    }

    #[test]
    #[should_panic(expected = "gather_rows: id 5 out of range for a table of 4 rows")]
    fn gather_rows_names_an_id_past_the_table() {
        Tensor::<f32>::zeros(&[4, 3]).gather_rows(&[0, 5]);
    }

    #[test]
    #[should_panic(expected = "narrow: cannot take 2..5 along axis 0 of shape [4]")]
    fn narrow_names_a_slice_past_the_end() {
        Tensor::<f32>::zeros(&[4]).narrow(0, 2, 3);
    }

    #[test]
    #[should_panic(expected = "concat: cannot join shapes [[1, 2], [2, 3]] along axis 0")]
    fn concat_names_shapes_that_disagree() {
        let a = Tensor::<f32>::zeros(&[1, 2]);
        let b = Tensor::<f32>::zeros(&[2, 3]);
        Tensor::concat(&[&a, &b], 0);
    }
}
