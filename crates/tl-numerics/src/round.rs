//! Round-to-nearest-even of f32 and f64 values into a low-precision format.
//!
//! The result of every kernel here is the value IEEE 754 conversion to the format would
//! produce (round to nearest, ties to even, gradual underflow, overflow to ±inf — or to NaN
//! in E4M3, which has no infinities), returned in the input's own type. A saturating variant
//! of each kernel clamps overflow to ±`max_finite` instead. Three kernels do the work:
//!
//! - `f32_to_bf16_value`: bf16 is the top half of an f32, so rounding is one integer add
//!   on the bits. Branch-free, so slice loops auto-vectorize.
//! - `f32_to_narrow_value`, for fp16, E4M3 and E5M2, whose exponent range is narrower than
//!   f32's (f32 holds all their subnormals as normal numbers): an integer add on the bits
//!   in the format's normal range and a floating-point add of a "magic" constant in its
//!   subnormal range, merged by selects. Branch-free as well.
//! - `f64_to_format_value`: the same two regimes on the full 53-bit significand, for every
//!   format. An f64 must never be rounded through f32 first: the first rounding can land
//!   exactly on a midpoint of the format (or move off one), and the second rounding then
//!   breaks the tie the wrong way.
//!
//! All three first round as if the exponent had no upper bound, and then compare with the
//! largest finite value: anything above it has overflowed and is replaced by what the
//! conversion gives on overflow ([`Overflow`]). That single comparison is exactly IEEE
//! overflow, for the formats with and without infinities alike (see `f64_to_format_value`).
//!
//! The floating-point adds rely only on IEEE addition in the default round-to-nearest mode
//! (which Rust guarantees). They are also immune to flush-to-zero modes: their results are
//! multiples of the format's smallest subnormal, normal in f32/f64, and any input an FPU
//! would flush is far below half of that, so it rounds to zero either way.

use std::iter::Sum;
use std::mem::MaybeUninit;
use std::ops::{Add, AddAssign};

use crate::format::Format;

/// Evaluates `$body` with `$F` a constant equal to the format `$format`, one match arm per
/// format.
///
/// With the format a constant, an inlined kernel called with `$F` folds all its format
/// parameters (shifts, masks, thresholds) to immediates, and a loop around it is
/// straight-line code that the compiler vectorizes. Matching once, outside the loop, is
/// what keeps the slice functions fast.
macro_rules! with_format {
    ($format:expr, $F:ident => $body:expr) => {
        match $format {
            Format::Bf16 => {
                const $F: Format = Format::Bf16;
                $body
            }
            Format::Fp16 => {
                const $F: Format = Format::Fp16;
                $body
            }
            Format::E4M3 => {
                const $F: Format = Format::E4M3;
                $body
            }
            Format::E5M2 => {
                const $F: Format = Format::E5M2;
                $body
            }
        }
    };
}

/// A floating-point type whose values can be rounded into a [`Format`], keeping the type:
/// an f32 comes back as an f32, an f64 as an f64, each holding a value of the format.
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
/// // 500 is beyond E4M3's range: NaN (it has no infinity), or 448 when saturating.
/// assert!(500.0_f32.round_to(Format::E4M3).is_nan());
/// assert_eq!(500.0_f32.round_to_saturating(Format::E4M3), 448.0);
/// ```
pub trait Round: Copy {
    /// The value of format `f` nearest to `self`, ties to even.
    ///
    /// Values below the smallest normal round onto the format's subnormals, and ±0 keeps
    /// its sign. A value beyond the finite range — one whose rounding with an unbounded
    /// exponent lies above `max_finite`, that is from `max_finite` plus half an ulp on in
    /// the IEEE-style formats (65520 for fp16, 61440 for E5M2), and above 464 in E4M3 (464
    /// itself is a tie that goes to 448) — becomes ±inf, or NaN with its sign in E4M3, which
    /// has no infinity; so ±inf stays ±inf, and becomes NaN in E4M3. A NaN gives a quiet NaN
    /// with the same sign (in E4M3, whose only NaN has no payload, the default quiet NaN).
    fn round_to(self, f: Format) -> Self;

    /// The value of format `f` nearest to `self`, ties to even, with overflow clamped to
    /// ±`max_finite`: as [`round_to`](Round::round_to) wherever that gives a finite value or
    /// a NaN from a NaN, and ±`max_finite` for a value beyond the finite range (±inf
    /// included).
    ///
    /// This is the conversion fp8 training stores tensors with (as NVIDIA's Transformer
    /// Engine casts): a per-tensor scale puts the values near the top of the range, where a
    /// few outliers clipped to the largest value do far less harm than an inf or a NaN.
    fn round_to_saturating(self, f: Format) -> Self;

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

    /// Rounds every element of `xs` into format `f` with
    /// [`round_to_saturating`](Round::round_to_saturating), in place.
    ///
    /// The default calls `round_to_saturating` per element; `f32` and `f64` override it as
    /// they do [`round_slice_in_place`](Round::round_slice_in_place).
    fn round_slice_saturating_in_place(xs: &mut [Self], f: Format) {
        for x in xs.iter_mut() {
            *x = x.round_to_saturating(f);
        }
    }

    /// Rounds every element of `xs` into format `f` with
    /// [`round_to_saturating`](Round::round_to_saturating), in place, and counts the values
    /// that fell off either end of the range: those clamped to ±`max_finite` and the nonzero
    /// ones that became zero.
    fn round_slice_saturating_counting(xs: &mut [Self], f: Format) -> RangeCounts;

