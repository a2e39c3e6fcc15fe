//! Properties of rounding, plain and saturating, f64 above all, checked against the
//! table-and-midpoint reference, in every format.
//!
//! Inputs are concentrated where rounding is hard: on and a few f64 ulps around midpoints
//! between neighbouring format values (ties, and the inputs a detour through f32 would move
//! onto a tie), across the subnormal range and at the overflow threshold.

mod common;

use proptest::prelude::*;
use proptest::sample::select;
use tl_numerics::{Format, Round};

fn format() -> impl Strategy<Value = Format> {
    select(Format::ALL.to_vec())
}

/// Any f64 bit pattern: NaNs, infinities, zeros, f64 subnormals, every exponent.
fn any_bits_f64() -> impl Strategy<Value = f64> {
    any::<u64>().prop_map(f64::from_bits)
}

/// A value whose exponent lies in or just around the range of `format` (from below half the
/// smallest subnormal to beyond the overflow threshold), with random significand and sign.
fn in_range(format: Format) -> impl Strategy<Value = f64> {
    let lowest = format.min_subnormal().log2() as i32 - 3;
    let highest = format.max_finite().log2() as i32 + 3;
    (lowest..=highest, any::<u64>(), any::<bool>()).prop_map(|(exponent, fraction, negative)| {
        let magnitude = (1.0 + (fraction >> 12) as f64 * 2f64.powi(-52)) * 2f64.powi(exponent);
        if negative { -magnitude } else { magnitude }
    })
}

/// A midpoint between neighbouring values of `format` (the last one is the overflow
/// threshold), moved by a few f64 ulps or by a tiny relative amount, with random sign.
fn near_midpoint(format: Format) -> impl Strategy<Value = f64> {
    let top = common::Layout::of(format).overflow_pattern();
    // Two thirds of the draws from the ends, where the subnormal and overflow edges are.
    let pattern = prop_oneof![0..top, 0..16_u32, (top - 16)..top];
    let nudge = prop_oneof![
        Just(Nudge::Ulps(0)),
        (-4_i64..=4).prop_map(Nudge::Ulps),
        (20_i32..=52, any::<bool>()).prop_map(|(k, up)| Nudge::Relative(k, up)),
    ];
    (pattern, nudge, any::<bool>()).prop_map(move |(k, nudge, negative)| {
        let mid = common::midpoint(format, k);
        let moved = match nudge {
            Nudge::Ulps(n) => f64::from_bits(mid.to_bits().wrapping_add_signed(n)),
            Nudge::Relative(k, up) => {
                let delta = mid * 2f64.powi(-k);
                if up { mid + delta } else { mid - delta }
            }
        };
        if negative { -moved } else { moved }
    })
}

#[derive(Debug, Clone)]
enum Nudge {
    /// Move by this many f64 ulps (0: the midpoint itself).
    Ulps(i64),
    /// Move by `2^-k` relative, up or down: `2^-30` is below f32's resolution, the detour
    /// through f32 would land on the midpoint.
    Relative(i32, bool),
}

/// Any interesting f64 for `format`.
fn hard_f64(format: Format) -> impl Strategy<Value = f64> {
    prop_oneof![any_bits_f64(), in_range(format), near_midpoint(format)]
}

fn format_and_value() -> impl Strategy<Value = (Format, f64)> {
    format().prop_flat_map(|f| (Just(f), hard_f64(f)))
}

