//! The AVX-512 kernel's binary32 route: for operands whose products binary32 holds
//! exactly (fp16 and the fp8 formats, and bf16 values of a modest range), and models whose
//! signed block sums fit 31 bits (the V100's and the A100's) or do in two halves (the
//! H100's).
//!
//! The integer route multiplies significands and moves each product to the block's
//! alignment with a variable shift, which truncates magnitudes only, so it keeps a sum of
//! magnitudes and a masked sum of the negative terms. Here every term is the operand's own
//! binary32 value instead:
//!
//! - a product `x·y` of two values of at most 12 significant bits is exact in binary32, and
//!   so is its scaling by `2^(23 + extra − M)` (a power of two, the result in the normal
//!   range), which counts it in units of the block's alignment;
//! - `vcvttps2dq` truncates that toward zero, sign included: the term of the definition, as
//!   a signed integer, in one instruction;
//! - the signed sum `S` converts to binary32 with rounding toward zero (embedded rounding),
//!   which is the definition's truncation to 24 bits, and one multiplication by
//!   `2^(M − 23 − extra)`, also toward zero, places it (and truncates a subnormal result to
//!   its multiple of `2^-149`).
//!
//! Only the alignment exponent `M` is still found on integers: the largest `e(x) + e(y)`
//! of the block, and the accumulator's.
//!
//! The H100's block of 16 terms of up to `2^27` units each (two extra bits) can sum beyond
//! `2^31`; its sum is kept in two parts, the accumulator with the first eight products and
//! the last eight, each below `2^31`, added exactly in binary64 and truncated from there.
//!
//! # When the route is exact, and why the model's floor never binds
//!
//! Write `c = 23 + extra` and `F = c − 126`. The route takes a product only when, over the
//! nonzero operands, `e(x) + e(y)` lies in `[2c − 126, 92]` (`e` the format exponent), and
//! every starting accumulator is zero or has an exponent in `[F, 125]`. Then:
//!
//! - every nonzero product is at least `2^(e(x) + e(y) − 22) ≥ 2^-104` (a significand of
//!   12 bits is at least 1 unit) and below `2^94`: exact and normal in binary32;
//! - a block with a nonzero product has `M ≥ 2c − 126`, so its nonzero result is at least
//!   one unit, `2^(M − c) ≥ 2^F`; a block of zero products leaves the accumulator as it
//!   is. So an accumulator is always zero or at least `2^F`, never subnormal, and `M` is
//!   never below `F` except in a block whose every term is zero. The kernel starts each
//!   block's maximum from `F`, which therefore changes no result, and keeps both scale
//!   factors `2^(c − M)` and `2^(M − c)` normal binary32 values;
//! - for the same reason the A100's floor of −132 (and the H100's −133) never binds: it
//!   lies below `F`;
//! - no sum reaches `2^128`: each block adds at most `block · 2^94` to a magnitude that
//!   starts below `2^126`, and the route takes `k` below `2^32` only.
//!
//! The V100's model has no floor at all; the kernel's floor `F` is the only one, and binds
//! for no result, as shown. Anything else (and any block or extra bits whose signed sums
//! could reach `2^31` even in halves) takes the integer route, which gives the same bits.

use std::arch::x86_64::*;

use super::super::{BlockFma, GemmElement, ZERO_EXPONENT};
use super::avx512::{decompose16, lanes};
use super::{PREFETCH_ROWS, decompose, prefetch};

/// Lanes: output columns per panel.
const LANES: usize = 16;

/// The largest `e(x) + e(y)` the route takes.
const MAX_PRODUCT_EXPONENT: i32 = 92;
/// The largest exponent of a starting accumulator the route takes.
const MAX_INITIAL_EXPONENT: i32 = 125;

/// The rows of `a`, decomposed for the binary32 route: values as binary32 and format
/// exponents biased by 127 (so that a row's plus a panel's is the biased exponent of their
/// product, as the accumulator's field is), `m × depth` row-major, `k` padded with zeros to
/// `depth`, a whole number of blocks (a zero product changes neither a block's alignment
/// nor its sum, so padding changes no result).
struct Rows {
    depth: usize,
    values: Vec<f32>,
    exponents: Vec<i32>,
    range: Range,
}

