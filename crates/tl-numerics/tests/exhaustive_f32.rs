//! Every one of the 2^32 f32 bit patterns, rounded into every format, plainly and with
//! saturation, against an independent reference.
//!
//! Ignored by default (about 4.3 billion inputs, four formats); CI runs it in release:
//! `cargo test --release -p tl-numerics -- --ignored`.
//!
//! Each input is checked six ways per format: plain rounding by a vectorized slice kernel,
//! by the scalar `round_to`, and by the f64 kernel on the same value widened to f64 (which
//! must agree, since widening is exact); and the saturating conversion the same three ways.
//! The slice kernels are `round_slice` and `round_slice_saturating_counting` (in place,
//! whose counts are checked too) for the positive patterns, and `round_slice_into` (a
//! rounded copy) and `round_slice_saturating` for the negative ones: rounding is symmetric
//! in the sign, so each kernel meets every magnitude.
//!
//! The reference does not round bits: it walks the sorted table of the format's values
//! (`common::Layout::value_table`) alongside the inputs. The non-negative f32 patterns, in
//! increasing order, are increasing magnitudes (then the NaNs), so the pair of table
//! entries enclosing the input only ever moves up, and the pick between the two is the
//! midpoint comparison of `common::pick_nearest`. The saturating reference is the plain one
//! with every overflow (to infinity, or to NaN in E4M3) replaced by the largest finite value.
//!
//! One pass over the patterns checks all four formats: each thread takes a range of
//! magnitudes, and each chunk of inputs is built once and rounded into every format.

mod common;

use std::mem::MaybeUninit;
use std::thread;
use std::time::Instant;

use common::{Layout, pick_nearest};

use tl_numerics::{
    Format, RangeCounts, Round, round_slice, round_slice_into, round_slice_saturating,
    round_slice_saturating_counting,
};

const QUIET_BIT: u32 = 0x0040_0000;
const SIGN_BIT: u32 = 0x8000_0000;
const F32_INF_BITS: u32 = 0x7F80_0000;
/// f32's default quiet NaN: what E4M3's one NaN (no payload) is expected to widen to.
const F32_NAN_BITS: u32 = 0x7FC0_0000;
const CHUNK: usize = 4096;
const MAX_REPORTED: usize = 10;

/// The expected results of rounding one magnitude into a format, as f32 bits.
#[derive(Debug, Clone, Copy)]
struct Expected {
    plain: u32,
    saturating: u32,
    /// Whether the saturation clamped it (beyond the finite range, not a NaN).
    saturated: bool,
}

/// One format's reference: its table of values and a cursor into it.
struct Reference {
    format: Format,
    layout: Layout,
    table: Vec<f64>,
    /// The largest pattern whose value is `<=` the last magnitude looked up.
    lower: usize,
}

impl Reference {
    fn new(format: Format) -> Reference {
        let layout = Layout::of(format);
        Reference {
            format,
            layout,
            table: layout.value_table(),
            lower: 0,
        }
    }

    /// The expected results for the non-negative f32 with bits `abs_bits`; the calls must
    /// come in increasing order of `abs_bits`.
    #[inline]
    fn expected(&mut self, abs_bits: u32) -> Expected {
        if abs_bits > F32_INF_BITS {
            // NaN: quiet, payload cut to what the format stores (E4M3's NaN stores none).
            let nan = if self.layout.ieee_top {
                (abs_bits | QUIET_BIT) & !((1u32 << (23 - self.layout.fraction_bits)) - 1)
            } else {
                F32_NAN_BITS
            };
            return Expected {
                plain: nan,
                saturating: nan,
                saturated: false,
            };
        }
        let abs = f64::from(f32::from_bits(abs_bits));
        let top = self.layout.overflow_pattern();
        let pattern = if abs >= self.table[top as usize] {
            top // infinity, or at least the value the overflow pattern stands for
        } else {
            while self.table[self.lower + 1] <= abs {
                self.lower += 1;
            }
            pick_nearest(&self.table, self.lower as u32, abs)
        };
        if pattern == top {
            Expected {
                plain: if self.layout.ieee_top {
                    F32_INF_BITS
                } else {
                    F32_NAN_BITS
                },
                saturating: (self.layout.max_finite() as f32).to_bits(),
                saturated: true,
            }
        } else {
            let bits = (self.table[pattern as usize] as f32).to_bits();
            Expected {
                plain: bits,
                saturating: bits,
                saturated: false,
            }
        }
    }
}

/// Whether the f64 result `got` for the f32 input `x` is the widened `expected` f32 bits (a
/// NaN only needs to be a NaN of the input's sign: f64 keeps more payload).
#[inline]
fn widened_agrees(got: f64, x: f32, expected: u32) -> bool {
    let expected = f32::from_bits(expected);
    if expected.is_nan() {
        got.is_nan() && got.is_sign_negative() == x.is_sign_negative()
    } else {
        got.to_bits() == f64::from(expected).to_bits()
    }
}

