//! `cast`: the emulated 16-bit storage of a tensor, as a differentiable op.
//!
//! Its forward pass rounds every element into the format. The true derivative of rounding
//! is zero almost everywhere, which would stop learning; hardware instead passes the gradient
//! through the conversion, and that gradient is itself stored in the format. So the VJP of a
//! cast is the cast of the incoming gradient.
//!
//! The backward pass also counts the gradient values the rounding flushed to zero (nonzero
//! before, zero after) on a per-thread counter: the underflow telemetry that the loss scaler
//! reports, so that a scale too small for fp16 shows up before training stalls.

use std::cell::Cell;

use rayon::prelude::*;
use tl_numerics::{Format, round_slice, round_slice_counting_flushes, round_slice_into};
use tl_tensor::ndarray::ArrayD;
use tl_tensor::{Element, Tensor};

thread_local! {
    static UNDERFLOWS: Cell<u64> = const { Cell::new(0) };
}

/// Rounds `x` into `format`, forward and backward, keeping the element type.
///
/// Forward: `y = rd(x)`. Backward: `x̄ = rd(ȳ)`. An `f64` tensor is rounded directly from
/// its 53-bit significand (never through `f32`, whose first rounding can move a value onto
/// or off a tie of the 16-bit format).
///
/// ```
/// use tl_numerics::Format;
/// use tl_precision::cast;
/// use tl_tensor::{Tensor, ndarray::arr1};
///
/// let x = Tensor::<f64>::param(arr1(&[1.01, -2.5]).into_dyn());
/// let y = cast(&x, Format::Bf16);
/// assert_eq!(y.to_vec(), vec![1.0078125, -2.5]); // 1 + 2^-7 is the nearest bf16 value
/// // ȳ = 1.01 per element; the gradient arrives rounded like the value.
/// y.backward_with(arr1(&[1.01, 1.01]).into_dyn());
/// assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[1.0078125, 1.0078125]);
/// ```
pub fn cast<E: Element>(x: &Tensor<E>, format: Format) -> Tensor<E> {
    // On the memory meter: a rounded copy, of a parameter or of an activation.
    let _label = tl_tensor::memory::label_scope(if x.is_leaf() && x.requires_grad() {
        WEIGHT_COPY_LABEL
    } else {
        COPY_LABEL
    });
    let value = || rounded_copy(&x.value(), format);
    Tensor::from_op_shaped(&x.shape(), value, &[x], cast_vjp(format))
}

/// The memory meter's label of a [`cast`] of a parameter: a rounded weight copy.
pub const WEIGHT_COPY_LABEL: &str = "rounded weight copy";

/// The memory meter's label of a [`cast`] of anything else: a rounded copy.
pub const COPY_LABEL: &str = "rounded copy";

/// [`cast`] of a tensor that the caller is done with (a product it has just computed):
/// when nothing else holds `x`, its storage is rounded in place and becomes the result's,
/// so no second buffer is made. The graph is the same as `cast`'s.
pub(crate) fn cast_owned<E: Element>(x: Tensor<E>, format: Format) -> Tensor<E> {
    Tensor::from_op_in_place(x, |values| round_in_place(values, format), cast_vjp(format))
}

/// [`cast`] of `x` when `rounded` already holds `rd(x)` (a cast of `x` made earlier and
/// still alive): the result shares that storage instead of rounding again. Its node is its
/// own, with `cast`'s VJP, so the gradient it passes to `x` is rounded on its own, exactly
/// as a separate `cast` would round it.
pub(crate) fn cast_sharing<E: Element>(
    x: &Tensor<E>,
    rounded: &Tensor<E>,
    format: Format,
) -> Tensor<E> {
    Tensor::from_op_shared(rounded, &[x], cast_vjp(format))
}

