//! Exact emulation of the 16-bit floating-point formats bf16 and fp16.
//!
//! Low-precision hardware stores numbers in 16 bits; tinyllm computes in f32 or f64 and
//! *rounds* to the 16-bit format wherever the hardware would store one, so that training
//! sees the same numbers it would on a GPU. This crate is that rounding,
//! `rd16(x)`: the value of the format nearest to `x`, ties to even, with gradual underflow
//! into the format's subnormals, overflow to ±inf, ±0 and ±inf kept, and NaN staying NaN.
//!
//! A rounded value keeps its type: an f32 comes back as an f32 and an f64 as an f64, both
//! holding a value of the format. An f64 is rounded directly from its 53-bit significand,
//! never through f32: rounding twice can break a tie the wrong way (for example
//! `1 + 2^-10 + 2^-11 - 2^-30` is just below an fp16 midpoint, but rounds to it in f32).
//!
//! # Examples
//!
//! ```
//! use tl_numerics::{round_slice, round_to_bf16, round_to_fp16, Format};
//!
//! assert_eq!(round_to_bf16(1.01_f32), 1.0078125); // the nearest bf16 value: 1 + 2^-7
//! assert_eq!(round_to_fp16(65519.0_f64), 65504.0); // fp16's largest finite value
//! assert_eq!(round_to_fp16(65520.0_f64), f64::INFINITY); // at the overflow threshold
//!
//! let mut xs = vec![1.0_f32, 1.00390625, 1e-8];
//! round_slice(&mut xs, Format::Fp16);
//! assert_eq!(xs, [1.0, 1.00390625, 0.0]); // 1e-8 is below half of fp16's 2^-24
//! ```

pub mod block_fma;
mod error;
mod format;
mod round;

pub use block_fma::{BlockFma, GemmElement};
pub use error::{NumericsError, Result};
pub use format::Format;
pub use round::Round;

/// Rounds `x` to the nearest bf16 value, ties to even, keeping its type.
///
/// bf16 has 8 bits of precision and float32's exponent range, so the relative error is at
/// most `2^-8` for normal results: `|rd(x) - x| <= 2^-8 |x|`.
///
/// # Examples
///
/// ```
/// use tl_numerics::round_to_bf16;
///
/// // 1 + 2^-8 is halfway between 1 and 1 + 2^-7; the tie goes to the even significand.
/// assert_eq!(round_to_bf16(1.0_f32 + 2f32.powi(-8)), 1.0);
/// assert_eq!(round_to_bf16(1.01_f64), 1.0078125);
/// // An f64 is rounded from all its bits: 2^-22 just above the tie decides it.
/// assert_eq!(round_to_bf16(1.0 + 2f64.powi(-8) + 2f64.powi(-22)), 1.0078125);
/// assert!(round_to_bf16(f32::NAN).is_nan());
/// ```
#[inline]
pub fn round_to_bf16<E: Round>(x: E) -> E {
    x.round_to(Format::Bf16)
}

/// Rounds `x` to the nearest fp16 value, ties to even, keeping its type.
///
/// fp16 has 11 bits of precision, a largest finite value of 65504 (anything from 65520 on
/// overflows to infinity) and subnormals down to `2^-24` (anything up to `2^-25` becomes 0).
///
/// # Examples
///
/// ```
/// use tl_numerics::round_to_fp16;
///
/// assert_eq!(round_to_fp16(65519.0_f32), 65504.0);
/// assert_eq!(round_to_fp16(65520.0_f32), f32::INFINITY);
/// assert_eq!(round_to_fp16(2f64.powi(-25)), 0.0); // a tie between 0 and 2^-24: even is 0
/// assert_eq!(round_to_fp16(1.5 * 2f64.powi(-25)), 2f64.powi(-24));
/// // Rounded directly, not through f32 (which would give 1 + 2^-9):
/// let x = 1.0 + 2f64.powi(-10) + 2f64.powi(-11) - 2f64.powi(-30);
/// assert_eq!(round_to_fp16(x), 1.0 + 2f64.powi(-10));
/// ```
#[inline]
pub fn round_to_fp16<E: Round>(x: E) -> E {
    x.round_to(Format::Fp16)
}

/// Rounds every element of `xs` to the nearest value of format `f`, in place.
///
/// Same results as calling [`Round::round_to`] on each element; the kernels are
/// branch-free so the compiler vectorizes the loops (f32 to bf16 runs at memory bandwidth).
///
/// # Examples
///
/// ```
/// use tl_numerics::{round_slice, Format};
///
/// let mut xs = [1.01_f64, -3.0e-8, 1e6];
/// round_slice(&mut xs, Format::Fp16);
/// // 1 + 10 * 2^-10; just above 2^-25 so up to -2^-24; beyond 65520 so infinity.
/// assert_eq!(xs, [1.009765625, -(2f64.powi(-24)), f64::INFINITY]);
/// ```
pub fn round_slice<E: Round>(xs: &mut [E], f: Format) {
    E::round_slice_in_place(xs, f);
}

/// Rounds every element of `xs` in place, like [`round_slice`], and returns how many
/// nonzero values became zero (of either sign): the values flushed because they lie below
/// half of the format's smallest subnormal. One pass over memory.
///
/// # Examples
///
/// ```
/// use tl_numerics::{round_slice_counting_flushes, Format};
///
/// let mut xs = [1.01_f32, 1e-8, 0.0, -1e-9];
/// // 1e-8 and -1e-9 lie below half of fp16's smallest subnormal 2^-24; the 0 was zero.
/// assert_eq!(round_slice_counting_flushes(&mut xs, Format::Fp16), 2);
/// assert_eq!(xs, [1.009765625, 0.0, 0.0, -0.0]);
/// ```
pub fn round_slice_counting_flushes<E: Round>(xs: &mut [E], f: Format) -> u64 {
    E::round_slice_counting_flushes(xs, f)
}

/// Writes every element of `src`, rounded to the nearest value of format `f`, to `dst`:
/// [`round_slice`] on a copy, but in a single pass, and into memory that may be
/// uninitialised (a fresh buffer's spare capacity).
///
/// # Panics
/// If the slices differ in length.
///
/// # Examples
///
/// ```
/// use std::mem::MaybeUninit;
/// use tl_numerics::{round_slice_into, Format};
///
/// let src = [1.01_f32, 3.0e5];
/// let mut dst = [MaybeUninit::<f32>::uninit(); 2];
/// round_slice_into(&src, &mut dst, Format::Bf16);
/// // 1 + 2^-7 is the bf16 value nearest 1.01; 3e5 is 299,008 + 992, nearer 299,008.
/// let dst = dst.map(|x| unsafe { x.assume_init() });
/// assert_eq!(dst, [1.0078125, 299_008.0]);
/// ```
pub fn round_slice_into<E: Round>(src: &[E], dst: &mut [std::mem::MaybeUninit<E>], f: Format) {
    E::round_slice_into(src, dst, f);
}
