//! Hand-computed cases: the chapter's worked examples, the edges of both formats, and the
//! inputs on which other converters are known to round wrongly.

use tl_numerics::{
    Format, RangeCounts, Round, round_slice, round_slice_counting_flushes, round_slice_into,
    round_slice_saturating_counting, round_to_bf16, round_to_fp16,
};

fn p2(e: i32) -> f64 {
    2f64.powi(e)
}

/// Asserts the f32 and the f64 path both give `expected` for `x` (exact in f32).
fn assert_both(format: Format, x: f64, expected: f64) {
    assert_eq!(
        f64::from(x as f32),
        x,
        "{x:e} must be exact in f32 for this check"
    );
    assert_eq!(
        x.round_to(format).to_bits(),
        expected.to_bits(),
        "f64 {x:e}"
    );
    assert_eq!(
        (x as f32).round_to(format).to_bits(),
        (expected as f32).to_bits(),
        "f32 {x:e}"
    );
}

#[test]
fn bf16_tie_between_one_and_next_goes_to_even_one() {
    // 1 + 2^-8 is halfway between 1 (even significand) and 1 + 2^-7 (odd).
    assert_both(Format::Bf16, 1.0 + p2(-8), 1.0);
    assert_eq!(round_to_bf16(f32::from_bits(0x3F80_8000)), 1.0); // the same tie, as bits
}

#[test]
fn bf16_of_1_01_is_1_0078125() {
    // 1.01 = 1 + 1.28 * 2^-7: nearer to 1 + 2^-7 = 1.0078125 than to 1 + 2^-6.
    assert_eq!(round_to_bf16(1.01_f32), 1.0078125);
    assert_eq!(round_to_bf16(1.01_f64), 1.0078125);
}

#[test]
fn bf16_tie_with_odd_lower_neighbour_rounds_up() {
    // 1 + 2^-7 + 2^-8: between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
    assert_both(Format::Bf16, 1.0 + p2(-7) + p2(-8), 1.0 + p2(-6));
}

#[test]
fn fp16_overflow_threshold_is_65520() {
    // 65504 = (2 - 2^-10) * 2^15, ulp 32, so the threshold is 65504 + 16 = 65520.
    assert_both(Format::Fp16, 65519.0, 65504.0);
    assert_both(Format::Fp16, 65520.0, f64::INFINITY);
    assert_both(Format::Fp16, -65520.0, f64::NEG_INFINITY);
    assert_eq!(round_to_fp16(65519.999_f64), 65504.0);
    assert_eq!(round_to_fp16(65520.0 - p2(-30)), 65504.0);
    assert_eq!(round_to_fp16(1e300_f64), f64::INFINITY);
}

#[test]
fn fp16_underflow_ties_to_zero_and_rounds_up_above_half() {
    // 2^-25 is halfway between 0 and 2^-24: ties to the even 0.
    assert_both(Format::Fp16, p2(-25), 0.0);
    assert_both(Format::Fp16, -p2(-25), -0.0);
    assert_both(Format::Fp16, 1.5 * p2(-25), p2(-24));
    assert_both(Format::Fp16, p2(-24), p2(-24));
    assert_eq!(round_to_fp16(p2(-25) + p2(-70)), p2(-24)); // 2^-70 is 2^-45 relative: exact in f64
    assert_eq!(round_to_fp16(p2(-25) - p2(-70)), 0.0);
}

#[test]
fn fp16_subnormal_ties_go_to_even_multiples_of_2_pow_minus_24() {
    assert_both(Format::Fp16, 2.5 * p2(-24), 2.0 * p2(-24));
    assert_both(Format::Fp16, 3.5 * p2(-24), 4.0 * p2(-24));
    // The largest subnormal rounds up into the smallest normal 2^-14.
    assert_both(Format::Fp16, 1023.5 * p2(-24), p2(-14));
}

#[test]
fn bf16_subnormals_and_overflow() {
    assert_both(Format::Bf16, p2(-134), 0.0); // half of 2^-133: tie to 0
    assert_both(Format::Bf16, 3.0 * p2(-134), p2(-132)); // 1.5 * 2^-133: tie to 2 * 2^-133
    assert_both(Format::Bf16, p2(-133), p2(-133));
    let max = Format::Bf16.max_finite();
    let half_ulp = p2(127 - 8);
    assert_eq!(round_to_bf16(max + half_ulp), f64::INFINITY);
    assert_eq!(round_to_bf16(max + half_ulp - p2(80)), max);
    assert_eq!(round_to_bf16(f32::MAX), f32::INFINITY);
    assert_eq!(round_to_bf16(f32::from_bits(0x7F7F_7FFF)), max as f32);
    assert_eq!(round_to_bf16(f32::from_bits(0x7F7F_8000)), f32::INFINITY);
}