/// The columns `j0..j0 + 16` of `b`, one panel, `depth × 16` row-major, zeros past the last
/// column and the last inner index: values as binary32 and format exponents. One buffer
/// serves every panel in turn, filled just before its rows run, as the integer route's.
struct Panel {
    values: Vec<f32>,
    exponents: Vec<i32>,
    range: Range,
}

/// The smallest and largest exponent of the nonzero values seen (`None` if all are zero).
#[derive(Clone, Copy, Default)]
struct Range(Option<(i32, i32)>);

impl Range {
    /// Whether every product of a value in `self` and one in `other` has an exponent in
    /// `[low, high]` (true if either holds only zeros).
    fn products_within(self, other: Range, (low, high): (i32, i32)) -> bool {
        match (self.0, other.0) {
            (Some((a_low, a_high)), Some((b_low, b_high))) => {
                a_low + b_low >= low && a_high + b_high <= high
            }
            _ => true,
        }
    }
}

/// `out = a · b` (or `out + a · b`) on the binary32 route, if it takes these operands and
/// this model (see the module documentation); `false`, with `out` untouched, if not.
///
/// # Safety
/// The CPU must support AVX-512 F and CD.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm<E: GemmElement>(
    fma: BlockFma,
    emin: i32,
    (m, k, n): (usize, usize, usize),
    a: &[E],
    b: &[E],
    out: &mut [E],
    accumulate: bool,
) -> bool {
    let extra = fma.extra_bits as i32;
    // Signed sums of the accumulator and `terms` products stay below 2^31.
    let fits =
        |terms: usize| ((terms as u64) << (25 + extra)) + (1u64 << (24 + extra)) < 1u64 << 31;
    let halves = !fits(fma.block);
    if halves && !fits(fma.block / 2) {
        return false;
    }
    let c = 23 + extra;
    let floor = c - 126;
    if k >= 1 << 32 {
        return false;
    }
    if accumulate
        && !out.iter().all(|o| {
            let x = o.to_f64() as f32;
            let e = ((x.to_bits() >> 23) & 0xFF) as i32 - 127;
            x == 0.0 || (floor..=MAX_INITIAL_EXPONENT).contains(&e)
        })
    {
        return false;
    }
    if !matches!(
        (fma.block, halves),
        (1 | 2 | 4 | 8 | 16, false) | (16, true)
    ) {
        return false;
    }
    let products = (2 * c - 126, MAX_PRODUCT_EXPONENT);
    let depth = k.div_ceil(fma.block) * fma.block;
    // SAFETY (both): the caller's.
    let Some(rows) = (unsafe { pack_rows(a, (m, k), depth, emin) }) else {
        return false;
    };
    // A panel out of range shows only when it is filled; by then the outputs of earlier
    // panels are written, so they are kept to be put back.
    let saved = out.to_vec();
    let mut panel = Panel {
        values: vec![0.0; depth * LANES],
        exponents: vec![ZERO_EXPONENT; depth * LANES],
        range: Range::default(),
    };
    for j0 in (0..n).step_by(LANES) {
        if !(unsafe { panel.fill(b, (k, n), j0, emin) }
            && rows.range.products_within(panel.range, products))
        {
            out.copy_from_slice(&saved);
            return false;
        }
        let columns = j0..(j0 + LANES).min(n);
        // SAFETY: the caller's.
        let shape = (m, n, columns);
        unsafe {
            match (fma.block, halves) {
                (1, false) => run::<E, 1, false>(&rows, &panel, c, shape, out, accumulate),
                (2, false) => run::<E, 2, false>(&rows, &panel, c, shape, out, accumulate),
                (4, false) => run::<E, 4, false>(&rows, &panel, c, shape, out, accumulate),
                (8, false) => run::<E, 8, false>(&rows, &panel, c, shape, out, accumulate),
                (16, false) => run::<E, 16, false>(&rows, &panel, c, shape, out, accumulate),
                (16, true) => run::<E, 16, true>(&rows, &panel, c, shape, out, accumulate),
                _ => unreachable!("blocks without a kernel are declined before packing"),
            }
        }
    }
    true
}

/// The smallest and largest exponent of the nonzero values seen so far, lane by lane:
/// reduced to a [`Range`] once a whole operand or panel is read.
#[derive(Clone, Copy)]
struct LaneRange {
    low: __m512i,
    high: __m512i,
}

