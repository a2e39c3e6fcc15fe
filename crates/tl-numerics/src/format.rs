//! The floating-point formats and their parameters: the two 16-bit formats and the two
//! 8-bit (fp8) ones.
//!
//! All four are binary formats with a sign bit, a biased exponent and a significand with an
//! implicit leading bit, and gradual underflow into subnormals; they differ in how the bits
//! after the sign are split between exponent and significand, and in what the top of the
//! range is used for:
//!
//! | format | bits | exponent bits | stored fraction bits | precision `p` | exponent range | largest finite | smallest subnormal | infinities |
//! |--------|------|---------------|----------------------|---------------|----------------|----------------|--------------------|------------|
//! | bf16   | 16   | 8             | 7                    | 8             | -126 ..= 127   | ≈ 3.3895e38    | `2^-133`           | yes        |
//! | fp16   | 16   | 5             | 10                   | 11            | -14 ..= 15     | 65504          | `2^-24`            | yes        |
//! | e4m3   | 8    | 4             | 3                    | 4             | -6 ..= 8       | 448            | `2^-9`             | no         |
//! | e5m2   | 8    | 5             | 2                    | 3             | -14 ..= 15     | 57344          | `2^-16`            | yes        |
//!
//! bf16, fp16 and e5m2 follow the IEEE 754 layout: the all-ones exponent field is reserved
//! for ±inf (fraction zero) and NaN (fraction nonzero), so the largest exponent of a finite
//! value is `emax = 2^(exponent_bits - 1) - 1` and the largest finite value is
//! `(2 - 2^(1-p)) * 2^emax`. e5m2 is fp16 with its significand cut from 11 bits to 3: the
//! same exponent range.
//!
//! e4m3 is the OCP 8-bit format "E4M3FN" (finite, with NaN): with only 4 exponent bits,
//! giving up a whole binade for infinities would cost half the dynamic range above 1, so the
//! all-ones exponent field holds ordinary normal values and the only NaNs are `S.1111.111`.
//! Its largest exponent is therefore `emax = 8` (the all-ones field 15 minus the bias 7), one
//! more than the IEEE rule gives, and its largest finite value is `1.110₂ * 2^8 = 448`, the
//! all-ones significand `1.111₂` being taken by NaN. It has no infinities: a conversion that
//! overflows gives NaN (and the saturating one, ±448).
//!
//! Every other parameter follows from `p` and the minimum exponent
//! `emin = 2 - 2^(exponent_bits - 1)` (the bias is `1 - emin`): the unit roundoff is `2^-p`,
//! the smallest normal `2^emin` and the smallest subnormal `2^(emin - p + 1)`.

use std::fmt;
use std::str::FromStr;

use crate::error::{NumericsError, Result};

/// A low-precision floating-point format whose rounding is emulated in f32 or f64: one of
/// the two 16-bit formats or the two fp8 formats.
///
/// # Examples
///
/// ```
/// use tl_numerics::Format;
///
/// let f: Format = "fp16".parse()?;
/// assert_eq!(f, Format::Fp16);
/// assert_eq!(f.max_finite(), 65504.0);
/// assert_eq!(f.to_string(), "fp16");
///
/// // E4M3 spends its all-ones exponent on values, not on infinities.
/// let e4m3: Format = "e4m3".parse()?;
/// assert_eq!((e4m3.max_finite(), e4m3.has_infinity()), (448.0, false));
/// assert_eq!(Format::E5M2.max_finite(), 57344.0);
/// # Ok::<(), tl_numerics::NumericsError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// bfloat16: float32's 8 exponent bits (same range) with 8 bits of precision.
    Bf16,
    /// IEEE 754 binary16: 5 exponent bits (largest finite 65504) with 11 bits of precision.
    Fp16,
    /// OCP fp8 E4M3 ("E4M3FN"): 4 exponent bits (bias 7) and 4 bits of precision; no
    /// infinities, largest finite 448, NaN only as `S.1111.111`. In fp8 training, the usual
    /// format of weights and activations.
    E4M3,
    /// OCP fp8 E5M2: fp16's 5 exponent bits (bias 15, same range) and 3 bits of precision;
    /// IEEE-style, with infinities and largest finite 57344. In fp8 training, the usual
    /// format of gradients, which need the range more than the precision.
    E5M2,
}

/// `2^e` as an f64, built from its bits so that it can be evaluated in a `const fn`.
///
/// Valid for the normal f64 exponents `-1022 ..= 1023`, which covers every parameter of
/// every format.
const fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

impl Format {
    /// Every format, in a fixed order (the 16-bit ones, then fp8): handy to loop over in
    /// tests and reports.
    ///
    /// Code that only makes sense for the 16-bit formats (autocast's recipes, loss scaling)
    /// should loop over [`SIXTEEN_BIT`](Format::SIXTEEN_BIT) instead.
    pub const ALL: [Format; 4] = [Format::Bf16, Format::Fp16, Format::E4M3, Format::E5M2];

    /// The two 16-bit formats, bf16 and fp16.
    pub const SIXTEEN_BIT: [Format; 2] = [Format::Bf16, Format::Fp16];

    /// The two 8-bit formats, E4M3 and E5M2.
    pub const FP8: [Format; 2] = [Format::E4M3, Format::E5M2];

