//! The parameters, names and parsing of `Format`.

use std::collections::HashSet;
use std::str::FromStr;

use tl_numerics::{Format, NumericsError};

#[test]
fn parameters_match_the_ieee_layouts() {
    // bf16: 8 exponent bits (emin -126, emax 127), p = 8.
    let bf16 = Format::Bf16;
    assert_eq!((bf16.precision_bits(), bf16.exponent_bits()), (8, 8));
    assert_eq!(bf16.unit_roundoff(), 2f64.powi(-8));
    assert_eq!(bf16.max_finite(), 3.3895313892515355e38);
    assert_eq!(bf16.max_finite(), (2.0 - 2f64.powi(-7)) * 2f64.powi(127));
    assert_eq!(bf16.min_normal(), 2f64.powi(-126));
    assert_eq!(bf16.min_subnormal(), 2f64.powi(-133));

    // fp16: 5 exponent bits (emin -14, emax 15), p = 11.
    let fp16 = Format::Fp16;
    assert_eq!((fp16.precision_bits(), fp16.exponent_bits()), (11, 5));
    assert_eq!(fp16.unit_roundoff(), 2f64.powi(-11));
    assert_eq!(fp16.max_finite(), 65504.0);
    assert_eq!(fp16.min_normal(), 2f64.powi(-14));
    assert_eq!(fp16.min_subnormal(), 2f64.powi(-24));
}

#[test]
fn parameters_match_the_fp8_layouts() {
    // E4M3 (OCP E4M3FN): 4 exponent bits, bias 7 (emin -6), p = 4. The all-ones exponent
    // field holds values, so emax is 8, and the largest significand is 1.110 (1.111 at the
    // top exponent is the NaN): 1.75 * 2^8.
    let e4m3 = Format::E4M3;
    assert_eq!((e4m3.precision_bits(), e4m3.exponent_bits()), (4, 4));
    assert_eq!(e4m3.unit_roundoff(), 2f64.powi(-4));
    assert_eq!(e4m3.max_finite(), 448.0);
    assert_eq!(e4m3.min_normal(), 2f64.powi(-6));
    assert_eq!(e4m3.min_subnormal(), 2f64.powi(-9));
    assert!(!e4m3.has_infinity());

    // E5M2: IEEE-style, fp16's exponent field (emin -14, emax 15) with p = 3.
    let e5m2 = Format::E5M2;
    assert_eq!((e5m2.precision_bits(), e5m2.exponent_bits()), (3, 5));
    assert_eq!(e5m2.unit_roundoff(), 2f64.powi(-3));
    assert_eq!(e5m2.max_finite(), 57344.0);
    assert_eq!(e5m2.max_finite(), (2.0 - 2f64.powi(-2)) * 2f64.powi(15));
    assert_eq!(e5m2.min_normal(), 2f64.powi(-14));
    assert_eq!(e5m2.min_subnormal(), 2f64.powi(-16));
    assert!(e5m2.has_infinity());
    assert!(Format::Bf16.has_infinity() && Format::Fp16.has_infinity());
}

#[test]
fn the_format_lists_split_all_into_sixteen_bit_and_fp8() {
    assert_eq!(
        Format::ALL,
        [Format::Bf16, Format::Fp16, Format::E4M3, Format::E5M2]
    );
    assert_eq!(Format::SIXTEEN_BIT, [Format::Bf16, Format::Fp16]);
    assert_eq!(Format::FP8, [Format::E4M3, Format::E5M2]);
    let joined: Vec<Format> = Format::SIXTEEN_BIT.into_iter().chain(Format::FP8).collect();
    assert_eq!(joined, Format::ALL);
    // Sixteen bits: sign, exponent and the stored fraction (p - 1 bits); eight for fp8.
    for (formats, width) in [(Format::SIXTEEN_BIT, 16), (Format::FP8, 8)] {
        for f in formats {
            assert_eq!(1 + f.exponent_bits() + f.precision_bits() - 1, width, "{f}");
        }
    }
}

#[test]
fn parameters_are_usable_in_const_context() {
    const FP16_MAX: f64 = Format::Fp16.max_finite();
    const BF16_U: f64 = Format::Bf16.unit_roundoff();
    const E4M3_MAX: f64 = Format::E4M3.max_finite();
    const E4M3_HAS_INFINITY: bool = Format::E4M3.has_infinity();
    assert_eq!((FP16_MAX, BF16_U), (65504.0, 0.00390625));
    assert_eq!((E4M3_MAX, E4M3_HAS_INFINITY), (448.0, false));
}

#[test]
fn parameters_agree_with_the_half_crate() {
    assert_eq!(Format::Bf16.max_finite(), half::bf16::MAX.to_f64());
    assert_eq!(Format::Bf16.min_normal(), half::bf16::MIN_POSITIVE.to_f64());
    assert_eq!(
        Format::Bf16.min_subnormal(),
        half::bf16::MIN_POSITIVE_SUBNORMAL.to_f64()
    );
    assert_eq!(Format::Fp16.max_finite(), half::f16::MAX.to_f64());
    assert_eq!(Format::Fp16.min_normal(), half::f16::MIN_POSITIVE.to_f64());
    assert_eq!(
        Format::Fp16.min_subnormal(),
        half::f16::MIN_POSITIVE_SUBNORMAL.to_f64()
    );
}

#[test]
fn names_display_and_parse_round_trip() {
    for format in Format::ALL {
        assert_eq!(format.to_string(), format.name());
        assert_eq!(format.name().parse::<Format>(), Ok(format));
    }
    assert_eq!(Format::Bf16.to_string(), "bf16");
    assert_eq!(Format::Fp16.to_string(), "fp16");
    assert_eq!(Format::E4M3.to_string(), "e4m3");
    assert_eq!(Format::E5M2.to_string(), "e5m2");
    let distinct: HashSet<Format> = Format::ALL.into_iter().collect();
    assert_eq!(distinct.len(), 4);
}

#[test]
fn parsing_accepts_exactly_the_four_names() {
    for bad in [
        "BF16",
        "Fp16",
        " bf16",
        "bf16 ",
        "float16",
        "f16",
        "bfloat16",
        "fp32",
        "",
        "fp8",
        "E4M3",
        "e4m3fn",
        "float8_e4m3fn",
        "e5m2 ",
        "E5M2",
        "fp8_e5m2",
        "e3m4",
    ] {
        assert_eq!(
            Format::from_str(bad),
            Err(NumericsError::UnknownFormat {
                input: bad.to_owned()
            }),
            "{bad:?}"
        );
    }
}

#[test]
fn unknown_format_message_names_the_input_and_the_valid_names() {
    let message = Format::from_str("float8").unwrap_err().to_string();
    assert!(message.contains("float8"), "{message}");
    for format in Format::ALL {
        assert!(message.contains(format.name()), "{message}");
    }
}