/// The VJP of every cast: `x̄ = rd(ȳ)`, counting the values the rounding flushed to zero.
fn cast_vjp<E: Element>(format: Format) -> impl FnOnce(ArrayD<E>) -> Vec<Option<ArrayD<E>>> {
    move |grad_out| {
        let (grad_in, flushed) = round_counting_flushes(grad_out, format);
        record_underflows(flushed);
        vec![Some(grad_in)]
    }
}

/// Elements per task when rounding on the rayon pool (64 KiB of f32): large enough that a
/// task's bookkeeping is small next to its work, small enough for both threads to share
/// the work of a modest tensor.
pub(crate) const BLOCK: usize = 1 << 14;

// Both directions round block by block on the rayon pool. Every element is rounded on its
// own, so the split never changes a bit (nor a count: counts are per block, and integer sums
// do not depend on their order).

/// A copy of `values`, in standard layout, with every element rounded into `format`.
///
/// A contiguous input is read once and each rounded element written once, straight into
/// the new buffer (a copy followed by rounding in place would pass over memory twice).
fn rounded_copy<E: Element>(values: &ArrayD<E>, format: Format) -> ArrayD<E> {
    let Some(src) = values.as_slice() else {
        let mut copy = values.as_standard_layout().into_owned();
        let contiguous = copy.as_slice_mut().expect("standard layout");
        contiguous
            .par_chunks_mut(BLOCK)
            .for_each(|block| round_slice(block, format));
        return copy;
    };
    let mut rounded = Vec::with_capacity(src.len());
    rounded.spare_capacity_mut()[..src.len()]
        .par_chunks_mut(BLOCK)
        .zip(src.par_chunks(BLOCK))
        .for_each(|(out, block)| round_slice_into(block, out, format));
    // SAFETY: the chunks above cover the first `src.len()` elements of the spare capacity,
    // and `round_slice_into` initialised every element of each chunk.
    unsafe { rounded.set_len(src.len()) };
    ArrayD::from_shape_vec(values.raw_dim(), rounded).expect("as many elements as the input")
}

/// Rounds every element of `values` into `format`, in place.
fn round_in_place<E: Element>(values: &mut ArrayD<E>, format: Format) {
    match values.as_slice_memory_order_mut() {
        Some(contiguous) => contiguous
            .par_chunks_mut(BLOCK)
            .for_each(|block| round_slice(block, format)),
        None => values.map_inplace(|v| *v = v.round_to(format)),
    }
}

/// Rounds every element of `values` into `format`, in place, and counts the nonzero values
/// the rounding flushed to zero.
fn round_counting_flushes<E: Element>(mut values: ArrayD<E>, format: Format) -> (ArrayD<E>, u64) {
    let flushed = match values.as_slice_memory_order_mut() {
        // Nearly every gradient is contiguous and takes the vectorized slice kernels.
        Some(contiguous) => round_gradient(contiguous, format),
        None => {
            let zero = E::zero();
            let mut flushed = 0;
            values.map_inplace(|v| {
                let rounded = v.round_to(format);
                flushed += u64::from(*v != zero && rounded == zero);
                *v = rounded;
            });
            flushed
        }
    };
    (values, flushed)
}

/// Rounds a gradient in place into `format`, as the backward pass of [`cast`] does, and
/// returns how many nonzero values the rounding flushed to zero, *without* adding them to
/// [`underflow_count`].
///
/// This is for fused kernels that round gradients where a `cast` would stand in the unfused
/// graph, often on worker threads: the counter is per-thread, so they add up their counts
/// and hand the total to [`record_underflows`] on the thread that runs the backward pass.
///
/// ```
/// use tl_numerics::Format;
/// use tl_precision::{record_underflows, round_gradient, take_underflow_count};
///
/// take_underflow_count(); // start from a clean count
/// let mut grad = [1.01_f32, 1e-8, 0.0];
/// let flushed = round_gradient(&mut grad, Format::Fp16);
/// assert_eq!(grad, [1.009765625, 0.0, 0.0]); // 1e-8 is below half of 2^-24
/// assert_eq!(flushed, 1); // the zero that was already zero does not count
/// record_underflows(flushed);
/// assert_eq!(take_underflow_count(), 1);
/// ```
pub fn round_gradient<E: Element>(values: &mut [E], format: Format) -> u64 {
    values
        .par_chunks_mut(BLOCK)
        .map(|block| round_slice_counting_flushes(block, format))
        .sum()
}

