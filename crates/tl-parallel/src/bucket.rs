//! Buckets: the parameters' gradients (or values) flattened into a few large buffers, so that
//! a step makes a few big collectives instead of one small one per parameter.
//!
//! Buckets are filled in reverse parameter order — the order backward produces the
//! gradients, the last layer's first — and a parameter that does not fit in what is left of a
//! bucket is split across two, so every bucket but the last holds exactly `capacity`
//! elements.

use tl_tensor::kernels::finite::all_finite;
use tl_tensor::{Element, Tensor};

use crate::runs::{ensure_grad, read_run, write_run};

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
/// from the last parameter to the first. Empty parameters take no segment. See
/// docs/course/L11.3.md § 2, *Buckets*.
///
/// Backward produces the gradients from the last parameter to the first, so the first
/// bucket holds the last parameters and is complete first. A parameter that does not fit in
/// what is left of the current bucket is split: its first elements fill the bucket, the rest
/// go on in the next one (a parameter larger than a bucket spans several). Every bucket but
/// the last holds exactly `capacity` elements, and within a bucket the segments keep the
/// order they were filled in. An empty model is one empty bucket.
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

/// Copies the gradients of `segments` (one bucket of a [`plan`]) into `out`, one run after
/// the other in the segments' order, each multiplied by this rank's `weight` `n_r/B`
/// ([`replica_weight`](crate::batch::replica_weight)); returns whether every value copied was
/// finite (before the multiplication). `out` holds [`bucket_len`](crate::runs::bucket_len)
/// zeros: a parameter without a gradient (one this rank's micro-batches did not reach)
/// contributes zeros. See docs/course/L11.3.md § 2, *The weighted sum* and *Buckets*.
///
/// The weight is applied here, once, before the sum: after the all-reduce the bucket holds
/// `Σ_r (n_r/B)·g_r`, the batch's gradient, and nothing divides it by the number of ranks
/// again.
///
/// A segment `{param, start, len}` is elements `start..start + len` of the parameter's
/// gradient in its logical (row-major) order; read them with
/// [`read_run`](crate::runs::read_run).
///
/// # Panics
/// If `out` is shorter than the segments.
pub(crate) fn fill_bucket<E: Element>(
    params: &[Tensor<E>],
    segments: &[Segment],
    weight: E,
    out: &mut [E],
) -> bool {
    let mut finite = true;
    let mut offset = 0;
    for s in segments {
        let run = &mut out[offset..offset + s.len];
        // A parameter without a gradient contributes zeros.
        params[s.param].with_grad(|grad| grad.map(|g| read_run(g, s.start, run)));
        finite &= all_finite(run);
        run.iter_mut().for_each(|v| *v *= weight);
        offset += s.len;
    }
    finite
}

/// Writes the reduced bucket `summed` back into the gradients of `segments`, the inverse of
/// [`fill_bucket`]: run `i` of `summed` replaces elements `start..start + len` of its
/// parameter's gradient. A parameter without a gradient is given one first (zeros,
/// [`ensure_grad`](crate::runs::ensure_grad)), so that every rank ends with the same
/// gradients. Elements of `summed` past the segments (the last bucket's
/// [`STEP_EXTRAS`]) are not gradients and are left alone. See docs/course/L11.3.md § 2,
/// *Buckets*.
///
/// # Panics
/// If `summed` is shorter than the segments.
pub(crate) fn write_bucket<E: Element>(params: &[Tensor<E>], segments: &[Segment], summed: &[E]) {
    let mut offset = 0;
    for s in segments {
        let param = &params[s.param];
        ensure_grad(param);
        let run = &summed[offset..offset + s.len];
        param.update_grad(|g| write_run(g, s.start, run));
        offset += s.len;
    }
}

/// Whether the backward of micro-batch `micro_batch` (counted from 0) of a step of
/// `micro_batches` reduces the gradients as backward produces them: only the last one's.
/// The earlier micro-batches accumulate their gradients locally and communicate nothing
/// (PyTorch's `no_sync`): their gradients are not final yet, and reducing each would send
/// `micro_batches` times the bytes. See docs/course/L11.3.md § 2, *Buckets*.
pub(crate) fn reduces_in_backward(micro_batch: usize, micro_batches: usize) -> bool {
    micro_batch + 1 == micro_batches
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_tensor::ndarray::ArrayD;

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
    fn a_bucket_is_filled_weighted_and_written_back_in_place() {
        // Parameters of 3 and 5 elements in buckets of 4: the second split over two
        // buckets, the first parameter without a gradient.
        let a = Tensor::<f64>::param(ArrayD::zeros(vec![3]));
        let b = Tensor::<f64>::param(ArrayD::zeros(vec![5]));
        b.set_grad(Some(
            ArrayD::from_shape_vec(vec![5], vec![1., 2., 3., 4., 5.]).unwrap(),
        ));
        let params = [a.clone(), b.clone()];
        let buckets = plan(&[3, 5], 4);
        let mut filled = Vec::new();
        for bucket in &buckets {
            let mut out = vec![0.0; bucket.iter().map(|s| s.len).sum()];
            assert!(fill_bucket(&params, bucket, 0.5, &mut out));
            filled.push(out);
        }
        // Weighted by 0.5, parameter 1 first; a parameter without a gradient gives zeros.
        assert_eq!(filled, [vec![0.5, 1., 1.5, 2.], vec![2.5, 0., 0., 0.]]);
        for (bucket, sums) in buckets.iter().zip(&filled) {
            let mut summed = sums.iter().map(|v| v * 4.0).collect::<Vec<_>>();
            summed.extend([7.0; STEP_EXTRAS]); // the last bucket's extras are not gradients
            write_bucket(&params, bucket, &summed);
        }
        assert_eq!(b.grad().unwrap().as_slice().unwrap(), [2., 4., 6., 8., 10.]);
        assert_eq!(a.grad().unwrap().as_slice().unwrap(), [0., 0., 0.]);
        // An inf is reported, before the weighting could hide it.
        b.set_grad(Some(ArrayD::from_elem(vec![5], f64::INFINITY)));
        let mut out = vec![0.0; 4];
        assert!(!fill_bucket(&params, &buckets[0], 0.0, &mut out));
    }

    #[test]
    fn only_the_last_micro_batch_reduces_in_backward() {
        assert!(reduces_in_backward(0, 1));
        assert!(!reduces_in_backward(0, 3) && !reduces_in_backward(1, 3));
        assert!(reduces_in_backward(2, 3));
    }
}
