//! Tensors as a collective's buffers: their values when they have some, their length
//! alone when they are [meta](tl_tensor::meta), so that one code path runs both.

use tl_collective::{Slice, SliceMut};
use tl_tensor::memory;
use tl_tensor::{Tensor, meta};

use crate::ddp::GradElement;

/// Runs `f` on `tensor`'s values in row-major order as a collective's input (shape-only
/// when meta).
pub(super) fn with_view<E: GradElement, T>(
    tensor: &Tensor<E>,
    f: impl FnOnce(Slice<'_>) -> T,
) -> T {
    if tensor.is_meta() {
        return f(Slice::shape::<E>(tensor.numel()));
    }
    let value = tensor.value();
    let standard = value.as_standard_layout();
    f(<E as tl_collective::Element>::view(
        standard.as_slice().expect("standard layout"),
    ))
}

/// Runs `f` on `tensor`'s values in row-major order as a collective's output, written in
/// place (shape-only when meta).
pub(super) fn with_view_mut<E: GradElement, T>(
    tensor: &Tensor<E>,
    f: impl FnOnce(SliceMut<'_>) -> T,
) -> T {
    if tensor.is_meta() {
        return f(SliceMut::shape::<E>(tensor.numel()));
    }
    tensor.update_value(|values| {
        if values.as_slice().is_none() {
            // The same elements in row-major order: the count, and so the meter, is kept.
            *values = values.as_standard_layout().into_owned();
        }
        f(<E as tl_collective::Element>::view_mut(
            values.as_slice_mut().expect("standard layout"),
        ))
    })
}

/// A fresh constant of `shape` to receive a collective's result, labelled `label` on the
/// meter: zeros, or a meta tensor when `meta`.
pub(super) fn fresh<E: GradElement>(shape: &[usize], meta: bool, label: &'static str) -> Tensor<E> {
    let _label = memory::label_scope(label);
    if meta {
        Tensor::meta(shape)
    } else {
        Tensor::zeros(shape)
    }
}

/// A fresh constant holding `tensor`'s values (its shape, when meta), labelled `label`.
pub(super) fn copy_of<E: GradElement>(tensor: &Tensor<E>, label: &'static str) -> Tensor<E> {
    let _label = memory::label_scope(label);
    if meta::computes(&[tensor]) {
        Tensor::from_array(tensor.value().as_standard_layout().into_owned())
    } else {
        Tensor::meta(&tensor.shape())
    }
}

/// Whether an op on `inputs` runs on shapes only.
pub(super) fn is_meta<E: GradElement>(inputs: &[&Tensor<E>]) -> bool {
    !meta::computes(inputs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_tensor::ndarray::arr2;

    #[test]
    fn a_tensor_of_another_layout_is_seen_and_written_in_row_major_order() {
        // The transpose of [[1, 2, 3], [4, 5, 6]], stored column-major.
        let transposed = arr2(&[[1.0f64, 2.0, 3.0], [4.0, 5.0, 6.0]])
            .reversed_axes()
            .into_dyn();
        assert!(transposed.as_slice().is_none());
        let tensor = Tensor::from_array(transposed);
        let seen = with_view(&tensor, |view| match view {
            Slice::F64(values) => values.to_vec(),
            _ => unreachable!("f64 values"),
        });
        assert_eq!(seen, [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        let before = memory::live_bytes();
        with_view_mut(&tensor, |view| match view {
            SliceMut::F64(values) => values
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = i as f64),
            _ => unreachable!("f64 values"),
        });
        assert_eq!(tensor.to_vec(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(
            memory::live_bytes(),
            before,
            "the same elements, rearranged"
        );
    }

    #[test]
    fn a_meta_tensor_is_a_shape_only_buffer_of_its_length() {
        let tensor = Tensor::<f32>::meta(&[4, 5]);
        assert!(with_view(&tensor, |view| view.is_shape() && view.len() == 20));
        assert!(with_view_mut(&tensor, |view| view.len() == 20));
        assert!(fresh::<f32>(&[2, 3], true, "").is_meta());
        assert_eq!(copy_of(&tensor, "").shape(), [4, 5]);
    }
}
