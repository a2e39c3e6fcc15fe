//! Every one of the 2^32 f32 bit patterns, rounded into both formats, against an
//! independent reference.
//!
//! Ignored by default (about 4.3 billion inputs per format); CI runs it in release:
//! `cargo test --release -p tl-numerics -- --ignored`.
//!
//! Each input is checked three ways: a vectorized slice kernel, the scalar `round_to`, and
//! the f64 kernel on the same value widened to f64 (which must agree, since widening is
//! exact). The slice kernel is `round_slice` (in place) for the positive patterns and
//! `round_slice_into` (a rounded copy) for the negative ones: rounding is symmetric in the
//! sign, so each kernel meets every magnitude.

mod common;

use std::thread;
use std::time::Instant;

use common::{Layout, pick_nearest, value_of};
use std::mem::MaybeUninit;

use tl_numerics::{Format, Round, round_slice, round_slice_into};

const QUIET_BIT: u32 = 0x0040_0000;
const SIGN_BIT: u32 = 0x8000_0000;
const CHUNK: usize = 4096;
const MAX_REPORTED: usize = 10;

/// The largest positive pattern whose value is `<= abs`, found by truncating the f32's bits
/// (the table lookup then checks it really encloses `abs`).
fn truncated_pattern(format: Format, abs_bits: u32) -> u32 {
    match format {
        // bf16 is the upper half of an f32: dropping the low 16 bits truncates.
        Format::Bf16 => abs_bits >> 16,
        Format::Fp16 => {
            let abs = f64::from(f32::from_bits(abs_bits));
            if abs < common::pow2(-14) {
                // Subnormal range: a whole number of 2^-24 steps; the product is exact.
                (abs * common::pow2(24)).floor() as u32
            } else {
                let exponent = (abs_bits >> 23) as i32 - 127;
                (((exponent + 15) as u32) << 10) | ((abs_bits >> 13) & 0x3FF)
            }
        }
    }
}

/// The expected f32 bits of rounding the non-negative f32 with bits `abs_bits`.
fn reference_bits(format: Format, layout: Layout, table: &[f64], abs_bits: u32) -> u32 {
    if abs_bits > 0x7F80_0000 {
        // NaN: quiet, payload cut to what the format stores.
        let kept = !((1u32 << (23 - layout.fraction_bits)) - 1);
        return (abs_bits | QUIET_BIT) & kept;
    }
    let abs = f64::from(f32::from_bits(abs_bits));
    let top = layout.infinity_pattern();
    let magnitude = if abs >= table[top as usize] {
        f64::INFINITY
    } else {
        let lower = truncated_pattern(format, abs_bits);
        assert!(
            table[lower as usize] <= abs && abs < table[lower as usize + 1],
            "reference truncation is wrong for {abs_bits:#010x}"
        );
        value_of(layout, table, pick_nearest(table, lower, abs))
    };
    (magnitude as f32).to_bits()
}

/// Whether the three paths all round `x` to `expected` bits: `sliced` (from a slice kernel),
/// the scalar `round_to`, and the f64 kernel on `x` widened to f64.
///
/// Kept small and inlined, with the report in a separate cold function: this runs 2^33
/// times per format.
#[inline]
fn all_paths_agree(format: Format, x: f32, sliced: f32, expected: u32) -> bool {
    let widened = f64::from(x).round_to(format);
    let widened_ok = if widened.is_nan() {
        f32::from_bits(expected).is_nan() && widened.is_sign_negative() == x.is_sign_negative()
    } else {
        widened.to_bits() == f64::from(f32::from_bits(expected)).to_bits()
    };
    sliced.to_bits() == expected && x.round_to(format).to_bits() == expected && widened_ok
}

#[cold]
#[inline(never)]
fn describe_mismatch(format: Format, x: f32, sliced: f32, expected: u32) -> String {
    format!(
        "{format} {:#010x} ({x:e}): expected {expected:#010x}, slice kernel {:#010x}, \
         round_to {:#010x}, f64 {:e}",
        x.to_bits(),
        sliced.to_bits(),
        x.round_to(format).to_bits(),
        f64::from(x).round_to(format),
    )
}

/// Checks the non-negative patterns `start..end` and their negatives, and returns
/// descriptions of the first mismatches.
///
/// The reference is computed once per magnitude: the formats are sign-magnitude, so rounding
/// `-x` gives the rounding of `x` with the sign bit set (NaN included).
fn check_range(format: Format, start: u32, end: u32) -> Vec<String> {
    let layout = Layout::of(format);
    let table = layout.value_table();
    let mut mismatches = Vec::new();
    let mut positive = [0.0_f32; CHUNK];
    let mut negated = [0.0_f32; CHUNK];
    let mut negative = [MaybeUninit::<f32>::uninit(); CHUNK];
    let mut chunk_start = start;
    while chunk_start < end {
        let len = (end - chunk_start).min(CHUNK as u32) as usize;
        for i in 0..len {
            positive[i] = f32::from_bits(chunk_start + i as u32);
            negated[i] = -positive[i];
        }
        round_slice(&mut positive[..len], format);
        round_slice_into(&negated[..len], &mut negative[..len], format);
        for i in 0..len {
            let abs_bits = chunk_start + i as u32;
            let expected = reference_bits(format, layout, &table, abs_bits);
            let x = f32::from_bits(abs_bits);
            for (x, sliced, expected) in [
                (x, positive[i], expected),
                // SAFETY: round_slice_into wrote the first `len` elements.
                (
                    -x,
                    unsafe { negative[i].assume_init() },
                    expected | SIGN_BIT,
                ),
            ] {
                if !all_paths_agree(format, x, sliced, expected) {
                    mismatches.push(describe_mismatch(format, x, sliced, expected));
                    if mismatches.len() >= MAX_REPORTED {
                        return mismatches;
                    }
                }
            }
        }
        chunk_start += len as u32;
    }
    mismatches
}

fn check_all_patterns(format: Format) {
    let started = Instant::now();
    let threads = thread::available_parallelism().map_or(2, |n| n.get()) as u64;
    let total = 1u64 << 31; // the non-negative patterns; check_range adds their negatives
    let mismatches: Vec<String> = thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (start, end) = (total * t / threads, total * (t + 1) / threads);
                let (start, end) = (start as u32, end as u32);
                scope.spawn(move || check_range(format, start, end))
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("worker panicked"))
            .collect()
    });
    eprintln!(
        "{format}: 2^32 f32 patterns checked on {threads} threads in {:.1?}",
        started.elapsed()
    );
    assert!(
        mismatches.is_empty(),
        "mismatches:\n{}",
        mismatches.join("\n")
    );
}

#[test]
#[ignore = "2^32 inputs: run in release with --ignored"]
fn every_f32_rounds_to_the_nearest_bf16_ties_to_even() {
    check_all_patterns(Format::Bf16);
}

#[test]
#[ignore = "2^32 inputs: run in release with --ignored"]
fn every_f32_rounds_to_the_nearest_fp16_ties_to_even() {
    check_all_patterns(Format::Fp16);
}
