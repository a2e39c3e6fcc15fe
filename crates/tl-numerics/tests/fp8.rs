//! The two fp8 formats, value by value: each of the 256 encodings, each midpoint between
//! neighbours, the overflow thresholds, and the ends of the range, in both element types
//! and in the plain and saturating conversions.
//!
//! The encodings are decoded here from the OCP 8-bit formats' definition, byte by byte (not
//! with the crate's parameters): E4M3 is `S.EEEE.MMM` with bias 7, no infinities and NaN only
//! as `S.1111.111`; E5M2 is `S.EEEEE.MM` with bias 15, IEEE-style (`S.11111.00` is ±inf, the
//! other three `S.11111.xx` are NaN).

mod common;

use tl_numerics::{
    Format, RangeCounts, Round, round_slice, round_slice_into, round_slice_saturating,
    round_slice_saturating_counting, round_to_e4m3, round_to_e5m2,
};

fn p2(e: i32) -> f64 {
    2f64.powi(e)
}

/// The value of an fp8 encoding: exact, NaN for the NaN encodings, ±inf for E5M2's.
fn decode(format: Format, byte: u8) -> f64 {
    let (fraction_bits, bias) = match format {
        Format::E4M3 => (3, 7),
        Format::E5M2 => (2, 15),
        _ => unreachable!("only the fp8 formats"),
    };
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let exponent_field = i32::from((byte & 0x7F) >> fraction_bits);
    let fraction = f64::from(byte & ((1 << fraction_bits) - 1));
    let all_ones_exponent: i32 = 0x7F >> fraction_bits;
    let magnitude = match format {
        Format::E4M3 if byte & 0x7F == 0x7F => f64::NAN,
        Format::E5M2 if exponent_field == all_ones_exponent && fraction == 0.0 => f64::INFINITY,
        Format::E5M2 if exponent_field == all_ones_exponent => f64::NAN,
        _ if exponent_field == 0 => fraction * p2(1 - bias - fraction_bits),
        _ => (1.0 + fraction * p2(-fraction_bits)) * p2(exponent_field - bias),
    };
    sign * magnitude
}

/// The finite non-negative values of `format` with their encodings, in increasing order.
fn positive_values(format: Format) -> Vec<(u8, f64)> {
    (0..=0x7F_u8)
        .map(|b| (b, decode(format, b)))
        .filter(|(_, v)| v.is_finite())
        .collect()
}

/// Asserts `x` rounds to `expected` (plain) in f64, and in f32 when `x` is an f32.
fn assert_rounds(format: Format, x: f64, expected: f64) {
    let same = |got: f64| {
        (got.is_nan() && expected.is_nan() && got.is_sign_negative() == expected.is_sign_negative())
            || got.to_bits() == expected.to_bits()
    };
    let got = x.round_to(format);
    assert!(
        same(got),
        "{format} f64 {x:e}: got {got:e}, expected {expected:e}"
    );
    if f64::from(x as f32).to_bits() == x.to_bits() {
        let got = f64::from((x as f32).round_to(format));
        assert!(
            same(got),
            "{format} f32 {x:e}: got {got:e}, expected {expected:e}"
        );
    }
}

/// Asserts `x` rounds to `expected` with saturation, in f64 and (when exact) f32.
fn assert_saturates(format: Format, x: f64, expected: f64) {
    assert_eq!(
        x.round_to_saturating(format).to_bits(),
        expected.to_bits(),
        "{format} f64 {x:e}"
    );
    if f64::from(x as f32).to_bits() == x.to_bits() {
        let got = (x as f32).round_to_saturating(format);
        assert_eq!(
            got.to_bits(),
            (expected as f32).to_bits(),
            "{format} f32 {x:e}"
        );
    }
}

