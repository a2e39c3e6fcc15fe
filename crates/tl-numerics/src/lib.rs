//! Exact emulation of low-precision floating-point formats: the 16-bit bf16 and fp16, and
//! the 8-bit (fp8) E4M3 and E5M2.
//!
//! Low-precision hardware stores numbers in 16 or 8 bits; tinyllm computes in f32 or f64
//! and *rounds* to the format wherever the hardware would store one, so that training sees
//! the same numbers it would on a GPU. This crate is that rounding, `rd(x)`: the value of
//! the format nearest to `x`, ties to even, with gradual underflow into the format's
//! subnormals, ±0 kept, and NaN staying NaN. On overflow it does what the format's own
//! conversion does: ±inf, or NaN in E4M3, which has no infinities. fp8 training stores its
//! tensors with a *saturating* conversion instead, which clamps overflow to the largest
//! finite value: [`Round::round_to_saturating`] and [`round_slice_saturating`].
//!
//! A rounded value keeps its type: an f32 comes back as an f32 and an f64 as an f64, both
//! holding a value of the format. An f64 is rounded directly from its 53-bit significand,
//! never through f32: rounding twice can break a tie the wrong way (for example
//! `1 + 2^-10 + 2^-11 - 2^-30` is just below an fp16 midpoint, but rounds to it in f32).
//!
//! # Examples
//!
//! ```
//! use tl_numerics::{round_slice, round_to_bf16, round_to_e4m3, round_to_fp16, Format};
//!
//! assert_eq!(round_to_bf16(1.01_f32), 1.0078125); // the nearest bf16 value: 1 + 2^-7
//! assert_eq!(round_to_fp16(65519.0_f64), 65504.0); // fp16's largest finite value
//! assert_eq!(round_to_fp16(65520.0_f64), f64::INFINITY); // at the overflow threshold
//! assert_eq!(round_to_e4m3(1.1_f32), 1.125); // E4M3 has 3 fraction bits: 1 + 1/8
//!
//! let mut xs = vec![1.0_f32, 1.00390625, 1e-8];
//! round_slice(&mut xs, Format::Fp16);
//! assert_eq!(xs, [1.0, 1.00390625, 0.0]); // 1e-8 is below half of fp16's 2^-24
//! ```

pub mod block_fma;
mod error;
mod format;
mod round;

pub use block_fma::{BlockFma, GemmElement, GemmKernel};
pub use error::{NumericsError, Result};
pub use format::Format;
pub use round::{RangeCounts, Round, ScaledCast};

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

/// Rounds `x` to the nearest E4M3 value, ties to even, keeping its type.
///
/// E4M3 (OCP's E4M3FN) has 4 bits of precision, subnormals down to `2^-9`, a largest
/// finite value of 448 and no infinity: what lies beyond the finite range, above 464 (the
/// tie between 448 and the 480 its exponent field would reach next goes to the even 448),
/// becomes NaN, and so does ±inf. [`Round::round_to_saturating`] clamps to ±448 instead.
///
/// # Examples
///
/// ```
/// use tl_numerics::{round_to_e4m3, Format, Round};
///
/// assert_eq!(round_to_e4m3(448.0_f32), 448.0);
/// assert_eq!(round_to_e4m3(464.0_f32), 448.0); // a tie: 448 = 1.110 * 2^8 is even
/// assert!(round_to_e4m3(465.0_f32).is_nan()); // nearer 480, which is not a value: NaN
/// assert!(round_to_e4m3(-f64::INFINITY).is_nan() && round_to_e4m3(-f64::INFINITY).is_sign_negative());
/// assert_eq!(465.0_f32.round_to_saturating(Format::E4M3), 448.0);
/// // Subnormals: the spacing below 2^-6 is 2^-9; half of it ties to 0, more rounds up.
/// assert_eq!(round_to_e4m3(2f64.powi(-9)), 2f64.powi(-9));
/// assert_eq!(round_to_e4m3(2f64.powi(-10)), 0.0);
/// assert_eq!(round_to_e4m3(1.5 * 2f64.powi(-10)), 2f64.powi(-9));
/// // Ties to even: 1 + 1/16 lies between 1 (even) and 1.125, 1 + 3/16 between 1.125 and 1.25 (even).
/// assert_eq!(round_to_e4m3(1.0625_f32), 1.0);
/// assert_eq!(round_to_e4m3(1.1875_f32), 1.25);
/// // Rounded directly from the f64, not through f32 (which would make it the tie, then 1):
/// assert_eq!(round_to_e4m3(1.0625 + 2f64.powi(-40)), 1.125);
/// ```
#[inline]
pub fn round_to_e4m3<E: Round>(x: E) -> E {
    x.round_to(Format::E4M3)
}

