//! How a tensor core adds up a matrix product: the block fused multiply-add, emulated
//! exactly.
//!
//! An IEEE GEMM in f32 adds one product at a time, rounding to nearest after each addition.
//! A tensor core does not. Measured on the hardware (Fasi, Higham, Mikaitis & Pranesh,
//! "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021) and modelled bit for bit
//! (Khattak & Mikaitis, "Accurate models of NVIDIA tensor cores", 2025, whose models were
//! checked against the GPUs on 10^5 random inputs), one multiply-accumulate instruction takes
//! a block of `b` products and the running binary32 accumulator `c` and adds all `b + 1`
//! terms at once:
//!
//! 1. every product `x·y` is exact;
//! 2. the terms are aligned to the largest exponent among them, `M`, and each is truncated
//!    toward zero to a multiple of `2^(M − 23 − extra_bits)`: binary32's 24 bits below `M`,
//!    plus a few extra alignment bits;
//! 3. the aligned terms are added exactly (the adder has carry bits to spare);
//! 4. the sum is normalised once and truncated toward zero into binary32, which becomes the
//!    accumulator of the next block.
//!
//! A dot product of length `k` is `ceil(k / b)` such steps over consecutive blocks of the
//! inner index, in order, starting from `c = +0`.
//!
//! | model | block `b` | extra bits | smallest alignment exponent |
//! |-------|-----------|------------|-----------------------------|
//! | V100  | 4         | 0          | none                        |
//! | A100  | 8         | 1          | −132                        |
//! | H100  | 16        | 2          | −133                        |
//!
//! **The exponent of a product is not normalised.** The hardware takes the product of two
//! significands in `[1, 2)` as it comes, in `[1, 4)`, with the exponent `e(x) + e(y)`; a
//! product of `1.5 · 1.5 = 2.25` counts as exponent 0, not 1, so the alignment keeps one more
//! bit for it. Here `e(x)` is the exponent of `x` in its own input format, where a subnormal
//! has the format's smallest normal exponent (for fp16, `2^-24` has exponent −14, with
//! significand `2^-10`). The accumulator's exponent is its binary32 exponent (−126 for a
//! subnormal), and `M` is never below the model's smallest alignment exponent.
//!
//! # Worked examples
//!
//! The papers' probes (the test suite of Fasi et al. and the test vectors of Khattak &
//! Mikaitis; `tests/block_fma.rs` runs all of them). With `c = 1` and the two products
//! `2^-24 · 1`, an f32 GEMM rounds each addition to the even `1`. A V100 (no extra bit)
//! aligns both small terms to `1`'s unit `2^-23` and truncates them away; an A100 keeps one
//! more bit, unit `2^-24`, and the exact sum `1 + 2^-23` is a binary32 value:
//!
//! ```
//! use tl_numerics::{BlockFma, Format};
//!
//! let a = [2f64.powi(-24); 2];
//! let b = [1.0; 2];
//! assert_eq!(BlockFma::V100.step(Format::Fp16, 1.0, &a, &b), 1.0);
//! assert_eq!(BlockFma::A100.step(Format::Fp16, 1.0, &a, &b), 1.0 + 2f32.powi(-23));
//! ```
//!
//! The sum is truncated, not rounded: `1·1 + 1·1 + 1·1 + (1 + 2^-23 + 2^-22)` is exact in
//! the adder, and lies between the binary32 values 4 and `4 + 2^-21`, nearer the second;
//! every model gives 4.
//!
//! ```
//! use tl_numerics::{BlockFma, Format};
//!
//! let c = 1.0 + 2f32.powi(-23) + 2f32.powi(-22);
//! assert_eq!(BlockFma::H100.step(Format::Bf16, c, &[1.0; 3], &[1.0; 3]), 4.0);
//! ```
//!
//! # Where the sources are silent, and what this model does
//!
//! - **Special values** are decided over the whole dot product before any block, as the
//!   models do: a NaN operand or `∞·0` gives NaN, so do infinities of both signs; otherwise
//!   an infinity wins with its sign.
//! - **Overflow.** A sum at or beyond `2^128` gives ±∞, not the largest finite value that
//!   truncation would suggest (the models do the same, and a loss scaler must see it).
//! - **Zero.** A sum that is exactly zero is `+0`, whatever the signs that cancelled; a
//!   nonzero sum below `2^-149` truncates to a zero of its own sign.
//! - **Subnormals** are kept, in the inputs and in the result (a multiple of `2^-149`).

