//! Buckets: the parameters' gradients (or values) flattened into a few large buffers, so that
//! a step makes a few big collectives instead of one small one per parameter.
//!
//! Buckets are filled in reverse parameter order — the order backward produces the
//! gradients, the last layer's first — and a parameter that does not fit in what is left of a
//! bucket is split across two, so every bucket but the last holds exactly `capacity`
//! elements.

use tl_tensor::memory::{self, Kind, Tag};
use tl_tensor::ndarray::ArrayD;
use tl_tensor::{Element, Tensor};

/// Bytes per bucket unless a [`DataParallel`](crate::DataParallel) is given others
/// (`with_bucket_bytes`): PyTorch DDP's default, 25 MiB. The one definition of the default:
/// tl-train's config takes it from here.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Scalars appended to the last bucket of a step's gradient reduction (DDP's all-reduce,
/// ZeRO-2's reduce-scatter), in this order: this rank's part of the global loss, whether
/// its gradients held an inf or a NaN (1 or 0), and its count of gradient values the 16-bit
/// casts flushed to zero. Summed over the ranks they give the global loss, the number of
/// ranks that overflowed and the global underflows. (ZeRO-3, whose units have no last
/// bucket, all-reduces the same three on their own.)
pub const STEP_EXTRAS: usize = 3;

/// A run of one parameter's elements inside a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Index of the parameter in the slice that was planned.
    pub param: usize,
    /// First element of the run, in the parameter's logical (row-major) order.
    pub start: usize,
    /// Number of elements.
    pub len: usize,
}

/// The buckets for parameters of `numels` elements, at most `capacity` elements each, filled
/// from the last parameter to the first. Empty parameters take no segment.
///
/// # Panics
/// If `capacity` is zero.
pub fn plan(numels: &[usize], capacity: usize) -> Vec<Vec<Segment>> {
    assert!(capacity > 0, "bucket capacity must be positive");
    let mut buckets = Vec::new();
    let mut current = Vec::new();
    let mut filled = 0;
    for (param, &numel) in numels.iter().enumerate().rev() {
        let mut start = 0;
        while start < numel {
            let len = (numel - start).min(capacity - filled);
            current.push(Segment { param, start, len });
            start += len;
            filled += len;
            if filled == capacity {
                buckets.push(std::mem::take(&mut current));
                filled = 0;
            }
        }
    }
    if !current.is_empty() || buckets.is_empty() {
        buckets.push(current);
    }
    buckets
}

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

    fn seg(param: usize, start: usize, len: usize) -> Segment {
        Segment { param, start, len }
    }

    #[test]
    fn buckets_fill_from_the_last_parameter_and_split_what_does_not_fit() {
        // Parameters of 3, 0, 5 and 2 elements in buckets of 4: reversed, 2 + 2 of the 5,
        // then the other 3 of the 5 and 1 of the first, then its last 2.
        assert_eq!(
            plan(&[3, 0, 5, 2], 4),
            [
                vec![seg(3, 0, 2), seg(2, 0, 2)],
                vec![seg(2, 2, 3), seg(0, 0, 1)],
                vec![seg(0, 1, 2)],
            ]
        );
    }

    #[test]
    fn a_model_smaller_than_a_bucket_is_one_bucket() {
        assert_eq!(plan(&[2, 3], 100), [vec![seg(1, 0, 3), seg(0, 0, 2)]]);
        assert_eq!(plan(&[], 100), [Vec::<Segment>::new()]);
    }

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
