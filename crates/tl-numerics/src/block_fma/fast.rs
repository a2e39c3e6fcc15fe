//! The vectorised kernels: output columns side by side in 32-bit integer lanes (eight in the
//! portable and AVX2 kernels, sixteen in the AVX-512 one), each operand as a 12-bit
//! significand and its format exponent.
//!
//! Both operands are decomposed once per product, in the packing pass: every element of `a`
//! and of `b` is read once, its significand, format exponent and sign found there, and the
//! columns of `b` laid out in panels of one lane per column. The kernels then only multiply,
//! shift and add; no block repeats a decomposition, and every panel is read by every row.
//!
//! For one row of `a` and a panel of `b`, a block of products takes two passes. The first
//! finds each lane's alignment exponent, the largest `e(x) + e(y)` (the accumulator's
//! exponent and the model's floor included); a zero operand's exponent is so low that its
//! products never count. The second multiplies the significands (the panel's are stored
//! shifted left by `1 + extra` bits, so that a product's units are one right shift away) and
//! adds each term, truncated by that shift, into sums below 2^32: the portable and AVX2
//! kernels a sum of positive and a sum of negative terms, the AVX-512 kernel the sum of all
//! magnitudes and, under a mask of the product's sign, the sum of the negative ones. The
//! accumulator is then normalised and truncated into binary32 from the difference.
//!
//! The AVX-512 kernel first tries a route on binary32 arithmetic instead (`scaled`): where
//! every product of the operands is exact in binary32 and the model's signed block sums fit
//! 31 bits, whole or in two halves (fp16 and fp8 operands, and bf16 ones of a modest range,
//! on the V100's, A100's and H100's models), each term is its binary32 product scaled to
//! the block's units and truncated by one conversion, sign included, and the block's sum is
//! truncated into binary32 by a conversion and a multiplication rounded toward zero.
//! Elsewhere it takes the integer route; both give the same bits.

use super::{BlockFma, GemmElement, GemmKernel, ZERO_EXPONENT};

#[cfg(target_arch = "x86_64")]
mod scaled;

/// Lanes of the portable and AVX2 kernels.
pub(super) const LANES: usize = 8;
/// Lanes of the AVX-512 kernel.
#[cfg(target_arch = "x86_64")]
const WIDE_LANES: usize = 16;

/// A finite value as `(significand, exponent, negative)` with `|x| = s · 2^(e - 11)`, `s` an
/// integer below 2^12 and `e` the format exponent (`ZERO_EXPONENT` for a zero); `None` if
/// `x` is not finite or not such a value (true of every value of a format of at most 12
/// bits of precision, whose smallest normal exponent is `emin`).
///
/// Bit operations on the f64 encoding only: this runs once for every element of both
/// operands, and a product of `k` inner terms reads each of them `n` or `m` times after.
#[inline]
fn decompose(x: f64, emin: i32) -> Option<(u32, i32, bool)> {
    let bits = x.to_bits();
    if bits << 1 == 0 {
        return Some((0, ZERO_EXPONENT, false));
    }
    let field = ((bits >> 52) & 0x7FF) as i32;
    if field == 0x7FF {
        return None;
    }
    let fraction = bits & ((1 << 52) - 1);
    // |x| = significand · 2^e0.
    let (significand, e0) = if field == 0 {
        (fraction, -1074)
    } else {
        (fraction | 1 << 52, field - 1075)
    };
    let exponent = (e0 + 63 - significand.leading_zeros() as i32).max(emin);
    if !(-1000..1000).contains(&exponent) {
        return None;
    }
    // s = significand · 2^(e0 - exponent + 11): below 2^12 since the exponent is at least
    // floor(log2 |x|), so a left shift (of a significand below 2^12) loses nothing, and a
    // right shift must drop only zeros.
    let shift = exponent - 11 - e0;
    let s = if shift <= 0 {
        significand << -shift
    } else if shift < 64 && significand & ((1 << shift) - 1) == 0 {
        significand >> shift
    } else {
        return None;
    };
    debug_assert!(s < 1 << 12);
    Some((s as u32, exponent, bits >> 63 == 1))
}

/// The rows of `a` (`m×k`), decomposed: significands, format exponents and sign masks
/// (all ones for a negative value), each row-major.
struct Rows {
    k: usize,
    significands: Vec<u32>,
    exponents: Vec<i32>,
    negatives: Vec<u32>,
}

impl Rows {
    fn pack<E: GemmElement>(a: &[E], k: usize, emin: i32, wide: bool) -> Option<Rows> {
        #[cfg(target_arch = "x86_64")]
        if wide && let Some(a) = E::as_f32s(a) {
            // SAFETY: `wide` is the AVX-512 kernel's packing, run only where the CPU has it.
            return unsafe { avx512::pack_rows(a, k, emin) };
        }
        let _ = wide;
        let mut rows = Rows {
            k,
            significands: Vec::with_capacity(a.len()),
            exponents: Vec::with_capacity(a.len()),
            negatives: Vec::with_capacity(a.len()),
        };
        for x in a {
            let (s, e, negative) = decompose(x.to_f64(), emin)?;
            rows.significands.push(s);
            rows.exponents.push(e);
            rows.negatives.push(if negative { u32::MAX } else { 0 });
        }
        Some(rows)
    }

    fn row(&self, i: usize) -> Row<'_> {
        let at = i * self.k..(i + 1) * self.k;
        Row {
            significands: &self.significands[at.clone()],
            exponents: &self.exponents[at.clone()],
            negatives: &self.negatives[at],
        }
    }
}