use crate::error::{NumericsError, Result};
use crate::format::Format;

/// A tensor core's way of adding up products: blocks of `block` exact products added to the
/// accumulator at once, aligned with `extra_bits` bits beyond binary32's 24 (see the module
/// documentation for the exact rule).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockFma {
    block: usize,
    extra_bits: u32,
    /// The alignment exponent `M` is at least this.
    min_alignment: i32,
}

/// The largest number of extra alignment bits [`BlockFma::new`] accepts.
pub const MAX_EXTRA_BITS: u32 = 40;
/// The largest block [`BlockFma::new`] accepts.
pub const MAX_BLOCK: usize = 1 << 16;

/// No lower limit on the alignment exponent: below any exponent a product can have.
const NO_LIMIT: i32 = -4096;
/// The exponent of a zero term: below every other, so it never decides the alignment.
const ZERO_EXPONENT: i32 = -100_000;
/// Lanes of the fast kernel: output columns computed side by side.
const LANES: usize = 8;
/// The largest block the fast kernel keeps its products for.
const FAST_MAX_BLOCK: usize = 32;

impl BlockFma {
    /// NVIDIA V100 (Volta): blocks of 4, no extra alignment bit.
    pub const V100: BlockFma = BlockFma {
        block: 4,
        extra_bits: 0,
        min_alignment: NO_LIMIT,
    };
    /// NVIDIA A100 (Ampere): blocks of 8, one extra alignment bit.
    pub const A100: BlockFma = BlockFma {
        block: 8,
        extra_bits: 1,
        min_alignment: -132,
    };
    /// NVIDIA H100 (Hopper): blocks of 16, two extra alignment bits.
    pub const H100: BlockFma = BlockFma {
        block: 16,
        extra_bits: 2,
        min_alignment: -133,
    };

    /// A block FMA of `block` products with `extra_bits` extra alignment bits, and no lower
    /// limit on the alignment exponent.
    ///
    /// # Errors
    /// [`NumericsError::InvalidBlockFma`] for a block of 0 or more than [`MAX_BLOCK`], or
    /// more than [`MAX_EXTRA_BITS`] extra bits.
    ///
    /// ```
    /// use tl_numerics::BlockFma;
    ///
    /// let fma = BlockFma::new(16, 2)?;
    /// assert_eq!((fma.block(), fma.extra_bits()), (16, 2));
    /// assert!(BlockFma::new(0, 0).is_err());
    /// # Ok::<(), tl_numerics::NumericsError>(())
    /// ```
    pub fn new(block: usize, extra_bits: u32) -> Result<Self> {
        if block == 0 || block > MAX_BLOCK || extra_bits > MAX_EXTRA_BITS {
            return Err(NumericsError::InvalidBlockFma { block, extra_bits });
        }
        Ok(BlockFma {
            block,
            extra_bits,
            min_alignment: NO_LIMIT,
        })
    }

    /// The number of products added at once.
    pub const fn block(self) -> usize {
        self.block
    }

    /// The alignment bits kept beyond binary32's 24.
    pub const fn extra_bits(self) -> u32 {
        self.extra_bits
    }

    /// The smallest alignment exponent, if the model has one (the A100's −132, the
    /// H100's −133; none for the V100 and for [`new`](Self::new)'s models).
    pub const fn min_alignment_exponent(self) -> Option<i32> {
        if self.min_alignment == NO_LIMIT {
            None
        } else {
            Some(self.min_alignment)
        }
    }