impl LaneRange {
    #[target_feature(enable = "avx512f,avx512cd")]
    fn new() -> LaneRange {
        LaneRange {
            low: _mm512_set1_epi32(i32::MAX),
            high: _mm512_set1_epi32(i32::MIN),
        }
    }

    /// Adds the lanes of `exponents` that are not `ZERO_EXPONENT`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512cd")]
    fn add(&mut self, exponents: __m512i) {
        let nonzero = _mm512_cmpneq_epi32_mask(exponents, _mm512_set1_epi32(ZERO_EXPONENT));
        self.low = _mm512_mask_min_epi32(self.low, nonzero, self.low, exponents);
        self.high = _mm512_mask_max_epi32(self.high, nonzero, self.high, exponents);
    }

    #[target_feature(enable = "avx512f,avx512cd")]
    fn reduce(self) -> Range {
        let (low, high) = (
            _mm512_reduce_min_epi32(self.low),
            _mm512_reduce_max_epi32(self.high),
        );
        Range((low <= high).then_some((low, high)))
    }
}

/// The values and exponents of sixteen binary32 encodings (`xs`, at most sixteen, the
/// lanes past them read as zeros): `None` if one is not a finite value of at most 12
/// significant bits. Zeros have the exponent `ZERO_EXPONENT`; `range` takes the others'.
#[inline]
#[target_feature(enable = "avx512f,avx512cd")]
fn decompose_run(xs: &[f32], emin: i32, range: &mut LaneRange) -> Option<(__m512, __m512i)> {
    let mask = lanes(xs.len());
    // SAFETY: the mask reads only the run's elements.
    let bits = unsafe { _mm512_maskz_loadu_epi32(mask, xs.as_ptr().cast()) };
    let exponents = if let Some((_, e, _)) = decompose16(bits, _mm512_set1_epi32(emin)) {
        e
    } else {
        let mut e = [ZERO_EXPONENT; LANES];
        for (e, &x) in e.iter_mut().zip(xs) {
            *e = decompose(f64::from(x), emin)?.1;
        }
        // SAFETY: `e` holds 16 i32.
        unsafe { _mm512_loadu_si512(e.as_ptr().cast()) }
    };
    range.add(exponents);
    Some((_mm512_castsi512_ps(bits), exponents))
}

/// The rows of `a` (`m×k`), decomposed into `depth` inner indices each; `None` if a value
/// is not a finite value of at most 12 significant bits.
///
/// # Safety
/// The CPU must support AVX-512 F and CD.
#[target_feature(enable = "avx512f,avx512cd")]
fn pack_rows<E: GemmElement>(
    a: &[E],
    (m, k): (usize, usize),
    depth: usize,
    emin: i32,
) -> Option<Rows> {
    let mut rows = Rows {
        depth,
        values: vec![0.0; m * depth],
        exponents: vec![ZERO_EXPONENT; m * depth],
        range: Range::default(),
    };
    let mut range = LaneRange::new();
    for i in 0..m {
        let row = i * depth..i * depth + k;
        let (values, exponents) = (&mut rows.values[row.clone()], &mut rows.exponents[row]);
        if let Some(a) = E::as_f32s(a) {
            for (p0, xs) in a[i * k..(i + 1) * k].chunks(LANES).enumerate() {
                let (v, e) = decompose_run(xs, emin, &mut range)?;
                let (mask, at) = (lanes(xs.len()), p0 * LANES);
                let biased = _mm512_add_epi32(e, _mm512_set1_epi32(127));
                // SAFETY: the mask writes only the run's places, within the row's `k`.
                unsafe {
                    _mm512_mask_storeu_ps(values.as_mut_ptr().add(at), mask, v);
                    _mm512_mask_storeu_epi32(exponents.as_mut_ptr().add(at).cast(), mask, biased);
                }
            }
        } else {
            for (p, x) in a[i * k..(i + 1) * k].iter().enumerate() {
                let x = x.to_f64();
                let (_, e, _) = decompose(x, emin)?;
                if x != 0.0 {
                    range.add(_mm512_set1_epi32(e));
                    (values[p], exponents[p]) = (x as f32, e + 127);
                }
            }
        }
    }
    rows.range = range.reduce();
    Some(rows)
}