/// One row of `a`.
#[derive(Clone, Copy)]
pub(super) struct Row<'a> {
    significands: &'a [u32],
    exponents: &'a [i32],
    negatives: &'a [u32],
}

/// The columns `j0..j0 + width` of `b` (`k×n`), one panel, `k × width` row-major, zeros
/// past the last column (a zero product changes neither the alignment nor the sum):
/// significands shifted left by `1 + extra` bits, format exponents, sign masks per lane (for
/// the eight-lane kernels) and, per inner index, the signs of the panel's lanes as the bits
/// of one word (for the AVX-512 kernel).
///
/// One buffer serves every panel in turn, each filled just before its rows run: a panel
/// is read by every row while it is still in cache, and a product of any size allocates
/// one panel's worth of memory.
struct PanelBuffer {
    width: usize,
    significands: Vec<u32>,
    exponents: Vec<i32>,
    negatives: Vec<u32>,
    signs: Vec<u32>,
}

impl PanelBuffer {
    fn new(k: usize, width: usize) -> PanelBuffer {
        PanelBuffer {
            width,
            significands: vec![0; k * width],
            exponents: vec![ZERO_EXPONENT; k * width],
            negatives: vec![0; if width == LANES { k * width } else { 0 }],
            signs: vec![0; k],
        }
    }

    /// Fills the panel of the columns from `j0`; `false` if an operand is not a finite value
    /// of at most 12 significant bits.
    fn fill<E: GemmElement>(
        &mut self,
        b: &[E],
        (k, n): (usize, usize),
        j0: usize,
        shift: u32,
        emin: i32,
    ) -> bool {
        let columns = self.width.min(n - j0);
        #[cfg(target_arch = "x86_64")]
        if self.width == WIDE_LANES
            && let Some(b) = E::as_f32s(b)
        {
            // SAFETY: a panel of sixteen lanes is the AVX-512 kernel's, run only where the
            // CPU has it.
            return unsafe { avx512::fill_panel(self, b, (k, n), j0, shift, emin) };
        }
        for p in 0..k {
            prefetch(b, (p + PREFETCH_ROWS) * n + j0, columns);
            if !self.fill_row(&b[p * n + j0..p * n + j0 + columns], p, shift, emin) {
                return false;
            }
        }
        true
    }

    /// Fills the panel's row `p` from the values `xs` (its columns, at most `width`).
    fn fill_row<E: GemmElement>(&mut self, xs: &[E], p: usize, shift: u32, emin: i32) -> bool {
        let (width, lane_masks) = (self.width, !self.negatives.is_empty());
        let base = p * width;
        let mut signs = 0;
        for (l, x) in xs.iter().enumerate() {
            let Some((s, e, negative)) = decompose(x.to_f64(), emin) else {
                return false;
            };
            self.significands[base + l] = s << shift;
            self.exponents[base + l] = e;
            if lane_masks {
                self.negatives[base + l] = if negative { u32::MAX } else { 0 };
            }
            signs |= u32::from(negative) << l;
        }
        for l in xs.len()..width {
            self.significands[base + l] = 0;
            self.exponents[base + l] = ZERO_EXPONENT;
            if lane_masks {
                self.negatives[base + l] = 0;
            }
        }
        self.signs[p] = signs;
        true
    }

    fn panel(&self) -> Panel<'_> {
        Panel {
            significands: &self.significands,
            exponents: &self.exponents,
            negatives: &self.negatives,
            signs: &self.signs,
        }
    }
}

/// How many rows of `b` ahead of the one being packed [`PanelBuffer::fill`] asks the cache
/// for. A panel reads one short run of each row, so in a wide `b` (the weight gradient's,
/// 4096×896) every run is on another page, where the hardware prefetchers do not follow:
/// unasked, each row is a trip to memory, and packing cost more than the products.
const PREFETCH_ROWS: usize = 8;

