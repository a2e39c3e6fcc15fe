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
//! - `f64_to_format_value`: the same two regimes on the full 53-bit significand, for both
//!   formats. An f64 must never be rounded through f32 first: the first rounding can land
//!   exactly on a midpoint of the 16-bit format (or move off one), and the second rounding
//!   then breaks the tie the wrong way.
//!
//! The floating-point adds rely only on IEEE addition in the default round-to-nearest mode
//! (which Rust guarantees). They are also immune to flush-to-zero modes: their results are
//! multiples of the format's smallest subnormal, normal in f32/f64, and any input an FPU
//! would flush is far below half of that, so it rounds to zero either way.

use std::mem::MaybeUninit;

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
    /// branch-free kernels vectorize.
    fn round_slice_in_place(xs: &mut [Self], f: Format) {
        for x in xs.iter_mut() {
            *x = x.round_to(f);
        }
    }

    /// Writes `src` rounded into format `f` to `dst`, element by element: a rounded copy in
    /// one pass, into memory that need not be initialised.
    ///
    /// # Panics
    /// If the slices differ in length.
    fn round_slice_into(src: &[Self], dst: &mut [MaybeUninit<Self>], f: Format) {
        assert_eq!(src.len(), dst.len(), "round_slice_into: lengths differ");
        for (out, x) in dst.iter_mut().zip(src) {
            out.write(x.round_to(f));
        }
    }

    /// Rounds every element of `xs` into format `f`, in place, and returns how many nonzero
    /// values became zero (of either sign): the values the format's range flushed.
    fn round_slice_counting_flushes(xs: &mut [Self], f: Format) -> u64;
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
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            unsafe { f32_slices::in_place_avx2(xs, f) };
            return;
        }
        f32_slices::in_place(xs, f);
    }

    fn round_slice_into(src: &[f32], dst: &mut [MaybeUninit<f32>], f: Format) {
        assert_eq!(src.len(), dst.len(), "round_slice_into: lengths differ");
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            unsafe { f32_slices::into_avx2(src, dst, f) };
            return;
        }
        f32_slices::into(src, dst, f);
    }

    fn round_slice_counting_flushes(xs: &mut [f32], f: Format) -> u64 {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { f32_slices::counting_avx2(xs, f) };
        }
        f32_slices::counting(xs, f)
    }
}

/// The f32 slice loops, each written once and compiled twice: for any x86-64 (SSE2, four
/// lanes) and for AVX2 (eight lanes), chosen at run time. The kernels are pure integer and
/// IEEE operations without fused multiply-adds, so both builds give the same bits.
mod f32_slices {
    use std::mem::MaybeUninit;

    use super::{f32_to_bf16_value, f32_to_fp16_value};
    use crate::format::Format;

    // Each loop matches the format once, outside: with the kernel fixed, the body is
    // straight-line code and the compiler vectorizes it.

    #[inline(always)]
    pub(super) fn in_place(xs: &mut [f32], f: Format) {
        match f {
            Format::Bf16 => xs.iter_mut().for_each(|x| *x = f32_to_bf16_value(*x)),
            Format::Fp16 => xs.iter_mut().for_each(|x| *x = f32_to_fp16_value(*x)),
        }
    }

    #[inline(always)]
    pub(super) fn into(src: &[f32], dst: &mut [MaybeUninit<f32>], f: Format) {
        let pairs = dst.iter_mut().zip(src);
        match f {
            Format::Bf16 => pairs.for_each(|(out, &x)| {
                out.write(f32_to_bf16_value(x));
            }),
            Format::Fp16 => pairs.for_each(|(out, &x)| {
                out.write(f32_to_fp16_value(x));
            }),
        }
    }

    #[inline(always)]
    pub(super) fn counting(xs: &mut [f32], f: Format) -> u64 {
        match f {
            Format::Bf16 => counting_with(xs, f32_to_bf16_value),
            Format::Fp16 => counting_with(xs, f32_to_fp16_value),
        }
    }

