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
/// The largest block the fast kernels keep their products for.
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
    /// vectorised integer kernel, the fastest this CPU runs ([`GemmKernel::fastest`]:
    /// sixteen outputs at a time on AVX-512, eight on AVX2 or in plain Rust); others the
    /// exact scalar path. All give the same bits, and every output depends on its row and
    /// column only, so a caller may split the rows over threads without changing a bit.
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

    /// [`gemm`](Self::gemm) (or with `accumulate`, [`gemm_accumulate`](Self::gemm_accumulate))
    /// on the kernel given rather than the one the CPU and the operands select: how tests
    /// hold each kernel to the exact path's bits. Returns whether `kernel` ran; if not (the
    /// CPU lacks its instructions, or a vectorised kernel was asked for operands, outputs or
    /// a model it does not take), `out` is untouched.
    ///
    /// # Panics
    /// If a slice's length does not match its shape.
    ///
    /// ```
    /// use tl_numerics::{BlockFma, Format, GemmKernel};
    ///
    /// let (fma, fp16) = (BlockFma::A100, Format::Fp16);
    /// let (a, b) = ([1.0f32, 2f32.powi(-24), 2f32.powi(-24)], [1.0f32; 3]);
    /// let mut out = [0.0f32];
    /// assert!(fma.gemm_on(GemmKernel::Portable, fp16, (1, 3, 1), &a, &b, &mut out, false));
    /// assert_eq!(out[0], 1.0 + 2f32.powi(-23));
    /// // Not a 12-bit value: only the exact path takes it.
    /// let c = [1.0 + 2f32.powi(-20)];
    /// let one = (1, 1, 1);
    /// assert!(!fma.gemm_on(GemmKernel::Portable, fp16, one, &c, &b[..1], &mut out, false));
    /// assert!(fma.gemm_on(GemmKernel::Exact, fp16, one, &c, &b[..1], &mut out, false));
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_on<E: GemmElement>(
        self,
        kernel: GemmKernel,
        inputs: Format,
        (m, k, n): (usize, usize, usize),
        a: &[E],
        b: &[E],
        out: &mut [E],
        accumulate: bool,
    ) -> bool {
        if !kernel.is_available() {
            return false;
        }
        self.gemm_with(kernel, inputs, (m, k, n), a, b, out, accumulate)
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
        let fast = GemmKernel::fastest();
        if !self.gemm_with(fast, inputs, (m, k, n), a, b, out, accumulate) {
            self.gemm_with(GemmKernel::Exact, inputs, (m, k, n), a, b, out, accumulate);
        }
    }

    /// The product on `kernel`, which the CPU supports; `false` (and `out` untouched) if a
    /// vectorised kernel cannot take these operands, outputs or model.
    #[allow(clippy::too_many_arguments)]
    fn gemm_with<E: GemmElement>(
        self,
        kernel: GemmKernel,
        inputs: Format,
        (m, k, n): (usize, usize, usize),
        a: &[E],
        b: &[E],
        out: &mut [E],
        accumulate: bool,
    ) -> bool {
        assert!(
            a.len() == m * k && b.len() == k * n && out.len() == m * n,
            "BlockFma::gemm: slices of {}, {} and {} elements do not fit {m}×{k} by {k}×{n}",
            a.len(),
            b.len(),
            out.len()
        );
        if m == 0 || n == 0 {
            return true;
        }
        let emin = inputs.min_exponent();
        if kernel != GemmKernel::Exact {
            let finite_initial = !accumulate || out.iter().all(|o| o.to_f64().is_finite());
            return self.fits_fast_kernel()
                && finite_initial
                && fast::gemm(self, kernel, emin, (m, k, n), a, b, out, accumulate);
        }
        let initial = |o: E| if accumulate { o.to_f64() as f32 } else { 0.0 };
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
        true
    }

    /// Whether a block's aligned terms add up in the fast kernel's 32-bit lanes: each
    /// product below `2^(25 + extra)` units, the accumulator below `2^(24 + extra)`.
    fn fits_fast_kernel(self) -> bool {
        let bound = (self.block as u64) << (25 + self.extra_bits);
        self.block <= FAST_MAX_BLOCK && bound + (1u64 << (24 + self.extra_bits)) <= 1 << 32
    }
}