/// Asks the cache for `xs[at..at + len]` (nothing if out of bounds).
#[inline(always)]
fn prefetch<E>(xs: &[E], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len > 0 && at + len <= xs.len() {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        for x in [&xs[at], &xs[at + len - 1]] {
            // SAFETY: a prefetch is only a hint, and the address is that of an element.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(x).cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (xs, at, len);
}

/// One panel of `b`.
#[derive(Clone, Copy)]
pub(super) struct Panel<'a> {
    significands: &'a [u32],
    exponents: &'a [i32],
    negatives: &'a [u32],
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    signs: &'a [u32],
}

/// `out = a · b` (or `out + a · b`, each output's old value as binary32 the starting
/// accumulator) on `kernel` (`Portable`, `Avx2` or `Avx512`, which the caller has checked
/// the CPU supports), `a` m×k and `b` k×n row-major. `false`, with `out` untouched, if an
/// operand is not a finite value of at most 12 significant bits.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm<E: GemmElement>(
    fma: BlockFma,
    kernel: GemmKernel,
    emin: i32,
    (m, k, n): (usize, usize, usize),
    a: &[E],
    b: &[E],
    out: &mut [E],
    accumulate: bool,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    let width = if kernel == GemmKernel::Avx512 {
        WIDE_LANES
    } else {
        LANES
    };
    #[cfg(not(target_arch = "x86_64"))]
    let width = LANES;
    // SAFETY: the caller checked that the CPU supports AVX-512 F and CD.
    #[cfg(target_arch = "x86_64")]
    if kernel == GemmKernel::Avx512
        && unsafe { scaled::gemm(fma, emin, (m, k, n), a, b, out, accumulate) }
    {
        return true;
    }
    let Some(rows) = Rows::pack(a, k, emin, width != LANES) else {
        return false;
    };
    // A column of `b` that no kernel takes shows only when its panel is filled; by then the
    // outputs of earlier panels are written, so they are kept to be put back.
    let saved = out.to_vec();
    let mut buffer = PanelBuffer::new(k, width);
    for j0 in (0..n).step_by(width) {
        if !buffer.fill(b, (k, n), j0, 1 + fma.extra_bits, emin) {
            out.copy_from_slice(&saved);
            return false;
        }
        let panel = buffer.panel();
        let columns = j0..(j0 + width).min(n);
        match kernel {
            #[cfg(target_arch = "x86_64")]
            GemmKernel::Avx512 => {
                // Four rows per panel where there are four, then two, then one.
                let mut i = 0;
                // SAFETY (all three): the caller checked that the CPU supports AVX-512 F and
                // CD.
                while i + 4 <= m {
                    unsafe {
                        wide_tile::<E, 4>(
                            fma,
                            &rows,
                            panel,
                            out,
                            (i, n, columns.clone()),
                            accumulate,
                        )
                    };
                    i += 4;
                }
                if i + 2 <= m {
                    unsafe {
                        wide_tile::<E, 2>(
                            fma,
                            &rows,
                            panel,
                            out,
                            (i, n, columns.clone()),
                            accumulate,
                        )
                    };
                    i += 2;
                }
                if i < m {
                    unsafe {
                        wide_tile::<E, 1>(
                            fma,
                            &rows,
                            panel,
                            out,
                            (i, n, columns.clone()),
                            accumulate,
                        )
                    };
                }
            }
            _ => {
                for i in 0..m {
                    let outputs = &mut out[i * n..][columns.clone()];
                    let acc = initial::<E, LANES>(outputs, accumulate);
                    #[cfg(target_arch = "x86_64")]
                    let acc = if kernel == GemmKernel::Avx2 {
                        // SAFETY: the caller checked that the CPU supports AVX2.
                        unsafe { avx2::row_tile(fma, rows.row(i), panel, acc) }
                    } else {
                        row_tile_portable(fma, rows.row(i), panel, acc)
                    };
                    #[cfg(not(target_arch = "x86_64"))]
                    let acc = row_tile_portable(fma, rows.row(i), panel, acc);
                    store(outputs, &acc);
                }
            }
        }
    }
    true
}

/// Rows `i..i + R` against one panel of sixteen columns (`columns` of `out`), on the
/// AVX-512 kernel.
///
/// # Safety
/// The CPU must support AVX-512 F and CD.
#[cfg(target_arch = "x86_64")]
unsafe fn wide_tile<E: GemmElement, const R: usize>(
    fma: BlockFma,
    rows: &Rows,
    panel: Panel<'_>,
    out: &mut [E],
    (i, n, columns): (usize, usize, std::ops::Range<usize>),
    accumulate: bool,
) {
    let outputs = |r: usize| (i + r) * n + columns.start..(i + r) * n + columns.end;
    let acc: [[u32; WIDE_LANES]; R] =
        std::array::from_fn(|r| initial::<E, WIDE_LANES>(&out[outputs(r)], accumulate));
    // SAFETY: the caller's.
    let acc =
        unsafe { avx512::rows_tile(fma, std::array::from_fn(|r| rows.row(i + r)), panel, acc) };
    for (r, acc) in acc.iter().enumerate() {
        store(&mut out[outputs(r)], acc);
    }
}

/// The starting accumulators of one row's outputs in a panel, as binary32 bits: their old
/// values when accumulating, else +0 (and +0 past the last column).
fn initial<E: GemmElement, const W: usize>(outputs: &[E], accumulate: bool) -> [u32; W] {
    let mut acc = [0u32; W];
    if accumulate {
        for (a, o) in acc.iter_mut().zip(outputs) {
            *a = (o.to_f64() as f32).to_bits();
        }
    }
    acc
}

/// Writes a row's outputs from a panel's binary32 bits.
fn store<E: GemmElement>(outputs: &mut [E], acc: &[u32]) {
    for (o, &v) in outputs.iter_mut().zip(acc) {
        *o = E::from_f32(f32::from_bits(v));
    }
}

/// The kernel in plain Rust, lane by lane: the definition the AVX2 and AVX-512 builds must
/// match bit for bit (tests compare them).
fn row_tile_portable(
    fma: BlockFma,
    row: Row<'_>,
    panel: Panel<'_>,
    mut acc: [u32; LANES],
) -> [u32; LANES] {
    let extra = fma.extra_bits as i32;
    let k = row.significands.len();
    for t0 in (0..k).step_by(fma.block) {
        let t1 = (t0 + fma.block).min(k);
        let mut top = [0i32; LANES];
        let mut acc_exponent = [0i32; LANES];
        for l in 0..LANES {
            let field = ((acc[l] >> 23) & 0xFF) as i32;
            let zero = acc[l] & 0x7FFF_FFFF == 0;
            acc_exponent[l] = if zero {
                ZERO_EXPONENT
            } else {
                field.max(1) - 127
            };
            top[l] = fma.min_alignment.max(acc_exponent[l]);
        }
        for t in t0..t1 {
            let exponents = &panel.exponents[t * LANES..(t + 1) * LANES];
            for (top, &e) in top.iter_mut().zip(exponents) {
                *top = (*top).max(row.exponents[t] + e);
            }
        }
        let (mut positive, mut negative) = ([0u32; LANES], [0u32; LANES]);
        for l in 0..LANES {
            let hidden = if acc[l] & 0x7F80_0000 != 0 {
                0x80_0000
            } else {
                0
            };
            let significand = ((acc[l] & 0x7F_FFFF) | hidden) << extra;
            let units = shr(significand, top[l] - acc_exponent[l]);
            let is_negative = acc[l] >> 31 == 1;
            positive[l] = if is_negative { 0 } else { units };
            negative[l] = if is_negative { units } else { 0 };
        }
        for t in t0..t1 {
            for l in 0..LANES {
                let at = t * LANES + l;
                let product = row.significands[t] * panel.significands[at];
                let exponent = row.exponents[t] + panel.exponents[at];
                let units = shr(product, top[l] - exponent);
                let mask = row.negatives[t] ^ panel.negatives[at];
                positive[l] += units & !mask;
                negative[l] += units & mask;
            }
        }
        for l in 0..LANES {
            let overflowed = acc[l] & 0x7FFF_FFFF == 0x7F80_0000;
            let next = normalize(positive[l], negative[l], top[l] - 23 - extra);
            acc[l] = if overflowed { acc[l] } else { next };
        }
    }
    acc
}

