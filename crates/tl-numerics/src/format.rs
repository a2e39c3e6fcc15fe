//! The two 16-bit floating-point formats and their parameters.
//!
//! Both formats are binary IEEE-style formats with a sign bit, a biased exponent and a
//! significand with an implicit leading bit; they differ only in how the 15 remaining bits
//! are split between exponent and significand:
//!
//! | format | exponent bits | stored significand bits | precision `p` | exponent range |
//! |--------|---------------|-------------------------|---------------|----------------|
//! | bf16   | 8             | 7                       | 8             | -126 ..= 127   |
//! | fp16   | 5             | 10                      | 11            | -14 ..= 15     |
//!
//! Every parameter below follows from `p`, the minimum exponent `emin` and the maximum
//! exponent `emax`: the unit roundoff is `2^-p`, the largest finite value
//! `(2 - 2^(1-p)) * 2^emax`, the smallest normal `2^emin` and the smallest subnormal
//! `2^(emin - p + 1)`.

use std::fmt;
use std::str::FromStr;

use crate::error::{NumericsError, Result};

/// A 16-bit floating-point format whose rounding is emulated in f32 or f64.
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
/// # Ok::<(), tl_numerics::NumericsError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// bfloat16: float32's 8 exponent bits (same range) with 8 bits of precision.
    Bf16,
    /// IEEE 754 binary16: 5 exponent bits (largest finite 65504) with 11 bits of precision.
    Fp16,
}

/// `2^e` as an f64, built from its bits so that it can be evaluated in a `const fn`.
///
/// Valid for the normal f64 exponents `-1022 ..= 1023`, which covers every parameter of
/// both formats.
const fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

impl Format {
    /// Both formats, in a fixed order: handy to loop over in tests and reports.
    pub const ALL: [Format; 2] = [Format::Bf16, Format::Fp16];

    /// The 16-bit formats, bf16 and fp16: today every format, but code that only makes
    /// sense for them (autocast's recipes, loss scaling) loops over this list rather than
    /// [`ALL`](Format::ALL), so that a narrower format added to `ALL` does not reach it.
    pub const SIXTEEN_BIT: [Format; 2] = [Format::Bf16, Format::Fp16];

    /// The name used by [`Display`](fmt::Display) and accepted by [`FromStr`]: `"bf16"` or `"fp16"`.
    pub const fn name(self) -> &'static str {
        match self {
            Format::Bf16 => "bf16",
            Format::Fp16 => "fp16",
        }
    }

    /// The precision `p`: significant bits, the implicit leading bit included (8 or 11).
    pub const fn precision_bits(self) -> u32 {
        match self {
            Format::Bf16 => 8,
            Format::Fp16 => 11,
        }
    }

    /// The width of the exponent field in bits (8 or 5).
    pub const fn exponent_bits(self) -> u32 {
        match self {
            Format::Bf16 => 8,
            Format::Fp16 => 5,
        }
    }

    /// The exponent of the smallest normal value, `emin = 2 - 2^(exponent_bits - 1)`.
    pub(crate) const fn min_exponent(self) -> i32 {
        2 - (1 << (self.exponent_bits() - 1))
    }

    /// The exponent of the largest finite value, `emax = 2^(exponent_bits - 1) - 1`.
    pub(crate) const fn max_exponent(self) -> i32 {
        (1 << (self.exponent_bits() - 1)) - 1
    }

    /// The unit roundoff `u = 2^-p`: the largest relative error of one rounding to nearest
    /// (`2^-8` for bf16, `2^-11` for fp16), for results in the normal range.
    pub const fn unit_roundoff(self) -> f64 {
        pow2(-(self.precision_bits() as i32))
    }

    /// The largest finite value, `(2 - 2^(1-p)) * 2^emax`.
    ///
    /// bf16: `(2 - 2^-7) * 2^127 ≈ 3.3895e38`; fp16: `(2 - 2^-10) * 2^15 = 65504`.
    pub const fn max_finite(self) -> f64 {
        // The significand 2 - 2^(1-p) has p bits, so the product is exact.
        (2.0 - pow2(1 - self.precision_bits() as i32)) * pow2(self.max_exponent())
    }

    /// The smallest positive normal value, `2^emin` (`2^-126` for bf16, `2^-14` for fp16).
    pub const fn min_normal(self) -> f64 {
        pow2(self.min_exponent())
    }

    /// The smallest positive subnormal value, `2^(emin - p + 1)` (`2^-133` for bf16,
    /// `2^-24` for fp16): the spacing of the format below `min_normal`.
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

    /// Parses exactly `"bf16"` or `"fp16"`.
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
    /// assert!(err.to_string().contains("\"bf16\", \"fp16\""));
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