    /// One multiply-accumulate, `acc + Σ a[i]·b[i]` over one block, for operands of format
    /// `inputs` (which decides their exponents; see the module documentation).
    ///
    /// # Panics
    /// If the slices differ in length or are longer than the block.
    ///
    /// ```
    /// use tl_numerics::{BlockFma, Format};
    ///
    /// // Toward zero, whatever the sign: 1 - 2^-25 is cut to 1 on a V100.
    /// assert_eq!(BlockFma::V100.step(Format::Fp16, 1.0, &[-(2f64.powi(-25))], &[1.0]), 1.0);
    /// ```
    pub fn step(self, inputs: Format, acc: f32, a: &[f64], b: &[f64]) -> f32 {
        assert_eq!(a.len(), b.len(), "BlockFma::step: operand lengths differ");
        assert!(
            a.len() <= self.block,
            "BlockFma::step: {} products do not fit a block of {}",
            a.len(),
            self.block
        );
        if let Some(special) = special_result(acc, a, b) {
            return special;
        }
        exact_step(self, inputs.min_exponent(), acc, a, b)
    }

    /// The dot product `Σ a[i]·b[i]` as the tensor core computes it: [`step`](Self::step)
    /// over consecutive blocks, starting from `+0`.
    ///
    /// # Panics
    /// If the slices differ in length.
    ///
    /// ```
    /// use tl_numerics::{BlockFma, Format};
    ///
    /// // Both small terms share a block with the 1: cut away on a V100, kept on an A100.
    /// let a = [1.0, 2f64.powi(-24), 2f64.powi(-24)];
    /// assert_eq!(BlockFma::V100.dot(Format::Fp16, &a, &[1.0; 3]), 1.0);
    /// assert_eq!(BlockFma::A100.dot(Format::Fp16, &a, &[1.0; 3]), 1.0 + 2f32.powi(-23));
    /// ```
    pub fn dot(self, inputs: Format, a: &[f64], b: &[f64]) -> f32 {
        self.dot_with(inputs, 0.0, a, b)
    }

    /// The multiply-accumulate `acc + Σ a[i]·b[i]` over any number of blocks: the
    /// instruction's `D = C + A·B` for one output, with `acc` as `C`.
    ///
    /// # Panics
    /// If the slices differ in length.
    ///
    /// ```
    /// use tl_numerics::{BlockFma, Format};
    ///
    /// // 1 + 2^-23 (the accumulator), 1·1 and, at index 8, 2^-23·1. In the first block, the
    /// // sum is exact: 2 + 2^-22. Past it, 2 + 2^-23 is first truncated to 2.
    /// let (mut a, mut b) = (vec![0.0; 9], vec![0.0; 9]);
    /// (a[0], b[0], a[8], b[8]) = (1.0, 1.0, 2f64.powi(-23), 1.0);
    /// let c = 1.0 + 2f32.powi(-23);
    /// assert_eq!(BlockFma::H100.dot_with(Format::Fp16, c, &a, &b), 2.0 + 2f32.powi(-22));
    /// assert_eq!(BlockFma::A100.dot_with(Format::Fp16, c, &a, &b), 2.0);
    /// ```
    pub fn dot_with(self, inputs: Format, acc: f32, a: &[f64], b: &[f64]) -> f32 {
        assert_eq!(a.len(), b.len(), "BlockFma::dot: operand lengths differ");
        if let Some(special) = special_result(acc, a, b) {
            return special;
        }
        let emin = inputs.min_exponent();
        a.chunks(self.block)
            .zip(b.chunks(self.block))
            .fold(acc, |acc, (a, b)| {
                if acc.is_infinite() {
                    acc // an earlier block overflowed; finite terms cannot bring it back
                } else {
                    exact_step(self, emin, acc, a, b)
                }
            })
    }