    /// Writes `rd_sat(x · scale)` in format `f` of every `x` of `src` to `dst`, and returns
    /// what the cast saw: the [`RangeCounts`] of the rounding (of the scaled values) and the
    /// largest magnitude of `src` itself, before scaling ([`ScaledCast`]).
    ///
    /// This is fp8 delayed scaling's whole cast in one pass over memory: the same bits as
    /// multiplying every element by `scale` (one IEEE product, no fused multiply-add),
    /// then [`round_slice_saturating_counting`](Round::round_slice_saturating_counting),
    /// then a fold of the magnitudes, which were three passes and an allocation.
    ///
    /// # Panics
    /// If the slices differ in length.
    fn scale_round_saturating_into(
        src: &[Self],
        scale: Self,
        dst: &mut [MaybeUninit<Self>],
        f: Format,
    ) -> ScaledCast;
}

/// What a scaled saturating cast saw of a slice
/// ([`scale_round_saturating_into`](crate::scale_round_saturating_into)): how many scaled
/// values fell off the ends of the range, and the largest magnitude before scaling, which
/// is what fp8 delayed scaling records as the tensor's amax.
///
/// Both are order-free, so the casts of separate blocks of one tensor, done in any order
/// or on any thread, [`merge`](ScaledCast::merge) into exactly the cast of the whole.
///
/// # Examples
///
/// ```
/// use tl_numerics::{RangeCounts, ScaledCast};
///
/// let a = ScaledCast { counts: RangeCounts { saturated: 1, flushed: 0 }, amax: 3.0 };
/// let b = ScaledCast { counts: RangeCounts { saturated: 0, flushed: 2 }, amax: 5.0 };
/// assert_eq!(a.merge(b), ScaledCast { counts: RangeCounts { saturated: 1, flushed: 2 }, amax: 5.0 });
/// let nan = ScaledCast { amax: f32::NAN, ..ScaledCast::default() };
/// assert!(a.merge(nan).amax.is_nan());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ScaledCast {
    /// The scaled values clamped to ±`max_finite`, and the nonzero scaled values flushed to
    /// zero, as [`round_slice_saturating_counting`](Round::round_slice_saturating_counting)
    /// counts them.
    pub counts: RangeCounts,
    /// The largest `|x|` of the unscaled values, as an f32 (an f64 rounded to nearest), 0
    /// for an empty slice; `f32::NAN` (the default quiet NaN) when any value is a NaN.
    pub amax: f32,
}

impl ScaledCast {
    /// The cast of two blocks together: counts added, the larger amax, and a NaN amax from
    /// either side poisoning the result (as fp8's amax fold always has).
    #[must_use]
    pub fn merge(self, other: ScaledCast) -> ScaledCast {
        let amax = if self.amax.is_nan() || other.amax.is_nan() {
            f32::NAN
        } else {
            self.amax.max(other.amax)
        };
        ScaledCast {
            counts: self.counts + other.counts,
            amax,
        }
    }
}

/// How many values of a slice a rounding moved off the ends of the format's range, as
/// counted by [`round_slice_saturating_counting`](crate::round_slice_saturating_counting).
///
/// Both counts are what fp8 training watches per tensor: many saturated values mean the
/// tensor's scale is too large, many flushed ones that it is too small. Counts of separate
/// slices (blocks of one tensor) add up with `+` or [`Sum`].
///
/// # Examples
///
/// ```
/// use tl_numerics::RangeCounts;
///
/// let blocks = [RangeCounts { saturated: 2, flushed: 0 }, RangeCounts { saturated: 1, flushed: 5 }];
/// let total: RangeCounts = blocks.into_iter().sum();
/// assert_eq!(total, RangeCounts { saturated: 3, flushed: 5 });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RangeCounts {
    /// The values beyond the finite range, clamped to ±`max_finite`: ±inf, and the values
    /// whose rounding with an unbounded exponent lies above `max_finite` (the ones plain
    /// rounding turns into ±inf, or NaN in E4M3). A value that rounds down onto
    /// `max_finite` (449 in E4M3) is not counted, nor is a NaN.
    pub saturated: u64,
    /// The nonzero values that became zero (of either sign): those below half of the
    /// format's smallest subnormal, and half of it exactly (a tie, to the even zero).
    pub flushed: u64,
}

impl Add for RangeCounts {
    type Output = RangeCounts;

    fn add(self, other: RangeCounts) -> RangeCounts {
        RangeCounts {
            saturated: self.saturated + other.saturated,
            flushed: self.flushed + other.flushed,
        }
    }
}

impl AddAssign for RangeCounts {
    fn add_assign(&mut self, other: RangeCounts) {
        *self = *self + other;
    }
}

impl Sum for RangeCounts {
    fn sum<I: Iterator<Item = RangeCounts>>(counts: I) -> RangeCounts {
        counts.fold(RangeCounts::default(), Add::add)
    }
}

/// What a rounding gives for a value beyond the format's finite range: one that is ±inf,
/// or whose rounding to nearest with an unbounded exponent lies above `max_finite`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Overflow {
    /// What the format's own conversion gives, with the sign of the input: ±inf, or NaN in
    /// a format without infinities (E4M3).
    Format,
    /// ±`max_finite`, with the sign of the input.
    Saturate,
}

/// The widest build of an [`f32_slices`] loop this CPU runs, called with `$args`: its
/// AVX-512F build, else its AVX2 build, else the portable one (every build gives the same
/// bits).
macro_rules! widest {
    ($portable:ident, $avx2:ident, $avx512:ident, ($($arg:expr),*)) => {{
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            return unsafe { f32_slices::$avx512($($arg),*) };
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { f32_slices::$avx2($($arg),*) };
        }
        f32_slices::$portable($($arg),*)
    }};
}

impl Round for f32 {
    #[inline]
    fn round_to(self, f: Format) -> f32 {
        with_format!(f, F => f32_to_format_value(self, F, Overflow::Format).0)
    }

    #[inline]
    fn round_to_saturating(self, f: Format) -> f32 {
        with_format!(f, F => f32_to_format_value(self, F, Overflow::Saturate).0)
    }

