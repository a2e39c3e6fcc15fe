//! Round-to-nearest-even of f32 and f64 values into a 16-bit format.
//!
//! The result of every kernel here is the value IEEE 754 conversion to the 16-bit format
//! would produce (round to nearest, ties to even, gradual underflow, overflow to ±inf),
//! returned in the input's own type. Three kernels do the work:
//!
//! - `f32_to_bf16_value`: bf16 is the top half of an f32, so rounding is one integer add
//!   on the bits. Branch-free, so slice loops auto-vectorize.
//! - `f32_to_fp16_value`: an integer add on the bits in fp16's normal range and a
//!   floating-point add of a "magic" constant in its subnormal range, merged by selects.
//!   Branch-free as well.
//! - `f64_to_format_value`: integer arithmetic on the full 53-bit significand, for both
//!   formats. An f64 must never be rounded through f32 first: the first rounding can land
//!   exactly on a midpoint of the 16-bit format (or move off one), and the second rounding
//!   then breaks the tie the wrong way.

use crate::format::Format;

/// A floating-point type whose values can be rounded into a 16-bit [`Format`], keeping the
/// type: an f32 comes back as an f32, an f64 as an f64, each holding a value of the format.
///
/// Implemented for `f32` and `f64`.
///
/// # Examples
///
/// ```
/// use tl_numerics::{Format, Round};
///
/// // 1 + 2^-8 lies halfway between the bf16 neighbours 1 and 1 + 2^-7: ties go to even.
/// assert_eq!(1.00390625_f32.round_to(Format::Bf16), 1.0);
/// assert_eq!(1.01_f64.round_to(Format::Bf16), 1.0078125);
/// ```
pub trait Round: Copy {
    /// The value of format `f` nearest to `self`, ties to even.
    ///
    /// Values below the smallest normal round onto the format's subnormals; values at or
    /// beyond `max_finite` plus half an ulp become ±inf; ±0 and ±inf are kept; a NaN gives a
    /// quiet NaN with the same sign.
    fn round_to(self, f: Format) -> Self;

    /// Rounds every element of `xs` into format `f`, in place.
    ///
    /// The default calls [`round_to`](Round::round_to) per element; `f32` and `f64`
    /// override it with loops that choose the kernel once, outside the loop, so that the
    /// f32 loops vectorize.
    fn round_slice_in_place(xs: &mut [Self], f: Format) {
        for x in xs.iter_mut() {
            *x = x.round_to(f);
        }
    }
}

impl Round for f32 {
    #[inline]
    fn round_to(self, f: Format) -> f32 {
        match f {
            Format::Bf16 => f32_to_bf16_value(self),
            Format::Fp16 => f32_to_fp16_value(self),
        }
    }

    fn round_slice_in_place(xs: &mut [f32], f: Format) {
        // Two monomorphic loops: with the format known, each body is straight-line code.
        match f {
            Format::Bf16 => xs.iter_mut().for_each(|x| *x = f32_to_bf16_value(*x)),
            Format::Fp16 => xs.iter_mut().for_each(|x| *x = f32_to_fp16_value(*x)),
        }
    }
}

impl Round for f64 {
    #[inline]
    fn round_to(self, f: Format) -> f64 {
        f64_to_format_value(self, f)
    }

    fn round_slice_in_place(xs: &mut [f64], f: Format) {
        match f {
            Format::Bf16 => xs
                .iter_mut()
                .for_each(|x| *x = f64_to_format_value(*x, Format::Bf16)),
            Format::Fp16 => xs
                .iter_mut()
                .for_each(|x| *x = f64_to_format_value(*x, Format::Fp16)),
        }
    }
}

const F32_ABS_MASK: u32 = 0x7FFF_FFFF;
const F32_INF_BITS: u32 = 0x7F80_0000;
const F32_QUIET_BIT: u32 = 0x0040_0000;

/// Rounds an f32 to the nearest bf16 value, returned as an f32.
///
/// bf16 is the upper 16 bits of an f32 (same sign, same 8 exponent bits, the first 7
/// fraction bits), so rounding clears the low 16 bits after adding just under half of their
/// weight: `0x7FFF` plus the lowest kept bit. Above the midpoint the add carries into the
/// kept bits (round up); at the midpoint it carries only when the kept part is odd (ties to
/// even); below it, never. A carry out of the fraction increments the exponent, which is
/// exactly the step to the next binade, and from the largest finite value to infinity. f32
/// subnormals need no special case: bf16 has the same exponent range, hence the same
/// subnormal spacing relative to the bits. Only NaN needs a select, because its payload may
/// sit in the low bits alone and would round to infinity.
#[inline(always)]
fn f32_to_bf16_value(x: f32) -> f32 {
    let bits = x.to_bits();
    // wrapping: only a NaN with a full payload can wrap, and its result is discarded.
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) & 0xFFFF_0000;
    let nan = (bits | F32_QUIET_BIT) & 0xFFFF_0000;
    let is_nan = (bits & F32_ABS_MASK) > F32_INF_BITS;
    f32::from_bits(if is_nan { nan } else { rounded })
}

/// `2^-14` (fp16's smallest normal) as f32 bits.
const FP16_MIN_NORMAL_BITS: u32 = 0x3880_0000;
/// 65504 (fp16's largest finite value) as f32 bits.
const FP16_MAX_FINITE_BITS: u32 = 0x477F_E000;
/// The f32 fraction bits below fp16's 10 stored fraction bits.
const FP16_DROPPED_MASK: u32 = 0x1FFF;