/// The kernels [`BlockFma::gemm`] runs on. It takes the fastest the CPU supports for
/// operands of at most 12 significant bits and models whose block sums fit 32-bit lanes,
/// and the exact path for the rest; [`BlockFma::gemm_on`] runs the one asked for. All give
/// the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmKernel {
    /// The definition on wide integers, output by output: any operands, any model.
    Exact,
    /// The integer kernel in plain Rust, eight outputs at a time: any CPU.
    Portable,
    /// The integer kernel in AVX2, eight outputs at a time.
    Avx2,
    /// The kernel in AVX-512 (F and CD), sixteen outputs at a time, up to four rows per
    /// panel: on binary32 arithmetic where every product is exact in binary32 and the
    /// model's signed block sums fit 31 bits, whole or in two halves (fp16 and fp8
    /// operands, and bf16 ones of a modest range, on the V100, A100 and H100 models), else
    /// on integers.
    Avx512,
}

impl GemmKernel {
    /// Every kernel, the exact path first.
    pub const ALL: [GemmKernel; 4] = [
        GemmKernel::Exact,
        GemmKernel::Portable,
        GemmKernel::Avx2,
        GemmKernel::Avx512,
    ];

    /// Whether this CPU has the instructions the kernel needs (checked at run time).
    pub fn is_available(self) -> bool {
        match self {
            GemmKernel::Exact | GemmKernel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            GemmKernel::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            GemmKernel::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512cd")
            }
            #[cfg(not(target_arch = "x86_64"))]
            GemmKernel::Avx2 | GemmKernel::Avx512 => false,
        }
    }

    /// The vectorised kernel [`BlockFma::gemm`] takes on this CPU: AVX-512, else AVX2,
    /// else the portable one.
    pub fn fastest() -> GemmKernel {
        [GemmKernel::Avx512, GemmKernel::Avx2]
            .into_iter()
            .find(|k| k.is_available())
            .unwrap_or(GemmKernel::Portable)
    }
}

/// The element types [`BlockFma::gemm`] reads and writes: f32 and f64.
pub trait GemmElement: Copy + Send + Sync {
    /// The value as an f64 (exact).
    fn to_f64(self) -> f64;
    /// A binary32 value in this type (exact).
    fn from_f32(x: f32) -> Self;
    /// The slice itself if its elements are f32, else `None` (the default): the AVX-512
    /// kernel's packing then reads the binary32 encodings sixteen at a time.
    fn as_f32s(xs: &[Self]) -> Option<&[f32]>
    where
        Self: Sized,
    {
        let _ = xs;
        None
    }
}

impl GemmElement for f32 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_f32(x: f32) -> Self {
        x
    }
    fn as_f32s(xs: &[Self]) -> Option<&[f32]> {
        Some(xs)
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

mod fast;

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorised kernels this CPU runs; the others named on stderr, so that a machine
    /// without them says so rather than passing in silence.
    fn vectorised_kernels() -> Vec<GemmKernel> {
        let (available, missing): (Vec<_>, Vec<_>) =
            GemmKernel::ALL[1..].iter().partition(|k| k.is_available());
        if !missing.is_empty() {
            eprintln!("not tested, this CPU lacks their instructions: {missing:?}");
        }
        available
    }

    /// The fast kernels against the exact path on edge cases: cancellation to a subnormal,
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
                for kernel in vectorised_kernels() {
                    let mut out = [0.0f32];
                    let shape = (1, a.len(), 1);
                    assert!(fma.gemm_on(kernel, Format::Bf16, shape, a, b, &mut out, false));
                    assert_eq!(
                        out[0].to_bits(),
                        expected.to_bits(),
                        "{kernel:?} {fma:?} {a:?}·{b:?}"
                    );
                }
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
