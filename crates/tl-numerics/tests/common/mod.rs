//! Independent references for the rounding tests.
//!
//! They share no code and no algorithm with the crate: instead of rounding the significand
//! with shifts and carries, they decode 16-bit patterns into their exact values, find the two
//! patterns whose values enclose `|x|`, and compare `|x|` with the midpoint of the two. The
//! format parameters are restated here from the IEEE layouts, not read from the crate.
//!
//! Why the midpoint comparison is exact: two adjacent values of a 16-bit format have at most
//! 11 significant bits, so their sum and half-sum need at most 12 and are exact in f64 (and
//! both lie in f64's normal range), and comparing two f64 values is exact.

#![allow(dead_code)] // each test file uses a different part of this module

use std::sync::LazyLock;

use tl_numerics::Format;

/// The layout of a format's positive patterns: `0 | exponent field | fraction field`.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// Stored fraction bits (7 for bf16, 10 for fp16).
    pub fraction_bits: u32,
    /// Exponent bias (127 for bf16, 15 for fp16).
    pub bias: i32,
}

impl Layout {
    pub fn of(format: Format) -> Layout {
        match format {
            Format::Bf16 => Layout {
                fraction_bits: 7,
                bias: 127,
            },
            Format::Fp16 => Layout {
                fraction_bits: 10,
                bias: 15,
            },
        }
    }

    /// The pattern of +infinity: all exponent bits set, fraction zero.
    pub fn infinity_pattern(self) -> u32 {
        0x7FFF & !((1 << self.fraction_bits) - 1)
    }

    /// The exact value of a positive pattern, as f64.
    ///
    /// The infinity pattern decodes to `2^(emax + 1)`, the value it would have with an
    /// unbounded exponent: it is the upper neighbour of the largest finite value, and the
    /// midpoint between the two is the overflow threshold of round-to-nearest.
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

    /// All positive patterns' values, from +0 up to and including the infinity pattern.
    pub fn value_table(self) -> Vec<f64> {
        (0..=self.infinity_pattern())
            .map(|p| self.decode(p))
            .collect()
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

/// The value of a chosen positive pattern as f64, with the infinity pattern meaning infinity.
pub fn value_of(layout: Layout, table: &[f64], pattern: u32) -> f64 {
    if pattern == layout.infinity_pattern() {
        f64::INFINITY
    } else {
        table[pattern as usize]
    }
}

/// Reference rounding of any f64 by binary search over the table of format values.
///
/// NaN is only checked to be NaN by the callers, so it is returned as is.
pub fn reference_round_f64(format: Format, x: f64) -> f64 {
    // Built once per format: the tables have 32K entries and proptest calls this often.
    static BF16: LazyLock<Vec<f64>> = LazyLock::new(|| Layout::of(Format::Bf16).value_table());
    static FP16: LazyLock<Vec<f64>> = LazyLock::new(|| Layout::of(Format::Fp16).value_table());
    let table = match format {
        Format::Bf16 => &BF16,
        Format::Fp16 => &FP16,
    };
    reference_round_f64_with(Layout::of(format), table, x)
}

/// As [`reference_round_f64`] with the table built once by the caller.
pub fn reference_round_f64_with(layout: Layout, table: &[f64], x: f64) -> f64 {
    if x.is_nan() || x == 0.0 {
        return x;
    }
    let abs = x.abs();
    let top = layout.infinity_pattern();
    let magnitude = if abs >= table[top as usize] {
        f64::INFINITY
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
/// `k < infinity_pattern` (so the last one is the overflow threshold).
pub fn midpoint(format: Format, k: u32) -> f64 {
    let layout = Layout::of(format);
    (layout.decode(k) + layout.decode(k + 1)) / 2.0
}
