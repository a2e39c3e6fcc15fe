//! Independent references for the rounding tests.
//!
//! They share no code and no algorithm with the crate: instead of rounding the significand
//! with shifts and carries, they decode the format's bit patterns into their exact values,
//! find the two patterns whose values enclose `|x|`, and compare `|x|` with the midpoint of
//! the two. The format parameters are restated here from the formats' specifications (IEEE
//! 754 for bf16 and fp16, OCP's 8-bit formats for E4M3 and E5M2), not read from the crate.
//!
//! Why the midpoint comparison is exact: two adjacent values of any of the formats have at
//! most 11 significant bits, so their sum and half-sum need at most 12 and are exact in f64
//! (and both lie in f64's normal range), and comparing two f64 values is exact.

#![allow(dead_code)] // each test file uses a different part of this module

use std::sync::LazyLock;

use tl_numerics::Format;

/// The layout of a format's positive patterns: `0 | exponent field | fraction field`.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// Stored fraction bits (7 for bf16, 10 for fp16, 3 for E4M3, 2 for E5M2).
    pub fraction_bits: u32,
    /// Exponent bias (127 for bf16, 15 for fp16 and E5M2, 7 for E4M3).
    pub bias: i32,
    /// The bits after the sign: 15 in the 16-bit formats, 7 in fp8.
    pub magnitude_bits: u32,
    /// Whether the all-ones exponent field is reserved for ±inf and NaN (IEEE style). In
    /// E4M3 ("E4M3FN") it is not: it holds normal values, and only the all-ones pattern
    /// `S.1111.111` is NaN; there is no infinity.
    pub ieee_top: bool,
}

impl Layout {
    pub fn of(format: Format) -> Layout {
        let (fraction_bits, bias, magnitude_bits, ieee_top) = match format {
            Format::Bf16 => (7, 127, 15, true),
            Format::Fp16 => (10, 15, 15, true),
            Format::E4M3 => (3, 7, 7, false),
            Format::E5M2 => (2, 15, 7, true),
        };
        Layout {
            fraction_bits,
            bias,
            magnitude_bits,
            ieee_top,
        }
    }

    /// The first positive pattern above the largest finite value: +infinity (all exponent
    /// bits set, fraction zero) in the IEEE-style formats, the NaN pattern `0.1111.111` in
    /// E4M3.
    pub fn overflow_pattern(self) -> u32 {
        let all_ones = (1 << self.magnitude_bits) - 1;
        if self.ieee_top {
            all_ones & !((1 << self.fraction_bits) - 1)
        } else {
            all_ones
        }
    }

    /// What a rounding gives for a magnitude that overflows: infinity, or NaN in E4M3.
    pub fn overflow_value(self) -> f64 {
        if self.ieee_top {
            f64::INFINITY
        } else {
            f64::NAN
        }
    }

    /// The exact value of a positive pattern, as f64.
    ///
    /// The overflow pattern decodes to the value it would have with an unbounded exponent:
    /// `2^(emax + 1)` for infinity's pattern, `1.111₂ * 2^8 = 480` for E4M3's NaN. It is the
    /// upper neighbour of the largest finite value, and the midpoint between the two is the
    /// overflow threshold of round-to-nearest.
    pub fn decode(self, pattern: u32) -> f64 {
        let exponent_field = (pattern >> self.fraction_bits) as i32;
        let fraction = f64::from(pattern & ((1 << self.fraction_bits) - 1));
        let scale = 2f64.powi(-(self.fraction_bits as i32));
        if exponent_field == 0 {
            fraction * scale * 2f64.powi(1 - self.bias)
        } else {
            (1.0 + fraction * scale) * 2f64.powi(exponent_field - self.bias)
        }
    }

    /// All positive patterns' values, from +0 up to and including the overflow pattern.
    pub fn value_table(self) -> Vec<f64> {
        (0..=self.overflow_pattern())
            .map(|p| self.decode(p))
            .collect()
    }

    /// The largest finite value.
    pub fn max_finite(self) -> f64 {
        self.decode(self.overflow_pattern() - 1)
    }
}

/// Picks between the enclosing patterns `lower` and `lower + 1` for a magnitude `abs` with
/// `table[lower] <= abs < table[lower + 1]`: the nearer, ties to the even pattern.
pub fn pick_nearest(table: &[f64], lower: u32, abs: f64) -> u32 {
    let lo = table[lower as usize];
    if abs == lo {
        return lower;
    }
    let mid = (lo + table[lower as usize + 1]) / 2.0;
    if abs < mid || (abs == mid && lower.is_multiple_of(2)) {
        lower
    } else {
        lower + 1
    }
}

/// The value of a chosen positive pattern as f64, with the overflow pattern meaning
/// overflow (infinity, or NaN in E4M3).
pub fn value_of(layout: Layout, table: &[f64], pattern: u32) -> f64 {
    if pattern == layout.overflow_pattern() {
        layout.overflow_value()
    } else {
        table[pattern as usize]
    }
}

/// Reference rounding of any f64 by binary search over the table of format values.
///
/// NaN is only checked to be NaN by the callers, so it is returned as is.
pub fn reference_round_f64(format: Format, x: f64) -> f64 {
    // Built once per format: the 16-bit tables have 32K entries and proptest calls this
    // often.
    static BF16: LazyLock<Vec<f64>> = LazyLock::new(|| Layout::of(Format::Bf16).value_table());
    static FP16: LazyLock<Vec<f64>> = LazyLock::new(|| Layout::of(Format::Fp16).value_table());
    static E4M3: LazyLock<Vec<f64>> = LazyLock::new(|| Layout::of(Format::E4M3).value_table());
    static E5M2: LazyLock<Vec<f64>> = LazyLock::new(|| Layout::of(Format::E5M2).value_table());
    let table = match format {
        Format::Bf16 => &BF16,
        Format::Fp16 => &FP16,
        Format::E4M3 => &E4M3,
        Format::E5M2 => &E5M2,
    };
    reference_round_f64_with(Layout::of(format), table, x)
}

/// Reference saturating rounding: [`reference_round_f64`], with a magnitude that overflows
/// (or is infinite) clamped to the largest finite value, sign kept. NaN is returned as is.
pub fn reference_round_saturating_f64(format: Format, x: f64) -> f64 {
    let rounded = reference_round_f64(format, x);
    if !x.is_nan() && (rounded.is_infinite() || rounded.is_nan()) {
        Layout::of(format).max_finite().copysign(x)
    } else {
        rounded
    }
}

/// As [`reference_round_f64`] with the table built once by the caller.
pub fn reference_round_f64_with(layout: Layout, table: &[f64], x: f64) -> f64 {
    if x.is_nan() || x == 0.0 {
        return x;
    }
    let abs = x.abs();
    let top = layout.overflow_pattern();
    let magnitude = if abs >= table[top as usize] {
        layout.overflow_value()
    } else {
        // Largest pattern whose value is <= abs; table[0] = 0 <= abs < table[top].
        let lower = table.partition_point(|&v| v <= abs) as u32 - 1;
        value_of(layout, table, pick_nearest(table, lower, abs))
    };
    magnitude.copysign(x)
}

/// `2^e` as f64 for the normal exponents, from the bits (cheaper than `powi` in hot loops).
pub fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// The midpoint between the format values of positive patterns `k` and `k + 1`, for
/// `k < overflow_pattern` (so the last one is the overflow threshold).
pub fn midpoint(format: Format, k: u32) -> f64 {
    let layout = Layout::of(format);
    (layout.decode(k) + layout.decode(k + 1)) / 2.0
}