/// Bitwise equality, with any two NaNs equal.
fn same(a: f64, b: f64) -> bool {
    (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn f64_rounds_to_the_nearest_value_ties_to_even((f, x) in format_and_value()) {
        let expected = common::reference_round_f64(f, x);
        let got = x.round_to(f);
        prop_assert!(same(got, expected), "{f} {x:e} ({:#x}): got {got:e}, expected {expected:e}", x.to_bits());
    }

    #[test]
    fn f32_rounds_to_the_nearest_value_ties_to_even(f in format(), bits in any::<u32>()) {
        let x = f32::from_bits(bits);
        let expected = common::reference_round_f64(f, f64::from(x));
        let got = x.round_to(f);
        prop_assert!(same(f64::from(got), expected), "{f} {bits:#x}: got {got:e}, expected {expected:e}");
    }

    #[test]
    fn f64_saturates_to_the_nearest_value_clamped_to_the_range((f, x) in format_and_value()) {
        let expected = common::reference_round_saturating_f64(f, x);
        let got = x.round_to_saturating(f);
        prop_assert!(same(got, expected), "{f} {x:e} ({:#x}): got {got:e}, expected {expected:e}", x.to_bits());
        prop_assert!(got.is_nan() == x.is_nan() && got.is_sign_negative() == x.is_sign_negative());
    }

    #[test]
    fn f32_saturates_to_the_nearest_value_clamped_to_the_range(f in format(), bits in any::<u32>()) {
        let x = f32::from_bits(bits);
        let expected = common::reference_round_saturating_f64(f, f64::from(x));
        let got = x.round_to_saturating(f);
        prop_assert!(same(f64::from(got), expected), "{f} {bits:#x}: got {got:e}, expected {expected:e}");
    }

    #[test]
    fn saturation_changes_only_what_overflows((f, x) in format_and_value()) {
        // The two conversions differ exactly where plain rounding leaves the finite range
        // (±inf, or NaN from a number in E4M3), and there saturation gives ±max_finite.
        for (plain, saturating) in [
            (x.round_to(f), x.round_to_saturating(f)),
            ((x as f32).round_to(f).into(), (x as f32).round_to_saturating(f).into()),
        ] {
            if plain.is_infinite() || (plain.is_nan() && !x.is_nan()) {
                prop_assert_eq!(saturating, f.max_finite().copysign(x), "{} {:e}", f, x);
            } else {
                prop_assert!(same(saturating, plain), "{f} {x:e}: {saturating:e} vs {plain:e}");
            }
        }
    }

    #[test]
    fn rounding_is_idempotent((f, x) in format_and_value()) {
        let once = x.round_to(f);
        prop_assert!(same(once.round_to(f), once));
        let once32 = (x as f32).round_to(f);
        prop_assert!(once32.round_to(f).to_bits() == once32.to_bits() || once32.is_nan());
    }

    #[test]
    fn rounding_is_monotone((f, x) in format_and_value(), y in any_bits_f64(), step in 0_u64..4) {
        // Pairs far apart and pairs a few f64 ulps apart around the same (hard) input.
        let near = f64::from_bits(x.to_bits().wrapping_add(step));
        // NaN compares false: where plain rounding overflows to NaN (E4M3) there is no order
        // to keep, and the pair is only checked saturating.
        let ordered = |a: f64, b: f64| a.is_nan() || b.is_nan() || a <= b;
        for (a, b) in [(x, y), (x, near)] {
            if a.is_nan() || b.is_nan() {
                continue;
            }
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            prop_assert!(ordered(lo.round_to(f), hi.round_to(f)), "{f}: {lo:e} <= {hi:e}");
            prop_assert!(lo.round_to_saturating(f) <= hi.round_to_saturating(f), "{f}: {lo:e} <= {hi:e}");
            let (lo32, hi32) = (lo as f32, hi as f32);
            let (r_lo, r_hi) = (lo32.round_to(f), hi32.round_to(f));
            prop_assert!(ordered(r_lo.into(), r_hi.into()), "{f}: {lo32:e} <= {hi32:e}");
            prop_assert!(
                lo32.round_to_saturating(f) <= hi32.round_to_saturating(f),
                "{f}: {lo32:e} <= {hi32:e}"
            );
        }
    }

    #[test]
    fn rounding_is_symmetric((f, x) in format_and_value()) {
        prop_assert_eq!((-x).round_to(f).to_bits(), (-x.round_to(f)).to_bits());
        prop_assert_eq!((-x).round_to_saturating(f).to_bits(), (-x.round_to_saturating(f)).to_bits());
        let x32 = x as f32;
        prop_assert_eq!((-x32).round_to(f).to_bits(), (-x32.round_to(f)).to_bits());
        prop_assert_eq!(
            (-x32).round_to_saturating(f).to_bits(),
            (-x32.round_to_saturating(f)).to_bits()
        );
    }

    #[test]
    fn f32_and_f64_paths_agree_on_f32_values(f in format(), bits in any::<u32>(), mid in any::<bool>()) {
        // Either any f32, or an f32 midpoint of the format (f32 holds all of them).
        let x = if mid {
            let top = common::Layout::of(f).overflow_pattern();
            common::midpoint(f, bits % top) as f32
        } else {
            f32::from_bits(bits)
        };
        let via32 = f64::from(x.round_to(f));
        let via64 = f64::from(x).round_to(f);
        prop_assert!(same(via32, via64), "{f} {x:e}: f32 {via32:e}, f64 {via64:e}");
        prop_assert_eq!(via32.is_sign_negative(), via64.is_sign_negative());
        let via32 = f64::from(x.round_to_saturating(f));
        let via64 = f64::from(x).round_to_saturating(f);
        prop_assert!(same(via32, via64), "{f} {x:e}: saturating f32 {via32:e}, f64 {via64:e}");
    }

    #[test]
    fn relative_error_is_at_most_the_unit_roundoff((f, x) in format_and_value()) {
        // |rd(x) - x| <= u |x| wherever the result is normal; below that the absolute error
        // is at most half the subnormal spacing.
        let r = x.round_to(f);
        if x.is_finite() && r.is_finite() {
            let error = (r - x).abs();
            if x.abs() >= f.min_normal() {
                prop_assert!(error <= f.unit_roundoff() * x.abs(), "{f} {x:e} -> {r:e}");
            } else {
                prop_assert!(error <= f.min_subnormal() / 2.0, "{f} {x:e} -> {r:e}");
            }
        }
    }
}

/// A midpoint between neighbouring fp8 values (the last: the overflow threshold) moved by
/// `2^-shift` relative, `shift` from 26 to 52: a value f32 cannot hold, which a detour
/// through f32 would put exactly on the midpoint (the move is under a quarter of an f32 ulp).
/// Returns the format, the input, the neighbour on the side it was moved to, and the even
/// neighbour (where the detour through f32 would go), signed as the input.
fn fp8_just_off_a_midpoint() -> impl Strategy<Value = (Format, f64, f64, f64)> {
    let moves = (26_i32..=52, any::<bool>(), any::<bool>());
    (select(Format::FP8.to_vec()), any::<u32>(), moves).prop_map(|(f, k, (shift, up, negative))| {
        let layout = common::Layout::of(f);
        let table = layout.value_table();
        let k = k % layout.overflow_pattern();
        let mid = common::midpoint(f, k);
        let nudge = if up {
            2f64.powi(-shift)
        } else {
            -(2f64.powi(-shift))
        };
        let side = if up { k + 1 } else { k };
        let even = if k.is_multiple_of(2) { k } else { k + 1 };
        let sign = if negative { -1.0 } else { 1.0 };
        let value = |pattern| common::value_of(layout, &table, pattern).copysign(sign);
        (f, sign * mid * (1.0 + nudge), value(side), value(even))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn fp8_rounds_an_f64_off_a_midpoint_to_its_side((f, x, side, even) in fp8_just_off_a_midpoint()) {
        let got = x.round_to(f);
        prop_assert!(same(got, side), "{f} {x:e}: got {got:e}, expected {side:e}");
        prop_assert!(got.is_sign_negative() == x.is_sign_negative());
        let saturated = if side.is_finite() { side } else { f.max_finite().copysign(x) };
        prop_assert_eq!(x.round_to_saturating(f), saturated);
        // The same input as an f32 is the midpoint itself, a tie that goes to the even
        // neighbour: what a detour through f32 would have given.
        let x32 = x as f32;
        let via32 = f64::from(x32.round_to(f));
        prop_assert!(same(via32, even), "{f} {x32:e}: got {via32:e}, expected {even:e}");
    }
}