    /// `out = a · b` for row-major `a` (`m×k`), `b` (`k×n`) and `out` (`m×n`) holding values
    /// of format `inputs`, every output the [`dot`](Self::dot) of its row and column,
    /// written as binary32 values.
    ///
    /// Operands of at most 12 significant bits (bf16, fp16 and fp8 values) take a
    /// vectorised integer kernel, eight outputs at a time; others the exact scalar path.
    /// Both give the same bits, and every output depends on its row and column only, so a
    /// caller may split the rows over threads without changing a bit.
    ///
    /// # Panics
    /// If a slice's length does not match its shape.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm<E: GemmElement>(
        self,
        inputs: Format,
        m: usize,
        k: usize,
        n: usize,
        a: &[E],
        b: &[E],
        out: &mut [E],
    ) {
        self.gemm_from(inputs, (m, k, n), a, b, out, false);
    }

    /// `out = out + a · b` as [`gemm`](Self::gemm), each output's old value (as binary32)
    /// the accumulator its first block starts from: the instruction's `D = C + A·B`, as a
    /// GEMM split along its inner dimension chains it.
    ///
    /// # Panics
    /// If a slice's length does not match its shape.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_accumulate<E: GemmElement>(
        self,
        inputs: Format,
        m: usize,
        k: usize,
        n: usize,
        a: &[E],
        b: &[E],
        out: &mut [E],
    ) {
        self.gemm_from(inputs, (m, k, n), a, b, out, true);
    }

    fn gemm_from<E: GemmElement>(
        self,
        inputs: Format,
        (m, k, n): (usize, usize, usize),
        a: &[E],
        b: &[E],
        out: &mut [E],
        accumulate: bool,
    ) {
        assert!(
            a.len() == m * k && b.len() == k * n && out.len() == m * n,
            "BlockFma::gemm: slices of {}, {} and {} elements do not fit {m}×{k} by {k}×{n}",
            a.len(),
            b.len(),
            out.len()
        );
        if m == 0 || n == 0 {
            return;
        }
        let emin = inputs.min_exponent();
        let initial = |o: E| if accumulate { o.to_f64() as f32 } else { 0.0 };
        let finite_initial = !accumulate || out.iter().all(|o| o.to_f64().is_finite());
        if self.fits_fast_kernel()
            && finite_initial
            && let (Some(a), Some(b)) = (fast::pack(a, emin), fast::pack(b, emin))
        {
            fast::gemm(self, (m, k, n), &a, &b, out, accumulate);
            return;
        }
        let a: Vec<f64> = a.iter().map(|x| x.to_f64()).collect();
        let mut column = vec![0.0f64; k];
        for j in 0..n {
            for (p, c) in column.iter_mut().enumerate() {
                *c = b[p * n + j].to_f64();
            }
            for i in 0..m {
                let o = &mut out[i * n + j];
                *o = E::from_f32(self.dot_with(
                    inputs,
                    initial(*o),
                    &a[i * k..(i + 1) * k],
                    &column,
                ));
            }
        }
    }

    /// Whether a block's aligned terms add up in the fast kernel's 32-bit lanes: each
    /// product below `2^(25 + extra)` units, the accumulator below `2^(24 + extra)`.
    fn fits_fast_kernel(self) -> bool {
        let bound = (self.block as u64) << (25 + self.extra_bits);
        self.block <= FAST_MAX_BLOCK && bound + (1u64 << (24 + self.extra_bits)) <= 1 << 32
    }
}

/// The element types [`BlockFma::gemm`] reads and writes: f32 and f64.
pub trait GemmElement: Copy + Send + Sync {
    /// The value as an f64 (exact).
    fn to_f64(self) -> f64;
    /// A binary32 value in this type (exact).
    fn from_f32(x: f32) -> Self;
}

