//! [`Precision`]: the arithmetic a training step runs its matmuls in.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tl_numerics::Format;

use crate::autocast::{AutocastGuard, autocast_accumulation, autocast_with};
use crate::error::PrecisionError;

/// The precision of a training step: plain f32, or f32 masters with emulated 16-bit matmuls.
///
/// Parsed from and displayed as `"fp32"`, `"bf16"` or `"fp16"` (the names a config file or
/// command line uses).
///
/// ```
/// use tl_numerics::Format;
/// use tl_precision::Precision;
///
/// let p: Precision = "bf16".parse()?;
/// assert_eq!(p.format(), Some(Format::Bf16));
/// assert_eq!(Precision::Fp32.format(), None);
/// assert!("float16".parse::<Precision>().is_err());
/// # Ok::<(), tl_precision::PrecisionError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Every op in the element type; no autocast.
    #[default]
    Fp32,
    /// Matmuls under bf16 autocast (no loss scaling needed: bf16 has f32's range).
    Bf16,
    /// Matmuls under fp16 autocast (pair it with a loss scaler: small gradients underflow).
    Fp16,
}

impl Precision {
    /// All precisions, in a fixed order.
    pub const ALL: [Precision; 3] = [Precision::Fp32, Precision::Bf16, Precision::Fp16];

    /// The name: `"fp32"`, `"bf16"` or `"fp16"`.
    pub const fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    /// The 16-bit format its matmuls round to, or `None` for plain f32.
    pub const fn format(self) -> Option<Format> {
        match self {
            Precision::Fp32 => None,
            Precision::Bf16 => Some(Format::Bf16),
            Precision::Fp16 => Some(Format::Fp16),
        }
    }

    /// Turns on the autocast of this precision until the guard drops (`None` for fp32, which
    /// leaves the thread's current mode alone).
    ///
    /// The products keep the accumulation model in force on the thread
    /// ([`autocast_accumulation`]): a caller that chose the hardware with
    /// [`autocast_with`] runs a recipe's steps, which turn on their precision themselves, on
    /// that hardware.
    ///
    /// ```
    /// use tl_numerics::Format;
    /// use tl_precision::{Accumulation, Precision, autocast_accumulation, autocast_with};
    ///
    /// let _h100 = autocast_with(Format::Bf16, Accumulation::H100);
    /// let _fp16 = Precision::Fp16.autocast();
    /// assert_eq!(autocast_accumulation(), Accumulation::H100);
    /// ```
    pub fn autocast(self) -> Option<AutocastGuard> {
        self.format()
            .map(|format| autocast_with(format, autocast_accumulation()))
    }
}

/// The precision whose matmuls round to a 16-bit format.
///
/// Fallible since tl-numerics also has the fp8 formats: a training step in fp8 needs
/// per-tensor scales and saturating casts, not just autocast into the format, so no
/// `Precision` stands for one.
///
/// # Errors
/// [`PrecisionError::NoPrecisionForFormat`] for E4M3 and E5M2.
///
/// ```
/// use tl_numerics::Format;
/// use tl_precision::{Precision, PrecisionError};
///
/// assert_eq!(Precision::try_from(Format::Bf16), Ok(Precision::Bf16));
/// assert_eq!(
///     Precision::try_from(Format::E4M3),
///     Err(PrecisionError::NoPrecisionForFormat { format: Format::E4M3 })
/// );
/// ```
impl TryFrom<Format> for Precision {
    type Error = PrecisionError;

    fn try_from(format: Format) -> Result<Self, Self::Error> {
        match format {
            Format::Bf16 => Ok(Precision::Bf16),
            Format::Fp16 => Ok(Precision::Fp16),
            Format::E4M3 | Format::E5M2 => Err(PrecisionError::NoPrecisionForFormat { format }),
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = PrecisionError;

    /// Parses exactly `"fp32"`, `"bf16"` or `"fp16"`.
    ///
    /// # Errors
    /// [`PrecisionError::UnknownPrecision`] for any other text.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| PrecisionError::UnknownPrecision {
                input: s.to_owned(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_others_are_rejected() {
        for p in Precision::ALL {
            assert_eq!(p.name().parse::<Precision>(), Ok(p));
            assert_eq!(p.to_string(), p.name());
        }
        for bad in ["FP32", "bf16 ", "fp8", ""] {
            assert_eq!(
                bad.parse::<Precision>(),
                Err(PrecisionError::UnknownPrecision { input: bad.into() })
            );
        }
        for format in Format::SIXTEEN_BIT {
            let precision = Precision::try_from(format).unwrap();
            assert_eq!(precision.format(), Some(format));
        }
        for format in Format::FP8 {
            let err = Precision::try_from(format).unwrap_err();
            assert_eq!(err, PrecisionError::NoPrecisionForFormat { format });
            assert!(err.to_string().contains(format.name()), "{err}");
        }
    }

    #[test]
    fn fp32_installs_no_autocast() {
        assert!(Precision::Fp32.autocast().is_none());
        let guard = Precision::Fp16.autocast();
        assert_eq!(crate::autocast_format(), Some(Format::Fp16));
        drop(guard);
        assert_eq!(crate::autocast_format(), None);
    }
}