#[test]
fn f64_is_not_rounded_through_f32() {
    // half::bf16::from_f64 drops the low 32 bits first and returns 1.0 here.
    assert_eq!(round_to_bf16(1.0 + p2(-8) + p2(-22)), 1.0078125);
    // Just below a midpoint: an f32 would round onto the midpoint, then to even 0x3C02.
    let x = 1.0 + p2(-10) + p2(-11) - p2(-30);
    assert_eq!(round_to_fp16(x), 1.0 + p2(-10)); // 0x3C01
    // The same trap for bf16, with the odd neighbour below: correct is 1 + 2^-7.
    assert_eq!(round_to_bf16(1.0 + p2(-7) + p2(-8) - p2(-30)), 1.0 + p2(-7));
    // One f64 ulp above a tie decides it too.
    let above = f64::from_bits((1.0 + p2(-8)).to_bits() + 1);
    assert_eq!(round_to_bf16(above), 1.0078125);
}

#[test]
fn zeros_keep_their_sign_and_infinities_stay_where_the_format_has_them() {
    for format in Format::ALL {
        for zero in [0.0_f64, -0.0] {
            assert_eq!(zero.round_to(format).to_bits(), zero.to_bits());
            let zero32 = zero as f32;
            assert_eq!(zero32.round_to(format).to_bits(), zero32.to_bits());
        }
        assert!((-1e-300_f64).round_to(format).is_sign_negative());
        if format.has_infinity() {
            assert_eq!(f64::INFINITY.round_to(format), f64::INFINITY);
            assert_eq!(f32::NEG_INFINITY.round_to(format), f32::NEG_INFINITY);
        } else {
            // E4M3 has no infinity: ±inf is beyond its range, and becomes NaN, sign kept.
            let (r64, r32) = (
                f64::INFINITY.round_to(format),
                f32::NEG_INFINITY.round_to(format),
            );
            assert!(r64.is_nan() && r64.is_sign_positive(), "{format}");
            assert!(r32.is_nan() && r32.is_sign_negative(), "{format}");
        }
        // Saturation clamps infinities in every format.
        let max = format.max_finite();
        assert_eq!(f64::INFINITY.round_to_saturating(format), max);
        assert_eq!(f32::NEG_INFINITY.round_to_saturating(format), -max as f32);
    }
}

#[test]
fn nan_stays_a_quiet_nan_with_its_sign() {
    // Signalling NaNs whose payload sits only in bits the format drops: a naive truncation
    // would turn them into infinity.
    let signalling32 = f32::from_bits(0xFF80_0001);
    let signalling64 = f64::from_bits(0x7FF0_0000_0000_0001);
    for format in Format::ALL {
        let r32 = signalling32.round_to(format);
        assert!(r32.is_nan() && r32.is_sign_negative());
        assert_ne!(r32.to_bits() & 0x0040_0000, 0, "quiet bit");
        let r64 = signalling64.round_to(format);
        assert!(r64.is_nan() && r64.is_sign_positive());
        assert_ne!(r64.to_bits() & (1 << 51), 0, "quiet bit");
        assert!(round_slice_of(&[f32::NAN], format)[0].is_nan());
    }
}

fn round_slice_of(xs: &[f32], format: Format) -> Vec<f32> {
    let mut out = xs.to_vec();
    round_slice(&mut out, format);
    out
}

/// `round_slice_into` of `xs`, into a fresh buffer.
fn round_slice_into_of<E: Round>(xs: &[E], format: Format) -> Vec<E> {
    let mut out = Vec::with_capacity(xs.len());
    round_slice_into(xs, &mut out.spare_capacity_mut()[..xs.len()], format);
    // SAFETY: round_slice_into wrote every one of the first xs.len() elements.
    unsafe { out.set_len(xs.len()) };
    out
}

#[test]
fn round_slice_equals_elementwise_round_to() {
    let xs64: Vec<f64> = (-300..300)
        .map(|i| f64::from(i) * 1.37_f64.powi(i / 3) * 1e-3)
        .chain([f64::NAN, f64::INFINITY, -0.0, 65520.0, p2(-25)])
        .collect();
    let xs32: Vec<f32> = xs64.iter().map(|&x| x as f32).collect();
    for format in Format::ALL {
        let mut got64 = xs64.clone();
        round_slice(&mut got64, format);
        for (x, r) in xs64.iter().zip(&got64) {
            assert_eq!(r.to_bits(), x.round_to(format).to_bits(), "{format} {x:e}");
        }
        for (x, r) in xs32.iter().zip(round_slice_of(&xs32, format)) {
            assert_eq!(r.to_bits(), x.round_to(format).to_bits(), "{format} {x:e}");
        }
        for (x, r) in xs64.iter().zip(round_slice_into_of(&xs64, format)) {
            assert_eq!(r.to_bits(), x.round_to(format).to_bits(), "{format} {x:e}");
        }
        for (x, r) in xs32.iter().zip(round_slice_into_of(&xs32, format)) {
            assert_eq!(r.to_bits(), x.round_to(format).to_bits(), "{format} {x:e}");
        }
    }
}