#[test]
fn the_encodings_decode_to_the_formats_parameters() {
    let e4m3 = positive_values(Format::E4M3);
    assert_eq!(e4m3.len(), 127, "0x00..=0x7E: everything but the NaN");
    assert_eq!(e4m3.last(), Some(&(0x7E, 448.0)));
    assert_eq!(e4m3[1], (0x01, p2(-9)));
    assert_eq!(e4m3[8], (0x08, p2(-6))); // the smallest normal
    let e5m2 = positive_values(Format::E5M2);
    assert_eq!(e5m2.len(), 124, "0x00..=0x7B: below the infinity");
    assert_eq!(e5m2.last(), Some(&(0x7B, 57344.0)));
    assert_eq!(e5m2[1], (0x01, p2(-16)));
    assert_eq!(e5m2[4], (0x04, p2(-14)));
    for (format, values) in [(Format::E4M3, e4m3), (Format::E5M2, e5m2)] {
        let (_, max) = *values.last().unwrap();
        assert_eq!(format.max_finite(), max);
        assert_eq!(format.min_subnormal(), values[1].1);
        let normal = values[1 << (format.precision_bits() - 1)].1;
        assert_eq!(format.min_normal(), normal);
    }
}

#[test]
fn every_one_of_the_256_encodings_rounds_to_itself() {
    for format in Format::FP8 {
        let mut finite = 0;
        for byte in 0..=0xFF_u8 {
            let v = decode(format, byte);
            if v.is_nan() {
                assert!(v.round_to(format).is_nan());
                continue;
            }
            // Plain rounding keeps every value of the format, infinities and -0 included,
            // in both element types; saturation keeps every finite one.
            assert_rounds(format, v, v);
            if v.is_finite() {
                finite += 1;
                assert_saturates(format, v, v);
            } else {
                assert_saturates(format, v, format.max_finite().copysign(v));
            }
        }
        // E4M3: 256 less the two NaNs; E5M2: less two infinities and six NaNs.
        let expected = if format == Format::E4M3 { 254 } else { 248 };
        assert_eq!(finite, expected, "{format}");
    }
}

#[test]
fn midpoints_between_neighbours_go_to_the_even_encoding_and_f64_rounds_directly() {
    for format in Format::FP8 {
        let values = positive_values(format);
        for pair in values.windows(2) {
            let [(lo_byte, lo), (hi_byte, hi)] = [pair[0], pair[1]];
            let mid = (lo + hi) / 2.0;
            let even = if lo_byte.is_multiple_of(2) { lo } else { hi };
            assert_eq!(hi_byte, lo_byte + 1);
            for sign in [1.0, -1.0] {
                assert_rounds(format, sign * mid, sign * even);
                // One f64 ulp, or 2^-40 relative (below f32's resolution, so that an f32
                // detour would land on the midpoint and go to even), either side.
                let ulp_below = f64::from_bits(mid.to_bits() - 1);
                let ulp_above = f64::from_bits(mid.to_bits() + 1);
                let (below, above) = (mid * (1.0 - p2(-40)), mid * (1.0 + p2(-40)));
                for x in [ulp_below, below] {
                    assert_rounds(format, sign * x, sign * lo);
                    assert_saturates(format, sign * x, sign * lo);
                }
                for x in [ulp_above, above] {
                    assert_rounds(format, sign * x, sign * hi);
                    assert_saturates(format, sign * x, sign * hi);
                }
                // In f32 the nudged value is the midpoint itself.
                assert_eq!(
                    ((sign * above) as f32).round_to(format),
                    (sign * even) as f32
                );
            }
        }
    }
}

#[test]
fn e4m3_overflows_to_nan_above_464_and_saturates_to_448() {
    let f = Format::E4M3;
    // 448 = 1.110 * 2^8 (even); the next step, 1.111 * 2^8 = 480, is the NaN encoding. The
    // tie 464 goes to 448, anything above it is nearer 480: beyond the range.
    assert_rounds(f, 464.0, 448.0);
    assert_rounds(f, -464.0, -448.0);
    let just_above = f64::from_bits(464.0_f64.to_bits() + 1);
    assert_rounds(f, just_above, f64::NAN);
    assert_rounds(
        f,
        f64::from(f32::from_bits(464.0_f32.to_bits() + 1)),
        f64::NAN,
    );
    for x in [465.0, 479.0, 480.0, 512.0, 1e30, f64::MAX, f64::INFINITY] {
        assert_rounds(f, x, f64::NAN);
        assert_rounds(f, -x, -f64::NAN);
        assert_saturates(f, x, 448.0);
        assert_saturates(f, -x, -448.0);
    }
    assert_saturates(f, 464.0, 448.0);
    assert_saturates(f, 449.0, 448.0);
    assert_eq!(round_to_e4m3(465.0_f32).to_bits(), f32::NAN.to_bits());
    assert_eq!(round_to_e4m3(-465.0_f64).to_bits(), (-f64::NAN).to_bits());
}