    /// One pass: round each value and count it if it was nonzero and is zero now. The
    /// count is per slice in a `u32` lane sum, which vectorizes; slices longer than
    /// `u32::MAX` are counted in pieces.
    #[inline(always)]
    fn counting_with(xs: &mut [f32], round: impl Fn(f32) -> f32) -> u64 {
        xs.chunks_mut(1 << 30)
            .map(|piece| {
                let flushed = piece.iter_mut().fold(0_u32, |n, x| {
                    let rounded = round(*x);
                    let was_flushed = (*x != 0.0) & (rounded == 0.0);
                    *x = rounded;
                    n + u32::from(was_flushed)
                });
                u64::from(flushed)
            })
            .sum()
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn in_place_avx2(xs: &mut [f32], f: Format) {
        in_place(xs, f);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn into_avx2(src: &[f32], dst: &mut [MaybeUninit<f32>], f: Format) {
        into(src, dst, f);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn counting_avx2(xs: &mut [f32], f: Format) -> u64 {
        counting(xs, f)
    }

    #[cfg(all(test, target_arch = "x86_64"))]
    mod tests {
        use super::*;

        /// Every 4099th f32 pattern (a stride coprime with the layout's fields, so it meets
        /// every exponent, both signs, NaNs and subnormals), with some zeros.
        fn sweep() -> Vec<f32> {
            (0..=u32::MAX)
                .step_by(4099)
                .map(f32::from_bits)
                .chain([0.0, -0.0, 1e-30, -1e-30])
                .collect()
        }

        #[test]
        fn both_builds_of_every_loop_give_the_same_bits() {
            if !std::arch::is_x86_feature_detected!("avx2") {
                return; // only the portable build runs on this CPU
            }
            let bits = |xs: &[f32]| xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let src = sweep();
            for f in Format::ALL {
                let (mut portable, mut avx2) = (src.clone(), src.clone());
                in_place(&mut portable, f);
                // SAFETY: AVX2 checked above.
                unsafe { in_place_avx2(&mut avx2, f) };
                assert_eq!(bits(&portable), bits(&avx2), "{f} in place");

                let mut copied = vec![MaybeUninit::uninit(); src.len()];
                let mut copied_avx2 = vec![MaybeUninit::uninit(); src.len()];
                into(&src, &mut copied, f);
                // SAFETY: AVX2 checked above.
                unsafe { into_avx2(&src, &mut copied_avx2, f) };
                // SAFETY: both loops wrote every element.
                let copied: Vec<f32> = copied.iter().map(|x| unsafe { x.assume_init() }).collect();
                // SAFETY: as above.
                let copied_avx2: Vec<f32> = copied_avx2
                    .iter()
                    .map(|x| unsafe { x.assume_init() })
                    .collect();
                assert_eq!(bits(&copied), bits(&portable), "{f} into");
                assert_eq!(bits(&copied_avx2), bits(&portable), "{f} into, AVX2");

                let (mut counted, mut counted_avx2) = (src.clone(), src.clone());
                let flushed = counting(&mut counted, f);
                // SAFETY: AVX2 checked above.
                let flushed_avx2 = unsafe { counting_avx2(&mut counted_avx2, f) };
                assert_eq!(bits(&counted), bits(&portable), "{f} counting");
                assert_eq!(bits(&counted_avx2), bits(&portable), "{f} counting, AVX2");
                let expected = src
                    .iter()
                    .zip(&portable)
                    .filter(|&(&x, &r)| x != 0.0 && r == 0.0)
                    .count() as u64;
                assert!(expected > 0, "{f}: the sweep flushes some values");
                assert_eq!((flushed, flushed_avx2), (expected, expected), "{f} count");
            }
        }
    }
}

impl Round for f64 {
    #[inline]
    fn round_to(self, f: Format) -> f64 {
        f64_to_format_value(self, f)
    }

    fn round_slice_counting_flushes(xs: &mut [f64], f: Format) -> u64 {
        let mut flushed = 0;
        for x in xs.iter_mut() {
            let rounded = f64_to_format_value(*x, f);
            flushed += u64::from(*x != 0.0 && rounded == 0.0);
            *x = rounded;
        }
        flushed
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

const F64_ABS_MASK: u64 = !(1 << 63);
const F64_INF_BITS: u64 = 0x7FF0_0000_0000_0000;
const F64_QUIET_BIT: u64 = 1 << 51;

/// Rounds an f64 to the nearest value of `format`, returned as an f64, directly from its
/// 53-bit significand.
///
/// The same two regimes as `f32_to_fp16_value`, with the constants of `format`:
///
/// - Normal results, `|x| >= 2^emin`: the result keeps the top `p` of the 53 significand
///   bits, so the low `53 - p` bits (45 for bf16, 42 for fp16) are rounded off in one
///   integer add on the bits: add just under half their weight plus the lowest kept bit
///   (so that an exact half carries only into an odd kept part: ties to even), then clear
///   them. A carry out of the significand increments the exponent, which is the correct
///   step to the next binade.
/// - Subnormal results, `|x| < 2^emin`: the spacing is fixed at `s = 2^(emin - p + 1)`,
///   fewer and fewer significand bits survive. Adding `c = 2^52 * s` puts `|x|` in
///   `[c, 2c)`, where f64's spacing is exactly `s`, so the (single, correctly rounded) f64
///   addition rounds `|x|` to a multiple of `s` with ties to even (`c` is an even multiple);
///   subtracting `c` is exact. f64 subnormals and zeros need no case: they land on zero.
///
/// Then anything above `max_finite` becomes infinity. Rounding as if the exponent were
/// unbounded and mapping anything above `max_finite` to infinity is exactly IEEE overflow
/// for round to nearest: the threshold `max_finite + ulp/2` is a tie whose even neighbour
/// is `2^(emax+1)`. Both regimes are computed and merged with selects, so no branch depends
/// on the data; with `format` a constant (as in the slice loops) everything folds.
///
/// Rounding directly matters: going through f32 first would round the significand to 24
/// bits, which can land exactly on a midpoint of the format (or move off one), and the
/// second rounding then breaks the tie the wrong way.
#[inline(always)]
fn f64_to_format_value(x: f64, format: Format) -> f64 {
    let dropped_bits = 53 - format.precision_bits();
    let dropped_mask = (1u64 << dropped_bits) - 1;
    let bits = x.to_bits();
    let sign = bits & !F64_ABS_MASK;
    let abs = bits & F64_ABS_MASK;

    // No overflow: abs < 2^63 and we add less than 2^45.
    let lowest_kept = (abs >> dropped_bits) & 1;
    let normal = (abs + (dropped_mask >> 1) + lowest_kept) & !dropped_mask;
    let shifter = format.min_subnormal() * pow2(52);
    let subnormal = ((f64::from_bits(abs) + shifter) - shifter).to_bits();

    let magnitude = if abs < format.min_normal().to_bits() {
        subnormal
    } else {
        normal
    };
    let magnitude = if magnitude > format.max_finite().to_bits() {
        F64_INF_BITS
    } else {
        magnitude
    };
    // NaN: quiet it and keep only the payload bits the format has room for, so the result
    // is a NaN of the format (the one a hardware conversion would give).
    let nan = (abs | F64_QUIET_BIT) & !dropped_mask;
    let magnitude = if abs > F64_INF_BITS { nan } else { magnitude };
    f64::from_bits(sign | magnitude)
}

/// `2^e` for a normal f64 exponent `e`, built from the bits.
#[inline(always)]
const fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}