/// `x >> count`, 0 from 32 on (as AVX2's variable shift); `count` is never negative.
#[inline(always)]
fn shr(x: u32, count: i32) -> u32 {
    if (0..32).contains(&count) {
        x >> count
    } else {
        0
    }
}

/// The binary32 bits of `(positive - negative) · 2^unit`, truncated toward zero (±∞
/// from 2^128 on, +0 for an exact zero).
#[inline(always)]
fn normalize(positive: u32, negative: u32, unit: i32) -> u32 {
    let magnitude = positive.max(negative) - positive.min(negative);
    if magnitude == 0 {
        return 0;
    }
    let sign = if negative > positive { 0x8000_0000 } else { 0 };
    let length = 32 - magnitude.leading_zeros() as i32;
    // The biased exponent of the result's leading bit, 2^(unit + length - 1).
    let field = unit + length - 1 + 127;
    let significand = (magnitude >> (length - 24).max(0)) << (24 - length).max(0);
    let bits = if field >= 255 {
        0x7F80_0000
    } else if field >= 1 {
        ((field as u32) << 23) | (significand & 0x7F_FFFF)
    } else {
        shr(significand, 1 - field)
    };
    sign | bits
}

/// The kernel in AVX2 intrinsics, eight lanes per instruction.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::{BlockFma, ZERO_EXPONENT};
    use super::{LANES, Panel, Row};

    /// [`row_tile_portable`](super::row_tile_portable), bit for bit.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn row_tile(
        fma: BlockFma,
        row: Row<'_>,
        panel: Panel<'_>,
        acc: [u32; LANES],
    ) -> [u32; LANES] {
        let k = row.significands.len();
        assert!(panel.significands.len() == k * LANES && panel.exponents.len() == k * LANES);
        assert!(panel.negatives.len() == k * LANES && row.exponents.len() == k);
        assert!(row.negatives.len() == k);
        let extra = fma.extra_bits as i32;
        let load = |v: &[u32], at: usize| {
            // SAFETY: `at + 8 <= len`, checked by the asserts above for every `at` used.
            unsafe { _mm256_loadu_si256(v.as_ptr().add(at).cast()) }
        };
        let load_i = |v: &[i32], at: usize| {
            // SAFETY: as above.
            unsafe { _mm256_loadu_si256(v.as_ptr().add(at).cast()) }
        };
        let mut acc = load(&acc, 0);
        let abs_mask = _mm256_set1_epi32(0x7FFF_FFFF);
        let infinity = _mm256_set1_epi32(0x7F80_0000);
        let zero = _mm256_setzero_si256();
        let extra_v = _mm_cvtsi32_si128(extra);
        for t0 in (0..k).step_by(fma.block) {
            let t1 = (t0 + fma.block).min(k);
            // The accumulator's exponent: its field (at least 1) - 127, none for zero.
            let field = _mm256_and_si256(_mm256_srli_epi32::<23>(acc), _mm256_set1_epi32(0xFF));
            let is_zero = _mm256_cmpeq_epi32(_mm256_and_si256(acc, abs_mask), zero);
            let acc_exponent = _mm256_blendv_epi8(
                _mm256_sub_epi32(
                    _mm256_max_epi32(field, _mm256_set1_epi32(1)),
                    _mm256_set1_epi32(127),
                ),
                _mm256_set1_epi32(ZERO_EXPONENT),
                is_zero,
            );
            let mut top = _mm256_max_epi32(_mm256_set1_epi32(fma.min_alignment), acc_exponent);
            for t in t0..t1 {
                let e = _mm256_add_epi32(
                    _mm256_set1_epi32(row.exponents[t]),
                    load_i(panel.exponents, t * LANES),
                );
                top = _mm256_max_epi32(top, e);
            }
            // The accumulator's term.
            let hidden = _mm256_andnot_si256(
                _mm256_cmpeq_epi32(field, zero),
                _mm256_set1_epi32(0x80_0000),
            );
            let significand = _mm256_sll_epi32(
                _mm256_or_si256(_mm256_and_si256(acc, _mm256_set1_epi32(0x7F_FFFF)), hidden),
                extra_v,
            );
            let units = _mm256_srlv_epi32(significand, _mm256_sub_epi32(top, acc_exponent));
            let acc_negative = _mm256_srai_epi32::<31>(acc);
            let mut positive = _mm256_andnot_si256(acc_negative, units);
            let mut negative = _mm256_and_si256(acc_negative, units);
            for t in t0..t1 {
                let at = t * LANES;
                let product = _mm256_mullo_epi32(
                    _mm256_set1_epi32(row.significands[t] as i32),
                    load(panel.significands, at),
                );
                let e = _mm256_add_epi32(
                    _mm256_set1_epi32(row.exponents[t]),
                    load_i(panel.exponents, at),
                );
                let units = _mm256_srlv_epi32(product, _mm256_sub_epi32(top, e));
                let mask = _mm256_xor_si256(
                    _mm256_set1_epi32(row.negatives[t] as i32),
                    load(panel.negatives, at),
                );
                positive = _mm256_add_epi32(positive, _mm256_andnot_si256(mask, units));
                negative = _mm256_add_epi32(negative, _mm256_and_si256(mask, units));
            }
            let next = normalize(
                positive,
                negative,
                _mm256_sub_epi32(top, _mm256_set1_epi32(23 + extra)),
            );
            let overflowed = _mm256_cmpeq_epi32(_mm256_and_si256(acc, abs_mask), infinity);
            acc = _mm256_blendv_epi8(next, acc, overflowed);
        }
        let mut out = [0u32; LANES];
        // SAFETY: `out` holds 8 u32.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), acc) };
        out
    }

    /// [`normalize`](super::normalize) on eight lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn normalize(positive: __m256i, negative: __m256i, unit: __m256i) -> __m256i {
        let magnitude = _mm256_sub_epi32(
            _mm256_max_epu32(positive, negative),
            _mm256_min_epu32(positive, negative),
        );
        let flip = _mm256_set1_epi32(i32::MIN);
        let sign = _mm256_and_si256(
            _mm256_cmpgt_epi32(
                _mm256_xor_si256(negative, flip),
                _mm256_xor_si256(positive, flip),
            ),
            flip,
        );
        // The bit length, from the exponent of an exact conversion to f32: of the top 24
        // bits when there are more than 8, else of the value itself.
        let high = _mm256_srli_epi32::<8>(magnitude);
        let has_high = _mm256_cmpgt_epi32(high, _mm256_setzero_si256());
        let converted = _mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_blendv_epi8(
            magnitude, high, has_high,
        )));
        let length = _mm256_add_epi32(
            _mm256_sub_epi32(_mm256_srli_epi32::<23>(converted), _mm256_set1_epi32(126)),
            _mm256_and_si256(has_high, _mm256_set1_epi32(8)),
        );
        let field = _mm256_add_epi32(_mm256_add_epi32(unit, length), _mm256_set1_epi32(126));
        let down = _mm256_max_epi32(
            _mm256_sub_epi32(length, _mm256_set1_epi32(24)),
            _mm256_setzero_si256(),
        );
        let up = _mm256_max_epi32(
            _mm256_sub_epi32(_mm256_set1_epi32(24), length),
            _mm256_setzero_si256(),
        );
        let significand = _mm256_sllv_epi32(_mm256_srlv_epi32(magnitude, down), up);
        let normal = _mm256_or_si256(
            _mm256_slli_epi32::<23>(field),
            _mm256_and_si256(significand, _mm256_set1_epi32(0x7F_FFFF)),
        );
        // Below the normal range: a right shift by 1 - field (0 from 32 on; the count is
        // read unsigned, so a non-positive field's count is what is meant).
        let subnormal =
            _mm256_srlv_epi32(significand, _mm256_sub_epi32(_mm256_set1_epi32(1), field));
        let is_normal = _mm256_cmpgt_epi32(field, _mm256_setzero_si256());
        let is_infinite = _mm256_cmpgt_epi32(field, _mm256_set1_epi32(254));
        let bits = _mm256_blendv_epi8(subnormal, normal, is_normal);
        let bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7F80_0000), is_infinite);
        let is_zero = _mm256_cmpeq_epi32(magnitude, _mm256_setzero_si256());
        _mm256_andnot_si256(is_zero, _mm256_or_si256(sign, bits))
    }
}