    fn round_slice_in_place(xs: &mut [f32], f: Format) {
        widest!(in_place, in_place_avx2, in_place_avx512, (xs, f));
    }

    fn round_slice_into(src: &[f32], dst: &mut [MaybeUninit<f32>], f: Format) {
        assert_eq!(src.len(), dst.len(), "round_slice_into: lengths differ");
        widest!(into, into_avx2, into_avx512, (src, dst, f));
    }

    fn round_slice_counting_flushes(xs: &mut [f32], f: Format) -> u64 {
        widest!(counting, counting_avx2, counting_avx512, (xs, f))
    }

    fn round_slice_saturating_in_place(xs: &mut [f32], f: Format) {
        widest!(
            saturating_in_place,
            saturating_in_place_avx2,
            saturating_in_place_avx512,
            (xs, f)
        );
    }

    fn round_slice_saturating_counting(xs: &mut [f32], f: Format) -> RangeCounts {
        widest!(
            saturating_counting,
            saturating_counting_avx2,
            saturating_counting_avx512,
            (xs, f)
        )
    }

    fn scale_round_saturating_into(
        src: &[f32],
        scale: f32,
        dst: &mut [MaybeUninit<f32>],
        f: Format,
    ) -> ScaledCast {
        assert_eq!(
            src.len(),
            dst.len(),
            "scale_round_saturating_into: lengths differ"
        );
        widest!(
            scaled_saturating_into,
            scaled_saturating_into_avx2,
            scaled_saturating_into_avx512,
            (src, scale, dst, f)
        )
    }
}

/// The f32 slice loops, each written once and compiled three times: for any x86-64 (SSE2,
/// four lanes), for AVX2 (eight lanes) and for AVX-512F (sixteen lanes), the widest the CPU
/// has chosen at run time. The kernels are pure integer and IEEE operations without fused
/// multiply-adds, so every build gives the same bits. Sixteen lanes round a capstone
/// activation (5 MiB, in cache) 20–40% faster than eight on an AMD EPYC of the Zen 4 class
/// (`cargo bench -p tl-numerics --bench round -- round_activation`).
mod f32_slices {
    use std::mem::MaybeUninit;

    use super::{
        F32_ABS_MASK, F32_INF_BITS, Overflow, RangeCounts, ScaledCast, f32_to_format_value,
    };
    use crate::format::Format;

    // Each loop matches the format once, outside (`with_format!`): with the kernel fixed,
    // the body is straight-line code and the compiler vectorizes it.

    #[inline(always)]
    pub(super) fn in_place(xs: &mut [f32], f: Format) {
        with_format!(f, F => xs
            .iter_mut()
            .for_each(|x| *x = f32_to_format_value(*x, F, Overflow::Format).0))
    }

    #[inline(always)]
    pub(super) fn into(src: &[f32], dst: &mut [MaybeUninit<f32>], f: Format) {
        let pairs = dst.iter_mut().zip(src);
        with_format!(f, F => pairs.for_each(|(out, &x)| {
            out.write(f32_to_format_value(x, F, Overflow::Format).0);
        }))
    }

    #[inline(always)]
    pub(super) fn counting(xs: &mut [f32], f: Format) -> u64 {
        with_format!(f, F => counting_with(xs, |x| f32_to_format_value(x, F, Overflow::Format).0))
    }

    #[inline(always)]
    pub(super) fn saturating_in_place(xs: &mut [f32], f: Format) {
        with_format!(f, F => xs
            .iter_mut()
            .for_each(|x| *x = f32_to_format_value(*x, F, Overflow::Saturate).0))
    }

