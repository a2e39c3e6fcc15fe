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