impl GemmElement for f32 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl GemmElement for f64 {
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f32(x: f32) -> Self {
        f64::from(x)
    }
}

/// The result of a dot product with a NaN or an infinity among its accumulator and products
/// (`∞·0` is NaN), decided before any block as the hardware models do; `None` when every
/// term is finite.
fn special_result(acc: f32, a: &[f64], b: &[f64]) -> Option<f32> {
    let (mut nan, mut positive, mut negative) =
        (acc.is_nan(), acc == f32::INFINITY, acc == f32::NEG_INFINITY);
    for (&x, &y) in a.iter().zip(b) {
        if x.is_finite() && y.is_finite() {
            continue;
        }
        let p = x * y;
        nan |= p.is_nan();
        positive |= p == f64::INFINITY;
        negative |= p == f64::NEG_INFINITY;
    }
    if nan || (positive && negative) {
        Some(f32::NAN)
    } else if positive {
        Some(f32::INFINITY)
    } else if negative {
        Some(f32::NEG_INFINITY)
    } else {
        None
    }
}

/// A finite f64 as `(negative, significand, exponent)` with `|x| = significand · 2^exponent`.
fn decompose(x: f64) -> (bool, u64, i32) {
    let bits = x.to_bits();
    let field = ((bits >> 52) & 0x7FF) as i32;
    let fraction = bits & ((1 << 52) - 1);
    let (significand, exponent) = if field == 0 {
        (fraction, -1074)
    } else {
        (fraction | (1 << 52), field - 1075)
    };
    (bits >> 63 == 1, significand, exponent)
}

/// The exponent of a nonzero finite `x` in a format whose smallest normal exponent is
/// `emin`: `floor(log2 |x|)`, but never below `emin` (a subnormal's exponent).
fn format_exponent(x: f64, emin: i32) -> i32 {
    let (_, significand, exponent) = decompose(x);
    (exponent + 63 - significand.leading_zeros() as i32).max(emin)
}

/// One block step by the definition, exactly, for finite inputs of a format whose smallest
/// normal exponent is `emin`.
fn exact_step(fma: BlockFma, emin: i32, acc: f32, a: &[f64], b: &[f64]) -> f32 {
    // Each term as ±significand·2^exponent, exactly, with its exponent for the alignment.
    let mut terms: Vec<(bool, u128, i32)> = Vec::with_capacity(a.len() + 1);
    let mut top = fma.min_alignment;
    for (&x, &y) in a.iter().zip(b) {
        if x == 0.0 || y == 0.0 {
            continue;
        }
        let ((nx, sx, ex), (ny, sy, ey)) = (decompose(x), decompose(y));
        terms.push((nx != ny, u128::from(sx) * u128::from(sy), ex + ey));
        top = top.max(format_exponent(x, emin) + format_exponent(y, emin));
    }
    if acc != 0.0 {
        let (negative, significand, exponent) = decompose(f64::from(acc));
        terms.push((negative, u128::from(significand), exponent));
        top = top.max(format_exponent(f64::from(acc), -126));
    }
    let unit = top - 23 - fma.extra_bits as i32;
    let sum: i128 = terms
        .iter()
        .map(|&(negative, significand, exponent)| {
            // Truncated toward zero to a multiple of 2^unit, counted in units. A product is
            // below 4·2^top, so at most 25 + extra bits remain.
            let units = if exponent >= unit {
                significand << (exponent - unit)
            } else {
                significand
                    .checked_shr((unit - exponent) as u32)
                    .unwrap_or(0)
            } as i128;
            if negative { -units } else { units }
        })
        .sum();
    truncate_to_f32(sum.is_negative(), sum.unsigned_abs(), unit)
}