impl Panel {
    /// Fills the panel of the columns from `j0`; `false` if an operand is not a finite value
    /// of at most 12 significant bits.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and CD.
    #[target_feature(enable = "avx512f,avx512cd")]
    fn fill<E: GemmElement>(
        &mut self,
        b: &[E],
        (k, n): (usize, usize),
        j0: usize,
        emin: i32,
    ) -> bool {
        let columns = LANES.min(n - j0);
        let mut range = LaneRange::new();
        assert!(self.values.len() >= k * LANES && self.exponents.len() >= k * LANES);
        for p in 0..k {
            prefetch(b, (p + PREFETCH_ROWS) * n + j0, columns);
            let at = p * LANES;
            let xs = &b[p * n + j0..p * n + j0 + columns];
            if let Some(xs) = E::as_f32s(xs) {
                let Some((v, e)) = decompose_run(xs, emin, &mut range) else {
                    return false;
                };
                // SAFETY: `at + 16 <= k * 16`, asserted.
                unsafe {
                    _mm512_storeu_ps(self.values.as_mut_ptr().add(at), v);
                    _mm512_storeu_si512(self.exponents.as_mut_ptr().add(at).cast(), e);
                }
            } else {
                for l in 0..LANES {
                    let (mut v, mut e) = (0.0, ZERO_EXPONENT);
                    if let Some(x) = xs.get(l) {
                        let x = x.to_f64();
                        let Some((_, exponent, _)) = decompose(x, emin) else {
                            return false;
                        };
                        if x != 0.0 {
                            range.add(_mm512_set1_epi32(exponent));
                            (v, e) = (x as f32, exponent);
                        }
                    }
                    (self.values[at + l], self.exponents[at + l]) = (v, e);
                }
            }
        }
        self.range = range.reduce();
        true
    }
}

/// Rows `0..m` against the panel of `columns`, four rows at a time where there are four,
/// then two, then one.
#[target_feature(enable = "avx512f,avx512cd")]
fn run<E: GemmElement, const B: usize, const HALVES: bool>(
    rows: &Rows,
    panel: &Panel,
    c: i32,
    (m, n, columns): (usize, usize, std::ops::Range<usize>),
    out: &mut [E],
    accumulate: bool,
) {
    let depth = rows.depth;
    let panel = (&panel.values[..], &panel.exponents[..]);
    let mut i = 0;
    while i < m {
        let outputs = |r: usize| (i + r) * n + columns.start..(i + r) * n + columns.end;
        let row = |r: usize| {
            let at = (i + r) * depth..(i + r + 1) * depth;
            (&rows.values[at.clone()], &rows.exponents[at])
        };
        if i + 4 <= m {
            let acc = std::array::from_fn(|r| initial(&out[outputs(r)], accumulate));
            let acc = tile::<4, B, HALVES>(c, std::array::from_fn(row), panel, acc);
            for (r, acc) in acc.iter().enumerate() {
                store(&mut out[outputs(r)], *acc);
            }
            i += 4;
        } else if i + 2 <= m {
            let acc = std::array::from_fn(|r| initial(&out[outputs(r)], accumulate));
            let acc = tile::<2, B, HALVES>(c, std::array::from_fn(row), panel, acc);
            for (r, acc) in acc.iter().enumerate() {
                store(&mut out[outputs(r)], *acc);
            }
            i += 2;
        } else {
            let acc = [initial(&out[outputs(0)], accumulate)];
            let acc = tile::<1, B, HALVES>(c, [row(0)], panel, acc);
            store(&mut out[outputs(0)], acc[0]);
            i += 1;
        }
    }
}

/// A row's starting accumulators in one panel: the old outputs when accumulating, else +0.
#[target_feature(enable = "avx512f,avx512cd")]
fn initial<E: GemmElement>(outputs: &[E], accumulate: bool) -> __m512 {
    let mut acc = [0.0f32; LANES];
    if accumulate {
        for (a, o) in acc.iter_mut().zip(outputs) {
            *a = o.to_f64() as f32;
        }
    }
    // SAFETY: `acc` holds 16 f32.
    unsafe { _mm512_loadu_ps(acc.as_ptr()) }
}