#[test]
fn e5m2_overflows_to_infinity_from_61440_and_saturates_to_57344() {
    let f = Format::E5M2;
    // 57344 = 1.11 * 2^15 (odd); the next step is 2^16 (even), so the tie 61440 overflows.
    assert_rounds(f, 61440.0, f64::INFINITY);
    assert_rounds(f, -61440.0, f64::NEG_INFINITY);
    assert_rounds(f, f64::from_bits(61440.0_f64.to_bits() - 1), 57344.0);
    assert_rounds(
        f,
        f64::from(f32::from_bits(61440.0_f32.to_bits() - 1)),
        57344.0,
    );
    assert_rounds(f, 61440.0 * (1.0 - p2(-40)), 57344.0); // f32 would make it the tie
    assert_eq!(
        ((61440.0 * (1.0 - p2(-40))) as f32).round_to(f),
        f32::INFINITY
    );
    for x in [61440.0, 65536.0, 1e30, f64::INFINITY] {
        assert_saturates(f, x, 57344.0);
        assert_saturates(f, -x, -57344.0);
    }
    assert_saturates(f, 61439.0, 57344.0);
    assert_eq!(round_to_e5m2(1e10_f32), f32::INFINITY);
}

#[test]
fn the_subnormal_ends_flush_ties_to_zero_and_round_up_into_the_normals() {
    for (format, min_subnormal, min_normal) in [
        (Format::E4M3, p2(-9), p2(-6)),
        (Format::E5M2, p2(-16), p2(-14)),
    ] {
        let half = min_subnormal / 2.0;
        for sign in [1.0, -1.0] {
            // Half the smallest subnormal is a tie between 0 (even) and it; -0 keeps the sign.
            assert_rounds(format, sign * half, sign * 0.0);
            assert_rounds(format, sign * half * (1.0 + p2(-40)), sign * min_subnormal);
            assert_rounds(format, sign * half * (1.0 - p2(-40)), sign * 0.0);
            assert_rounds(
                format,
                sign * 1.5 * min_subnormal,
                sign * 2.0 * min_subnormal,
            );
            assert_rounds(format, sign * 1e-30, sign * 0.0);
            assert_rounds(format, sign * 5e-324, sign * 0.0); // f64's smallest subnormal
            // The largest subnormal plus half a step is a tie, to the even smallest normal.
            let largest_subnormal = min_normal - min_subnormal;
            assert_rounds(format, sign * (largest_subnormal + half), sign * min_normal);
            assert_saturates(format, sign * half, sign * 0.0);
        }
    }
}

#[test]
fn nans_stay_nans_with_their_sign() {
    // A signalling NaN whose payload sits only in bits fp8 drops, of either sign.
    for format in Format::FP8 {
        for bits in [0x7F80_0001_u32, 0xFF80_0001, 0x7FC0_0000, 0xFFFF_FFFF] {
            let x = f32::from_bits(bits);
            for r in [x.round_to(format), x.round_to_saturating(format)] {
                assert!(
                    r.is_nan() && r.is_sign_negative() == x.is_sign_negative(),
                    "{bits:#x}"
                );
                assert_ne!(r.to_bits() & 0x0040_0000, 0, "quiet bit");
            }
            let wide = f64::from(x);
            for r in [wide.round_to(format), wide.round_to_saturating(format)] {
                assert!(r.is_nan() && r.is_sign_negative() == x.is_sign_negative());
            }
        }
    }
    // E4M3 has one NaN per sign, without payload: the default quiet NaN comes back.
    let payload = f32::from_bits(0x7FFF_FFFF);
    assert_eq!(payload.round_to(Format::E4M3).to_bits(), 0x7FC0_0000);
    // E5M2 keeps the two payload bits it stores, as fp16 keeps ten.
    assert_eq!(payload.round_to(Format::E5M2).to_bits(), 0x7FE0_0000);
}