/// `±magnitude · 2^unit` truncated toward zero into binary32 (±∞ from `2^128` on).
fn truncate_to_f32(negative: bool, magnitude: u128, unit: i32) -> f32 {
    if magnitude == 0 {
        return 0.0;
    }
    let sign = u32::from(negative) << 31;
    let length = 128 - magnitude.leading_zeros() as i32;
    let exponent = unit + length - 1;
    let bits = if exponent > 127 {
        0x7F80_0000
    } else if exponent >= -126 {
        let significand = if length > 24 {
            magnitude >> (length - 24)
        } else {
            magnitude << (24 - length)
        };
        (((exponent + 127) as u32) << 23) | (significand as u32 & 0x7F_FFFF)
    } else {
        // Below 2^-126: a whole number of 2^-149 steps, truncated.
        let shift = unit + 149;
        let steps = if shift >= 0 {
            magnitude << shift
        } else {
            magnitude.checked_shr((-shift) as u32).unwrap_or(0)
        };
        steps as u32
    };
    f32::from_bits(sign | bits)
}

/// The vectorised kernel: eight output columns side by side in 32-bit integer lanes, each
/// operand as a 12-bit significand and its format exponent.
///
/// For one row of `a` and a panel of eight columns of `b`, a block of products takes two
/// passes. The first finds each lane's alignment exponent, the largest `e(x) + e(y)` (the
/// accumulator's exponent and the model's floor included); a zero operand's exponent is so
/// low that its products never count. The second multiplies the significands (the panel's
/// are stored shifted left by `1 + extra` bits, so that a product's units are one right shift
/// away) and adds each term, truncated by that shift, into a sum of positive and a sum of
/// negative terms (each below 2^32). The accumulator is then normalised and truncated into
/// binary32 from the difference.
mod fast {
    use super::{BlockFma, GemmElement, LANES, ZERO_EXPONENT, format_exponent};

    /// An operand: sign in bit 31 and a significand below 2^12 (`|x| = s · 2^(e - 11)`),
    /// and its format exponent `e` (`ZERO_EXPONENT` for zero).
    #[derive(Clone, Copy, Default, Debug)]
    pub(super) struct Packed {
        signed: u32,
        exponent: i32,
    }

    /// The operands packed, if each is finite and a value `s · 2^(e - 11)` with `s` an
    /// integer below 2^12 at its format exponent `e` (true of every value of a format of at
    /// most 12 bits of precision).
    pub(super) fn pack<E: GemmElement>(xs: &[E], emin: i32) -> Option<Vec<Packed>> {
        let mut packed = Vec::with_capacity(xs.len());
        for x in xs {
            let x = x.to_f64();
            if x == 0.0 {
                packed.push(Packed {
                    signed: 0,
                    exponent: ZERO_EXPONENT,
                });
                continue;
            }
            if !x.is_finite() {
                return None;
            }
            let exponent = format_exponent(x, emin);
            // Exact: a power-of-two scaling of a finite value (both within f64's range, as
            // exponents of f32-sized values are).
            let s = x.abs() * 2f64.powi(11 - exponent);
            if !(s < 4096.0 && s.fract() == 0.0 && (-1000..1000).contains(&exponent)) {
                return None;
            }
            packed.push(Packed {
                signed: (s as u32) | (u32::from(x < 0.0) << 31),
                exponent,
            });
        }
        Some(packed)
    }

    /// Operands laid out for the lanes: significands, exponents and sign masks (all ones
    /// for a negative value) in separate arrays.
    #[derive(Default)]
    pub(super) struct Lanes {
        significands: Vec<u32>,
        exponents: Vec<i32>,
        negatives: Vec<u32>,
    }

    impl Lanes {
        fn fill(&mut self, packed: impl Iterator<Item = Packed>, shift: u32) {
            self.significands.clear();
            self.exponents.clear();
            self.negatives.clear();
            for p in packed {
                self.significands.push((p.signed & 0xFFF) << shift);
                self.exponents.push(p.exponent);
                self.negatives
                    .push(if p.signed >> 31 == 1 { u32::MAX } else { 0 });
            }
        }
    }