/// Adds `count` gradient values flushed to zero to this thread's [`underflow_count`]: the
/// other half of [`round_gradient`].
pub fn record_underflows(count: u64) {
    UNDERFLOWS.with(|total| total.set(total.get() + count));
}

/// The number of gradient values that the backward passes of [`cast`] on this thread have
/// flushed to zero since the last [`take_underflow_count`].
///
/// Under fp16 autocast this counts gradient entries below half of `2^-24` that were lost;
/// [`DynamicLossScaler::step`](crate::DynamicLossScaler::step) reads and resets it.
pub fn underflow_count() -> u64 {
    UNDERFLOWS.with(Cell::get)
}

/// Returns [`underflow_count`] and resets it to zero.
///
/// ```
/// use tl_numerics::Format;
/// use tl_precision::{cast, take_underflow_count};
/// use tl_tensor::{Tensor, ndarray::arr1};
///
/// take_underflow_count(); // start from a clean count
/// let x = Tensor::<f32>::param(arr1(&[1.0, 2.0]).into_dyn());
/// // ȳ = [1e-8, 1]: 1e-8 is below half of fp16's smallest subnormal 2^-24.
/// cast(&x, Format::Fp16).backward_with(arr1(&[1e-8, 1.0]).into_dyn());
/// assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[0.0, 1.0]);
/// assert_eq!(take_underflow_count(), 1);
/// assert_eq!(take_underflow_count(), 0);
/// ```
pub fn take_underflow_count() -> u64 {
    UNDERFLOWS.with(|total| total.replace(0))
}

#[cfg(test)]
#[allow(clippy::excessive_precision)] // exact binary fractions, written out in full
mod tests {
    use super::*;
    use tl_tensor::ndarray::{ArrayD, IxDyn, arr1, arr2};

    #[test]
    fn forward_and_backward_round_in_both_formats() {
        // 1.01 → bf16 1 + 2^-7 = 1.0078125; → fp16 1 + 10·2^-10 = 1.009765625.
        // 70000 overflows fp16 (max 65504) but is 70144 in bf16 (spacing 2^9 at 2^16).
        for (format, expected) in [
            (Format::Bf16, [1.0078125, 70144.0]),
            (Format::Fp16, [1.009765625, f32::INFINITY]),
        ] {
            let x = Tensor::<f32>::param(arr1(&[1.01, 70000.0]).into_dyn());
            let y = cast(&x, format);
            assert_eq!(y.to_vec(), expected);
            y.backward_with(arr1(&[1.01, 70000.0]).into_dyn());
            assert_eq!(x.grad().unwrap().as_slice().unwrap(), expected);
        }
    }

    #[test]
    fn an_f64_is_rounded_directly_not_through_f32() {
        // 1 + 2^-8 + 2^-30 lies just above the bf16 tie 1 + 2^-8, so it rounds up to
        // 1 + 2^-7. Rounded to f32 first it loses 2^-30, lands on the tie and goes to 1.
        let above_tie = 1.0 + 2f64.powi(-8) + 2f64.powi(-30);
        // 1 + 2^-10 + 2^-11 - 2^-30 lies just below the fp16 tie, so it rounds down to
        // 1 + 2^-10; through f32 it becomes the tie and goes to the even 1 + 2^-9.
        let below_tie = 1.0 + 2f64.powi(-10) + 2f64.powi(-11) - 2f64.powi(-30);
        for (format, input, expected) in [
            (Format::Bf16, above_tie, 1.0 + 2f64.powi(-7)),
            (Format::Fp16, below_tie, 1.0 + 2f64.powi(-10)),
        ] {
            let x = Tensor::<f64>::param(arr1(&[input]).into_dyn());
            let y: Tensor<f64> = cast(&x, format);
            assert_eq!(y.item(), expected);
            y.backward_with(arr1(&[input]).into_dyn());
            assert_eq!(x.grad().unwrap()[[0]], expected);
        }
    }