    #[inline(always)]
    pub(super) fn saturating_counting(xs: &mut [f32], f: Format) -> RangeCounts {
        with_format!(f, F => saturating_counting_with(xs, |x| {
            f32_to_format_value(x, F, Overflow::Saturate)
        }))
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

    /// As [`counting_with`], with a second lane sum for the values the kernel reports
    /// beyond the finite range (the saturated ones).
    #[inline(always)]
    fn saturating_counting_with(xs: &mut [f32], round: impl Fn(f32) -> (f32, bool)) -> RangeCounts {
        xs.chunks_mut(1 << 30)
            .map(|piece| {
                let (saturated, flushed) = piece.iter_mut().fold((0_u32, 0_u32), |(s, n), x| {
                    let (rounded, beyond) = round(*x);
                    let was_flushed = (*x != 0.0) & (rounded == 0.0);
                    *x = rounded;
                    (s + u32::from(beyond), n + u32::from(was_flushed))
                });
                RangeCounts {
                    saturated: u64::from(saturated),
                    flushed: u64::from(flushed),
                }
            })
            .sum()
    }

    #[inline(always)]
    pub(super) fn scaled_saturating_into(
        src: &[f32],
        scale: f32,
        dst: &mut [MaybeUninit<f32>],
        f: Format,
    ) -> ScaledCast {
        with_format!(f, F => scaled_with(src, scale, dst, |x| {
            f32_to_format_value(x, F, Overflow::Saturate)
        }))
    }

    /// One pass: scale, round, write, count as [`saturating_counting_with`] does, and keep
    /// the largest magnitude of the input as the largest of its magnitude *bits*.
    ///
    /// For f32s that are not NaN, the order of the bits with the sign cleared is the order
    /// of the magnitudes, and every NaN's bits lie above infinity's; so an unsigned integer
    /// max, which vectorizes (a float max with NaN propagation does not), gives the amax,
    /// or a NaN's bits when there was one. The float fold it replaces (`0` to start, NaN
    /// poisoning) gives exactly this: `+0` for zeros of either sign, the largest magnitude,
    /// or the default NaN.
    #[inline(always)]
    fn scaled_with(
        src: &[f32],
        scale: f32,
        dst: &mut [MaybeUninit<f32>],
        round: impl Fn(f32) -> (f32, bool),
    ) -> ScaledCast {
        let (mut counts, mut amax_bits) = (RangeCounts::default(), 0_u32);
        for (src, dst) in src.chunks(1 << 30).zip(dst.chunks_mut(1 << 30)) {
            let (saturated, flushed, largest) = src.iter().zip(dst.iter_mut()).fold(
                (0_u32, 0_u32, 0_u32),
                |(s, n, m), (&x, out)| {
                    let scaled = x * scale;
                    let (rounded, beyond) = round(scaled);
                    let was_flushed = (scaled != 0.0) & (rounded == 0.0);
                    out.write(rounded);
                    (
                        s + u32::from(beyond),
                        n + u32::from(was_flushed),
                        m.max(x.to_bits() & F32_ABS_MASK),
                    )
                },
            );
            counts += RangeCounts {
                saturated: u64::from(saturated),
                flushed: u64::from(flushed),
            };
            amax_bits = amax_bits.max(largest);
        }
        let amax = if amax_bits > F32_INF_BITS {
            f32::NAN
        } else {
            f32::from_bits(amax_bits)
        };
        ScaledCast { counts, amax }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn scaled_saturating_into_avx2(
        src: &[f32],
        scale: f32,
        dst: &mut [MaybeUninit<f32>],
        f: Format,
    ) -> ScaledCast {
        scaled_saturating_into(src, scale, dst, f)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scaled_saturating_into_avx512(
        src: &[f32],
        scale: f32,
        dst: &mut [MaybeUninit<f32>],
        f: Format,
    ) -> ScaledCast {
        scaled_saturating_into(src, scale, dst, f)
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

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn saturating_in_place_avx2(xs: &mut [f32], f: Format) {
        saturating_in_place(xs, f);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn saturating_counting_avx2(xs: &mut [f32], f: Format) -> RangeCounts {
        saturating_counting(xs, f)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn in_place_avx512(xs: &mut [f32], f: Format) {
        in_place(xs, f);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn into_avx512(src: &[f32], dst: &mut [MaybeUninit<f32>], f: Format) {
        into(src, dst, f);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn counting_avx512(xs: &mut [f32], f: Format) -> u64 {
        counting(xs, f)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn saturating_in_place_avx512(xs: &mut [f32], f: Format) {
        saturating_in_place(xs, f);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn saturating_counting_avx512(xs: &mut [f32], f: Format) -> RangeCounts {
        saturating_counting(xs, f)
    }

    #[cfg(all(test, target_arch = "x86_64"))]
    mod tests {
        use super::*;

        /// Every 4099th f32 pattern (a stride coprime with the layout's fields, so it meets
        /// every exponent, both signs, NaNs and subnormals), with some zeros, both
        /// infinities and f32's largest values (beyond even bf16's range).
        fn sweep() -> Vec<f32> {
            (0..=u32::MAX)
                .step_by(4099)
                .map(f32::from_bits)
                .chain([0.0, -0.0, 1e-30, -1e-30])
                .chain([f32::INFINITY, f32::NEG_INFINITY, f32::MAX, -f32::MAX])
                .collect()
        }

        fn bits(xs: &[f32]) -> Vec<u32> {
            xs.iter().map(|x| x.to_bits()).collect()
        }

        /// A build of the loops: AVX2 (eight lanes) or AVX-512F (sixteen).
        #[derive(Clone, Copy, Debug)]
        enum Wide {
            Avx2,
            Avx512,
        }

        impl Wide {
            /// The builds this CPU can run.
            fn available() -> Vec<Wide> {
                let mut builds = Vec::new();
                if std::arch::is_x86_feature_detected!("avx2") {
                    builds.push(Wide::Avx2);
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    builds.push(Wide::Avx512);
                }
                builds
            }

            // SAFETY (these methods): a `Wide` comes from `available`, which checked the
            // CPU's support for its build.

            fn in_place(self, xs: &mut [f32], f: Format) {
                match self {
                    Wide::Avx2 => unsafe { in_place_avx2(xs, f) },
                    Wide::Avx512 => unsafe { in_place_avx512(xs, f) },
                }
            }

            fn into(self, src: &[f32], dst: &mut [MaybeUninit<f32>], f: Format) {
                match self {
                    Wide::Avx2 => unsafe { into_avx2(src, dst, f) },
                    Wide::Avx512 => unsafe { into_avx512(src, dst, f) },
                }
            }

            fn counting(self, xs: &mut [f32], f: Format) -> u64 {
                match self {
                    Wide::Avx2 => unsafe { counting_avx2(xs, f) },
                    Wide::Avx512 => unsafe { counting_avx512(xs, f) },
                }
            }

            fn saturating_in_place(self, xs: &mut [f32], f: Format) {
                match self {
                    Wide::Avx2 => unsafe { saturating_in_place_avx2(xs, f) },
                    Wide::Avx512 => unsafe { saturating_in_place_avx512(xs, f) },
                }
            }

            fn saturating_counting(self, xs: &mut [f32], f: Format) -> RangeCounts {
                match self {
                    Wide::Avx2 => unsafe { saturating_counting_avx2(xs, f) },
                    Wide::Avx512 => unsafe { saturating_counting_avx512(xs, f) },
                }
            }
        }

        /// The rounded copy made by `into`, portable or by a wide build.
        fn copied(src: &[f32], f: Format, build: Option<Wide>) -> Vec<f32> {
            let mut out = vec![MaybeUninit::uninit(); src.len()];
            match build {
                Some(build) => build.into(src, &mut out, f),
                None => into(src, &mut out, f),
            }
            // SAFETY: every build writes every element.
            out.iter().map(|x| unsafe { x.assume_init() }).collect()
        }

        #[test]
        fn every_build_of_every_loop_gives_the_same_bits() {
            let builds = Wide::available();
            if builds.is_empty() {
                return; // only the portable build runs on this CPU
            }
            let src = sweep();
            for f in Format::ALL {
                let mut portable = src.clone();
                in_place(&mut portable, f);
                assert_eq!(bits(&copied(&src, f, None)), bits(&portable), "{f} into");
                let mut flushed_portable = src.clone();
                let flushed = counting(&mut flushed_portable, f);
                assert_eq!(bits(&flushed_portable), bits(&portable), "{f} counting");
                let expected_flushed = src
                    .iter()
                    .zip(&portable)
                    .filter(|&(&x, &r)| x != 0.0 && r == 0.0)
                    .count() as u64;
                assert!(expected_flushed > 0, "{f}: the sweep flushes some values");
                assert_eq!(flushed, expected_flushed, "{f} count");

                let mut saturated = src.clone();
                saturating_in_place(&mut saturated, f);
                let mut counted = src.clone();
                let counts = saturating_counting(&mut counted, f);
                assert_eq!(bits(&counted), bits(&saturated), "{f} saturating counting");
                // Saturation changes exactly the values plain rounding sends beyond the
                // finite range (to ±inf, or NaN from a non-NaN in E4M3), and nothing else.
                let max = f.max_finite() as f32;
                let mut expected = RangeCounts {
                    saturated: 0,
                    flushed: expected_flushed,
                };
                for ((&x, &plain), &clamped) in src.iter().zip(&portable).zip(&saturated) {
                    if !x.is_nan() && (plain.is_infinite() || plain.is_nan()) {
                        expected.saturated += 1;
                        assert_eq!(clamped.to_bits(), max.copysign(x).to_bits(), "{f} {x:e}");
                    } else {
                        assert_eq!(clamped.to_bits(), plain.to_bits(), "{f} {x:e}");
                    }
                }
                assert!(
                    expected.saturated > 0,
                    "{f}: the sweep saturates some values"
                );
                assert_eq!(counts, expected, "{f} counts");

                for &build in &builds {
                    let mut wide = src.clone();
                    build.in_place(&mut wide, f);
                    assert_eq!(bits(&wide), bits(&portable), "{f} in place, {build:?}");
                    let copy = copied(&src, f, Some(build));
                    assert_eq!(bits(&copy), bits(&portable), "{f} into, {build:?}");
                    let mut wide = src.clone();
                    let wide_flushed = build.counting(&mut wide, f);
                    assert_eq!(bits(&wide), bits(&portable), "{f} counting, {build:?}");
                    assert_eq!(wide_flushed, expected_flushed, "{f} count, {build:?}");
                    let mut wide = src.clone();
                    build.saturating_in_place(&mut wide, f);
                    assert_eq!(bits(&wide), bits(&saturated), "{f} saturating, {build:?}");
                    let mut wide = src.clone();
                    let wide_counts = build.saturating_counting(&mut wide, f);
                    assert_eq!(
                        bits(&wide),
                        bits(&saturated),
                        "{f} saturating counting, {build:?}"
                    );
                    assert_eq!(wide_counts, expected, "{f} counts, {build:?}");
                }
            }
        }

        /// fp8's cast as it was before the fused loop, kept as the oracle: scale into a new
        /// vector, round it with the saturating counting loop, fold the amax of the input.
        fn scaled_reference(src: &[f32], scale: f32, f: Format) -> (Vec<f32>, ScaledCast) {
            let mut scaled: Vec<f32> = src.iter().map(|&v| v * scale).collect();
            let counts = saturating_counting(&mut scaled, f);
            let amax = src.iter().fold(0.0f32, |m, &v| {
                let a = v.abs();
                if a.is_nan() || m.is_nan() {
                    f32::NAN
                } else {
                    m.max(a)
                }
            });
            (scaled, ScaledCast { counts, amax })
        }

        /// A build of the fused cast: portable, AVX2 or AVX-512F.
        #[derive(Clone, Copy, Debug)]
        enum Build {
            Portable,
            Avx2,
            Avx512,
        }

        fn fused(src: &[f32], scale: f32, f: Format, build: Build) -> (Vec<f32>, ScaledCast) {
            let mut out = vec![MaybeUninit::uninit(); src.len()];
            let cast = match build {
                Build::Portable => scaled_saturating_into(src, scale, &mut out, f),
                // SAFETY: the caller checked AVX2.
                Build::Avx2 => unsafe { scaled_saturating_into_avx2(src, scale, &mut out, f) },
                // SAFETY: the caller checked AVX-512F.
                Build::Avx512 => unsafe { scaled_saturating_into_avx512(src, scale, &mut out, f) },
            };
            // SAFETY: every build writes every element.
            let out = out.iter().map(|x| unsafe { x.assume_init() }).collect();
            (out, cast)
        }

        /// The builds this CPU can run, the portable one always; a build it cannot run is
        /// said on stderr, so that a pass never hides an untested path.
        fn builds() -> Vec<Build> {
            let mut builds = vec![Build::Portable];
            for (build, feature, present) in [
                (
                    Build::Avx2,
                    "avx2",
                    std::arch::is_x86_feature_detected!("avx2"),
                ),
                (
                    Build::Avx512,
                    "avx512f",
                    std::arch::is_x86_feature_detected!("avx512f"),
                ),
            ] {
                if present {
                    builds.push(build);
                } else {
                    eprintln!("this CPU has no {feature}: its build of the fp8 cast is untested");
                }
            }
            builds
        }

        /// xorshift64*: a reproducible stream without a dependency.
        struct Rng(u64);

        impl Rng {
            fn next(&mut self) -> u64 {
                self.0 ^= self.0 >> 12;
                self.0 ^= self.0 << 25;
                self.0 ^= self.0 >> 27;
                self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
            }

            fn below(&mut self, n: u64) -> u64 {
                self.next() % n
            }
        }

        /// `n` values of every kind the cast meets: ordinary ones near the scaled range, tiny
        /// ones that flush, f32 subnormals, huge ones that saturate, ±0, ±inf, NaNs of
        /// either sign with payloads, and arbitrary bit patterns; `kinds` is 7 for finite
        /// values only, 8 for infinities too, 10 for NaNs as well.
        fn values(rng: &mut Rng, n: usize, kinds: u64) -> Vec<f32> {
            (0..n)
                .map(|_| {
                    let sign = if rng.below(2) == 0 { 1.0 } else { -1.0 };
                    let unit = (rng.below(1 << 24) as f32) / (1 << 24) as f32;
                    match rng.below(kinds) {
                        0 | 1 => sign * unit * 4.0,
                        2 => sign * unit * 1e-6,
                        3 => sign * f32::from_bits(rng.below(0x0080_0000) as u32),
                        4 => sign * (1.0 + unit) * 1e6,
                        5 => 0.0 * sign,
                        6 => f32::from_bits(rng.next() as u32 & 0x7F7F_FFFF) * sign,
                        7 => f32::INFINITY * sign,
                        8 => f32::from_bits(0x7FC0_0000 | rng.below(1 << 22) as u32) * sign,
                        _ => f32::from_bits(0x7F80_0001 | rng.below(1 << 22) as u32),
                    }
                })
                .collect()
        }

        #[test]
        fn the_fused_scaled_cast_is_the_three_passes_it_replaces_bit_for_bit() {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
            let builds = builds();
            let scales = [
                1.0,
                448.0 / 3.7,
                2f32.powi(-20),
                2f32.powi(40),
                57344.0,
                0.3,
            ];
            let (mut nans, mut infinite, mut saturated, mut flushed) = (0, 0, 0, 0);
            for round in 0..400 {
                // Every small length (lane remainders of every build), then random ones.
                let n = if round < 70 {
                    round
                } else {
                    rng.below(5000) as usize
                };
                let src = values(&mut rng, n, [7, 8, 10][round % 3]);
                let scale = scales[round % scales.len()];
                for f in [Format::E4M3, Format::E5M2] {
                    let (expected, expected_cast) = scaled_reference(&src, scale, f);
                    for &build in &builds {
                        let (got, cast) = fused(&src, scale, f, build);
                        assert_eq!(bits(&got), bits(&expected), "{f} {build:?} n={n}");
                        assert_eq!(cast.counts, expected_cast.counts, "{f} {build:?} n={n}");
                        assert_eq!(
                            cast.amax.to_bits(),
                            expected_cast.amax.to_bits(),
                            "{f} {build:?} n={n}: amax"
                        );
                    }
                    nans += usize::from(expected_cast.amax.is_nan());
                    infinite += usize::from(expected_cast.amax.is_infinite());
                    saturated += expected_cast.counts.saturated;
                    flushed += expected_cast.counts.flushed;
                }
            }
            // The stream met every case the kernels tell apart.
            assert!(nans > 0 && infinite > 0 && saturated > 0 && flushed > 0);
            // The sweep of bit patterns too, on every format with saturation.
            let src = sweep();
            for f in Format::ALL {
                let (expected, expected_cast) = scaled_reference(&src, 3.0, f);
                for &build in &builds {
                    let (got, cast) = fused(&src, 3.0, f, build);
                    assert_eq!(bits(&got), bits(&expected), "{f} {build:?} sweep");
                    assert_eq!(cast.counts, expected_cast.counts, "{f} {build:?} sweep");
                    assert_eq!(cast.amax.to_bits(), expected_cast.amax.to_bits());
                }
            }
        }
    }
}

impl Round for f64 {
    #[inline]
    fn round_to(self, f: Format) -> f64 {
        with_format!(f, F => f64_to_format_value(self, F, Overflow::Format).0)
    }

    #[inline]
    fn round_to_saturating(self, f: Format) -> f64 {
        with_format!(f, F => f64_to_format_value(self, F, Overflow::Saturate).0)
    }

    fn round_slice_in_place(xs: &mut [f64], f: Format) {
        with_format!(f, F => xs
            .iter_mut()
            .for_each(|x| *x = f64_to_format_value(*x, F, Overflow::Format).0))
    }

    fn round_slice_into(src: &[f64], dst: &mut [MaybeUninit<f64>], f: Format) {
        assert_eq!(src.len(), dst.len(), "round_slice_into: lengths differ");
        let pairs = dst.iter_mut().zip(src);
        with_format!(f, F => pairs.for_each(|(out, &x)| {
            out.write(f64_to_format_value(x, F, Overflow::Format).0);
        }))
    }

    fn round_slice_counting_flushes(xs: &mut [f64], f: Format) -> u64 {
        with_format!(f, F => xs.iter_mut().fold(0, |flushed, x| {
            let rounded = f64_to_format_value(*x, F, Overflow::Format).0;
            let was_flushed = *x != 0.0 && rounded == 0.0;
            *x = rounded;
            flushed + u64::from(was_flushed)
        }))
    }

    fn round_slice_saturating_in_place(xs: &mut [f64], f: Format) {
        with_format!(f, F => xs
            .iter_mut()
            .for_each(|x| *x = f64_to_format_value(*x, F, Overflow::Saturate).0))
    }

    fn round_slice_saturating_counting(xs: &mut [f64], f: Format) -> RangeCounts {
        with_format!(f, F => xs.iter_mut().fold(RangeCounts::default(), |counts, x| {
            let (rounded, beyond) = f64_to_format_value(*x, F, Overflow::Saturate);
            let was_flushed = *x != 0.0 && rounded == 0.0;
            *x = rounded;
            RangeCounts {
                saturated: counts.saturated + u64::from(beyond),
                flushed: counts.flushed + u64::from(was_flushed),
            }
        }))
    }

    /// The amax is kept as the largest magnitude bits, as the f32 loop does (see
    /// `f32_slices::scaled_with`), and rounded to f32 once at the end: rounding is monotone,
    /// so that is the largest of the magnitudes rounded one by one.
    fn scale_round_saturating_into(
        src: &[f64],
        scale: f64,
        dst: &mut [MaybeUninit<f64>],
        f: Format,
    ) -> ScaledCast {
        assert_eq!(
            src.len(),
            dst.len(),
            "scale_round_saturating_into: lengths differ"
        );
        let start = (RangeCounts::default(), 0_u64);
        let (counts, amax_bits) = with_format!(f, F => src.iter().zip(dst.iter_mut()).fold(
            start,
            |(counts, m), (&x, out)| {
                let scaled = x * scale;
                let (rounded, beyond) = f64_to_format_value(scaled, F, Overflow::Saturate);
                let was_flushed = scaled != 0.0 && rounded == 0.0;
                out.write(rounded);
                let counts = RangeCounts {
                    saturated: counts.saturated + u64::from(beyond),
                    flushed: counts.flushed + u64::from(was_flushed),
                };
                (counts, m.max(x.to_bits() & F64_ABS_MASK))
            },
        ));
        let amax = if amax_bits > F64_INF_BITS {
            f32::NAN
        } else {
            f64::from_bits(amax_bits) as f32
        };
        ScaledCast { counts, amax }
    }
}

const F32_ABS_MASK: u32 = 0x7FFF_FFFF;
const F32_INF_BITS: u32 = 0x7F80_0000;
const F32_QUIET_BIT: u32 = 0x0040_0000;
/// The default quiet NaN (`f32::NAN`): the f32 form of E4M3's one NaN, which has no payload.
const F32_NAN_BITS: u32 = 0x7FC0_0000;

/// The f32 bits of an f64 that f32 holds exactly (as it does every parameter of fp16, E4M3
/// and E5M2).
#[inline(always)]
const fn f32_bits(x: f64) -> u32 {
    (x as f32).to_bits()
}

/// Rounds an f32 into `format`, returned as an f32, with what becomes of a value beyond the
/// finite range chosen by `overflow`; also says whether `x` was beyond that range (±inf, or
/// a rounding above `max_finite`), for the saturating loops' count.
///
/// Inlined with `format` and `overflow` constants (as the slice loops call it), the matches
/// fold away and so does the flag where it is unused.
#[inline(always)]
fn f32_to_format_value(x: f32, format: Format, overflow: Overflow) -> (f32, bool) {
    match format {
        Format::Bf16 => f32_to_bf16(x, overflow),
        Format::Fp16 | Format::E4M3 | Format::E5M2 => f32_to_narrow_value(x, format, overflow),
    }
}

/// `f32_to_bf16_value`, and for [`Overflow::Saturate`] ±inf results replaced by bf16's
/// largest finite value: the carry of the rounding reaches the infinity pattern exactly for
/// the values beyond the finite range, and ±inf stays ±inf, so an infinite result is the
/// "beyond" case (a NaN rounds to a NaN, whose quiet bit keeps it off the infinity
/// pattern).
#[inline(always)]
fn f32_to_bf16(x: f32, overflow: Overflow) -> (f32, bool) {
    /// bf16's largest finite value `(2 - 2^-7) * 2^127` as f32 bits.
    const BF16_MAX_FINITE_BITS: u32 = 0x7F7F_0000;
    let rounded = f32_to_bf16_value(x).to_bits();
    let beyond = rounded & F32_ABS_MASK == F32_INF_BITS;
    let clamped = (rounded & !F32_ABS_MASK) | BF16_MAX_FINITE_BITS;
    let saturate = overflow == Overflow::Saturate;
    let result = if beyond & saturate { clamped } else { rounded };
    (f32::from_bits(result), beyond)
}

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

/// Rounds an f32 to the nearest value of `format` (fp16, E4M3 or E5M2), returned as an
/// f32, with the result beyond the finite range chosen by `overflow`; also says whether `x`
/// was beyond that range.
///
/// These formats keep `p <= 11` significant bits of f32's 24 and have a narrower exponent
/// range, so f32 holds every one of their values, subnormals included, as a normal f32.
///
/// - In the format's normal range, `|x| >= 2^emin`, the `24 - p` low fraction bits (13 for
///   fp16, 20 for E4M3, 21 for E5M2) are rounded off with the same carry trick as bf16: add
///   just under half their weight plus the lowest kept bit, clear them.
/// - Below `2^emin` the spacing is fixed at the smallest subnormal `s = 2^(emin - p + 1)`,
///   whatever the exponent of `x`: adding `c = 2^23 * s` (0.5 for fp16, `2^14` for E4M3,
///   `2^7` for E5M2) puts `|x|` in `[c, 2c)`, where f32's own spacing is `s`, so the f32
///   addition itself rounds to a multiple of `s` with ties to even (`c` is an even
///   multiple), and subtracting `c` back is exact.
///
/// Both are computed as if the exponent had no upper bound; a result above `max_finite`
/// (65504, 448, 57344) means `x` overflowed, and its magnitude is replaced by infinity,
/// NaN (E4M3) or `max_finite` (saturating). For E4M3 this happens above 464: between 448
/// (`1.110₂ * 2^8`, even) and the next value with an unbounded exponent, 480 (`1.111₂ *
/// 2^8`, the NaN pattern's place), the tie 464 goes to 448. All paths are computed and
/// merged with selects so that loops vectorize.
#[inline(always)]
fn f32_to_narrow_value(x: f32, format: Format, overflow: Overflow) -> (f32, bool) {
    let dropped_bits = 24 - format.precision_bits();
    let dropped_mask = (1u32 << dropped_bits) - 1;
    let max_finite = f32_bits(format.max_finite());
    let bits = x.to_bits();
    let sign = bits & !F32_ABS_MASK;
    let abs = bits & F32_ABS_MASK;
    // No overflow: abs <= 0x7FFF_FFFF and we add at most 2^20 (E5M2 drops 21 bits).
    let normal = (abs + (dropped_mask >> 1) + ((abs >> dropped_bits) & 1)) & !dropped_mask;
    let shifter = (format.min_subnormal() * pow2(23)) as f32;
    let subnormal = ((f32::from_bits(abs) + shifter) - shifter).to_bits();
    let magnitude = if abs < f32_bits(format.min_normal()) {
        subnormal
    } else {
        normal
    };
    let overflowed = magnitude > max_finite;
    let magnitude = if overflowed {
        match overflow {
            Overflow::Saturate => max_finite,
            Overflow::Format if format.has_infinity() => F32_INF_BITS,
            Overflow::Format => F32_NAN_BITS,
        }
    } else {
        magnitude
    };
    // NaN: quiet, and only the payload bits the format has room for (none in E4M3).
    let is_nan = abs > F32_INF_BITS;
    let nan = if format.has_infinity() {
        (abs | F32_QUIET_BIT) & !dropped_mask
    } else {
        F32_NAN_BITS
    };
    let magnitude = if is_nan { nan } else { magnitude };
    (f32::from_bits(sign | magnitude), overflowed & !is_nan)
}

const F64_ABS_MASK: u64 = !(1 << 63);
const F64_INF_BITS: u64 = 0x7FF0_0000_0000_0000;
const F64_QUIET_BIT: u64 = 1 << 51;
/// The default quiet NaN (`f64::NAN`): the f64 form of E4M3's one NaN.
const F64_NAN_BITS: u64 = 0x7FF8_0000_0000_0000;

/// Rounds an f64 to the nearest value of `format`, returned as an f64, directly from its
/// 53-bit significand, with the result beyond the finite range chosen by `overflow`; also
/// says whether `x` was beyond that range.
///
/// The same two regimes as `f32_to_narrow_value`, with the constants of `format`:
///
/// - Normal results, `|x| >= 2^emin`: the result keeps the top `p` of the 53 significand
///   bits, so the low `53 - p` bits (45 for bf16, 42 for fp16, 49 for E4M3, 50 for E5M2)
///   are rounded off in one integer add on the bits: add just under half their weight plus
///   the lowest kept bit (so that an exact half carries only into an odd kept part: ties to
///   even), then clear them. A carry out of the significand increments the exponent, which
///   is the correct step to the next binade.
/// - Subnormal results, `|x| < 2^emin`: the spacing is fixed at `s = 2^(emin - p + 1)`,
///   fewer and fewer significand bits survive. Adding `c = 2^52 * s` puts `|x|` in
///   `[c, 2c)`, where f64's spacing is exactly `s`, so the (single, correctly rounded) f64
///   addition rounds `|x|` to a multiple of `s` with ties to even (`c` is an even multiple);
///   subtracting `c` is exact. f64 subnormals and zeros need no case: they land on zero.
///
/// Then anything above `max_finite` has overflowed and becomes ±inf, NaN (E4M3) or
/// ±`max_finite` (saturating). Rounding as if the exponent were unbounded and comparing
/// with `max_finite` is exactly IEEE overflow for round to nearest: the values above
/// `max_finite` are those nearer to (or at the tie, evener than) its neighbour above. In
/// the IEEE-style formats that neighbour is `2^(emax+1)`, an even significand, so the
/// threshold `max_finite + ulp/2` overflows (65520 for fp16, 61440 for E5M2). In E4M3 it is
/// `1.111₂ * 2^8 = 480`, odd, so the threshold 464 rounds to 448 and only what lies above
/// it overflows (as ml_dtypes' `float8_e4m3fn` conversion does). Both regimes are computed
/// and merged with selects, so no branch depends on the data; with `format` a constant (as
/// in the slice loops) everything folds.
///
/// Rounding directly matters: going through f32 first would round the significand to 24
/// bits, which can land exactly on a midpoint of the format (or move off one), and the
/// second rounding then breaks the tie the wrong way.
#[inline(always)]
fn f64_to_format_value(x: f64, format: Format, overflow: Overflow) -> (f64, bool) {
    let dropped_bits = 53 - format.precision_bits();
    let dropped_mask = (1u64 << dropped_bits) - 1;
    let max_finite = format.max_finite().to_bits();
    let bits = x.to_bits();
    let sign = bits & !F64_ABS_MASK;
    let abs = bits & F64_ABS_MASK;

    // No overflow: abs < 2^63 and we add less than 2^50.
    let lowest_kept = (abs >> dropped_bits) & 1;
    let normal = (abs + (dropped_mask >> 1) + lowest_kept) & !dropped_mask;
    let shifter = format.min_subnormal() * pow2(52);
    let subnormal = ((f64::from_bits(abs) + shifter) - shifter).to_bits();

    let magnitude = if abs < format.min_normal().to_bits() {
        subnormal
    } else {
        normal
    };
    let overflowed = magnitude > max_finite;
    let magnitude = if overflowed {
        match overflow {
            Overflow::Saturate => max_finite,
            Overflow::Format if format.has_infinity() => F64_INF_BITS,
            Overflow::Format => F64_NAN_BITS,
        }
    } else {
        magnitude
    };
    // NaN: quiet it and keep only the payload bits the format has room for, so the result
    // is a NaN of the format (the one a hardware conversion would give); E4M3's only NaN
    // has no payload.
    let is_nan = abs > F64_INF_BITS;
    let nan = if format.has_infinity() {
        (abs | F64_QUIET_BIT) & !dropped_mask
    } else {
        F64_NAN_BITS
    };
    let magnitude = if is_nan { nan } else { magnitude };
    (f64::from_bits(sign | magnitude), overflowed & !is_nan)
}

/// `2^e` for a normal f64 exponent `e`, built from the bits.
#[inline(always)]
const fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}