/// Rounds an f32 to the nearest fp16 value, returned as an f32.
///
/// In fp16's normal range `|x| >= 2^-14` the 13 low fraction bits are rounded off with the
/// same carry trick as bf16 (add `0x0FFF` plus the lowest kept bit, clear). Below `2^-14`
/// the spacing is fixed at `2^-24`, whatever the exponent of `x`: adding `0.5` puts `|x|`
/// in `[0.5, 1)`, where f32's own spacing is `2^-24`, so the f32 addition itself rounds to
/// a multiple of `2^-24` with ties to even (`0.5` is an even multiple), and subtracting `0.5`
/// back is exact. Results above 65504 (after rounding, i.e. `|x| >= 65520`) become
/// infinity. All paths are computed and merged with selects so that loops vectorize.
#[inline(always)]
fn f32_to_fp16_value(x: f32) -> f32 {
    let bits = x.to_bits();
    let sign = bits & !F32_ABS_MASK;
    let abs = bits & F32_ABS_MASK;
    // No overflow: abs <= 0x7FFF_FFFF and we add at most 0x1000.
    let normal = (abs + 0x0FFF + ((abs >> 13) & 1)) & !FP16_DROPPED_MASK;
    let subnormal = ((f32::from_bits(abs) + 0.5) - 0.5).to_bits();
    let magnitude = if abs < FP16_MIN_NORMAL_BITS {
        subnormal
    } else {
        normal
    };
    let magnitude = if magnitude > FP16_MAX_FINITE_BITS {
        F32_INF_BITS
    } else {
        magnitude
    };
    let nan = (abs | F32_QUIET_BIT) & !FP16_DROPPED_MASK;
    let magnitude = if abs > F32_INF_BITS { nan } else { magnitude };
    f32::from_bits(sign | magnitude)
}

const F64_SIGN_BIT: u64 = 1 << 63;
const F64_FRACTION_MASK: u64 = (1 << 52) - 1;
const F64_QUIET_BIT: u64 = 1 << 51;
const F64_EXPONENT_BIAS: i32 = 1023;

/// `2^e` for a normal f64 exponent `e`, built from the bits.
#[inline]
fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + F64_EXPONENT_BIAS) as u64) << 52)
}

/// Rounds an f64 to the nearest value of `format`, returned as an f64, directly from its
/// 53-bit significand.
///
/// Write `|x| = m * 2^(e - 52)` with the integer significand `2^52 <= m < 2^53`. The result
/// has spacing (ulp) `2^q` with `q = max(e, emin) - (p - 1)`: `p` bits below the leading bit
/// in the normal range, fewer once `e < emin` (gradual underflow). So `|x| / 2^q = m /
/// 2^shift` with `shift = 52 - e + q`, and rounding is: keep `m >> shift`, compare the
/// dropped bits with half of `2^shift`, add one above half or at half when the kept part is
/// odd. The result `n * 2^q` is exact in f64 (`n <= 2^p`), and a carry to `n = 2^p` is
/// simply the next power of two. Rounding as if the exponent were unbounded and then
/// mapping anything above `max_finite` to infinity is exactly IEEE overflow for round to
/// nearest: the threshold `max_finite + ulp/2` is a tie whose even neighbour is `2^(emax+1)`.
#[inline]
fn f64_to_format_value(x: f64, format: Format) -> f64 {
    let bits = x.to_bits();
    let sign = bits & F64_SIGN_BIT;
    let biased_exponent = ((bits >> 52) & 0x7FF) as i32;
    let fraction = bits & F64_FRACTION_MASK;
    let precision = format.precision_bits() as i32;

    if biased_exponent == 0x7FF {
        if fraction == 0 {
            return x; // ±inf
        }
        // NaN: quiet it and keep only the payload bits the format has room for, so the
        // result is a NaN of the format (the one a hardware conversion would give).
        let kept_fraction = !((1u64 << (53 - precision)) - 1);
        return f64::from_bits((bits | F64_QUIET_BIT) & (F64_SIGN_BIT | kept_fraction));
    }
    if biased_exponent == 0 {
        // ±0 and f64 subnormals: all below 2^-1022, far below half of either format's
        // smallest subnormal, so they round to zero of the same sign.
        return f64::from_bits(sign);
    }
    let exponent = biased_exponent - F64_EXPONENT_BIAS;
    if exponent > format.max_exponent() {
        // |x| >= 2^(emax+1): beyond the overflow threshold. Checked early also because the
        // unbounded-exponent result could overflow f64 itself when e = 1023.
        return f64::from_bits(sign | f64::INFINITY.to_bits());
    }

    let significand = fraction | (1 << 52);
    let min_exponent = format.min_exponent();
    let quantum_exponent = exponent.max(min_exponent) - (precision - 1);
    let shift = (52 - exponent + quantum_exponent) as u32;
    if shift > 53 {
        // |x| < 2^(q-1): below half the smallest subnormal, so the nearest value is zero.
        // (Also keeps the shifts below within u64.)
        return f64::from_bits(sign);
    }
    let kept = significand >> shift;
    let dropped = significand & ((1u64 << shift) - 1);
    let half = 1u64 << (shift - 1);
    let round_up = dropped > half || (dropped == half && kept & 1 == 1);
    let multiple = kept + u64::from(round_up);

    let magnitude = multiple as f64 * pow2(quantum_exponent);
    if magnitude > format.max_finite() {
        return f64::from_bits(sign | f64::INFINITY.to_bits());
    }
    f64::from_bits(sign | magnitude.to_bits())
}