    /// The name used by [`Display`](fmt::Display) and accepted by [`FromStr`]: `"bf16"`,
    /// `"fp16"`, `"e4m3"` or `"e5m2"`.
    pub const fn name(self) -> &'static str {
        match self {
            Format::Bf16 => "bf16",
            Format::Fp16 => "fp16",
            Format::E4M3 => "e4m3",
            Format::E5M2 => "e5m2",
        }
    }

    /// The precision `p`: significant bits, the implicit leading bit included (8, 11, 4 and
    /// 3 for bf16, fp16, E4M3 and E5M2).
    pub const fn precision_bits(self) -> u32 {
        match self {
            Format::Bf16 => 8,
            Format::Fp16 => 11,
            Format::E4M3 => 4,
            Format::E5M2 => 3,
        }
    }

    /// The width of the exponent field in bits (8, 5, 4 and 5).
    pub const fn exponent_bits(self) -> u32 {
        match self {
            Format::Bf16 => 8,
            Format::Fp16 => 5,
            Format::E4M3 => 4,
            Format::E5M2 => 5,
        }
    }

    /// Whether the format has ±infinity: true for bf16, fp16 and E5M2, false for E4M3, whose
    /// all-ones exponent field holds finite values. Where a format has no infinity, a
    /// conversion that overflows gives NaN.
    pub const fn has_infinity(self) -> bool {
        !matches!(self, Format::E4M3)
    }

    /// The exponent of the smallest normal value, `emin = 2 - 2^(exponent_bits - 1)`: the
    /// exponent field 1 less the bias `2^(exponent_bits - 1) - 1`, the same in all four.
    pub(crate) const fn min_exponent(self) -> i32 {
        2 - (1 << (self.exponent_bits() - 1))
    }

    /// The exponent of the largest finite value: `emax = 2^(exponent_bits - 1) - 1` where
    /// the all-ones exponent field is reserved for infinities and NaNs, one more (8) for
    /// E4M3, which uses that field for values.
    pub(crate) const fn max_exponent(self) -> i32 {
        let ieee = (1 << (self.exponent_bits() - 1)) - 1;
        if self.has_infinity() { ieee } else { ieee + 1 }
    }

    /// The largest significand of a finite value at exponent `emax`: all ones,
    /// `2 - 2^(1-p)`, except in E4M3, where the all-ones pattern `S.1111.111` is NaN and
    /// the largest is one step below, `2 - 2^(2-p) = 1.75`.
    const fn max_significand(self) -> f64 {
        let p = self.precision_bits() as i32;
        if self.has_infinity() {
            2.0 - pow2(1 - p)
        } else {
            2.0 - pow2(2 - p)
        }
    }

    /// The unit roundoff `u = 2^-p`: the largest relative error of one rounding to nearest
    /// (`2^-8` for bf16, `2^-11` for fp16, `2^-4` for E4M3, `2^-3` for E5M2), for results in
    /// the normal range.
    pub const fn unit_roundoff(self) -> f64 {
        pow2(-(self.precision_bits() as i32))
    }

    /// The largest finite value: `(2 - 2^(1-p)) * 2^emax` for the IEEE-style formats,
    /// `1.75 * 2^8` for E4M3.
    ///
    /// bf16: `(2 - 2^-7) * 2^127 ≈ 3.3895e38`; fp16: `(2 - 2^-10) * 2^15 = 65504`;
    /// E4M3: `(2 - 2^-2) * 2^8 = 448`; E5M2: `(2 - 2^-2) * 2^15 = 57344`.
    pub const fn max_finite(self) -> f64 {
        // The significand has at most p bits, so the product is exact.
        self.max_significand() * pow2(self.max_exponent())
    }

    /// The smallest positive normal value, `2^emin` (`2^-126` for bf16, `2^-14` for fp16
    /// and E5M2, `2^-6` for E4M3).
    pub const fn min_normal(self) -> f64 {
        pow2(self.min_exponent())
    }

    /// The smallest positive subnormal value, `2^(emin - p + 1)` (`2^-133` for bf16,
    /// `2^-24` for fp16, `2^-9` for E4M3, `2^-16` for E5M2): the spacing of the format below
    /// `min_normal`.
    pub const fn min_subnormal(self) -> f64 {
        pow2(self.min_exponent() + 1 - self.precision_bits() as i32)
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Format {
    type Err = NumericsError;

    /// Parses exactly `"bf16"`, `"fp16"`, `"e4m3"` or `"e5m2"`.
    ///
    /// Matching is exact (no case folding, no trimming) so that a name in a config file
    /// means one thing only.
    ///
    /// # Errors
    ///
    /// [`NumericsError::UnknownFormat`] for any other text; its message names the input and
    /// lists the valid names.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::str::FromStr;
    /// use tl_numerics::{Format, NumericsError};
    ///
    /// assert_eq!(Format::from_str("bf16"), Ok(Format::Bf16));
    /// let err = Format::from_str("BF16").unwrap_err();
    /// assert_eq!(err, NumericsError::UnknownFormat { input: "BF16".into() });
    /// assert!(err.to_string().contains("\"bf16\", \"fp16\", \"e4m3\", \"e5m2\""));
    /// // The fp8 names are the formats' own, not a family name or another library's.
    /// assert_eq!(Format::from_str("e5m2"), Ok(Format::E5M2));
    /// assert!(Format::from_str("fp8").is_err());
    /// assert!(Format::from_str("e4m3fn").is_err());
    /// ```
    fn from_str(s: &str) -> Result<Self> {
        Format::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| NumericsError::UnknownFormat {
                input: s.to_owned(),
            })
    }
}