#[test]
fn slices_round_as_the_scalar_conversions_do() {
    // Every encoding's value, the midpoints and their neighbours, and the range's ends.
    let mut xs: Vec<f64> = Vec::new();
    for format in Format::FP8 {
        let values = positive_values(format);
        for pair in values.windows(2) {
            let mid = (pair[0].1 + pair[1].1) / 2.0;
            xs.extend([pair[0].1, mid, mid * (1.0 + p2(-30)), mid * (1.0 - p2(-30))]);
        }
    }
    xs.extend([464.0, 465.0, 61440.0, 1e9, f64::INFINITY, f64::NAN, 0.0]);
    let xs: Vec<f64> = xs.iter().flat_map(|&x| [x, -x]).collect();
    let xs32: Vec<f32> = xs.iter().map(|&x| x as f32).collect();
    let bits32 = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let bits64 = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for format in Format::FP8 {
        let plain32: Vec<f32> = xs32.iter().map(|x| x.round_to(format)).collect();
        let plain64: Vec<f64> = xs.iter().map(|x| x.round_to(format)).collect();
        let saturating32: Vec<f32> = xs32.iter().map(|x| x.round_to_saturating(format)).collect();
        let saturating64: Vec<f64> = xs.iter().map(|x| x.round_to_saturating(format)).collect();

        let mut got32 = xs32.clone();
        round_slice(&mut got32, format);
        assert_eq!(bits32(&got32), bits32(&plain32), "{format} round_slice f32");
        let mut got64 = xs.clone();
        round_slice(&mut got64, format);
        assert_eq!(bits64(&got64), bits64(&plain64), "{format} round_slice f64");

        let mut copy = vec![std::mem::MaybeUninit::uninit(); xs.len()];
        round_slice_into(&xs, &mut copy, format);
        // SAFETY: round_slice_into wrote every element.
        let copy: Vec<f64> = copy.iter().map(|x| unsafe { x.assume_init() }).collect();
        assert_eq!(
            bits64(&copy),
            bits64(&plain64),
            "{format} round_slice_into f64"
        );

        let mut got32 = xs32.clone();
        round_slice_saturating(&mut got32, format);
        assert_eq!(
            bits32(&got32),
            bits32(&saturating32),
            "{format} saturating f32"
        );
        let mut got64 = xs.clone();
        round_slice_saturating(&mut got64, format);
        assert_eq!(
            bits64(&got64),
            bits64(&saturating64),
            "{format} saturating f64"
        );

        // The counts: beyond the range means plain rounding gave inf, or NaN from a number.
        let expected = |xs: &[f64]| RangeCounts {
            saturated: xs
                .iter()
                .filter(|x| !x.is_nan() && !x.round_to(format).is_finite())
                .count() as u64,
            flushed: xs
                .iter()
                .filter(|&&x| x != 0.0 && x.round_to(format) == 0.0)
                .count() as u64,
        };
        let mut got64 = xs.clone();
        let counts = round_slice_saturating_counting(&mut got64, format);
        assert_eq!(counts, expected(&xs), "{format} f64 counts");
        assert_eq!(
            bits64(&got64),
            bits64(&saturating64),
            "{format} counting f64"
        );
        let widened: Vec<f64> = xs32.iter().map(|&x| f64::from(x)).collect();
        let mut got32 = xs32.clone();
        let counts32 = round_slice_saturating_counting(&mut got32, format);
        assert_eq!(counts32, expected(&widened), "{format} f32 counts");
        assert_eq!(
            bits32(&got32),
            bits32(&saturating32),
            "{format} counting f32"
        );
        assert!(
            counts.saturated >= 6 && counts.flushed >= 2,
            "{format}: {counts:?}"
        );
    }
}

#[test]
fn the_reference_agrees_on_every_midpoint() {
    // The shared test reference (used by the property tests) against this file's decoding.
    for format in Format::FP8 {
        let values = positive_values(format);
        for pair in values.windows(2) {
            let mid = (pair[0].1 + pair[1].1) / 2.0;
            let even = if pair[0].0.is_multiple_of(2) {
                pair[0].1
            } else {
                pair[1].1
            };
            assert_eq!(
                common::reference_round_f64(format, mid),
                even,
                "{format} {mid:e}"
            );
        }
        let top = common::Layout::of(format).overflow_pattern();
        assert_eq!(
            common::midpoint(format, top - 1),
            if format == Format::E4M3 {
                464.0
            } else {
                61440.0
            }
        );
    }
}