/// Whether all six paths round `x` as expected: `plain` and `saturating` are the slice
/// kernels' results.
///
/// Kept small and inlined, with the report in a separate cold function: this runs 2^33
/// times per format.
#[inline]
fn all_paths_agree(format: Format, x: f32, plain: f32, saturating: f32, e: Expected) -> bool {
    let wide = f64::from(x);
    plain.to_bits() == e.plain
        && x.round_to(format).to_bits() == e.plain
        && saturating.to_bits() == e.saturating
        && x.round_to_saturating(format).to_bits() == e.saturating
        && widened_agrees(wide.round_to(format), x, e.plain)
        && widened_agrees(wide.round_to_saturating(format), x, e.saturating)
}

#[cold]
#[inline(never)]
fn describe_mismatch(format: Format, x: f32, plain: f32, saturating: f32, e: Expected) -> String {
    format!(
        "{format} {:#010x} ({x:e}): expected {:#010x}, saturating {:#010x}; slice kernels \
         {:#010x}, {:#010x}; round_to {:#010x}, round_to_saturating {:#010x}; f64 {:e}, {:e}",
        x.to_bits(),
        e.plain,
        e.saturating,
        plain.to_bits(),
        saturating.to_bits(),
        x.round_to(format).to_bits(),
        x.round_to_saturating(format).to_bits(),
        f64::from(x).round_to(format),
        f64::from(x).round_to_saturating(format),
    )
}

/// The slice kernels' outputs for one chunk in one format.
struct Buffers {
    plain: [f32; CHUNK],
    saturating: [f32; CHUNK],
    plain_negative: [MaybeUninit<f32>; CHUNK],
    saturating_negative: [f32; CHUNK],
}

/// Checks the non-negative patterns `start..end` and their negatives in every format, and
/// returns descriptions of the first mismatches.
///
/// The reference is computed once per magnitude: the formats are sign-magnitude, so rounding
/// `-x` gives the rounding of `x` with the sign bit set (NaN included).
fn check_range(start: u32, end: u32) -> Vec<String> {
    let mut references = Format::ALL.map(Reference::new);
    let mut mismatches = Vec::new();
    let mut positive = [0.0_f32; CHUNK];
    let mut negative = [0.0_f32; CHUNK];
    let mut out = Box::new(Buffers {
        plain: [0.0; CHUNK],
        saturating: [0.0; CHUNK],
        plain_negative: [MaybeUninit::uninit(); CHUNK],
        saturating_negative: [0.0; CHUNK],
    });
    let mut chunk_start = start;
    while chunk_start < end {
        let len = (end - chunk_start).min(CHUNK as u32) as usize;
        for i in 0..len {
            positive[i] = f32::from_bits(chunk_start + i as u32);
            negative[i] = -positive[i];
        }
        for reference in &mut references {
            let format = reference.format;
            let out = &mut *out;
            out.plain[..len].copy_from_slice(&positive[..len]);
            round_slice(&mut out.plain[..len], format);
            out.saturating[..len].copy_from_slice(&positive[..len]);
            let counts = round_slice_saturating_counting(&mut out.saturating[..len], format);
            round_slice_into(&negative[..len], &mut out.plain_negative[..len], format);
            out.saturating_negative[..len].copy_from_slice(&negative[..len]);
            round_slice_saturating(&mut out.saturating_negative[..len], format);

            let mut expected_counts = RangeCounts::default();
            for (i, &x) in positive[..len].iter().enumerate() {
                let abs_bits = chunk_start + i as u32;
                let e = reference.expected(abs_bits);
                expected_counts.saturated += u64::from(e.saturated);
                expected_counts.flushed += u64::from(abs_bits != 0 && e.saturating == 0);
                let negated = Expected {
                    plain: e.plain | SIGN_BIT,
                    saturating: e.saturating | SIGN_BIT,
                    ..e
                };
                // SAFETY: round_slice_into wrote the first `len` elements.
                let plain_negative = unsafe { out.plain_negative[i].assume_init() };
                for (x, plain, saturating, e) in [
                    (x, out.plain[i], out.saturating[i], e),
                    (-x, plain_negative, out.saturating_negative[i], negated),
                ] {
                    if !all_paths_agree(format, x, plain, saturating, e) {
                        mismatches.push(describe_mismatch(format, x, plain, saturating, e));
                        if mismatches.len() >= MAX_REPORTED {
                            return mismatches;
                        }
                    }
                }
            }
            if counts != expected_counts {
                mismatches.push(format!(
                    "{format}: patterns {chunk_start:#010x} + {len}: counted {counts:?}, \
                     expected {expected_counts:?}"
                ));
            }
        }
        chunk_start += len as u32;
    }
    mismatches
}

#[test]
#[ignore = "2^32 inputs in four formats: run in release with --ignored"]
fn every_f32_rounds_to_the_nearest_value_of_every_format_ties_to_even() {
    let started = Instant::now();
    let threads = thread::available_parallelism().map_or(2, |n| n.get()) as u64;
    let total = 1u64 << 31; // the non-negative patterns; check_range adds their negatives
    let mismatches: Vec<String> = thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (start, end) = (total * t / threads, total * (t + 1) / threads);
                scope.spawn(move || check_range(start as u32, end as u32))
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("worker panicked"))
            .collect()
    });
    eprintln!(
        "2^32 f32 patterns checked in {} formats on {threads} threads in {:.1?}",
        Format::ALL.len(),
        started.elapsed()
    );
    assert!(
        mismatches.is_empty(),
        "mismatches:\n{}",
        mismatches.join("\n")
    );
}