/// Writes a row's outputs from a panel's accumulators.
#[target_feature(enable = "avx512f,avx512cd")]
fn store<E: GemmElement>(outputs: &mut [E], acc: __m512) {
    let mut values = [0.0f32; LANES];
    // SAFETY: `values` holds 16 f32.
    unsafe { _mm512_storeu_ps(values.as_mut_ptr(), acc) };
    for (o, &v) in outputs.iter_mut().zip(&values) {
        *o = E::from_f32(v);
    }
}

/// `R` rows against one panel, block by block of `B` inner indices; with `HALVES`, each
/// block's sum in two parts (the accumulator and the first half of the products, then the
/// second half), each below 2^31, added exactly in binary64.
#[target_feature(enable = "avx512f,avx512cd")]
fn tile<const R: usize, const B: usize, const HALVES: bool>(
    c: i32,
    rows: [(&[f32], &[i32]); R],
    (values, exponents): (&[f32], &[i32]),
    acc: [__m512; R],
) -> [__m512; R] {
    let depth = rows[0].0.len();
    assert!(values.len() == depth * LANES && exponents.len() == depth * LANES);
    assert!(depth.is_multiple_of(B));
    for (row_values, row_exponents) in &rows {
        assert!(row_values.len() == depth && row_exponents.len() == depth);
    }
    let mut acc = acc;
    // The biased floor of the alignment exponent, and the constants of the two scales.
    let floor = _mm512_set1_epi32(c + 1);
    let down = _mm512_set1_epi32(c + 254);
    let up = _mm512_set1_epi32(c);
    for t0 in (0..depth).step_by(B) {
        let mut top = [floor; R];
        for r in 0..R {
            let field =
                _mm512_srli_epi32::<24>(_mm512_slli_epi32::<1>(_mm512_castps_si512(acc[r])));
            top[r] = _mm512_max_epi32(top[r], field);
        }
        for t in t0..t0 + B {
            // SAFETY: `t < depth`, so the 16 lanes from `t * 16` are in bounds (asserted).
            let e = unsafe { _mm512_loadu_si512(exponents.as_ptr().add(t * LANES).cast()) };
            for r in 0..R {
                // SAFETY: `t < depth` (asserted).
                let row_e = unsafe { *rows[r].1.get_unchecked(t) };
                top[r] = _mm512_max_epi32(top[r], _mm512_add_epi32(e, _mm512_set1_epi32(row_e)));
            }
        }
        let mut scale = [_mm512_setzero_ps(); R];
        let mut sum = [_mm512_setzero_si512(); R];
        let mut second = [_mm512_setzero_si512(); R];
        for r in 0..R {
            scale[r] = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_sub_epi32(down, top[r])));
            sum[r] = _mm512_cvttps_epi32(_mm512_mul_ps(acc[r], scale[r]));
        }
        for t in t0..t0 + B {
            // SAFETY: as above.
            let y = unsafe { _mm512_loadu_ps(values.as_ptr().add(t * LANES)) };
            for r in 0..R {
                // SAFETY: as above.
                let x = unsafe { *rows[r].0.get_unchecked(t) };
                let product = _mm512_mul_ps(_mm512_mul_ps(y, _mm512_set1_ps(x)), scale[r]);
                let term = _mm512_cvttps_epi32(product);
                if HALVES && t - t0 >= B / 2 {
                    second[r] = _mm512_add_epi32(second[r], term);
                } else {
                    sum[r] = _mm512_add_epi32(sum[r], term);
                }
            }
        }
        for r in 0..R {
            let unit = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_sub_epi32(top[r], up)));
            let truncated = if HALVES {
                truncated_sum(sum[r], second[r])
            } else {
                _mm512_cvt_roundepi32_ps::<TO_ZERO>(sum[r])
            };
            acc[r] = _mm512_mul_round_ps::<TO_ZERO>(truncated, unit);
        }
    }
    acc
}

/// Rounding toward zero, without floating-point exceptions.
const TO_ZERO: i32 = _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC;