    /// `out = a · b` (or `out + a · b`, each output's old value as binary32 the starting
    /// accumulator) on packed operands, `a` m×k and `b` k×n row-major.
    pub(super) fn gemm<E: GemmElement>(
        fma: BlockFma,
        (m, k, n): (usize, usize, usize),
        a: &[Packed],
        b: &[Packed],
        out: &mut [E],
        accumulate: bool,
    ) {
        let zero = Packed {
            signed: 0,
            exponent: ZERO_EXPONENT,
        };
        let mut row = Lanes::default();
        let mut panel = Lanes::default();
        let rows: Vec<Lanes> = (0..m)
            .map(|i| {
                row.fill(a[i * k..(i + 1) * k].iter().copied(), 0);
                std::mem::take(&mut row)
            })
            .collect();
        for j0 in (0..n).step_by(LANES) {
            let width = LANES.min(n - j0);
            // The columns j0.. of b, k × LANES, zeros past the edge (a zero product changes
            // neither the alignment nor the sum).
            let columns = (0..k).flat_map(|p| {
                (0..LANES).map(move |l| if l < width { b[p * n + j0 + l] } else { zero })
            });
            panel.fill(columns, 1 + fma.extra_bits);
            for (i, row) in rows.iter().enumerate() {
                let outputs = &mut out[i * n + j0..i * n + j0 + width];
                let mut acc = [0u32; LANES];
                if accumulate {
                    for (a, o) in acc.iter_mut().zip(outputs.iter()) {
                        *a = (o.to_f64() as f32).to_bits();
                    }
                }
                let acc = row_tile(fma, row, &panel, acc);
                for (o, &v) in outputs.iter_mut().zip(&acc) {
                    *o = E::from_f32(f32::from_bits(v));
                }
            }
        }
    }

