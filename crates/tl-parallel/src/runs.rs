//! Runs of a parameter's elements, in its logical (row-major) order: how the buckets, the
//! shards and the gathers copy parts of parameters and of their gradients in and out of
//! flat buffers, whatever the parameter's memory layout.

use tl_tensor::memory::{self, Kind, Tag};
use tl_tensor::ndarray::ArrayD;
use tl_tensor::{Element, Tensor};

use crate::bucket::Segment;

/// Elements a bucket of these segments holds.
pub(crate) fn bucket_len(segments: &[Segment]) -> usize {
    segments.iter().map(|s| s.len).sum()
}

/// Copies `array`'s elements `start..start + out.len()` (logical order) into `out`.
pub(crate) fn read_run<E: Copy>(array: &ArrayD<E>, start: usize, out: &mut [E]) {
    match array.as_slice() {
        Some(flat) => out.copy_from_slice(&flat[start..start + out.len()]),
        None => out
            .iter_mut()
            .zip(array.iter().skip(start))
            .for_each(|(o, &x)| *o = x),
    }
}

/// Writes `src` over `array`'s elements `start..start + src.len()` (logical order).
pub(crate) fn write_run<E: Copy>(array: &mut ArrayD<E>, start: usize, src: &[E]) {
    match array.as_slice_mut() {
        Some(flat) => flat[start..start + src.len()].copy_from_slice(src),
        None => array
            .iter_mut()
            .skip(start)
            .zip(src)
            .for_each(|(x, &s)| *x = s),
    }
}

/// Gives `param` a zero gradient if it has none, so that the reduced sum can be written into
/// it: a parameter this rank's micro-batches did not reach still gets the others' gradient.
pub(crate) fn ensure_grad<E: Element>(param: &Tensor<E>) {
    if param.with_grad(|grad| grad.is_none()) {
        set_grad_with(param, || ArrayD::zeros(param.shape()));
    }
}

/// Sets `param`'s gradient to `values()`; for a [meta](tl_tensor::meta) parameter, to a
/// meta gradient of its shape instead (`values` is not called), allocated and tagged on
/// the meter as [`Tensor::set_grad`] allocates and tags the values.
pub(crate) fn set_grad_with<E: Element>(param: &Tensor<E>, values: impl FnOnce() -> ArrayD<E>) {
    if !param.is_meta() {
        param.set_grad(Some(values()));
        return;
    }
    // Made in the gradient's own tag (a leaf's gradient is owned where its storage is), so
    // that handing it over is no retag.
    let _gradient = memory::tag_scope(Tag {
        kind: Kind::Gradients,
        owner: param.memory_tag().owner,
        label: "",
        ..memory::current_tag()
    });
    param.set_grad_tensor(Some(Tensor::meta(&param.shape())));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_read_and_write_in_logical_order_even_when_transposed() {
        let mut array = ArrayD::from_shape_vec(vec![2, 3], vec![0., 1., 2., 3., 4., 5.]).unwrap();
        let mut out = [0.0; 3];
        read_run(&array, 2, &mut out);
        assert_eq!(out, [2., 3., 4.]);
        let mut transposed = array.t().to_owned();
        transposed.swap_axes(0, 1); // logical order back to 0..6, memory order not
        read_run(&transposed, 1, &mut out);
        assert_eq!(out, [1., 2., 3.]);
        write_run(&mut array, 4, &[9., 8.]);
        assert_eq!(array.as_slice().unwrap(), [0., 1., 2., 3., 9., 8.]);
    }
}