/// `a + b`, each below 2^31 in magnitude, truncated toward zero to binary32: added exactly
/// in binary64 (eight lanes at a time), then rounded toward zero.
#[inline]
#[target_feature(enable = "avx512f,avx512cd")]
fn truncated_sum(a: __m512i, b: __m512i) -> __m512 {
    let half = |a: __m256i, b: __m256i| {
        _mm512_cvt_roundpd_ps::<TO_ZERO>(_mm512_add_pd(
            _mm512_cvtepi32_pd(a),
            _mm512_cvtepi32_pd(b),
        ))
    };
    let low = half(_mm512_castsi512_si256(a), _mm512_castsi512_si256(b));
    let high = half(
        _mm512_extracti64x4_epi64::<1>(a),
        _mm512_extracti64x4_epi64::<1>(b),
    );
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castpd256_pd512(_mm256_castps_pd(low)),
        _mm256_castps_pd(high),
    ))
}

#[cfg(test)]
mod tests {
    use super::super::super::GemmKernel;
    use super::*;
    use crate::{Format, Round};

    /// Values of `format` over many binades (its subnormals included; the fp8 formats'
    /// largest where they end), ±0 one time in ten, from a xorshift generator.
    fn values(len: usize, format: Format, seed: u64) -> Vec<f32> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let r = state;
                let x = match r % 10 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => ((r >> 8) % 64) as f64 * format.min_subnormal(),
                    _ => ((r >> 8) % 4096) as f64 / 512.0 * 2f64.powi(((r >> 20) % 24) as i32 - 12),
                };
                let x = if (r >> 40) & 1 == 1 { -x } else { x };
                x.round_to_saturating(format) as f32
            })
            .collect()
    }

    /// The route's result, if it takes the product, else `None`; the exact path's bits.
    fn both(
        fma: BlockFma,
        format: Format,
        shape: (usize, usize, usize),
        (a, b, c): (&[f32], &[f32], &[f32]),
        accumulate: bool,
    ) -> (Option<Vec<u32>>, Vec<u32>) {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut exact = c.to_vec();
        assert!(fma.gemm_on(
            GemmKernel::Exact,
            format,
            shape,
            a,
            b,
            &mut exact,
            accumulate
        ));
        let mut out = c.to_vec();
        let emin = format.min_exponent();
        // SAFETY: the callers run this only where the CPU has AVX-512 F and CD.
        let ran = unsafe { gemm(fma, emin, shape, a, b, &mut out, accumulate) };
        if !ran {
            assert_eq!(bits(&out), bits(c), "a declined product leaves its outputs");
        }
        (ran.then(|| bits(&out)), bits(&exact))
    }

    #[test]
    fn the_route_takes_fp16_and_fp8_products_and_gives_the_exact_paths_bits() {
        if !GemmKernel::Avx512.is_available() {
            eprintln!("NOT TESTED: this CPU lacks AVX-512");
            return;
        }
        // Every row tile (4, 2, 1), two panels and a ragged third, k that no block divides
        // and k shorter than a block.
        for (m, k, n) in [(7, 67, 37), (3, 3, 16), (1, 1, 1), (6, 130, 17)] {
            for (format, fma) in [
                (Format::Fp16, BlockFma::V100),
                (Format::Fp16, BlockFma::A100),
                (Format::E4M3, BlockFma::A100),
                (Format::E5M2, BlockFma::V100),
                (Format::Fp16, BlockFma::new(2, 3).unwrap()),
                (Format::Fp16, BlockFma::new(16, 0).unwrap()),
                // Block sums in two halves.
                (Format::Fp16, BlockFma::H100),
                (Format::Bf16, BlockFma::H100),
            ] {
                // bf16 values of a modest range: its subnormals moved up to 2^-30.
                let modest = |x: f32| {
                    if x != 0.0 && x.abs() < 2f32.powi(-30) {
                        x.signum() * 2f32.powi(-30)
                    } else {
                        x
                    }
                };
                let a: Vec<f32> = values(m * k, format, 1).into_iter().map(modest).collect();
                let mut b: Vec<f32> = values(k * n, format, 2).into_iter().map(modest).collect();
                // Cancellation: a column that is another negated.
                for p in 0..k {
                    if n > 5 {
                        b[p * n + 5] = -b[p * n + 4];
                    }
                }
                // Starting accumulators of every size the route takes: up to 2^125, down
                // to the smallest it takes (2^(extra - 103)), and zeros.
                let mut c: Vec<f32> = values(m * n, format, 3).into_iter().map(modest).collect();
                c[0] = 1.5 * 2f32.powi(125);
                if c.len() > 2 {
                    c[1] = -(2f32.powi(fma.extra_bits() as i32 - 103));
                    c[2] = -0.0;
                }
                for accumulate in [false, true] {
                    let (got, expected) = both(fma, format, (m, k, n), (&a, &b, &c), accumulate);
                    let got = got.unwrap_or_else(|| panic!("{fma:?} {format} declined"));
                    assert_eq!(
                        got,
                        expected,
                        "{fma:?} {format} {:?} {accumulate}",
                        (m, k, n)
                    );
                }
            }
        }
    }

    #[test]
    fn an_h100_block_sum_beyond_2_to_the_31_is_added_in_halves() {
        if !GemmKernel::Avx512.is_available() {
            eprintln!("NOT TESTED: this CPU lacks AVX-512");
            return;
        }
        // Sixteen products of the largest significands at the block's exponent, and an
        // accumulator just below 2: about 2^31 + 2^26 units of 2^-25, of either sign.
        for (format, x) in [
            (Format::Bf16, 255.0 / 128.0),
            (Format::Fp16, 2047.0 / 1024.0),
        ] {
            for sign in [1.0f32, -1.0] {
                let (a, b) = (vec![sign * x; 16], vec![x; 16]);
                let c = [sign * (2.0 - 2f32.powi(-23))];
                let (got, expected) = both(BlockFma::H100, format, (1, 16, 1), (&a, &b, &c), true);
                assert_eq!(got, Some(expected.clone()), "{format} {sign}");
                // 2^31 units of 2^-25 are 64.
                assert!(f32::from_bits(expected[0]).abs() > 64.0, "{format}");
            }
        }
    }

    #[test]
    fn the_route_declines_what_it_cannot_hold_exactly() {
        if !GemmKernel::Avx512.is_available() {
            eprintln!("NOT TESTED: this CPU lacks AVX-512");
            return;
        }
        let fp16 = Format::Fp16;
        let (a, b) = (values(4 * 9, fp16, 4), values(9 * 5, fp16, 5));
        let shape = (4, 9, 5);
        let zeros = vec![0.0; 20];
        // Block sums that may reach 2^31 even in halves; a block no kernel is built for.
        for fma in [BlockFma::new(16, 3).unwrap(), BlockFma::new(3, 0).unwrap()] {
            assert_eq!(both(fma, fp16, shape, (&a, &b, &zeros), false).0, None);
        }
        // A starting accumulator too small (subnormal, or below 2^(extra - 103)) or too
        // large (from 2^126); zeros and values between are taken.
        for (initial, taken) in [
            (f32::from_bits(1), false),
            (2f32.powi(-104), false),
            (2f32.powi(-103), true),
            (2f32.powi(126), false),
            (-0.0, true),
        ] {
            let mut c = zeros.clone();
            c[7] = initial;
            let (got, expected) = both(BlockFma::V100, fp16, shape, (&a, &b, &c), true);
            assert_eq!(got.is_some(), taken, "{initial:e}");
            assert!(got.is_none_or(|got| got == expected));
        }
        // bf16 products out of the range binary32 holds exactly: 2^-60 · 2^-60, or
        // 2^50 · 2^50. One product in range, the other not.
        let bf16 = Format::Bf16;
        for (x, taken) in [
            (2f32.powi(-60), false),
            (2f32.powi(50), false),
            (2f32.powi(-30), true),
        ] {
            let (mut a, mut b) = (a.clone(), b.clone());
            (a[0], b[0]) = (x, x);
            let (got, expected) = both(BlockFma::A100, bf16, shape, (&a, &b, &zeros), false);
            assert_eq!(got.is_some(), taken, "{x:e}");
            assert!(got.is_none_or(|got| got == expected));
        }
        // The AVX-512 kernel still takes them all, on its integer route.
        let (mut a, mut b) = (a.clone(), b.clone());
        (a[0], b[0]) = (2f32.powi(-60), 2f32.powi(-60));
        let mut out = zeros.clone();
        let mut exact = zeros.clone();
        assert!(BlockFma::A100.gemm_on(GemmKernel::Avx512, bf16, shape, &a, &b, &mut out, false));
        assert!(BlockFma::A100.gemm_on(GemmKernel::Exact, bf16, shape, &a, &b, &mut exact, false));
        assert_eq!(out, exact);
    }
}