/// The kernel in AVX-512 intrinsics: sixteen lanes per instruction, and up to four rows of
/// `a` against one panel at a time, so that each of the panel's loads serves all of them.
///
/// Against the AVX2 build it saves instructions where AVX-512 has them: a product's sign
/// is one bit of a mask register (the panel's signs are packed as the bits of a word, a
/// row's sign flips all of them), so a negative term costs one masked addition instead of
/// two masks and two additions; the exponents of the first pass are kept for the second
/// instead of added again; and the bit length of the normalisation is one `vplzcntd`.
///
/// Between blocks the accumulator stays decomposed, as the next block reads it: its
/// significand (already shifted left by the extra bits), its exponent and its sign, with a
/// sticky mask of the lanes that overflowed. Encoding binary32 after every block and
/// decoding it again before the next cost as much as the products of a V100's block of
/// four; the bits are assembled once, at the end.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::super::{BlockFma, FAST_MAX_BLOCK, ZERO_EXPONENT};
    use super::{PREFETCH_ROWS, Panel, PanelBuffer, Row, Rows, WIDE_LANES, decompose, prefetch};

    /// [`decompose`] on sixteen binary32 encodings: the significands, the exponents and
    /// the negative lanes. `None` if a lane is not finite or not a 12-bit value, or is a
    /// case this does not decide (a significand that would move left, which no format's
    /// `emin` of at least -137 gives): the caller asks [`decompose`], lane by lane.
    #[inline]
    #[target_feature(enable = "avx512f,avx512cd")]
    pub(super) fn decompose16(
        bits: __m512i,
        emin: __m512i,
    ) -> Option<(__m512i, __m512i, __mmask16)> {
        let magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFF_FFFF));
        let field = _mm512_srli_epi32::<23>(magnitude);
        let is_zero = _mm512_testn_epi32_mask(magnitude, magnitude);
        let has_hidden = _mm512_test_epi32_mask(magnitude, _mm512_set1_epi32(0x7F80_0000));
        let fraction = _mm512_and_si512(bits, _mm512_set1_epi32(0x7F_FFFF));
        // |x| = significand · 2^e0.
        let significand =
            _mm512_mask_or_epi32(fraction, has_hidden, fraction, _mm512_set1_epi32(0x80_0000));
        let e0 = _mm512_sub_epi32(
            _mm512_max_epi32(field, _mm512_set1_epi32(1)),
            _mm512_set1_epi32(150),
        );
        // floor(log2 |x|) = e0 + 31 - leading zeros, never below emin.
        let exponent = _mm512_max_epi32(
            _mm512_sub_epi32(
                _mm512_add_epi32(e0, _mm512_set1_epi32(31)),
                _mm512_lzcnt_epi32(significand),
            ),
            emin,
        );
        let shift = _mm512_sub_epi32(_mm512_sub_epi32(exponent, _mm512_set1_epi32(11)), e0);
        // The bits a right shift drops (all of them from 32 on) must be zeros.
        let dropped =
            _mm512_andnot_si512(_mm512_sllv_epi32(_mm512_set1_epi32(-1), shift), significand);
        let refused = _mm512_cmpeq_epi32_mask(field, _mm512_set1_epi32(0xFF))
            | (_mm512_cmplt_epi32_mask(shift, _mm512_set1_epi32(1)) & !is_zero)
            | _mm512_test_epi32_mask(dropped, dropped);
        if refused != 0 {
            return None;
        }
        Some((
            _mm512_srlv_epi32(significand, shift),
            _mm512_mask_mov_epi32(exponent, is_zero, _mm512_set1_epi32(ZERO_EXPONENT)),
            _mm512_cmplt_epi32_mask(bits, _mm512_setzero_si512()) & !is_zero,
        ))
    }

    /// The lanes of a run of `len` (at most 16) elements.
    pub(super) fn lanes(len: usize) -> __mmask16 {
        (((1u32 << len) - 1) & 0xFFFF) as __mmask16
    }

    /// [`Rows::pack`] on f32 operands, sixteen at a time.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and CD.
    #[target_feature(enable = "avx512f,avx512cd")]
    pub(super) unsafe fn pack_rows(a: &[f32], k: usize, emin: i32) -> Option<Rows> {
        let mut rows = Rows {
            k,
            significands: vec![0; a.len()],
            exponents: vec![0; a.len()],
            negatives: vec![0; a.len()],
        };
        let emin_v = _mm512_set1_epi32(emin);
        for (c, chunk) in a.chunks(WIDE_LANES).enumerate() {
            let at = c * WIDE_LANES;
            let mask = lanes(chunk.len());
            // SAFETY: the mask reads only the chunk's elements.
            let bits = unsafe { _mm512_maskz_loadu_epi32(mask, chunk.as_ptr().cast()) };
            if let Some((s, e, negative)) = decompose16(bits, emin_v) {
                let negatives = _mm512_maskz_mov_epi32(negative, _mm512_set1_epi32(-1));
                // SAFETY: the mask writes only the chunk's `len` places from `at`, all
                // within the vectors of `a.len()` elements.
                unsafe {
                    _mm512_mask_storeu_epi32(
                        rows.significands.as_mut_ptr().add(at).cast(),
                        mask,
                        s,
                    );
                    _mm512_mask_storeu_epi32(rows.exponents.as_mut_ptr().add(at).cast(), mask, e);
                    _mm512_mask_storeu_epi32(
                        rows.negatives.as_mut_ptr().add(at).cast(),
                        mask,
                        negatives,
                    );
                }
            } else {
                for (l, x) in chunk.iter().enumerate() {
                    let (s, e, negative) = decompose(f64::from(*x), emin)?;
                    rows.significands[at + l] = s;
                    rows.exponents[at + l] = e;
                    rows.negatives[at + l] = if negative { u32::MAX } else { 0 };
                }
            }
        }
        Some(rows)
    }

    /// [`PanelBuffer::fill`] on f32 operands, a row of the panel at a time.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and CD.
    #[target_feature(enable = "avx512f,avx512cd")]
    pub(super) unsafe fn fill_panel(
        buffer: &mut PanelBuffer,
        b: &[f32],
        (k, n): (usize, usize),
        j0: usize,
        shift: u32,
        emin: i32,
    ) -> bool {
        assert!(buffer.width == WIDE_LANES && buffer.signs.len() == k);
        assert!(buffer.significands.len() == k * WIDE_LANES);
        assert!(buffer.exponents.len() == k * WIDE_LANES);
        let columns = WIDE_LANES.min(n - j0);
        let mask = lanes(columns);
        let (emin_v, shift_v) = (_mm512_set1_epi32(emin), _mm_cvtsi32_si128(shift as i32));
        for p in 0..k {
            prefetch(b, (p + PREFETCH_ROWS) * n + j0, columns);
            let xs = &b[p * n + j0..p * n + j0 + columns];
            // SAFETY: the mask reads only the row's `columns` elements; the lanes past
            // them are zeros, which pack as zero operands.
            let bits = unsafe { _mm512_maskz_loadu_epi32(mask, xs.as_ptr().cast()) };
            if let Some((s, e, negative)) = decompose16(bits, emin_v) {
                let at = p * WIDE_LANES;
                // SAFETY: `at + 16 <= k * 16`, the asserted lengths.
                unsafe {
                    _mm512_storeu_si512(
                        buffer.significands.as_mut_ptr().add(at).cast(),
                        _mm512_sll_epi32(s, shift_v),
                    );
                    _mm512_storeu_si512(buffer.exponents.as_mut_ptr().add(at).cast(), e);
                }
                buffer.signs[p] = u32::from(negative);
            } else if !buffer.fill_row(xs, p, shift, emin) {
                return false;
            }
        }
        true
    }

    /// Sixteen accumulators between blocks: `±significand · 2^(exponent - 23 - extra)`,
    /// the exponent `ZERO_EXPONENT` for a zero (whose sign is kept in `negative`: a sum
    /// truncated to zero keeps its own), and for the lanes in `overflowed`, `infinities`
    /// holds their ±∞.
    #[derive(Clone, Copy)]
    struct Accumulator {
        significand: __m512i,
        exponent: __m512i,
        negative: __mmask16,
        overflowed: __mmask16,
        infinities: __m512i,
    }

    impl Accumulator {
        /// From binary32 bits.
        #[inline]
        #[target_feature(enable = "avx512f,avx512cd")]
        fn decode(bits: __m512i, extra: __m128i) -> Accumulator {
            let field = _mm512_and_si512(_mm512_srli_epi32::<23>(bits), _mm512_set1_epi32(0xFF));
            let has_hidden = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x7F80_0000));
            let fraction = _mm512_and_si512(bits, _mm512_set1_epi32(0x7F_FFFF));
            let significand =
                _mm512_mask_or_epi32(fraction, has_hidden, fraction, _mm512_set1_epi32(0x80_0000));
            let is_zero = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7FFF_FFFF));
            let exponent = _mm512_mask_mov_epi32(
                _mm512_sub_epi32(
                    _mm512_max_epi32(field, _mm512_set1_epi32(1)),
                    _mm512_set1_epi32(127),
                ),
                is_zero,
                _mm512_set1_epi32(ZERO_EXPONENT),
            );
            Accumulator {
                significand: _mm512_sll_epi32(significand, extra),
                exponent,
                negative: _mm512_cmplt_epi32_mask(bits, _mm512_setzero_si512()),
                overflowed: _mm512_cmpeq_epi32_mask(field, _mm512_set1_epi32(0xFF)),
                infinities: bits,
            }
        }

        /// To binary32 bits.
        #[inline]
        #[target_feature(enable = "avx512f,avx512cd")]
        fn encode(self, extra: __m128i) -> __m512i {
            let significand = _mm512_srl_epi32(self.significand, extra);
            // A normal value's hidden bit adds one to the field (exponent + 126), and a
            // subnormal's exponent is -126, whose field is then 0.
            let bits = _mm512_add_epi32(
                significand,
                _mm512_slli_epi32::<23>(_mm512_add_epi32(self.exponent, _mm512_set1_epi32(126))),
            );
            let is_nonzero = _mm512_test_epi32_mask(significand, significand);
            let bits = _mm512_maskz_mov_epi32(is_nonzero, bits);
            let bits = _mm512_mask_or_epi32(bits, self.negative, bits, _mm512_set1_epi32(i32::MIN));
            _mm512_mask_mov_epi32(bits, self.overflowed, self.infinities)
        }
    }

    /// [`row_tile_portable`](super::row_tile_portable) for each of `R` rows against a panel
    /// of sixteen columns, bit for bit.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and CD.
    #[target_feature(enable = "avx512f,avx512cd")]
    pub(super) unsafe fn rows_tile<const R: usize>(
        fma: BlockFma,
        rows: [Row<'_>; R],
        panel: Panel<'_>,
        acc: [[u32; WIDE_LANES]; R],
    ) -> [[u32; WIDE_LANES]; R] {
        let k = panel.signs.len();
        assert!(panel.significands.len() == k * WIDE_LANES);
        assert!(panel.exponents.len() == k * WIDE_LANES);
        for row in &rows {
            assert!(row.significands.len() == k && row.exponents.len() == k);
            assert!(row.negatives.len() == k);
        }
        assert!(fma.block <= FAST_MAX_BLOCK);
        let extra = _mm_cvtsi32_si128(fma.extra_bits as i32);
        let load = |v: &[u32], at: usize| {
            // SAFETY: `at + 16 <= len`, checked by the asserts above for every `at` used.
            unsafe { _mm512_loadu_si512(v.as_ptr().add(at).cast()) }
        };
        let load_i = |v: &[i32], at: usize| {
            // SAFETY: as above.
            unsafe { _mm512_loadu_si512(v.as_ptr().add(at).cast()) }
        };
        let mut acc = acc.map(|a| Accumulator::decode(load(&a, 0), extra));
        let zero = _mm512_setzero_si512();
        // Each row's `e(x) + e(y)` of the block, from the first pass for the second.
        let mut exponents = [[zero; FAST_MAX_BLOCK]; R];
        for t0 in (0..k).step_by(fma.block) {
            let t1 = (t0 + fma.block).min(k);
            let mut top = [zero; R];
            for r in 0..R {
                top[r] = _mm512_max_epi32(_mm512_set1_epi32(fma.min_alignment), acc[r].exponent);
            }
            for t in t0..t1 {
                let panel_exponents = load_i(panel.exponents, t * WIDE_LANES);
                for r in 0..R {
                    let e =
                        _mm512_add_epi32(panel_exponents, _mm512_set1_epi32(rows[r].exponents[t]));
                    exponents[r][t - t0] = e;
                    top[r] = _mm512_max_epi32(top[r], e);
                }
            }
            // The accumulator's term opens both sums.
            let mut total = [zero; R];
            let mut negative = [zero; R];
            for r in 0..R {
                let units = _mm512_srlv_epi32(
                    acc[r].significand,
                    _mm512_sub_epi32(top[r], acc[r].exponent),
                );
                total[r] = units;
                negative[r] = _mm512_maskz_mov_epi32(acc[r].negative, units);
            }
            for t in t0..t1 {
                let significands = load(panel.significands, t * WIDE_LANES);
                let signs = panel.signs[t];
                for r in 0..R {
                    let product = _mm512_mullo_epi32(
                        significands,
                        _mm512_set1_epi32(rows[r].significands[t] as i32),
                    );
                    let units =
                        _mm512_srlv_epi32(product, _mm512_sub_epi32(top[r], exponents[r][t - t0]));
                    total[r] = _mm512_add_epi32(total[r], units);
                    // The lanes whose product is negative: the panel's signs, all flipped
                    // by a negative row value (its mask is all ones).
                    let is_negative = (signs ^ rows[r].negatives[t]) as __mmask16;
                    negative[r] =
                        _mm512_mask_add_epi32(negative[r], is_negative, negative[r], units);
                }
            }
            for r in 0..R {
                normalize(
                    &mut acc[r],
                    total[r],
                    negative[r],
                    top[r],
                    fma.extra_bits,
                    extra,
                );
            }
        }
        acc.map(|acc| {
            let mut out = [0u32; WIDE_LANES];
            // SAFETY: `out` holds 16 u32.
            unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast(), acc.encode(extra)) };
            out
        })
    }

    /// [`normalize`](super::normalize) on sixteen lanes, from the sum of all magnitudes
    /// (below 2^32) and the sum of the negative ones, in units of `2^(top - 23 - extra)`,
    /// into the accumulator, decomposed. A lane that overflows now keeps its ±∞.
    #[inline]
    #[target_feature(enable = "avx512f,avx512cd")]
    fn normalize(
        acc: &mut Accumulator,
        total: __m512i,
        negative: __m512i,
        top: __m512i,
        extra_bits: u32,
        extra: __m128i,
    ) {
        let positive = _mm512_sub_epi32(total, negative);
        let magnitude = _mm512_sub_epi32(
            _mm512_max_epu32(positive, negative),
            _mm512_min_epu32(positive, negative),
        );
        let is_negative = _mm512_cmpgt_epu32_mask(negative, positive);
        let leading_zeros = _mm512_lzcnt_epi32(magnitude);
        // The leading bit moved to bit 31 (a zero magnitude shifts by 32 and stays 0).
        let normalized = _mm512_sllv_epi32(magnitude, leading_zeros);
        // The exponent of the leading bit: top - 23 - extra + (32 - leading_zeros) - 1.
        let leading = _mm512_sub_epi32(
            _mm512_add_epi32(top, _mm512_set1_epi32(8 - extra_bits as i32)),
            leading_zeros,
        );
        // The top 24 bits, truncated; below 2^-126 as many fewer as the exponent is below
        // (a subnormal binary32 value: a whole number of 2^-149 steps). Rare, so the
        // common case takes one immediate shift.
        let below_normal = _mm512_cmplt_epi32_mask(leading, _mm512_set1_epi32(-126));
        let significand = if below_normal == 0 {
            _mm512_srli_epi32::<8>(normalized)
        } else {
            let below = _mm512_max_epi32(
                _mm512_sub_epi32(_mm512_set1_epi32(-126), leading),
                _mm512_setzero_si512(),
            );
            _mm512_srlv_epi32(normalized, _mm512_add_epi32(below, _mm512_set1_epi32(8)))
        };
        let is_zero = _mm512_testn_epi32_mask(significand, significand);
        let overflows = _mm512_cmpgt_epi32_mask(leading, _mm512_set1_epi32(127));
        if overflows & !acc.overflowed != 0 {
            // Rare: a lane reaches 2^128 and stays ±∞, whatever its later blocks compute.
            let infinity = _mm512_mask_mov_epi32(
                _mm512_set1_epi32(0x7F80_0000),
                is_negative,
                _mm512_set1_epi32(0xFF80_0000_u32 as i32),
            );
            acc.infinities =
                _mm512_mask_mov_epi32(acc.infinities, overflows & !acc.overflowed, infinity);
            acc.overflowed |= overflows;
        }
        acc.significand = if extra_bits == 0 {
            significand
        } else {
            _mm512_sll_epi32(significand, extra)
        };
        acc.exponent = _mm512_mask_mov_epi32(
            _mm512_max_epi32(leading, _mm512_set1_epi32(-126)),
            is_zero,
            _mm512_set1_epi32(ZERO_EXPONENT),
        );
        acc.negative = is_negative;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decompose_reads_each_format_exactly() {
        let emin = -14; // fp16
        assert_eq!(decompose(1.0, emin), Some((0x800, 0, false)));
        assert_eq!(decompose(-1.5, emin), Some((0xC00, 0, true)));
        assert_eq!(decompose(-0.0, emin), Some((0, ZERO_EXPONENT, false)));
        // fp16's smallest subnormal, 2^-24: exponent -14, significand 2^-10 · 2^11.
        assert_eq!(decompose(2f64.powi(-24), emin), Some((2, -14, false)));
        assert_eq!(decompose(2f64.powi(-26), emin), None);
        assert_eq!(decompose(1.0 + 2f64.powi(-12), emin), None);
        assert_eq!(decompose(f64::INFINITY, emin), None);
        assert_eq!(decompose(f64::NAN, emin), None);
        // bf16's smallest subnormal as an f32: exponent -126.
        let tiny = f64::from(f32::from_bits(0x0001_0000));
        assert_eq!(decompose(tiny, -126), Some((1 << 4, -126, false)));
    }
}
