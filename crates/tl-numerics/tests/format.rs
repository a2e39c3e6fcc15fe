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
fn parameters_are_usable_in_const_context() {
    const FP16_MAX: f64 = Format::Fp16.max_finite();
    const BF16_U: f64 = Format::Bf16.unit_roundoff();
    assert_eq!((FP16_MAX, BF16_U), (65504.0, 0.00390625));
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
    let distinct: HashSet<Format> = Format::ALL.into_iter().collect();
    assert_eq!(distinct.len(), 2);
}

#[test]
fn parsing_accepts_exactly_the_two_names() {
    for bad in [
        "BF16", "Fp16", " bf16", "bf16 ", "float16", "f16", "bfloat16", "fp32", "",
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