#[test]
fn round_slice_counting_flushes_rounds_and_counts_the_values_lost_to_zero() {
    // Down to about 6e-15: fp16 flushes the 154 values below 2^-25 and the tie 2^-25 itself
    // (to the even 0) and -2^-26, bf16 none of them; the zero and the NaN never count.
    let xs64: Vec<f64> = (-300..300)
        .map(|i| f64::from(i) * 1.37_f64.powi(i / 3) * 1e-3)
        .chain([f64::NAN, -0.0, p2(-25), -p2(-26), p2(-24)])
        .collect();
    let xs32: Vec<f32> = xs64.iter().map(|&x| x as f32).collect();
    let flushed = |xs: &[f64], format| {
        xs.iter()
            .filter(|&&x| x != 0.0 && x.round_to(format) == 0.0)
            .count() as u64
    };
    let expected = [(Format::Bf16, 0), (Format::Fp16, 156)];
    for (format, count) in expected {
        let mut got64 = xs64.clone();
        assert_eq!(
            round_slice_counting_flushes(&mut got64, format),
            count,
            "{format} f64"
        );
        assert_eq!(
            flushed(&xs64, format),
            count,
            "{format}: the reference count"
        );
        for (x, r) in xs64.iter().zip(&got64) {
            assert_eq!(r.to_bits(), x.round_to(format).to_bits(), "{format} {x:e}");
        }
        let mut got32 = xs32.clone();
        let widened: Vec<f64> = xs32.iter().map(|&x| f64::from(x)).collect();
        let count32 = round_slice_counting_flushes(&mut got32, format);
        assert_eq!(count32, flushed(&widened, format), "{format} f32");
        for (x, r) in xs32.iter().zip(&got32) {
            assert_eq!(r.to_bits(), x.round_to(format).to_bits(), "{format} {x:e}");
        }
    }
}

#[test]
fn saturation_clamps_the_16_bit_formats_too() {
    // fp16: 65520 is the tie that plain rounding sends to infinity; saturated, 65504.
    assert_eq!(65520.0_f32.round_to_saturating(Format::Fp16), 65504.0);
    assert_eq!((-1e300_f64).round_to_saturating(Format::Fp16), -65504.0);
    assert_eq!(65519.0_f64.round_to_saturating(Format::Fp16), 65504.0);
    // bf16: f32's largest value is beyond bf16's (2 - 2^-7) * 2^127.
    let max = Format::Bf16.max_finite();
    assert_eq!(f32::MAX.round_to_saturating(Format::Bf16), max as f32);
    assert_eq!((-f64::MAX).round_to_saturating(Format::Bf16), -max);
    assert_eq!(f32::INFINITY.round_to_saturating(Format::Bf16), max as f32);
    // Everything else is plain rounding: a tie, a subnormal, NaN.
    assert_eq!((1.0 + p2(-8)).round_to_saturating(Format::Bf16), 1.0);
    assert_eq!(p2(-25).round_to_saturating(Format::Fp16), 0.0);
    assert!(f32::NAN.round_to_saturating(Format::Fp16).is_nan());

    let mut xs = [
        65520.0_f32,
        f32::NEG_INFINITY,
        65504.0,
        1e-8,
        -0.0,
        f32::NAN,
    ];
    let counts = round_slice_saturating_counting(&mut xs, Format::Fp16);
    assert_eq!(
        counts,
        RangeCounts {
            saturated: 2,
            flushed: 1
        }
    );
    assert_eq!(xs[..5], [65504.0, -65504.0, 65504.0, 0.0, -0.0]);
    let mut xs = [f64::MAX, 1e-50, 1.0];
    let counts = round_slice_saturating_counting(&mut xs, Format::Bf16);
    assert_eq!(
        counts,
        RangeCounts {
            saturated: 1,
            flushed: 1
        }
    );
}

#[test]
#[should_panic(expected = "lengths differ")]
fn round_slice_into_rejects_a_destination_of_another_length() {
    let mut dst = [std::mem::MaybeUninit::<f32>::uninit(); 3];
    round_slice_into(&[1.0_f32, 2.0], &mut dst, Format::Bf16);
}

#[test]
fn f32_paths_agree_with_the_half_crate_on_a_sweep_of_bit_patterns() {
    // half's f32 conversions are exact (single rounding); a stride coprime with the layout
    // visits every exponent and many fraction patterns.
    for bits in (0..=u32::MAX).step_by(40_009) {
        let x = f32::from_bits(bits);
        let bf16 = half::bf16::from_f32(x).to_f32();
        let fp16 = half::f16::from_f32(x).to_f32();
        if x.is_nan() {
            assert!(round_to_bf16(x).is_nan() && round_to_fp16(x).is_nan());
        } else {
            assert_eq!(round_to_bf16(x).to_bits(), bf16.to_bits(), "bf16 {bits:#x}");
            assert_eq!(round_to_fp16(x).to_bits(), fp16.to_bits(), "fp16 {bits:#x}");
        }
    }
}