    /// One row against a panel of `LANES` columns: the binary32 bits of the outputs.
    fn row_tile(fma: BlockFma, row: &Lanes, panel: &Lanes, acc: [u32; LANES]) -> [u32; LANES] {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { avx2::row_tile(fma, row, panel, acc) };
        }
        row_tile_portable(fma, row, panel, acc)
    }

    /// The kernel in plain Rust, lane by lane: the definition the AVX2 build must match bit
    /// for bit (a test compares them).
    pub(super) fn row_tile_portable(
        fma: BlockFma,
        row: &Lanes,
        panel: &Lanes,
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

    /// The same kernel in AVX2 intrinsics, eight lanes per instruction.
    #[cfg(target_arch = "x86_64")]
    mod avx2 {
        use std::arch::x86_64::*;

        use super::super::{BlockFma, LANES, ZERO_EXPONENT};
        use super::Lanes;

        /// [`row_tile_portable`](super::row_tile_portable), bit for bit.
        ///
        /// # Safety
        /// The CPU must support AVX2.
        #[target_feature(enable = "avx2")]
        pub(in super::super) unsafe fn row_tile(
            fma: BlockFma,
            row: &Lanes,
            panel: &Lanes,
            acc: [u32; LANES],
        ) -> [u32; LANES] {
            let k = row.significands.len();
            assert!(panel.significands.len() == k * LANES && panel.exponents.len() == k * LANES);
            assert!(panel.negatives.len() == k * LANES && row.exponents.len() == k);
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
                        load_i(&panel.exponents, t * LANES),
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
                        load(&panel.significands, at),
                    );
                    let e = _mm256_add_epi32(
                        _mm256_set1_epi32(row.exponents[t]),
                        load_i(&panel.exponents, at),
                    );
                    let units = _mm256_srlv_epi32(product, _mm256_sub_epi32(top, e));
                    let mask = _mm256_xor_si256(
                        _mm256_set1_epi32(row.negatives[t] as i32),
                        load(&panel.negatives, at),
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

    #[cfg(test)]
    mod tests {
        use super::*;

        /// Random packed operands of every kind: zeros, both signs, wide exponents.
        fn operands(count: usize, seed: u64) -> Vec<Packed> {
            let mut state = seed;
            (0..count)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let r = (state >> 33) as u32;
                    if r.is_multiple_of(7) {
                        return Packed {
                            signed: 0,
                            exponent: ZERO_EXPONENT,
                        };
                    }
                    Packed {
                        signed: (r & 0x7FF) | 0x800 | ((r >> 20) & 1) << 31,
                        exponent: ((r >> 12) % 60) as i32
                            - 30
                            - if r.is_multiple_of(11) { 100 } else { 0 },
                    }
                })
                .collect()
        }

        #[test]
        fn the_avx2_build_gives_the_portable_bits() {
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                for (i, fma) in [
                    BlockFma::V100,
                    BlockFma::A100,
                    BlockFma::H100,
                    BlockFma::new(3, 1).unwrap(),
                ]
                .into_iter()
                .enumerate()
                {
                    for k in [1, 5, 16, 37] {
                        let mut row = Lanes::default();
                        row.fill(operands(k, 1 + i as u64).into_iter(), 0);
                        let mut panel = Lanes::default();
                        panel.fill(
                            operands(k * LANES, 99 + k as u64).into_iter(),
                            1 + fma.extra_bits,
                        );
                        for acc in [
                            [0u32; LANES],
                            [
                                0x3F80_0000,
                                0xBF80_0000,
                                1,
                                0x8000_0001,
                                0x7F80_0000,
                                0x0080_0000,
                                0x4B00_0000,
                                0xCB7F_FFFF,
                            ],
                        ] {
                            let portable = row_tile_portable(fma, &row, &panel, acc);
                            // SAFETY: AVX2 checked above.
                            let vector = unsafe { avx2::row_tile(fma, &row, &panel, acc) };
                            assert_eq!(portable, vector, "{fma:?} k = {k} acc = {acc:x?}");
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast kernel against the exact path on edge cases: cancellation to a subnormal,
    /// overflow, mixed signs, zeros, bf16 subnormal operands.
    #[test]
    fn the_fast_kernel_and_the_exact_path_agree_on_edge_cases() {
        let cases: [(&[f32], &[f32]); 5] = [
            (
                &[1.5 * 2f32.powi(-63), -(2f32.powi(-63))],
                &[2f32.powi(-63); 2],
            ),
            (&[2f32.powi(127), 2f32.powi(127)], &[1.5, 1.5]),
            (&[1.0, -1.0, 0.0, 2f32.powi(-24)], &[1.0, 1.0, 5.0, 3.0]),
            (&[0.0; 4], &[1.0; 4]),
            (&[f32::from_bits(0x0001_0000), 1.5], &[3.0, 2f32.powi(-130)]),
        ];
        for fma in [BlockFma::V100, BlockFma::A100, BlockFma::H100] {
            for (a, b) in cases {
                let wide = |xs: &[f32]| xs.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
                let expected = fma.dot(Format::Bf16, &wide(a), &wide(b));
                let pa = fast::pack(a, Format::Bf16.min_exponent()).unwrap();
                let pb = fast::pack(b, Format::Bf16.min_exponent()).unwrap();
                let mut out = [0.0f32];
                fast::gemm(fma, (1, a.len(), 1), &pa, &pb, &mut out, false);
                assert_eq!(out[0].to_bits(), expected.to_bits(), "{fma:?} {a:?}·{b:?}");
            }
        }
    }

    #[test]
    fn the_presets_fit_the_fast_kernel_and_wide_models_do_not() {
        assert!(BlockFma::V100.fits_fast_kernel());
        assert!(BlockFma::A100.fits_fast_kernel());
        assert!(BlockFma::H100.fits_fast_kernel());
        assert!(!BlockFma::new(16, 3).unwrap().fits_fast_kernel());
        assert!(!BlockFma::new(64, 0).unwrap().fits_fast_kernel());
    }
}