/// Rounds `x` to the nearest E5M2 value, ties to even, keeping its type.
///
/// E5M2 has fp16's exponent range with 3 bits of precision: subnormals down to `2^-16`, a
/// largest finite value of 57344 (`1.75 * 2^15`), and IEEE overflow: from 61440, halfway
/// to `2^16`, on, the result is infinity.
///
/// # Examples
///
/// ```
/// use tl_numerics::{round_to_e5m2, Format, Round};
///
/// assert_eq!(round_to_e5m2(57344.0_f32), 57344.0);
/// assert_eq!(round_to_e5m2(61439.0_f32), 57344.0);
/// assert_eq!(round_to_e5m2(61440.0_f32), f32::INFINITY); // a tie: 2^16 is the even one
/// assert_eq!(round_to_e5m2(-1e6_f64), f64::NEG_INFINITY);
/// assert_eq!(61440.0_f32.round_to_saturating(Format::E5M2), 57344.0);
/// // Subnormals: multiples of 2^-16 below 2^-14.
/// assert_eq!(round_to_e5m2(2f64.powi(-16)), 2f64.powi(-16));
/// assert_eq!(round_to_e5m2(2f64.powi(-17)), 0.0); // the tie between 0 and 2^-16
/// assert_eq!(round_to_e5m2(3.0 * 2f64.powi(-17)), 2.0 * 2f64.powi(-16)); // 1.5 steps: to 2
/// // Ties to even: 1.125 lies between 1 (even) and 1.25, 1.375 between 1.25 and 1.5 (even).
/// assert_eq!(round_to_e5m2(1.125_f32), 1.0);
/// assert_eq!(round_to_e5m2(1.375_f32), 1.5);
/// ```
#[inline]
pub fn round_to_e5m2<E: Round>(x: E) -> E {
    x.round_to(Format::E5M2)
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

/// Rounds every element of `xs` to the nearest value of format `f`, in place, clamping
/// overflow to ±`max_finite`: [`Round::round_to_saturating`] on each element, in the same
/// vectorized loops as [`round_slice`].
///
/// # Examples
///
/// ```
/// use tl_numerics::{round_slice_saturating, Format};
///
/// let mut xs = [1000.0_f32, -f32::INFINITY, 300.0, f32::NAN];
/// round_slice_saturating(&mut xs, Format::E4M3);
/// // Above 256 the spacing is 32: 300 is nearer 288 than 320. NaN stays NaN.
/// assert_eq!(xs[..3], [448.0, -448.0, 288.0]);
/// assert!(xs[3].is_nan());
/// ```
pub fn round_slice_saturating<E: Round>(xs: &mut [E], f: Format) {
    E::round_slice_saturating_in_place(xs, f);
}

/// Rounds every element of `xs` in place, like [`round_slice_saturating`], and counts the
/// values that fell off the ends of the range: those clamped to ±`max_finite` and the
/// nonzero ones that became zero ([`RangeCounts`]). One pass over memory.
///
/// # Examples
///
/// ```
/// use tl_numerics::{round_slice_saturating_counting, Format, RangeCounts};
///
/// let mut xs = [500.0_f32, 450.0, f32::INFINITY, 1e-4, 0.0, 1.0];
/// let counts = round_slice_saturating_counting(&mut xs, Format::E4M3);
/// // 500 and inf were beyond the range; 450 merely rounds down to 448. 1e-4 is below
/// // half of E4M3's smallest subnormal 2^-9 (about 0.00195); the zero was zero.
/// assert_eq!(counts, RangeCounts { saturated: 2, flushed: 1 });
/// assert_eq!(xs, [448.0, 448.0, 448.0, 0.0, 0.0, 1.0]);
/// ```
pub fn round_slice_saturating_counting<E: Round>(xs: &mut [E], f: Format) -> RangeCounts {
    E::round_slice_saturating_counting(xs, f)
}

/// Writes `rd_sat(x · scale)` in format `f` of every `x` of `src` to `dst` (memory that need
/// not be initialised) and returns the cast's [`RangeCounts`] and the largest `|x|` before
/// scaling: fp8 delayed scaling's cast, its range counts and its amax in one pass
/// ([`Round::scale_round_saturating_into`]), vectorized for the CPU at hand.
///
/// # Panics
/// If the slices differ in length.
///
/// # Examples
///
/// ```
/// use std::mem::MaybeUninit;
/// use tl_numerics::{scale_round_saturating_into, Format, RangeCounts};
///
/// let src = [2.5_f32, -1.0, 1e-6, 0.0];
/// let mut dst = [MaybeUninit::uninit(); 4];
/// let cast = scale_round_saturating_into(&src, 200.0, &mut dst, Format::E4M3);
/// // 500 saturates to 448; 2e-4 flushes to zero; the amax is of the unscaled values.
/// assert_eq!(cast.counts, RangeCounts { saturated: 1, flushed: 1 });
/// assert_eq!(cast.amax, 2.5);
/// // SAFETY: the cast wrote every element.
/// let dst = dst.map(|x| unsafe { x.assume_init() });
/// assert_eq!(dst, [448.0, -192.0, 0.0, 0.0]);
/// ```
pub fn scale_round_saturating_into<E: Round>(
    src: &[E],
    scale: E,
    dst: &mut [std::mem::MaybeUninit<E>],
    f: Format,
) -> ScaledCast {
    E::scale_round_saturating_into(src, scale, dst, f)
}