    #[test]
    fn a_strided_gradient_is_rounded_and_counted_too() {
        // Every other column of a matrix is not contiguous in any order: the element path.
        // In fp16, 1.01 becomes 1 + 10·2^-10 and 1e-8 (below 2^-25) flushes to zero.
        let full = arr2(&[[1.01_f32, 5.0, 1e-8, 5.0], [1e-8, 5.0, 0.0, 5.0]]);
        let strided = full.slice_move(tl_tensor::ndarray::s![.., ..;2]).into_dyn();
        assert!(strided.as_slice_memory_order().is_none());
        let (rounded, flushed) = round_counting_flushes(strided, Format::Fp16);
        assert_eq!(
            rounded.iter().copied().collect::<Vec<_>>(),
            [1.009765625, 0.0, 0.0, 0.0]
        );
        assert_eq!(flushed, 2);
    }

    #[test]
    fn long_gradients_are_counted_across_blocks() {
        // 2.5 blocks of 1e-8 (all flushed in fp16) with a few zeros and ones mixed in.
        let len = BLOCK * 5 / 2;
        let grad = ArrayD::from_shape_fn(IxDyn(&[len]), |i| match i[0] % 7 {
            0 => 0.0_f32,
            1 => 1.0,
            _ => 1e-8,
        });
        let expected = (0..len).filter(|i| i % 7 >= 2).count() as u64;
        let (rounded, flushed) = round_counting_flushes(grad, Format::Fp16);
        assert_eq!(flushed, expected);
        assert_eq!(rounded.iter().filter(|&&v| v == 1.0).count(), (len + 5) / 7);
    }

    #[test]
    fn a_long_tensor_is_rounded_element_by_element() {
        // Several blocks for the rayon pool; every element must be its own rounding, and a
        // transposed (non-standard) input comes out in its logical order.
        let rows = 2 * BLOCK / 5 + 1;
        let values: Vec<f32> = (0..rows * 5).map(|i| 1.0 + i as f32 * 1e-6).collect();
        let x = Tensor::from_vec(values.clone(), &[rows, 5]).unwrap();
        let rounded = cast(&x.transpose(0, 1), Format::Bf16).to_vec();
        assert_eq!(rounded.len(), rows * 5);
        for (i, &r) in rounded.iter().enumerate() {
            let (row, column) = (i % rows, i / rows);
            assert_eq!(
                r,
                tl_numerics::Round::round_to(values[row * 5 + column], Format::Bf16)
            );
        }
    }

    #[test]
    fn constants_stay_constants() {
        let x = Tensor::<f32>::full(&[2], 1.01);
        let y = cast(&x, Format::Bf16);
        assert!(!y.requires_grad());
        assert_eq!(y.to_vec(), vec![1.0078125, 1.0078125]);
    }

    #[test]
    fn underflows_count_only_values_flushed_to_zero() {
        // ȳ = [0, 1e-8, -1e-8, 2^-24, 1]: the zero was already zero, ±1e-8 flush (below
        // 2^-25), 2^-24 is fp16's smallest subnormal and survives.
        let x = Tensor::<f32>::param(ArrayD::zeros(IxDyn(&[5])));
        take_underflow_count();
        let grad = arr1(&[0.0, 1e-8, -1e-8, 2f32.powi(-24), 1.0]).into_dyn();
        cast(&x, Format::Fp16).backward_with(grad.clone());
        assert_eq!(underflow_count(), 2);
        cast(&x, Format::Bf16).backward_with(grad);
        assert_eq!(take_underflow_count(), 2); // bf16 keeps 1e-8: nothing added
        assert_eq!(underflow_count(), 0);
    }
}
