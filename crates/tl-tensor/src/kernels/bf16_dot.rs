//! Products of bf16 values summed in f32, in the one order a CPU's bf16 units add them:
//! computed on those units where the CPU has them and the operands allow it, and by portable
//! f32 code with the same bits everywhere else. Where the units add fewer products per cycle
//! than the CPU's fused multiply-adds (timed once per process, [`units_preferred`]), or the
//! CPU has AVX-512 without them, a tile of fused multiply-adds in sixteen lanes computes the
//! same order on the units' packing of the right operand (`split_pairs_tile`), the left one
//! read with each value in an f32 of its own: the same bits.
//!
//! # The order
//! `vdpbf16ps` (AVX512-BF16) takes 16 lanes of bf16 pairs from each operand and adds both
//! products of a lane to its f32 accumulator, the odd element's first:
//!
//! ```text
//! acc ← rne(rne(acc + a[2j+1]·b[2j+1]) + a[2j]·b[2j])
//! ```
//!
//! Each addition is rounded to nearest even and each product is exact (8 × 8 significant
//! bits fit binary32's 24). A GEMM that keeps one output in one lane and walks the inner
//! dimension pair by pair therefore computes, for every output,
//!
//! ```text
//! acc = 0 (or the old output, accumulating)
//! for p in 0..⌈k/2⌉:  acc ← rne(acc + a[2p+1]·b[2p+1]);  acc ← rne(acc + a[2p]·b[2p])
//! ```
//!
//! with a zero pair element past an odd `k`. That fold is what this module computes, on any
//! path: a product of bf16 values accumulated in f32, in a fixed order that depends on `k`
//! alone — not on the shape, the blocking, the machine or the number of threads.
//!
//! # Where the units are not IEEE f32, and why it cannot show
//! Probed on an AMD EPYC (Zen 4) and documented by Intel for the instruction: the units read
//! subnormal bf16 inputs and a subnormal accumulator as zero, and flush a subnormal result to
//! zero (2⁻¹⁰⁰·2⁻³⁰ gives 0, where f32 gives 2⁻¹³⁰). Everything else — rounding, ±0,
//! infinities, NaN — follows IEEE 754. So the units are used only for operands that make
//! every value they read and write a normal number or zero, which the pass converting the
//! operands to bf16 (it reads every value anyway) establishes:
//!
//! - every value of both operands is finite, zero or normal, and a bf16 value;
//! - writing `e(x)` for the exponent of `x`'s leading bit over the nonzero values, a bf16
//!   value is a multiple of 2^(e−7), so every product, and every sum of products and its
//!   rounding, is a multiple of `2^(min e(a) + min e(b) − 14)`; with
//!   `min e(a) + min e(b) ≥ −112` no nonzero value can come below 2⁻¹²⁶, the smallest normal
//!   number (and accumulating, an old output `o` is a multiple of 2^(e(o)−23), so
//!   `min e(o) ≥ −103`);
//! - no partial sum can reach 2¹²⁷ (`max e(a) + max e(b) + 2 + bits(k) ≤ 126`, and old outputs
//!   below 2¹²⁶), so none overflows and no infinity or NaN is made.
//!
//! Operands outside that window — a subnormal, an infinity, a NaN, a value that is not bf16,
//! exponents far apart — take the portable path, which is IEEE f32 arithmetic in the same
//! order (fused multiply-adds, exact here since the products are). On the window both paths
//! compute the same IEEE operations on normal numbers, so they give the same bits; the tests
//! below compare them on random and on edge-case operands, and show the units' flush outside
//! the window.
//!
//! # The AMX order
//! Intel's AMX tiles (`tdpbf16ps`, AMX-BF16) sum in another order, probed on a Xeon that has
//! them: per block of 32 values of the inner dimension (one instruction), an even and an odd
//! f32 sum from +0, each addition rounded to nearest even, then `acc ← rne(acc + rne(e + o))`.
//! [`amx_gemm_into`] computes that order, on the tiles where the CPU has them and by portable
//! f32 code elsewhere, with the same bits; the window above applies to it unchanged. It is a
//! second order, not a faster way to the first: the two give different bits, and a product
//! takes the order its caller names (`--accumulate amx` in tinyllm). The probes, the argument
//! and the kernel are in the `amx` submodule.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use std::borrow::Cow;
use std::cell::Cell;

use ndarray::{Array2, ArrayView2, ArrayViewMut2, Axis, s};
use rayon::prelude::*;

use super::split::PARALLEL_WORK;
use crate::ops::matmul_with::PreparedRhs;
use crate::{Element, ProductKernel};

mod amx;
mod rate;
pub use amx::amx_available;
#[cfg(target_arch = "x86_64")]
use amx::{AMX_MR, amx_tile};
pub use rate::units_preferred;
use rate::{PairsTile, pairs_tile};

/// Which code computed a product (returned for tests and benchmarks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Route {
    /// The CPU's bf16 units (`vdpbf16ps`).
    Units,
    /// Fused multiply-adds in sixteen lanes on the units' packing, in the units' order: where
    /// the units add fewer products per cycle than the fused multiply-adds
    /// ([`units_preferred`]), or the CPU has AVX-512 without them.
    Fma,
    /// The CPU's AMX tiles (`tdpbf16ps`), for a product in the AMX order.
    Tiles,
    /// Portable f32 arithmetic in the product's order: the CPU has no units (or tiles) for
    /// it, it was asked for, or the operands fall outside the units' exact window.
    Portable,
}

/// The order a product of bf16 values adds up in: the AVX512-BF16 units' (this module's),
/// or the AMX tiles' ([`amx`]'s).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Order {
    Pairs,
    Amx,
}

impl Order {
    /// Whether this CPU computes the order by a packed kernel: the units' order on its units
    /// or by fused multiply-adds in sixteen lanes (AVX-512F and BW, for the packing), the
    /// AMX order on the tiles.
    fn on_hardware(self) -> bool {
        match self {
            Order::Pairs => packing_available(),
            Order::Amx => amx_available(),
        }
    }

    /// The route of a product computed by that kernel.
    fn route(self) -> Bf16Route {
        match (self, pairs_tile()) {
            (Order::Pairs, PairsTile::Units) => Bf16Route::Units,
            (Order::Pairs, PairsTile::Split) => Bf16Route::Fma,
            (Order::Amx, _) => Bf16Route::Tiles,
        }
    }
}

/// The route a product in the units' order takes on this CPU when its operands lie in the
/// units' window: [`Bf16Route::Units`], [`Bf16Route::Fma`] or, without AVX-512,
/// [`Bf16Route::Portable`]. The bits are the same on every route.
pub fn pairs_route() -> Bf16Route {
    if Order::Pairs.on_hardware() {
        Order::Pairs.route()
    } else {
        Bf16Route::Portable
    }
}

/// Whether this CPU has the AVX-512 instructions the units' packing and the fused
/// multiply-add tile run on (AVX-512F and BW): with or without the bf16 units.
fn packing_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU has the bf16 dot-product units this module uses (AVX512-BF16, with the
/// AVX-512F and AVX-512BW that every CPU with them has, for the packing).
pub fn units_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        packing_available() && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out = lhs · rhs` (or `out += lhs · rhs` with `accumulate`) for row-major f32 matrices
/// holding bf16 values (`lhs` m×k, `rhs` k×n, `out` m×n): [`bf16_gemm_into`] on slices.
///
/// # Panics
/// If a slice is shorter than its matrix.
///
/// ```
/// use tl_tensor::kernels::bf16_dot::bf16_gemm;
///
/// // [1, 0, 2⁻²⁴, −1]·[1, 1, 1, 1]: pair (1, 0) gives 1, then the pair's odd element first,
/// // 1 − 1 = 0, then 0 + 2⁻²⁴. In index order 1 + 2⁻²⁴ would round to 1 (a tie, to even),
/// // and the sum would be 0.
/// let lhs = [1.0, 0.0, 2f32.powi(-24), -1.0];
/// let rhs = [1.0f32; 4];
/// let mut out = [0.0f32];
/// bf16_gemm(1, 4, 1, &lhs, &rhs, &mut out, false);
/// assert_eq!(out[0], 2f32.powi(-24));
/// ```
pub fn bf16_gemm(
    m: usize,
    k: usize,
    n: usize,
    lhs: &[f32],
    rhs: &[f32],
    out: &mut [f32],
    accumulate: bool,
) -> Bf16Route {
    let (lhs, rhs, mut out) = slices_as_views((m, k, n), lhs, rhs, out);
    bf16_gemm_into(&mut out, lhs, rhs, accumulate)
}

/// [`bf16_gemm_portable_into`] on row-major slices, as [`bf16_gemm`].
///
/// # Panics
/// If a slice is shorter than its matrix.
pub fn bf16_gemm_portable(
    m: usize,
    k: usize,
    n: usize,
    lhs: &[f32],
    rhs: &[f32],
    out: &mut [f32],
    accumulate: bool,
) {
    let (lhs, rhs, mut out) = slices_as_views((m, k, n), lhs, rhs, out);
    bf16_gemm_portable_into(&mut out, lhs, rhs, accumulate);
}

/// The three matrices of a product given as row-major slices.
fn slices_as_views<'a>(
    (m, k, n): (usize, usize, usize),
    lhs: &'a [f32],
    rhs: &'a [f32],
    out: &'a mut [f32],
) -> (
    ArrayView2<'a, f32>,
    ArrayView2<'a, f32>,
    ArrayViewMut2<'a, f32>,
) {
    assert!(
        lhs.len() >= m * k && rhs.len() >= k * n && out.len() >= m * n,
        "bf16_gemm: {m}×{k} by {k}×{n} needs {}, {} and {} values, got {}, {} and {}",
        m * k,
        k * n,
        m * n,
        lhs.len(),
        rhs.len(),
        out.len()
    );
    (
        ArrayView2::from_shape((m, k), &lhs[..m * k]).expect("m×k"),
        ArrayView2::from_shape((k, n), &rhs[..k * n]).expect("k×n"),
        ArrayViewMut2::from_shape((m, n), &mut out[..m * n]).expect("m×n"),
    )
}

/// `out = lhs · rhs` (or `out += lhs · rhs` with `accumulate`) for matrices holding bf16
/// values, as views of any strides (a transposed operand, a head's columns), in the units'
/// order: on the units when this CPU has them and the operands are in their exact window,
/// portably otherwise. The operands are packed straight from the views, and the output
/// written in place when its rows are contiguous. Large products are spread over the rayon
/// pool; the bits never depend on it.
///
/// Values that are not bf16 are allowed and take the portable path, which sums their
/// products in the same order with one rounding per multiply-add.
///
/// # Panics
/// If the shapes do not chain: `lhs` is m×k, `rhs` k×n, `out` m×n.
pub fn bf16_gemm_into(
    out: &mut ArrayViewMut2<'_, f32>,
    lhs: ArrayView2<'_, f32>,
    rhs: ArrayView2<'_, f32>,
    accumulate: bool,
) -> Bf16Route {
    gemm_in(Order::Pairs, out, lhs, rhs, accumulate)
}

/// `out = lhs · rhs` (or `+=`) for row-major slices in the AMX order ([`amx_gemm_into`]).
///
/// # Panics
/// If a slice is shorter than its matrix.
///
/// ```
/// use tl_tensor::kernels::bf16_dot::amx_gemm;
///
/// // From 1, the products 2⁻²⁴, 0, 2⁻²⁴, 0: the even sum 2⁻²³ is added once, where one
/// // running sum would round 1 + 2⁻²⁴ back to 1 twice.
/// let tiny = 2f32.powi(-24);
/// let mut out = [1.0f32];
/// amx_gemm(1, 4, 1, &[tiny, 0.0, tiny, 0.0], &[1.0; 4], &mut out, true);
/// assert_eq!(out[0], 1.0 + 2f32.powi(-23));
/// ```
pub fn amx_gemm(
    m: usize,
    k: usize,
    n: usize,
    lhs: &[f32],
    rhs: &[f32],
    out: &mut [f32],
    accumulate: bool,
) -> Bf16Route {
    let (lhs, rhs, mut out) = slices_as_views((m, k, n), lhs, rhs, out);
    amx_gemm_into(&mut out, lhs, rhs, accumulate)
}

/// `out = lhs · rhs` (or `out += lhs · rhs`) for matrices holding bf16 values, as
/// [`bf16_gemm_into`] takes them, in the order of Intel's AMX tiles ([the module's
/// documentation](self#the-amx-order)): on the tiles when this CPU has them and the operands
/// are in the window, portably otherwise, with the same bits.
///
/// # Panics
/// If the shapes do not chain: `lhs` is m×k, `rhs` k×n, `out` m×n.
pub fn amx_gemm_into(
    out: &mut ArrayViewMut2<'_, f32>,
    lhs: ArrayView2<'_, f32>,
    rhs: ArrayView2<'_, f32>,
    accumulate: bool,
) -> Bf16Route {
    gemm_in(Order::Amx, out, lhs, rhs, accumulate)
}

/// [`amx_gemm_into`] by the portable path alone, whatever the CPU: IEEE f32 fused
/// multiply-adds in the AMX order. The reference the tiles are tested against, and what a
/// CPU without them runs.
///
/// # Panics
/// If the shapes do not chain: `lhs` is m×k, `rhs` k×n, `out` m×n.
pub fn amx_gemm_portable_into(
    out: &mut ArrayViewMut2<'_, f32>,
    lhs: ArrayView2<'_, f32>,
    rhs: ArrayView2<'_, f32>,
    accumulate: bool,
) {
    portable_in(Order::Amx, out, lhs, rhs, accumulate);
}

/// A product in `order`: on the CPU's units for it where it has them and the operands are in
/// the window, portably otherwise.
fn gemm_in(
    order: Order,
    out: &mut ArrayViewMut2<'_, f32>,
    lhs: ArrayView2<'_, f32>,
    rhs: ArrayView2<'_, f32>,
    accumulate: bool,
) -> Bf16Route {
    let Some((_, k, n)) = chain(out, lhs, rhs, accumulate) else {
        return Bf16Route::Portable;
    };
    #[cfg(target_arch = "x86_64")]
    if order.on_hardware() {
        let (mut a, mut b) = SCRATCH.with(Cell::take).unwrap_or_default();
        let (b_len, range) = pack_b_units(rhs, &mut b);
        let packed_rhs = UnitsRhs {
            b: &b[..b_len],
            kp: k.div_ceil(2),
            panels: n.div_ceil(UNITS_NR),
            range,
        };
        let fast = units_product(order, out, lhs, packed_rhs, accumulate, &mut a);
        SCRATCH.with(|scratch| scratch.set(Some((a, b))));
        if fast {
            return order.route();
        }
    }
    portable_in(order, out, lhs, rhs, accumulate);
    Bf16Route::Portable
}

/// A right operand packed for the units: `kp` pairs of rows in `panels` panels, as
/// [`Packed`] lays `b` out, its values in `range`.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct UnitsRhs<'a> {
    b: &'a [u32],
    kp: usize,
    panels: usize,
    range: Range,
}

/// `out = lhs · rhs` (or `+=`) on the units, `rhs` (or its leading rows and columns: `lhs`
/// has k ≤ 2·`rhs.kp` columns, `out` n ≤ 32·`rhs.panels`) already packed, if the operands are
/// in the window; `false`, with `out` untouched, if they are not. `a` is the buffer `lhs` is
/// packed into, unless the tile reads `lhs` where it lies ([`in_place`]).
///
/// A prefix of the rows must end at a pair (k even), or be all of them: a pair cut in two
/// would multiply the zero past `lhs`'s last column by a row the product does not have.
///
/// The tiles (`order` AMX) read the left operand a row at a time: a transposed one, packed
/// pair-major, is laid out again by rows.
#[cfg(target_arch = "x86_64")]
fn units_product(
    order: Order,
    out: &mut ArrayViewMut2<'_, f32>,
    lhs: ArrayView2<'_, f32>,
    rhs: UnitsRhs<'_>,
    accumulate: bool,
    a: &mut Vec<u32>,
) -> bool {
    let ((m, k), n) = (lhs.dim(), out.ncols());
    let kp = k.div_ceil(2);
    debug_assert!(kp <= rhs.kp && n.div_ceil(UNITS_NR) <= rhs.panels);
    debug_assert!(k.is_multiple_of(2) || kp == rhs.kp);
    let (mr, tile) = match order {
        Order::Pairs => (UNITS_MR, Some(pairs_tile())),
        Order::Amx => (AMX_MR, None),
    };
    // The fused multiply-adds read the left operand wide: broadcast from memory, a value
    // needs no splitting in registers, which would cost two instructions per row and pair
    // on the ports that do the multiply-adds.
    let width = match tile {
        Some(PairsTile::Split) => Width::Wide,
        _ => Width::Pairs,
    };
    // An operand the tile can read where it lies is only scanned for its range.
    let in_place = (width == Width::Wide).then(|| in_place(lhs, mr)).flatten();
    let (a_len, a_range, a_layout) = match in_place {
        Some(layout @ ALayout::ColumnsInPlace { .. }) => {
            (0, range_of_lines(row_slices(lhs.t())), layout)
        }
        Some(layout) => (0, range_of_lines(row_slices(lhs)), layout),
        None => pack_a_units(lhs, a, mr, width),
    };
    let o_range = if accumulate {
        scan_old_outputs(out.view())
    } else {
        Range::EMPTY
    };
    if !in_window(a_range, rhs.range, o_range, k) {
        return false;
    }
    let m_pad = m.next_multiple_of(mr);
    let by_rows;
    let in_place_len = |len| {
        // SAFETY: the rows (or columns) of `lhs` are slices `row` (`column`) elements apart
        // (`in_place`), so the `len` elements from its first lie inside it, and f32 and u32
        // have one layout.
        unsafe { std::slice::from_raw_parts(lhs.as_ptr().cast(), len) }
    };
    let (a, a_layout) = match (order, a_layout) {
        (_, ALayout::InPlace { row }) => (in_place_len((m - 1) * row + k), a_layout),
        (_, ALayout::ColumnsInPlace { column }) => (in_place_len((k - 1) * column + m), a_layout),
        (Order::Amx, ALayout::PairMajor) => {
            by_rows = rows_from_pair_major(&a[..a_len], m_pad, kp);
            (&by_rows[..], ALayout::Rows)
        }
        (_, ALayout::PairMajor | ALayout::Rows) => (&a[..a_len], a_layout),
    };
    let packed = Packed {
        a,
        m_pad,
        a_pair: width.slots(),
        a_layout,
        b: rhs.b,
        b_kp: rhs.kp,
        panels: rhs.panels,
        b_pair: UNITS_NR,
    };
    // SAFETY (both tiles): this order's units are there (`on_hardware`, checked by every
    // caller); `packed` holds m rounded up to `mr` rows of kp pairs (by rows for the tiles),
    // and `rhs` at least kp pairs of ⌈n/UNITS_NR⌉ panels, what the tile reads.
    let units = |t: Tile<'_, u32>| unsafe { units_tile(t) };
    let split = |t: Tile<'_, u32>| unsafe { split_pairs_tile(t) };
    let tiles = |t: Tile<'_, u32>| unsafe { amx_tile(t) };
    let tile: &(dyn Fn(Tile<'_, u32>) + Sync) = match tile {
        Some(PairsTile::Units) => &units,
        Some(PairsTile::Split) => &split,
        None => &tiles,
    };
    drive((m, n, kp), &packed, out, accumulate, (mr, UNITS_NR), tile);
    true
}

/// A left operand packed pair-major ([`Packed`]'s `a_pair_major`) laid out by rows: block
/// by block of KC pairs, each row's pairs of the block side by side. Squares of 16 pairs ×
/// 16 rows are turned in registers (`m_pad` is a whole number of tiles of 16 rows); the
/// pairs of a last block past its last 16 one by one.
#[cfg(target_arch = "x86_64")]
fn rows_from_pair_major(a: &[u32], m_pad: usize, kp: usize) -> Vec<u32> {
    assert!(a.len() == m_pad * kp && m_pad.is_multiple_of(16));
    let mut rows = Vec::with_capacity(a.len());
    let to = rows.spare_capacity_mut().as_mut_ptr().cast::<u32>();
    for (block, from) in a.chunks(KC * m_pad).enumerate() {
        let pairs = from.len() / m_pad;
        // SAFETY: the tiles' path, whose CPU has AVX-512F (`amx_available`); the block
        // starts `block·KC·m_pad` values into `rows`' capacity, and `turn_block` writes its
        // `from.len()` values there, every one of them.
        unsafe { turn_block(from, m_pad, pairs, to.add(block * KC * m_pad)) };
    }
    // SAFETY: the blocks wrote all `a.len()` values.
    unsafe { rows.set_len(a.len()) };
    rows
}

/// One block of [`rows_from_pair_major`]: `from` holds `pairs` runs of `m_pad` pairs; row i's
/// pairs go to `to[i·pairs..]`.
///
/// # Safety
/// The CPU has AVX-512F; `to` addresses `m_pad·pairs` writable values; 16 divides `m_pad`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn turn_block(from: &[u32], m_pad: usize, pairs: usize, to: *mut u32) {
    let whole = pairs / 16 * 16;
    for p0 in (0..whole).step_by(16) {
        for i0 in (0..m_pad).step_by(16) {
            // SAFETY: pairs p0..p0+16 of rows i0..i0+16 lie in `from`, and their places in
            // `to` in its `m_pad·pairs` values.
            unsafe {
                let square: [__m512i; 16] = std::array::from_fn(|q| {
                    _mm512_loadu_si512(from.as_ptr().add((p0 + q) * m_pad + i0).cast())
                });
                for (j, row) in transpose_16x16(square).into_iter().enumerate() {
                    _mm512_storeu_si512(to.add((i0 + j) * pairs + p0).cast(), row);
                }
            }
        }
    }
    for p in whole..pairs {
        for i in 0..m_pad {
            // SAFETY: as above, one value.
            unsafe { *to.add(i * pairs + p) = from[p * m_pad + i] };
        }
    }
}

/// The transpose of a 16 × 16 square of 32-bit values, one row a register: pairs of rows
/// interleaved by 32 and then 64 bits (each 128-bit lane then holds a 4 × 4 square turned),
/// then the lanes themselves turned.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn transpose_16x16(r: [__m512i; 16]) -> [__m512i; 16] {
    let t: [__m512i; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    // u[4g + c], lane L: column 4L + c of rows 4g..4g+4.
    let u: [__m512i; 16] = std::array::from_fn(|i| {
        let (g, c) = (i / 4, i % 4);
        let (a, b) = (t[4 * g + c / 2], t[4 * g + c / 2 + 2]);
        if c % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    let mut out = [_mm512_setzero_si512(); 16];
    for c in 0..4 {
        let x0 = _mm512_shuffle_i32x4::<0x88>(u[c], u[4 + c]);
        let x1 = _mm512_shuffle_i32x4::<0xdd>(u[c], u[4 + c]);
        let y0 = _mm512_shuffle_i32x4::<0x88>(u[8 + c], u[12 + c]);
        let y1 = _mm512_shuffle_i32x4::<0xdd>(u[8 + c], u[12 + c]);
        out[c] = _mm512_shuffle_i32x4::<0x88>(x0, y0);
        out[4 + c] = _mm512_shuffle_i32x4::<0x88>(x1, y1);
        out[8 + c] = _mm512_shuffle_i32x4::<0xdd>(x0, y0);
        out[12 + c] = _mm512_shuffle_i32x4::<0xdd>(x1, y1);
    }
    out
}

/// A right operand packed once for the units, for several products that each read its
/// leading rows and columns: the fused attention's keys and values, which every block of
/// queries reads up to its last row. Each product gives the bits [`bf16_gemm_into`] gives
/// on the same prefix (the units where the operands are in the window, else the portable
/// path).
///
/// The window is checked against the range of the whole operand, which contains every
/// prefix's: a prefix is never sent to the units that the check of its own values would
/// keep from them.
pub struct Bf16Rhs<'a> {
    rhs: ArrayView2<'a, f32>,
    order: Order,
    /// The packed operand and its range, where the CPU has the units (or tiles) of `order`.
    #[cfg(target_arch = "x86_64")]
    units: Option<(Vec<u32>, Range)>,
}

impl<'a> Bf16Rhs<'a> {
    /// Packs `rhs` (k×n, any strides) for the units' tiles where the CPU has AVX-512.
    pub fn new(rhs: ArrayView2<'a, f32>) -> Self {
        Self::in_order(Order::Pairs, rhs)
    }

    /// Packs `rhs` for products in the AMX order ([`amx_gemm_into`]), for the tiles where
    /// the CPU has them (the tiles read the units' packing).
    pub fn amx(rhs: ArrayView2<'a, f32>) -> Self {
        Self::in_order(Order::Amx, rhs)
    }

    fn in_order(order: Order, rhs: ArrayView2<'a, f32>) -> Self {
        Bf16Rhs {
            rhs,
            order,
            #[cfg(target_arch = "x86_64")]
            units: order.on_hardware().then(|| {
                let mut b = Vec::new();
                let (len, range) = pack_b_units(rhs, &mut b);
                b.truncate(len);
                (b, range)
            }),
        }
    }

    /// `out = lhs · rhs[..k, ..n]` (or `out += …` with `accumulate`), `lhs` m×k and `out`
    /// m×n; which path computed it.
    ///
    /// # Panics
    /// If the shapes do not fit: k or n past the operand's, or `out` not m×n.
    pub fn product_into(
        &self,
        out: &mut ArrayViewMut2<'_, f32>,
        lhs: ArrayView2<'_, f32>,
        accumulate: bool,
    ) -> Bf16Route {
        let ((m, k), n) = (lhs.dim(), out.ncols());
        let (rows, cols) = self.rhs.dim();
        assert!(
            k <= rows && n <= cols && out.nrows() == m,
            "Bf16Rhs: cannot multiply {:?} by the leading {k}×{n} of a {rows}×{cols} operand \
             into {:?}",
            lhs.shape(),
            out.shape()
        );
        let prefix = self.rhs.slice(s![..k, ..n]);
        #[cfg(target_arch = "x86_64")]
        if let Some((b, range)) = &self.units
            && m > 0
            && n > 0
            && k > 0
            && (k.is_multiple_of(2) || k == rows)
        {
            let (mut a, b_buffer) = SCRATCH.with(Cell::take).unwrap_or_default();
            let packed_rhs = UnitsRhs {
                b,
                kp: rows.div_ceil(2),
                panels: cols.div_ceil(UNITS_NR),
                range: *range,
            };
            let fast = units_product(self.order, out, lhs, packed_rhs, accumulate, &mut a);
            SCRATCH.with(|scratch| scratch.set(Some((a, b_buffer))));
            if fast {
                return self.order.route();
            }
        }
        gemm_in(self.order, out, lhs, prefix, accumulate)
    }
}

impl PreparedRhs<f32> for Bf16Rhs<'_> {
    fn product_into(
        &self,
        out: &mut ArrayViewMut2<'_, f32>,
        lhs: ArrayView2<'_, f32>,
        accumulate: bool,
    ) {
        Bf16Rhs::product_into(self, out, lhs, accumulate);
    }
}

/// [`bf16_gemm_into`] by the portable path alone, whatever the CPU: IEEE f32 fused
/// multiply-adds in the units' order. The reference the units are tested against, and what
/// a CPU without them runs.
///
/// # Panics
/// If the shapes do not chain: `lhs` is m×k, `rhs` k×n, `out` m×n.
pub fn bf16_gemm_portable_into(
    out: &mut ArrayViewMut2<'_, f32>,
    lhs: ArrayView2<'_, f32>,
    rhs: ArrayView2<'_, f32>,
    accumulate: bool,
) {
    portable_in(Order::Pairs, out, lhs, rhs, accumulate);
}

/// A product in `order` by the portable tiles.
fn portable_in(
    order: Order,
    out: &mut ArrayViewMut2<'_, f32>,
    lhs: ArrayView2<'_, f32>,
    rhs: ArrayView2<'_, f32>,
    accumulate: bool,
) {
    let Some((m, k, n)) = chain(out, lhs, rhs, accumulate) else {
        return;
    };
    let kp = k.div_ceil(2);
    let (tile, (mr, nr)) = portable_tile(order);
    let a = pack_a_portable(lhs, mr);
    let b = pack_b_portable(rhs, nr);
    let packed = Packed {
        a: &a,
        m_pad: m.next_multiple_of(mr),
        a_pair: 2,
        a_layout: ALayout::Rows,
        b: &b,
        b_kp: kp,
        panels: n.div_ceil(nr),
        b_pair: 2 * nr,
    };
    drive((m, n, kp), &packed, out, accumulate, (mr, nr), &tile);
}

/// The sizes (m, k, n) of a product, checked; `None` when it is empty, after writing the
/// empty sum (zeros) over `out` unless accumulating.
fn chain(
    out: &mut ArrayViewMut2<'_, f32>,
    lhs: ArrayView2<'_, f32>,
    rhs: ArrayView2<'_, f32>,
    accumulate: bool,
) -> Option<(usize, usize, usize)> {
    let ((m, k), n) = (lhs.dim(), rhs.ncols());
    assert!(
        rhs.nrows() == k && out.dim() == (m, n),
        "bf16_gemm: cannot multiply {:?} by {:?} into {:?}",
        lhs.shape(),
        rhs.shape(),
        out.shape()
    );
    if m == 0 || n == 0 || k == 0 {
        if !accumulate {
            out.fill(0.0);
        }
        return None;
    }
    Some((m, k, n))
}

/// A tile of the portable path, on f32 operands.
type PortableTile = fn(Tile<'_, f32>);

/// The portable tile of `order` for this CPU, and its rows and columns: on AVX-512F, the
/// units' order by [`pairs_tile_avx512`] (8 × 32); otherwise the generic tile
/// ([`portable_tile_body`], 4 × 16) compiled for the best vector unit there is.
fn portable_tile(order: Order) -> (PortableTile, (usize, usize)) {
    let generic = (PORTABLE_MR, PORTABLE_NR);
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY (all three): the CPU has AVX-512F (checked); `drive` gives the tile
            // what it reads, at the tile's size returned beside it.
            return match order {
                Order::Pairs => (|t| unsafe { pairs_tile_avx512(t) }, (FMA_MR, FMA_NR)),
                Order::Amx => (|t| unsafe { portable_tile_avx512::<true>(t) }, generic),
            };
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: as above, for AVX2 and FMA.
            return match order {
                Order::Pairs => (|t| unsafe { portable_tile_avx2::<false>(t) }, generic),
                Order::Amx => (|t| unsafe { portable_tile_avx2::<true>(t) }, generic),
            };
        }
    }
    // SAFETY: `drive` gives the tile what it reads.
    match order {
        Order::Pairs => (|t| unsafe { portable_tile_body::<false>(t) }, generic),
        Order::Amx => (|t| unsafe { portable_tile_body::<true>(t) }, generic),
    }
}

/// `lhs · rhs` in a fresh array for matrices holding bf16 values — or narrower ones: every
/// fp8 value is a bf16 value — by [`Bf16Products`]: f32 matrices in the units' order (on
/// them where the CPU has them), f64 matrices by the plain f64 GEMM.
///
/// # Panics
/// If the inner sizes differ.
pub fn bf16_matmul<E: Element>(lhs: ArrayView2<'_, E>, rhs: ArrayView2<'_, E>) -> Array2<E> {
    let mut out = Array2::zeros((lhs.nrows(), rhs.ncols()));
    E::kernel_product_view(&Bf16Products, &mut out.view_mut(), lhs, rhs, false);
    out
}

/// The products of autocast in bf16 with f32 accumulation, as a [`ProductKernel`]: f32
/// matrices by [`bf16_gemm`]. f64 matrices (the reference mode, whose products stay in
/// f64) by the plain f64 GEMM.
#[derive(Debug, Clone, Copy, Default)]
pub struct Bf16Products;

/// The products of autocast in bf16 in the AMX order, as a [`ProductKernel`]: f32 matrices
/// by [`amx_gemm`] (on the tiles where the CPU has them), f64 matrices by the plain f64 GEMM
/// as [`Bf16Products`] takes them.
#[derive(Debug, Clone, Copy, Default)]
pub struct AmxProducts;

/// The [`ProductKernel`] of one order: f32 products in it, views handed over whole (the
/// kernel packs and spreads them itself), a right operand prepared by `$prepare`.
macro_rules! product_kernel_in_order {
    ($kernel:ty, $order:expr, $prepare:path) => {
        impl ProductKernel for $kernel {
            fn product_f32(
                &self,
                m: usize,
                k: usize,
                n: usize,
                lhs: &[f32],
                rhs: &[f32],
                out: &mut [f32],
                accumulate: bool,
            ) {
                let (lhs, rhs, mut out) = slices_as_views((m, k, n), lhs, rhs, out);
                gemm_in($order, &mut out, lhs, rhs, accumulate);
            }

            fn product_view_f32(
                &self,
                out: &mut ArrayViewMut2<'_, f32>,
                lhs: ArrayView2<'_, f32>,
                rhs: ArrayView2<'_, f32>,
                accumulate: bool,
            ) {
                gemm_in($order, out, lhs, rhs, accumulate);
            }

            fn product_view_f64(
                &self,
                out: &mut ArrayViewMut2<'_, f64>,
                lhs: ArrayView2<'_, f64>,
                rhs: ArrayView2<'_, f64>,
                accumulate: bool,
            ) {
                super::gemm::gemm_serial_into(out, lhs, rhs, accumulate);
            }

            fn product_f64(
                &self,
                m: usize,
                k: usize,
                n: usize,
                lhs: &[f64],
                rhs: &[f64],
                out: &mut [f64],
                accumulate: bool,
            ) {
                let lhs = ArrayView2::from_shape((m, k), &lhs[..m * k]).expect("m×k");
                let rhs = ArrayView2::from_shape((k, n), &rhs[..k * n]).expect("k×n");
                let mut out = ArrayViewMut2::from_shape((m, n), &mut out[..m * n]).expect("m×n");
                super::gemm::gemm_serial_into(&mut out, lhs, rhs, accumulate);
            }

            fn spreads_itself(&self) -> bool {
                true
            }

            fn prepare_rhs_f32<'a>(
                &self,
                rhs: ArrayView2<'a, f32>,
            ) -> Option<Box<dyn PreparedRhs<f32> + 'a>> {
                Some(Box::new($prepare(rhs)))
            }
        }
    };
}

product_kernel_in_order!(Bf16Products, Order::Pairs, Bf16Rhs::new);
product_kernel_in_order!(AmxProducts, Order::Amx, Bf16Rhs::amx);

/// Rows and columns of the units' tile: 8 rows × 32 columns are 16 accumulators of 16 lanes,
/// enough independent sums to hide the instruction's latency, with room for the two panel
/// loads and the broadcast in AVX-512's 32 registers.
const UNITS_MR: usize = 8;
const UNITS_NR: usize = 32;
/// The portable tile: 4 rows × 16 columns, 8 accumulators of 8 lanes on AVX2.
const PORTABLE_MR: usize = 4;
const PORTABLE_NR: usize = 16;
/// The units' order in fused multiply-adds on AVX-512F: 8 rows × 32 columns, 16
/// accumulators of 16 lanes, as many as the units' tile.
const FMA_MR: usize = 8;
const FMA_NR: usize = 32;
/// Rows of the output per task, and pairs of the inner dimension per pass over the panels:
/// a block of 32 rows × 256 pairs of the left operand (32 KiB packed for the units) and a
/// panel's 256 × 32 pairs stay in a core's L1 and L2 caches while the tiles walk them.
const MC: usize = 32;
const KC: usize = 256;
// A block of KC pairs is whole AMX instructions, so a block's tile call starts one.
const _: () = assert!(KC.is_multiple_of(amx::AMX_PAIRS) && MC.is_multiple_of(16));
/// The bits below a bf16 value's in an f32: zero in every operand the units may read.
const BF16_LOW: i32 = 0xffff;

/// Exponent range and cleanliness of the values a path will read (biased exponents of the
/// nonzero values; `clean` when every value is zero or a normal number, finite, and — for an
/// operand — a bf16 value).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Range {
    min: u32,
    max: u32,
    clean: bool,
}

impl Range {
    const EMPTY: Range = Range {
        min: u32::MAX,
        max: 0,
        clean: true,
    };

    fn merge(self, other: Range) -> Range {
        Range {
            min: self.min.min(other.min),
            max: self.max.max(other.max),
            clean: self.clean && other.clean,
        }
    }

    /// Adds the f32 value of `bits`; `low_mask` selects the bits that must be zero (the
    /// 16 below a bf16 value's, or none for an old output).
    ///
    /// Branch-free, so that a loop of these vectorises.
    #[inline(always)]
    fn add(&mut self, bits: u32, low_mask: u32) {
        let exponent = (bits >> 23) & 0xff;
        let nonzero = bits & 0x7fff_ffff != 0;
        let bad = nonzero & ((exponent == 0) | (exponent == 0xff) | (bits & low_mask != 0));
        self.clean &= !bad;
        self.min = self.min.min(if nonzero { exponent } else { u32::MAX });
        self.max = self.max.max(if nonzero { exponent } else { 0 });
    }
}

/// Whether the units compute exactly what IEEE f32 does on these operands (the module's
/// window), given the ranges of both operands and of the old outputs.
fn in_window(a: Range, b: Range, old: Range, k: usize) -> bool {
    const BIAS: i64 = 127;
    if !(a.clean && b.clean && old.clean) {
        return false;
    }
    let products = a.max > 0 && b.max > 0; // both have a nonzero value
    let products_fit = !products || {
        let (min, max) = (
            i64::from(a.min) + i64::from(b.min) - 2 * BIAS,
            i64::from(a.max) + i64::from(b.max) - 2 * BIAS,
        );
        let bits_of_k = i64::from(usize::BITS - k.leading_zeros());
        min >= -112 && max + 2 + bits_of_k <= 126
    };
    let old_fit = old.max == 0 || {
        let (min, max) = (i64::from(old.min) - BIAS, i64::from(old.max) - BIAS);
        min >= -103 && max <= 125
    };
    products_fit && old_fit
}

/// The range of the old outputs a product accumulates into (no bf16 mask: any normal f32
/// value is fine), 16 values at a time where the rows are slices. The fused attention
/// accumulates each head's key and value gradients block by block, so this runs once per
/// small product: a scalar scan cost more than the product itself.
#[cfg(target_arch = "x86_64")]
fn scan_old_outputs(out: ArrayView2<'_, f32>) -> Range {
    let mut range = Range::EMPTY;
    // SAFETY (this function's calls): the units' path only, whose CPU has AVX-512F
    // (`units_available`).
    let mut lanes = unsafe { LaneRange::new() };
    for row in out.rows() {
        match row.to_slice() {
            // SAFETY: as above.
            Some(row) => unsafe { old_output_row(row, &mut lanes) },
            None => row.iter().for_each(|x| range.add(x.to_bits(), 0)),
        }
    }
    // SAFETY: as above.
    range.merge(unsafe { lanes.range() })
}

/// Adds one row of old outputs to `lanes`, 16 values at a time.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn old_output_row(row: &[f32], lanes: &mut LaneRange) {
    let mut chunks = row.chunks_exact(16);
    for chunk in &mut chunks {
        // SAFETY: a chunk holds 16 values.
        lanes.add(unsafe { _mm512_loadu_si512(chunk.as_ptr().cast()) }, 0);
    }
    for x in chunks.remainder() {
        lanes.rest.add(x.to_bits(), 0);
    }
}

thread_local! {
    /// This thread's packing buffers for the units (left operand, right operand), kept from
    /// one product to the next: a step packs the same sizes again and again, and a fresh
    /// buffer would be zeroed first (4% of a capstone bf16 step). A product takes them out
    /// for its duration, so a product that starts on this thread meanwhile (rayon runs
    /// another task while waiting) finds none and allocates its own. Not on the memory
    /// meter, like the other kernels' block scratch; at most the largest operands' packed
    /// size, 2 bytes a value, per thread.
    static SCRATCH: Cell<Option<(Vec<u32>, Vec<u32>)>> = const { Cell::new(None) };
}

/// `buffer`'s first `len` values, grown with zeros if it is shorter. What a previous product
/// left there stays: the packing writes every value the tiles read, padding included.
fn first(buffer: &mut Vec<u32>, len: usize) -> &mut [u32] {
    if buffer.len() < len {
        buffer.resize(len, 0);
    }
    &mut buffer[..len]
}

/// The rows of a matrix as slices: borrowed where they are contiguous, gathered otherwise.
fn row_slices<'a>(x: ArrayView2<'a, f32>) -> Vec<Cow<'a, [f32]>> {
    (0..x.nrows())
        .map(|i| {
            let row = x.index_axis_move(Axis(0), i);
            row.to_slice()
                .map_or_else(|| row.to_vec().into(), Cow::Borrowed)
        })
        .collect()
}

/// Whether `x` is better read a column at a time: its columns are slices and its rows not
/// (a transposed view), with more than one column.
fn by_columns(x: ArrayView2<'_, f32>) -> bool {
    x.strides()[1] != 1 && x.strides()[0] == 1 && x.ncols() > 1
}

/// How [`Width::Wide`]'s tile can read `lhs` where it lies, if it can: by rows that are
/// slices ([`ALayout::InPlace`]) or, transposed, by columns that are
/// ([`ALayout::ColumnsInPlace`]), with an even k (no pair past a row's end) and whole tiles
/// of `mr` rows (none past the last).
#[cfg(target_arch = "x86_64")]
fn in_place(lhs: ArrayView2<'_, f32>, mr: usize) -> Option<ALayout> {
    let (m, k) = lhs.dim();
    if !(k > 0 && k.is_multiple_of(2) && m > 0 && m.is_multiple_of(mr)) {
        return None;
    }
    let apart = |stride: isize, len: usize| usize::try_from(stride).ok().filter(|&s| s >= len);
    match *lhs.strides() {
        [row, 1] => apart(row, k).map(|row| ALayout::InPlace { row }),
        [1, column] => apart(column, m).map(|column| ALayout::ColumnsInPlace { column }),
        _ => None,
    }
}

/// The [`Range`] of the values of `lines`, as packing them would find.
#[cfg(target_arch = "x86_64")]
fn range_of_lines(lines: Vec<Cow<'_, [f32]>>) -> Range {
    lines
        .par_chunks(MC)
        .map(|rows| {
            // SAFETY (the three calls): the units' path only, whose CPU has AVX-512F.
            let mut lanes = unsafe { LaneRange::new() };
            for row in rows {
                unsafe { lanes.add_row(row) };
            }
            // SAFETY: as above.
            unsafe { lanes.range() }
        })
        .reduce(|| Range::EMPTY, Range::merge)
}

/// How a packed left operand holds a pair of bf16 values.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Width {
    /// In one `u32`, the even element in the low half: what the units read.
    Pairs,
    /// In two, the even element's f32 bits then the odd one's: what a fused multiply-add
    /// broadcasts straight from memory.
    Wide,
}

#[cfg(target_arch = "x86_64")]
impl Width {
    /// The `u32` slots of one pair.
    fn slots(self) -> usize {
        match self {
            Width::Pairs => 1,
            Width::Wide => 2,
        }
    }
}

/// `lhs` (m×k, any strides) packed for the units as [`Packed`] lays it out: block by block
/// of KC pairs, each row's pairs of the block side by side (each pair as `width` says, a
/// zero past an odd k), m rounded up to a whole tile of `mr` rows with zero rows; the range
/// of its values; and its layout, [`ALayout::Rows`] or [`ALayout::PairMajor`]. Rows that
/// are slices convert as they lie; a transposed operand is packed pair-major, each pair two
/// of its columns (rows of the matrix it transposes) read whole.
#[cfg(target_arch = "x86_64")]
fn pack_a_units(
    lhs: ArrayView2<'_, f32>,
    buffer: &mut Vec<u32>,
    mr: usize,
    width: Width,
) -> (usize, Range, ALayout) {
    let (m, k) = lhs.dim();
    let (kp, m_pad) = (k.div_ceil(2), m.next_multiple_of(mr));
    let w = width.slots();
    let a = first(buffer, m_pad * kp * w);
    let columns = by_columns(lhs);
    let lines = if columns {
        row_slices(lhs.t())
    } else {
        row_slices(lhs)
    };
    let mut range = Range::EMPTY;
    for (block, a) in a.chunks_mut(KC * m_pad * w).enumerate() {
        let (k0, pairs) = (block * KC, a.len() / (m_pad * w));
        let block_range = if columns {
            // Pair-major: pair p of every row is columns 2p and 2p+1 side by side, which
            // `bf16_pairs` (or `wide_pairs`) makes from two whole columns (rows of the
            // matrix `lhs` transposes) straight into place. Tasks of 16 pairs.
            a.par_chunks_mut(16 * m_pad * w)
                .enumerate()
                .map(|(task, packed)| {
                    // SAFETY (this closure's calls): the units' path only, whose CPU has
                    // AVX-512F and AVX-512BW (`units_available`).
                    let mut lanes = unsafe { LaneRange::new() };
                    for (i, rows) in packed.chunks_exact_mut(m_pad * w).enumerate() {
                        let p = k0 + 16 * task + i;
                        let (rows, past_m) = rows.split_at_mut(m * w);
                        past_m.fill(0);
                        let odd = lines.get(2 * p + 1).map(|odd| &odd[..]);
                        // SAFETY: as above.
                        unsafe {
                            match width {
                                Width::Pairs => bf16_pairs(&lines[2 * p], odd, rows, &mut lanes),
                                Width::Wide => wide_pairs(&lines[2 * p], odd, rows, &mut lanes),
                            }
                        };
                    }
                    // SAFETY: as above.
                    unsafe { lanes.range() }
                })
                .reduce(|| Range::EMPTY, Range::merge)
        } else {
            let row_len = pairs * w;
            a[m * row_len..].fill(0); // the tile's rows past m
            a[..m * row_len]
                .par_chunks_mut(MC * row_len)
                .enumerate()
                .map(|(task, packed)| {
                    let (r0, r1) = (task * MC, task * MC + packed.len() / row_len);
                    // SAFETY (this closure's calls): as above.
                    let mut lanes = unsafe { LaneRange::new() };
                    let span = 2 * k0..k.min(2 * (k0 + pairs));
                    for (packed, row) in packed.chunks_exact_mut(row_len).zip(&lines[r0..r1]) {
                        let row = &row[span.clone()];
                        // SAFETY: as above.
                        unsafe {
                            match width {
                                Width::Pairs => bf16_row(row, packed, &mut lanes),
                                Width::Wide => wide_row(row, packed, &mut lanes),
                            }
                        };
                    }
                    // SAFETY: as above.
                    unsafe { lanes.range() }
                })
                .reduce(|| Range::EMPTY, Range::merge)
        };
        range = range.merge(block_range);
    }
    let layout = if columns {
        ALayout::PairMajor
    } else {
        ALayout::Rows
    };
    (m_pad * kp * w, range, layout)
}

/// Writes the bf16 values of `row` into `packed` in order (two to a `u32`, the first in
/// the low half), adding each to `lanes`. The values are truncated, which for a bf16 value
/// is exact; a value that is not one marks the range unclean.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512BW; `packed` holds at least `row.len()` halves.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn bf16_row(row: &[f32], packed: &mut [u32], lanes: &mut LaneRange) {
    assert!(2 * packed.len() >= row.len());
    let halves = packed.as_mut_ptr().cast::<u16>();
    let whole = row.len() / 16 * 16;
    for i in (0..whole).step_by(16) {
        // SAFETY: `i + 16 ≤ row.len() ≤ 2·packed.len()`: both addresses are in bounds.
        unsafe {
            let v = _mm512_loadu_si512(row.as_ptr().add(i).cast());
            lanes.add(v, BF16_LOW);
            let h = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(v));
            _mm256_storeu_si256(halves.add(i).cast(), h);
        }
    }
    for (i, x) in row.iter().enumerate().skip(whole) {
        let bits = x.to_bits();
        lanes.rest.add(bits, BF16_LOW as u32);
        // SAFETY: `i < row.len() ≤ 2·packed.len()`.
        unsafe { *halves.add(i) = (bits >> 16) as u16 };
    }
    if row.len() % 2 == 1 {
        // The zero past an odd row, in the last pair's upper half.
        // SAFETY: `row.len() < 2·packed.len()` when `row.len()` is odd.
        unsafe { *halves.add(row.len()) = 0 };
    }
}

/// Writes the values of `row` into `packed` truncated to bf16, as f32 bits in order (a zero
/// past an odd length), adding each to `lanes`: [`Width::Wide`]'s pairs. The truncation is
/// exact for a bf16 value; a value that is not one marks the range unclean.
///
/// # Safety
/// The CPU has AVX-512F; `packed` holds at least `row.len()` rounded up to even values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn wide_row(row: &[f32], packed: &mut [u32], lanes: &mut LaneRange) {
    assert!(packed.len() >= row.len().next_multiple_of(2));
    let whole = row.len() / 16 * 16;
    for i in (0..whole).step_by(16) {
        // SAFETY: `i + 16 ≤ row.len() ≤ packed.len()`: both addresses are in bounds.
        unsafe {
            let v = _mm512_loadu_si512(row.as_ptr().add(i).cast());
            lanes.add(v, BF16_LOW);
            // (Stored as loaded, the row would be copied by a call to `memcpy` per 16 values.)
            let bf16 = _mm512_andnot_si512(_mm512_set1_epi32(BF16_LOW), v);
            _mm512_storeu_si512(packed.as_mut_ptr().add(i).cast(), bf16);
        }
    }
    for (slot, x) in packed[whole..].iter_mut().zip(&row[whole..]) {
        let bits = x.to_bits();
        lanes.rest.add(bits, BF16_LOW as u32);
        *slot = bits & !(BF16_LOW as u32);
    }
    if row.len() % 2 == 1 {
        packed[row.len()] = 0;
    }
}

/// `slots[2j]`, `slots[2j + 1]` = `even[j]`, `odd[j]` as f32 bits (`odd` zero if absent),
/// for `slots.len() / 2` values of `j`, each value added to `lanes`: [`Width::Wide`]'s
/// pairs, as [`bf16_pairs`] makes the units'.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn wide_pairs(even: &[f32], odd: Option<&[f32]>, slots: &mut [u32], lanes: &mut LaneRange) {
    let len = slots.len() / 2;
    assert!(even.len() >= len && odd.is_none_or(|odd| odd.len() >= len));
    // Lane i of the first half takes even[i/2] or odd[i/2]; of the second half, 8 further.
    let low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
    let whole = len / 16 * 16;
    for i in (0..whole).step_by(16) {
        // SAFETY: `i + 16 ≤ len`, within `even` and `odd` (asserted above), and slots
        // 2i..2i+32 within `slots`.
        unsafe {
            let e = _mm512_loadu_si512(even.as_ptr().add(i).cast());
            lanes.add(e, BF16_LOW);
            let o = match odd {
                Some(odd) => {
                    let o = _mm512_loadu_si512(odd.as_ptr().add(i).cast());
                    lanes.add(o, BF16_LOW);
                    o
                }
                None => _mm512_setzero_si512(),
            };
            let to = slots.as_mut_ptr().add(2 * i);
            _mm512_storeu_si512(to.cast(), _mm512_permutex2var_epi32(e, low, o));
            _mm512_storeu_si512(to.add(16).cast(), _mm512_permutex2var_epi32(e, high, o));
        }
    }
    for j in whole..len {
        let e = even[j].to_bits();
        let o = odd.map_or(0, |odd| odd[j].to_bits());
        lanes.rest.add(e, BF16_LOW as u32);
        lanes.rest.add(o, BF16_LOW as u32);
        slots[2 * j] = e;
        slots[2 * j + 1] = o;
    }
}

/// A [`Range`] over 16 lanes at once, and a scalar one for what is left over: made once per
/// block of packing and reduced once at its end (a horizontal reduction per row would cost
/// as much as the row's conversion on a head's 32 columns).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct LaneRange {
    min: __m512i,
    max: __m512i,
    bad: u16,
    rest: Range,
}

#[cfg(target_arch = "x86_64")]
impl LaneRange {
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn new() -> Self {
        LaneRange {
            min: _mm512_set1_epi32(-1),
            max: _mm512_setzero_si512(),
            bad: 0,
            rest: Range::EMPTY,
        }
    }

    /// Adds 16 values given as f32 bits ([`Range::add`]: `low_mask` selects the bits that
    /// must be zero).
    #[inline(always)]
    fn add(&mut self, v: __m512i, low_mask: i32) {
        // SAFETY: only called from functions compiled for AVX-512F.
        unsafe {
            let exponent = _mm512_and_si512(_mm512_srli_epi32::<23>(v), _mm512_set1_epi32(0xff));
            let nonzero = _mm512_test_epi32_mask(v, _mm512_set1_epi32(0x7fff_ffff));
            let special = _mm512_cmpeq_epi32_mask(exponent, _mm512_setzero_si512())
                | _mm512_cmpeq_epi32_mask(exponent, _mm512_set1_epi32(0xff))
                | _mm512_test_epi32_mask(v, _mm512_set1_epi32(low_mask));
            self.bad |= nonzero & special;
            self.min = _mm512_mask_min_epu32(self.min, nonzero, self.min, exponent);
            self.max = _mm512_mask_max_epu32(self.max, nonzero, self.max, exponent);
        }
    }

    /// Adds every value of `row` ([`Range::add`] with bf16's low bits).
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn add_row(&mut self, row: &[f32]) {
        let whole = row.len() / 16 * 16;
        for i in (0..whole).step_by(16) {
            // SAFETY: `i + 16 ≤ row.len()`.
            self.add(
                unsafe { _mm512_loadu_si512(row.as_ptr().add(i).cast()) },
                BF16_LOW,
            );
        }
        for x in &row[whole..] {
            self.rest.add(x.to_bits(), BF16_LOW as u32);
        }
    }

    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn range(&self) -> Range {
        let lanes = Range {
            min: _mm512_reduce_min_epu32(self.min),
            max: _mm512_reduce_max_epu32(self.max),
            clean: self.bad == 0,
        };
        lanes.merge(self.rest)
    }
}

/// `rhs` (k×n, any strides) packed for the units as [`Packed`] lays it out: block by block
/// of KC pairs, panel by panel of UNITS_NR columns, each pair of rows (2p, 2p+1) of the
/// panel's columns as UNITS_NR pairs, columns past n zero; and the range of its values.
///
/// Each task reads whole rows (or, transposed, whole columns) in order and writes them into
/// every panel: reading a panel's 32 columns down 4096 rows instead would fetch a new cache
/// line for every 128 bytes, and measured several times slower.
#[cfg(target_arch = "x86_64")]
fn pack_b_units(rhs: ArrayView2<'_, f32>, buffer: &mut Vec<u32>) -> (usize, Range) {
    let (k, n) = rhs.dim();
    let (kp, panels) = (k.div_ceil(2), n.div_ceil(UNITS_NR));
    let b = first(buffer, panels * kp * UNITS_NR);
    let columns = by_columns(rhs);
    let lines = if columns {
        row_slices(rhs.t())
    } else {
        row_slices(rhs)
    };
    let mut range = Range::EMPTY;
    for (block, b) in b.chunks_mut(KC * panels * UNITS_NR).enumerate() {
        let (k0, pairs) = (block * KC, b.len() / (panels * UNITS_NR));
        let block_range = if columns {
            // A panel's columns are slices: each converts into its pairs, spread over the
            // panel's rows.
            b.par_chunks_mut(pairs * UNITS_NR)
                .enumerate()
                .map(|(q, panel)| {
                    // SAFETY (this closure's calls): the units' path only, as in
                    // `pack_a_units`.
                    let mut lanes = unsafe { LaneRange::new() };
                    let mut column_pairs = vec![0u32; pairs];
                    let span = 2 * k0..k.min(2 * (k0 + pairs));
                    let cols = q * UNITS_NR..n.min((q + 1) * UNITS_NR);
                    for (j, column) in lines[cols.clone()].iter().enumerate() {
                        // SAFETY: as above.
                        unsafe { bf16_row(&column[span.clone()], &mut column_pairs, &mut lanes) };
                        for (p, pair) in column_pairs.iter().enumerate() {
                            panel[p * UNITS_NR + j] = *pair;
                        }
                    }
                    for slots in panel.chunks_exact_mut(UNITS_NR) {
                        slots[cols.len()..].fill(0); // columns past n
                    }
                    // SAFETY: as above.
                    unsafe { lanes.range() }
                })
                .reduce(|| Range::EMPTY, Range::merge)
        } else {
            // Rows are slices: a task takes a run of pairs of rows and writes each into
            // every panel, at disjoint places of the block.
            let out = SharedSlots(b.as_mut_ptr());
            let tasks = pairs.div_ceil(16);
            (0..tasks)
                .into_par_iter()
                .map(|task| {
                    let out = &out;
                    // SAFETY (this closure's calls): the units' path only, as above.
                    let mut lanes = unsafe { LaneRange::new() };
                    for p in 16 * task..pairs.min(16 * (task + 1)) {
                        let even = &lines[2 * (k0 + p)][..n];
                        let odd = lines.get(2 * (k0 + p) + 1).map(|odd| &odd[..n]);
                        // SAFETY: the units' path only, as above; pair p of every panel is
                        // written by this task alone (tasks own disjoint runs of pairs),
                        // inside the block (p < pairs, panels of `pairs` pairs).
                        unsafe {
                            let first = out.0.add(p * UNITS_NR);
                            bf16_pair_rows(even, odd, first, pairs * UNITS_NR, &mut lanes);
                        }
                    }
                    // SAFETY: as above.
                    unsafe { lanes.range() }
                })
                .reduce(|| Range::EMPTY, Range::merge)
        };
        range = range.merge(block_range);
    }
    (panels * kp * UNITS_NR, range)
}

/// The start of a packed block that tasks write at disjoint places.
struct SharedSlots(*mut u32);

// SAFETY: the tasks sharing it write disjoint slots (see `pack_b_units`), and the block
// outlives them (rayon joins them before `pack_b_units` goes on).
unsafe impl Sync for SharedSlots {}

/// A pair of rows (`even`, and `odd` or zeros) written into every panel of a packed block:
/// panel q's UNITS_NR slots, `panel_stride` values after panel q−1's starting at `first`,
/// get the pairs of columns 32q.., zeros past the rows' end; each value added to `lanes`.
/// One call per pair of rows, with `lanes` in registers throughout, where a call per panel
/// paid a call, an empty fill and the ranges' trip through memory every 32 pairs.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512BW; `odd` is as long as `even`, and `first` addresses
/// ⌈len/UNITS_NR⌉ runs of UNITS_NR writable values, `panel_stride` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn bf16_pair_rows(
    even: &[f32],
    odd: Option<&[f32]>,
    first: *mut u32,
    panel_stride: usize,
    lanes: &mut LaneRange,
) {
    let n = even.len();
    assert!(odd.is_none_or(|odd| odd.len() == n));
    let mut local = *lanes;
    let whole = n / UNITS_NR;
    for q in 0..whole {
        let c0 = q * UNITS_NR;
        for half in [0, 16] {
            // SAFETY: columns c0..c0+32 lie in both rows (q < n/32), the panel's slots are
            // the caller's, and this function has the features `pairs_16` needs.
            unsafe {
                let odd = odd.map(|odd| odd.as_ptr().add(c0 + half));
                let slots = first.add(q * panel_stride + half);
                pairs_16(even.as_ptr().add(c0 + half), odd, slots, &mut local);
            }
        }
    }
    if whole * UNITS_NR < n {
        let cols = whole * UNITS_NR..n;
        // SAFETY: the caller's contract.
        let slots =
            unsafe { std::slice::from_raw_parts_mut(first.add(whole * panel_stride), UNITS_NR) };
        let (slots, past_n) = slots.split_at_mut(cols.len());
        past_n.fill(0);
        let (even, odd) = (&even[cols.clone()], odd.map(|odd| &odd[cols]));
        // SAFETY: the caller's contract (the CPU's features).
        unsafe { bf16_pairs(even, odd, slots, &mut local) };
    }
    *lanes = local;
}

/// Sixteen pairs: `slots[j]` = (`even[j]`, `odd[j]`) in bf16 (`odd` zero if absent), each
/// value added to `lanes`.
///
/// # Safety
/// Called from code compiled for AVX-512F and AVX-512BW; 16 values readable at `even` (and
/// `odd`), 16 writable at `slots`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pairs_16(
    even: *const f32,
    odd: Option<*const f32>,
    slots: *mut u32,
    lanes: &mut LaneRange,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let e = _mm512_loadu_si512(even.cast());
        lanes.add(e, BF16_LOW);
        let mut pairs = _mm512_srli_epi32::<16>(e);
        if let Some(odd) = odd {
            let o = _mm512_loadu_si512(odd.cast());
            lanes.add(o, BF16_LOW);
            pairs = _mm512_or_si512(pairs, _mm512_and_si512(o, _mm512_set1_epi32(-65536)));
        }
        _mm512_storeu_si512(slots.cast(), pairs);
    }
}

/// `slots[j]` = the pair (`even[j]`, `odd[j]`) in bf16 (`odd` zero if absent), each value
/// added to `lanes`.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn bf16_pairs(even: &[f32], odd: Option<&[f32]>, slots: &mut [u32], lanes: &mut LaneRange) {
    let len = slots.len();
    assert!(even.len() >= len && odd.is_none_or(|odd| odd.len() >= len));
    let whole = len / 16 * 16;
    for i in (0..whole).step_by(16) {
        // SAFETY: `i + 16 ≤ len`, within every slice (asserted above); this function has
        // the features `pairs_16` needs.
        unsafe {
            let odd = odd.map(|odd| odd.as_ptr().add(i));
            pairs_16(even.as_ptr().add(i), odd, slots.as_mut_ptr().add(i), lanes);
        }
    }
    for j in whole..len {
        let e = even[j].to_bits();
        let o = odd.map_or(0, |odd| odd[j].to_bits());
        lanes.rest.add(e, BF16_LOW as u32);
        lanes.rest.add(o, BF16_LOW as u32);
        slots[j] = (e >> 16) | (o & 0xffff_0000);
    }
}

/// `lhs` (any strides) packed for the portable tile as [`Packed`] lays it out: block by
/// block of KC pairs, each row's 2·pairs values of the block side by side (a zero past an
/// odd k), m rounded up to a whole tile.
fn pack_a_portable(lhs: ArrayView2<'_, f32>, mr: usize) -> Vec<f32> {
    let (m, k) = lhs.dim();
    let (kp, m_pad) = (k.div_ceil(2), m.next_multiple_of(mr));
    let mut a = vec![0.0f32; m_pad * 2 * kp];
    for (block, a) in a.chunks_mut(KC * 2 * m_pad).enumerate() {
        let (k0, pairs) = (block * KC, a.len() / (2 * m_pad));
        let span = 2 * k0..k.min(2 * (k0 + pairs));
        for (packed, row) in a.chunks_exact_mut(2 * pairs).zip(lhs.rows()) {
            for (slot, x) in packed.iter_mut().zip(row.slice(s![span.clone()])) {
                *slot = *x;
            }
        }
    }
    a
}

/// `rhs` (any strides) packed for the portable tile as [`Packed`] lays it out: block by
/// block of KC pairs, panel by panel of `nr` columns, each pair of rows as row 2p's
/// columns then row 2p+1's (zero past an odd k and past n).
fn pack_b_portable(rhs: ArrayView2<'_, f32>, nr: usize) -> Vec<f32> {
    let (k, n) = rhs.dim();
    let (kp, panels) = (k.div_ceil(2), n.div_ceil(nr));
    let mut b = vec![0.0f32; panels * kp * 2 * nr];
    for (block, b) in b.chunks_mut(KC * panels * 2 * nr).enumerate() {
        let (k0, pairs) = (block * KC, b.len() / (panels * 2 * nr));
        for (q, panel) in b.chunks_exact_mut(pairs * 2 * nr).enumerate() {
            let cols = q * nr..n.min((q + 1) * nr);
            for (r, slots) in panel.chunks_exact_mut(nr).enumerate() {
                if 2 * k0 + r < k {
                    for (slot, x) in slots
                        .iter_mut()
                        .zip(rhs.slice(s![2 * k0 + r, cols.clone()]))
                    {
                        *slot = *x;
                    }
                }
            }
        }
    }
    b
}

/// Packed operands, both cut into blocks of KC pairs of the inner dimension (the last block
/// shorter), so that a tile's operands for one block are contiguous runs:
///
/// - `a`: as `a_layout` says, `a_pair` elements a pair;
/// - `b`: block after block of the `b_kp` pairs it was packed with, each `panels` panels of
///   that block's pairs (`b_pair` elements a pair: one row pair of the panel's columns). A
///   product may read fewer pairs and panels than `b` holds: a prefix of its rows and
///   columns ([`Bf16Rhs`]).
struct Packed<'a, T> {
    a: &'a [T],
    m_pad: usize,
    a_pair: usize,
    a_layout: ALayout,
    b: &'a [T],
    b_kp: usize,
    panels: usize,
    b_pair: usize,
}

/// How [`Packed`]'s `a` holds the left operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ALayout {
    /// Block after block, each `m_pad` rows of that block's pairs, so a row of a block of
    /// `pairs` pairs takes `pairs·a_pair` elements.
    Rows,
    /// Block after block, each block's pairs one after the other, every pair `m_pad` rows of
    /// `a_pair` elements wide: a transposed operand, packed for the units.
    PairMajor,
    /// Not packed: the operand's own f32 rows, `row` elements apart, read where they lie
    /// (`a_pair` 2, `m_pad` m).
    InPlace { row: usize },
    /// Not packed: a transposed operand's own f32 columns, `column` elements apart, read
    /// where they lie (`a_pair` 2, `m_pad` m): a pair's odd element a column after its even
    /// one.
    ColumnsInPlace { column: usize },
}

/// One call of a tile kernel: `tiles` tiles stacked down one panel of the output, each
/// `pairs` pairs of the inner dimension of its rows of `a` (the first tile's starting at
/// `a`, rows `a_row` elements apart and pairs `a_step`, a wide pair's odd element `a_odd`
/// after its even one, the next tile's a tile's rows further)
/// times the panel of `b`, added to its tile of the output (the first at `c`, rows `ldc`
/// apart), which starts from zero if `zero`. A call walks a whole panel of a block of rows,
/// so that the work between two tiles stays inside the kernel: the fused attention's scores
/// are products of 16 pairs, where a call per tile cost 2–7% of the product (criterion's
/// `bf16 scores` group).
#[derive(Clone, Copy)]
struct Tile<'a, T> {
    a: &'a [T],
    a_row: usize,
    a_step: usize,
    a_odd: usize,
    b: &'a [T],
    pairs: usize,
    c: *mut f32,
    ldc: usize,
    zero: bool,
    tiles: usize,
}

/// Runs `tile` over the whole product: tasks of MC output rows (spread over the pool when
/// the product is large), each walking the inner dimension in blocks of KC pairs, every
/// panel, every tile of its rows. Every output's pairs are added in order, so the order of
/// blocks, panels and tasks changes no bit. An output whose rows are not slices (a
/// transposed view) is computed into a contiguous copy and written back.
fn drive<T: Sync>(
    (m, n, kp): (usize, usize, usize),
    packed: &Packed<'_, T>,
    out: &mut ArrayViewMut2<'_, f32>,
    accumulate: bool,
    (mr, nr): (usize, usize),
    tile: &(dyn Fn(Tile<'_, T>) + Sync),
) {
    /// The largest tile: the AMX tiles' 16 rows × UNITS_NR.
    const EDGE: usize = 16 * UNITS_NR;
    assert!(mr * nr <= EDGE, "no tile has {mr}×{nr} outputs");
    if out.strides()[1] != 1 || out.strides()[0] < 0 {
        let mut copy = out.as_standard_layout().into_owned();
        drive(
            (m, n, kp),
            packed,
            &mut copy.view_mut(),
            accumulate,
            (mr, nr),
            tile,
        );
        out.assign(&copy);
        return;
    }
    let task = |(block, mut rows_out): (usize, ArrayViewMut2<'_, f32>)| {
        let r0 = block * MC;
        let rows = rows_out.nrows();
        let ldc = rows_out.strides()[0] as usize;
        let mut edge = [0.0f32; EDGE];
        for k0 in (0..kp).step_by(KC) {
            let pairs = KC.min(kp - k0);
            let zero = k0 == 0 && !accumulate;
            for q in 0..n.div_ceil(nr) {
                let (c0, cols) = (q * nr, nr.min(n - q * nr));
                let b_pairs = KC.min(packed.b_kp - k0);
                let b = &packed.b[(k0 * packed.panels + q * b_pairs) * packed.b_pair..];
                let block = k0 * packed.m_pad * packed.a_pair;
                let (a_start, a_row, a_step, a_odd) = match packed.a_layout {
                    ALayout::Rows => (block, pairs * packed.a_pair, packed.a_pair, 1),
                    ALayout::PairMajor => (block, packed.a_pair, packed.m_pad * packed.a_pair, 1),
                    ALayout::InPlace { row } => (2 * k0, row, 2, 1),
                    ALayout::ColumnsInPlace { column } => (2 * k0 * column, 1, 2 * column, column),
                };
                let a_at = |t: usize| &packed.a[a_start + (r0 + t) * a_row..];
                // The whole tiles of the panel in one call, then the ragged one through
                // `edge`, a whole tile's buffer padded with zeros.
                let whole = if cols == nr { rows / mr } else { 0 };
                if whole > 0 {
                    tile(Tile {
                        a: a_at(0),
                        a_row,
                        a_step,
                        a_odd,
                        b,
                        pairs,
                        // SAFETY: column c0 of the block's first row lies inside it.
                        c: unsafe { rows_out.as_mut_ptr().add(c0) },
                        ldc,
                        zero,
                        tiles: whole,
                    });
                }
                for t in (whole * mr..rows).step_by(mr) {
                    let tile_rows = mr.min(rows - t);
                    for i in 0..mr {
                        for j in 0..nr {
                            edge[i * nr + j] = if zero || i >= tile_rows || j >= cols {
                                0.0
                            } else {
                                rows_out[[t + i, c0 + j]]
                            };
                        }
                    }
                    tile(Tile {
                        a: a_at(t),
                        a_row,
                        a_step,
                        a_odd,
                        b,
                        pairs,
                        c: edge.as_mut_ptr(),
                        ldc: nr,
                        zero: false,
                        tiles: 1,
                    });
                    for i in 0..tile_rows {
                        for j in 0..cols {
                            rows_out[[t + i, c0 + j]] = edge[i * nr + j];
                        }
                    }
                }
            }
        }
    };
    let parallel = rayon::current_num_threads() > 1
        && m > MC
        && m.saturating_mul(n).saturating_mul(2 * kp) >= PARALLEL_WORK;
    let blocks = out.axis_chunks_iter_mut(Axis(0), MC).enumerate();
    if parallel {
        blocks.collect::<Vec<_>>().into_par_iter().for_each(task);
    } else {
        blocks.for_each(task);
    }
}

/// The units' tile: UNITS_MR rows × UNITS_NR columns, one `vdpbf16ps` per row and 16
/// columns per pair of the inner dimension; `t.tiles` of them down the panel.
///
/// # Safety
/// The CPU has AVX-512F and AVX512-BF16; `t.a` holds `t.tiles`·UNITS_MR rows of `t.pairs`
/// pairs (`t.a_row` and `t.a_step` apart), `t.b` `t.pairs` rows of UNITS_NR pairs, and `t.c`
/// addresses `t.tiles`·UNITS_MR rows of UNITS_NR writable f32 values `t.ldc` apart
/// (initialised unless `t.zero`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn units_tile(t: Tile<'_, u32>) {
    debug_assert!(t.a.len() > (t.tiles * UNITS_MR - 1) * t.a_row + (t.pairs - 1) * t.a_step);
    debug_assert!(t.b.len() >= t.pairs * UNITS_NR);
    let b = t.b.as_ptr();
    for tile in 0..t.tiles {
        // SAFETY (this loop): the caller's contract covers every address formed below.
        unsafe {
            let a = t.a.as_ptr().add(tile * UNITS_MR * t.a_row);
            let c = t.c.add(tile * UNITS_MR * t.ldc);
            let mut acc = load_block(c, t.ldc, t.zero);
            for p in 0..t.pairs {
                let b0: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(b.add(p * UNITS_NR).cast()));
                let b1: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(b.add(p * UNITS_NR + 16).cast()));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let pair = *a.add(r * t.a_row + p * t.a_step);
                    let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair as i32));
                    acc[0] = _mm512_dpbf16_ps(acc[0], a, b0);
                    acc[1] = _mm512_dpbf16_ps(acc[1], a, b1);
                }
            }
            store_block(c, t.ldc, &acc);
        }
    }
}

/// The units' order by fused multiply-adds: [`units_tile`]'s tile and right operand, each
/// bf16 pair of it split in registers into its two f32 values (the even one shifted up 16
/// bits, the odd one with its low half cleared), and the left operand packed
/// [`Width::Wide`], each value broadcast from memory; then `acc ← fma(a_odd, b_odd, acc)`,
/// `acc ← fma(a_even, b_even, acc)`: the portable tile's IEEE arithmetic, so its bits on any
/// values, in or out of the units' window.
///
/// # Safety
/// As [`units_tile`], on a CPU with AVX-512F, with `t.a` wide (two slots a pair).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn split_pairs_tile(t: Tile<'_, u32>) {
    debug_assert!(
        t.a.len() > (t.tiles * UNITS_MR - 1) * t.a_row + (t.pairs - 1) * t.a_step + t.a_odd
    );
    debug_assert!(t.b.len() >= t.pairs * UNITS_NR);
    let high = _mm512_set1_epi32(!BF16_LOW);
    let even = |x: __m512i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(x));
    let odd = |x: __m512i| _mm512_castsi512_ps(_mm512_and_si512(x, high));
    // SAFETY (all three): the caller's contract covers the tile and the addresses read.
    unsafe {
        fma_tile_body(
            t,
            UNITS_NR,
            |rows| {
                let [b0, b1] = [0, 16].map(|j| _mm512_loadu_si512(rows.add(j).cast()));
                [[even(b0), even(b1)], [odd(b0), odd(b1)]]
            },
            // Two loads of an f32 each, which become broadcasts from memory: read as one u64
            // and split, the pair would take two more instructions on the multiply-adds' port.
            |pair| {
                let pair = pair.cast::<f32>();
                [_mm512_set1_ps(*pair), _mm512_set1_ps(*pair.add(t.a_odd))]
            },
        )
    }
}

/// The accumulators of an 8 × 32 tile (the units' and the fused multiply-adds'): its block of
/// the output at `c`, rows `ldc` apart, or zeros if `zero`.
///
/// # Safety
/// The CPU has AVX-512F; unless `zero`, `c` addresses 8 rows of 32 initialised values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load_block(c: *const f32, ldc: usize, zero: bool) -> [[__m512; 2]; UNITS_MR] {
    let mut acc = [[_mm512_setzero_ps(); 2]; UNITS_MR];
    if !zero {
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: the caller's contract.
            unsafe {
                acc[0] = _mm512_loadu_ps(c.add(r * ldc));
                acc[1] = _mm512_loadu_ps(c.add(r * ldc + 16));
            }
        }
    }
    acc
}

/// Writes an 8 × 32 tile's accumulators to its block of the output at `c`, rows `ldc` apart.
///
/// # Safety
/// The CPU has AVX-512F; `c` addresses 8 rows of 32 writable values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_block(c: *mut f32, ldc: usize, acc: &[[__m512; 2]; UNITS_MR]) {
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: the caller's contract.
        unsafe {
            _mm512_storeu_ps(c.add(r * ldc), acc[0]);
            _mm512_storeu_ps(c.add(r * ldc + 16), acc[1]);
        }
    }
}

/// The portable tile: PORTABLE_MR rows × PORTABLE_NR columns by fused multiply-adds, the odd
/// element of each pair first (or, with `AMX`, in the tiles' order: [`amx::add_blocks`]);
/// `t.tiles` of them down the panel.
///
/// # Safety
/// `t.a` holds `t.tiles`·PORTABLE_MR rows of `2·t.pairs` values (`t.a_row` and `t.a_step`
/// apart), `t.b` `t.pairs` pairs of PORTABLE_NR-value rows, and `t.c` addresses
/// `t.tiles`·PORTABLE_MR rows of PORTABLE_NR writable values `t.ldc` apart (initialised
/// unless `t.zero`).
#[inline(always)]
unsafe fn portable_tile_body<const AMX: bool>(t: Tile<'_, f32>) {
    const MR: usize = PORTABLE_MR;
    const NR: usize = PORTABLE_NR;
    for tile in 0..t.tiles {
        let a = &t.a[tile * MR * t.a_row..];
        let mut acc = [[0.0f32; NR]; MR];
        // SAFETY (this loop): the caller's contract covers every address formed below.
        unsafe {
            let c = t.c.add(tile * MR * t.ldc);
            if !t.zero {
                for (r, acc) in acc.iter_mut().enumerate() {
                    acc.copy_from_slice(std::slice::from_raw_parts(c.add(r * t.ldc), NR));
                }
            }
            if AMX {
                amx::add_blocks(&mut acc, a, t);
            } else {
                for p in 0..t.pairs {
                    let rows = &t.b[2 * p * NR..][..2 * NR];
                    let (even, odd) = rows.split_at(NR);
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let a = &a[r * t.a_row + p * t.a_step..][..2];
                        for j in 0..NR {
                            acc[j] = a[1].mul_add(odd[j], acc[j]);
                            acc[j] = a[0].mul_add(even[j], acc[j]);
                        }
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                std::slice::from_raw_parts_mut(c.add(r * t.ldc), NR).copy_from_slice(acc);
            }
        }
    }
}

/// [`portable_tile_body`] compiled for AVX-512F.
///
/// # Safety
/// As [`portable_tile_body`], on a CPU with AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn portable_tile_avx512<const AMX: bool>(t: Tile<'_, f32>) {
    // SAFETY: the caller's contract.
    unsafe { portable_tile_body::<AMX>(t) }
}

/// The units' order by fused multiply-adds in sixteen lanes: FMA_MR rows × FMA_NR columns
/// of [`portable_tile_body`]'s arithmetic (`acc ← fma(a_odd, b_odd, acc)`, then the even
/// element), with the operands packed as for it at this size. One `vfmadd231ps` adds 16
/// products, where `vdpbf16ps` adds 32 but may issue at a quarter of the rate (one every two
/// cycles on the Xeon of docs/benchmarks.md, against two fused multiply-adds a cycle).
///
/// # Safety
/// The CPU has AVX-512F; `t` as [`portable_tile_body`] describes it, at FMA_MR × FMA_NR.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pairs_tile_avx512(t: Tile<'_, f32>) {
    const NR: usize = FMA_NR;
    const _: () = assert!(FMA_MR == UNITS_MR && NR == UNITS_NR);
    debug_assert!(t.a.len() > (t.tiles * FMA_MR - 1) * t.a_row + (t.pairs - 1) * t.a_step + 1);
    debug_assert!(t.b.len() >= t.pairs * 2 * NR);
    // SAFETY (all three): the caller's contract covers the tile and the addresses read.
    unsafe {
        fma_tile_body(
            t,
            2 * NR,
            |rows| [[0, 16], [NR, NR + 16]].map(|at| at.map(|j| _mm512_loadu_ps(rows.add(j)))),
            |pair| [_mm512_set1_ps(*pair), _mm512_set1_ps(*pair.add(1))],
        )
    }
}

/// The 8 × 32 tile of fused multiply-adds in the units' order, `t.tiles` of them down the
/// panel, on either packing: `rows(at)` reads the pair of rows of the right operand at
/// `at` (`b_step` elements a pair) as f32 values, `[even row, odd row]` × two vectors of 16
/// columns; `pair(at)` the left operand's pair at `at`, each value in all 16 lanes.
///
/// # Safety
/// The CPU has AVX-512F (the callers are compiled for it); `t` as its tile's contract says,
/// and `rows` and `pair` read only what it covers.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn fma_tile_body<T>(
    t: Tile<'_, T>,
    b_step: usize,
    rows: impl Fn(*const T) -> [[__m512; 2]; 2],
    pair: impl Fn(*const T) -> [__m512; 2],
) {
    for tile in 0..t.tiles {
        // SAFETY (this loop): the caller's contract covers every address formed below.
        unsafe {
            let a = t.a.as_ptr().add(tile * UNITS_MR * t.a_row);
            let c = t.c.add(tile * UNITS_MR * t.ldc);
            let mut acc = load_block(c, t.ldc, t.zero);
            for p in 0..t.pairs {
                let [b_even, b_odd] = rows(t.b.as_ptr().add(p * b_step));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let [a_even, a_odd] = pair(a.add(r * t.a_row + p * t.a_step));
                    for h in 0..2 {
                        acc[h] = _mm512_fmadd_ps(a_odd, b_odd[h], acc[h]);
                        acc[h] = _mm512_fmadd_ps(a_even, b_even[h], acc[h]);
                    }
                }
            }
            store_block(c, t.ldc, &acc);
        }
    }
}

/// [`portable_tile_body`] compiled for AVX2 and FMA.
///
/// # Safety
/// As [`portable_tile_body`], on a CPU with AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn portable_tile_avx2<const AMX: bool>(t: Tile<'_, f32>) {
    // SAFETY: the caller's contract.
    unsafe { portable_tile_body::<AMX>(t) }
}

#[cfg(test)]
mod tests {
    use super::rate::with_pairs_tile;
    use super::*;
    use crate::Generator;
    use tl_numerics::{Format, round_slice};

    /// The module's definition, one output at a time: IEEE f32 fused multiply-adds over the
    /// pairs, the odd element first, a zero past an odd k.
    fn reference(
        m: usize,
        k: usize,
        n: usize,
        lhs: &[f32],
        rhs: &[f32],
        out: &mut [f32],
        acc: bool,
    ) {
        for i in 0..m {
            for j in 0..n {
                let mut sum = if acc { out[i * n + j] } else { 0.0 };
                for p in 0..k.div_ceil(2) {
                    let (a1, b1) = if 2 * p + 1 < k {
                        (lhs[i * k + 2 * p + 1], rhs[(2 * p + 1) * n + j])
                    } else {
                        (0.0, 0.0)
                    };
                    sum = a1.mul_add(b1, sum);
                    sum = lhs[i * k + 2 * p].mul_add(rhs[2 * p * n + j], sum);
                }
                out[i * n + j] = sum;
            }
        }
    }

    /// Normal bf16 values of magnitude about 2^`scale`.
    pub(super) fn bf16_values(len: usize, scale: i32, rng: &Generator) -> Vec<f32> {
        let mut v: Vec<f32> = (0..len)
            .map(|_| rng.next_normal() as f32 * 2f32.powi(scale))
            .collect();
        round_slice(&mut v, Format::Bf16);
        v
    }

    pub(super) fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Runs `f` on a pool of `threads` threads.
    pub(super) fn on<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(f)
    }

    /// What a test of the units path says when the CPU has none: the other paths are still
    /// tested against the reference, and the units' absence is printed, never silent.
    fn units_or_say_so() -> bool {
        let available = units_available();
        if !available {
            eprintln!(
                "this CPU has no AVX512-BF16 units: their tile is not tested here (the portable \
                 path is, and the fused multiply-add tile where the CPU has AVX-512)"
            );
        }
        available
    }

    /// The route of a product inside the window: the units' packing where the CPU has
    /// AVX-512, on the units or by fused multiply-adds as [`pairs_tile`] says.
    fn inside() -> Bf16Route {
        units_or_say_so();
        routed(pairs_tile())
    }

    /// The route of a product inside the window on `tile`.
    fn routed(tile: PairsTile) -> Bf16Route {
        match tile {
            _ if !packing_available() => Bf16Route::Portable,
            PairsTile::Units if units_available() => Bf16Route::Units,
            _ => Bf16Route::Fma,
        }
    }

    /// Both tiles of the units' order on the units' packing.
    const TILES: [PairsTile; 2] = [PairsTile::Units, PairsTile::Split];

    /// Odd and even sizes, a row count past one task of MC rows and not a whole tile, a
    /// column count past one panel and not a whole one, an inner size past one block of KC
    /// pairs and odd.
    pub(super) const SHAPES: [(usize, usize, usize); 8] = [
        (1, 1, 1),
        (1, 7, 3),
        (3, 2, 33),
        (8, 32, 32),
        (9, 5, 17),
        (37, 65, 70),
        (70, 601, 45),
        (130, 514, 96),
    ];

    #[test]
    fn units_and_portable_paths_equal_the_definition_bit_for_bit() {
        units_or_say_so();
        let rng = Generator::new(11);
        for (m, k, n) in SHAPES {
            let lhs = bf16_values(m * k, 0, &rng);
            let rhs = bf16_values(k * n, -3, &rng);
            let old = bf16_values(m * n, 2, &rng);
            for accumulate in [false, true] {
                let mut expected = old.clone();
                reference(m, k, n, &lhs, &rhs, &mut expected, accumulate);
                let mut portable = old.clone();
                bf16_gemm_portable(m, k, n, &lhs, &rhs, &mut portable, accumulate);
                assert_eq!(bits(&portable), bits(&expected), "portable {m}×{k}×{n}");
                for (threads, tile) in [1, 3].into_iter().flat_map(|t| TILES.map(|tile| (t, tile)))
                {
                    let mut auto = old.clone();
                    let route = on(threads, || {
                        with_pairs_tile(tile, || {
                            bf16_gemm(m, k, n, &lhs, &rhs, &mut auto, accumulate)
                        })
                    });
                    let case = format!("{m}×{k}×{n} on {threads}, {tile:?}");
                    assert_eq!(route, routed(tile), "{case}");
                    assert_eq!(bits(&auto), bits(&expected), "{case}");
                }
            }
        }
    }

    #[test]
    fn the_route_this_cpu_reports_is_the_one_its_products_take() {
        let rng = Generator::new(5);
        let (m, k, n) = (9, 6, 17);
        let lhs = bf16_values(m * k, 0, &rng);
        let rhs = bf16_values(k * n, 0, &rng);
        let mut out = vec![0.0; m * n];
        let route = bf16_gemm(m, k, n, &lhs, &rhs, &mut out, false);
        assert_eq!(route, pairs_route());
        assert_eq!(route, inside());
        // A CPU with AVX-512F and BW computes it by a packed kernel, never the portable path.
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
            assert_ne!(route, Bf16Route::Portable);
        }
    }

    #[test]
    fn a_product_after_a_larger_one_reads_nothing_it_left_behind() {
        // The packing buffers are kept per thread: run the shapes largest first on this
        // thread, so every pad (rows past m, columns past n, the zero past an odd k) lies
        // where a larger product wrote values, transposed operands included.
        units_or_say_so();
        let rng = Generator::new(15);
        for (m, k, n) in SHAPES.iter().rev().copied() {
            let lhs = bf16_values(m * k, 0, &rng);
            let rhs = bf16_values(k * n, 0, &rng);
            let mut expected = vec![0.0; m * n];
            reference(m, k, n, &lhs, &rhs, &mut expected, false);
            let mut out = vec![0.0; m * n];
            bf16_gemm(m, k, n, &lhs, &rhs, &mut out, false);
            assert_eq!(bits(&out), bits(&expected), "{m}×{k}×{n}");
            let lhs_t = ndarray::Array2::from_shape_vec((m, k), lhs)
                .unwrap()
                .t()
                .to_owned();
            let rhs_t = ndarray::Array2::from_shape_vec((k, n), rhs)
                .unwrap()
                .t()
                .to_owned();
            let mut out = ndarray::Array2::zeros((m, n));
            bf16_gemm_into(&mut out.view_mut(), lhs_t.t(), rhs_t.t(), false);
            assert_eq!(
                bits(out.as_slice().unwrap()),
                bits(&expected),
                "{m}×{k}×{n}ᵀ"
            );
        }
        // An operand of infinities is packed (then sent to the portable path); the zero past
        // an odd k of the next product lies where an infinity was, and ∞·0 would be NaN.
        let (m, k, n) = (8, 63, 5);
        let mut out = vec![0.0; m * (k + 1)];
        let infinite = vec![f32::INFINITY; m * (k + 1)];
        let ones = vec![1.0f32; (k + 1) * (k + 1)];
        bf16_gemm(m, k + 1, k + 1, &infinite, &ones, &mut out, false);
        let lhs = bf16_values(m * k, 0, &rng);
        let rhs = bf16_values(k * n, 0, &rng);
        let mut expected = vec![0.0; m * n];
        reference(m, k, n, &lhs, &rhs, &mut expected, false);
        let mut out = vec![0.0; m * n];
        bf16_gemm(m, k, n, &lhs, &rhs, &mut out, false);
        assert_eq!(bits(&out), bits(&expected), "after infinities");
    }

    /// A product on row-major slices, and the route it reports.
    pub(super) type OnSlices =
        fn(usize, usize, usize, &[f32], &[f32], &mut [f32], bool) -> Bf16Route;

    /// `product` on m×k by k×n operands of seed `seed`: one value of the left operand out of the
    /// window at a time (a subnormal, infinities, a NaN, a value that is not bf16, values too
    /// small or too large for the products) takes the portable path with `reference`'s bits;
    /// signed zeros, inside the window, give `reference`'s bits too (on route `zeros`, if
    /// given). Returns the operands.
    pub(super) fn outside_the_window(
        product: OnSlices,
        reference: Reference,
        (m, k, n): (usize, usize, usize),
        zeros: Option<Bf16Route>,
        seed: u64,
    ) -> (Vec<f32>, Vec<f32>) {
        let rng = Generator::new(seed);
        let base_lhs = bf16_values(m * k, 0, &rng);
        let rhs = bf16_values(k * n, 0, &rng);
        let tiny = 2f32.powi(-130); // a subnormal, and a bf16 value
        let specials: [(&str, f32); 7] = [
            ("subnormal", tiny),
            ("infinity", f32::INFINITY),
            ("minus infinity", f32::NEG_INFINITY),
            ("NaN", f32::NAN),
            ("not a bf16 value", 1.0 + 2f32.powi(-10)),
            ("too small for the products", 2f32.powi(-113)),
            ("products could overflow", 2f32.powi(124)),
        ];
        for (what, value) in specials {
            let mut lhs = base_lhs.clone();
            lhs[2 * k + 5] = value;
            let mut expected = vec![0.0; m * n];
            reference(m, k, n, &lhs, &rhs, &mut expected, false);
            let mut out = vec![0.0; m * n];
            let route = product(m, k, n, &lhs, &rhs, &mut out, false);
            assert_eq!(route, Bf16Route::Portable, "{what}");
            assert_eq!(bits(&out), bits(&expected), "{what}");
        }
        // Signed zeros are inside the window: the units' and tiles' -0 handling is IEEE's.
        let mut lhs = base_lhs.clone();
        lhs[..k].fill(-0.0);
        let mut old = vec![1.0f32; m * n];
        old[..n].fill(-0.0);
        for accumulate in [false, true] {
            let mut expected = old.clone();
            reference(m, k, n, &lhs, &rhs, &mut expected, accumulate);
            let mut out = old.clone();
            let route = product(m, k, n, &lhs, &rhs, &mut out, accumulate);
            assert!(zeros.is_none_or(|zeros| zeros == route), "±0: {route:?}");
            assert_eq!(bits(&out), bits(&expected), "±0, accumulate {accumulate}");
        }
        (base_lhs, rhs)
    }

    #[test]
    fn operands_outside_the_window_take_the_portable_path_with_ieee_results() {
        units_or_say_so();
        // Rows the fused multiply-adds would read where they lie (whole tiles, an even k)
        // are scanned all the same: the value is in a vector of 16, then in a remainder.
        for shape in [(16, 40, 35), (16, 6, 35)] {
            outside_the_window(bf16_gemm, reference, shape, None, 11);
        }
        let (m, k, n) = (9, 13, 35);
        let (base_lhs, rhs) = outside_the_window(bf16_gemm, reference, (m, k, n), None, 12);
        let tiny = 2f32.powi(-130);
        // An old output that is subnormal, too small for its sums, too large, or not finite
        // takes the portable path, whether the scan finds it in a vector of 16 (column 7)
        // or in a row's remainder (column 33 of 35), in the first row or a later one.
        let old_specials = [
            tiny,
            2f32.powi(-104),
            2f32.powi(126),
            f32::INFINITY,
            f32::NAN,
        ];
        for (value, at) in old_specials
            .into_iter()
            .flat_map(|v| [7, 33, 4 * n + 20, 4 * n + 34].map(|at| (v, at)))
        {
            let mut old = vec![0.5f32; m * n];
            old[at] = value;
            let mut expected = old.clone();
            reference(m, k, n, &base_lhs, &rhs, &mut expected, true);
            let route = bf16_gemm(m, k, n, &base_lhs, &rhs, &mut old, true);
            assert_eq!(route, Bf16Route::Portable, "{value:e} at {at}");
            assert_eq!(bits(&old), bits(&expected));
        }
        // Old outputs in the window, anywhere, that are not bf16 values: the units.
        let mut old = vec![0.5f32 + 2f32.powi(-20); m * n];
        old[33] = 2f32.powi(-103);
        old[4 * n + 20] = -2f32.powi(125);
        let mut expected = old.clone();
        reference(m, k, n, &base_lhs, &rhs, &mut expected, true);
        let route = bf16_gemm(m, k, n, &base_lhs, &rhs, &mut old, true);
        assert_eq!(route, inside(), "old outputs in the window");
        assert_eq!(bits(&old), bits(&expected));
    }

    /// Which left operands the fused multiply-adds read where they lie (the choice changes no
    /// bit, only how much is packed, so only this test sees it).
    #[test]
    fn operands_read_in_place_are_whole_tiles_of_slices_with_an_even_k() {
        use ndarray::Array2;
        let x = Array2::<f32>::zeros((16, 12));
        let rows = |row| Some(ALayout::InPlace { row });
        let columns = |column| Some(ALayout::ColumnsInPlace { column });
        assert_eq!(in_place(x.view(), 8), rows(12));
        assert_eq!(in_place(x.slice(s![.., 2..8]), 8), rows(12));
        assert_eq!(in_place(x.slice(s![..8, ..]).reversed_axes(), 8), None); // 12 rows
        assert_eq!(
            in_place(x.slice(s![.., ..8]).reversed_axes(), 4),
            columns(12)
        );
        assert_eq!(in_place(x.t(), 4), columns(12));
        // An odd k, a ragged last tile, no rows or no columns, every other stride.
        assert_eq!(in_place(x.slice(s![.., ..7]), 8), None);
        assert_eq!(in_place(x.slice(s![..12, ..]), 8), None);
        let empty = |shape: (usize, usize)| {
            let data = x.as_slice().unwrap();
            ArrayView2::from_shape(ndarray::ShapeBuilder::strides(shape, (12, 1)), data).unwrap()
        };
        assert_eq!(in_place(empty((0, 12)), 8), None);
        assert_eq!(in_place(empty((16, 0)), 8), None);
        assert_eq!(in_place(x.slice(s![.., ..;2]), 8), None);
        assert_eq!(in_place(x.slice(s![..;-1, ..]), 8), None);
        // Rows (or columns) closer together than their length: a broadcast.
        let row = ndarray::Array1::<f32>::zeros(12);
        assert_eq!(in_place(row.broadcast((16, 12)).unwrap(), 8), None);
        let column = ndarray::Array1::<f32>::zeros(16);
        let broadcast = column.broadcast((12, 16)).unwrap().reversed_axes();
        assert_eq!(in_place(broadcast, 8), None);
    }

    #[test]
    fn the_window_edges() {
        let inside = inside();
        let route = |a: f32, b: f32, k: usize| {
            let lhs = vec![a; k];
            let rhs = vec![b; k];
            let mut out = [0.0f32];
            bf16_gemm(1, k, 1, &lhs, &rhs, &mut out, false)
        };
        // Smallest exponents: −56 + −56 = −112 is in, −113 is not.
        assert_eq!(route(2f32.powi(-56), 2f32.powi(-56), 2), inside);
        assert_eq!(
            route(2f32.powi(-56), 2f32.powi(-57), 2),
            Bf16Route::Portable
        );
        // Largest: with k = 3 (2 bits), 61 + 61 + 2 + 2 = 126 is in, one more is not.
        assert_eq!(route(2f32.powi(61), 2f32.powi(61), 3), inside);
        assert_eq!(route(2f32.powi(61), 2f32.powi(62), 3), Bf16Route::Portable);
        // All zero: nothing to flush.
        assert_eq!(route(0.0, -0.0, 5), inside);
    }

    /// The probes behind the module's exactness argument, on the units themselves with the
    /// window check bypassed: the order of a pair, IEEE rounding, and the flush of
    /// subnormal inputs, accumulators and results.
    #[test]
    fn probes_of_the_units() {
        if !units_or_say_so() {
            return;
        }
        // One output of k = 2 (one pair) starting from `acc`, on the units.
        let units = |acc: f32, a: [f32; 2], b: [f32; 2]| {
            let (mut packed_a, mut packed_b) = (Vec::new(), Vec::new());
            let _ = pack_a_units(
                ArrayView2::from_shape((1, 2), &a).unwrap(),
                &mut packed_a,
                UNITS_MR,
                Width::Pairs,
            );
            pack_b_units(ArrayView2::from_shape((2, 1), &b).unwrap(), &mut packed_b);
            let mut out = ndarray::arr2(&[[acc]]);
            let packed = Packed {
                a: &packed_a,
                m_pad: UNITS_MR,
                a_pair: 1,
                a_layout: ALayout::Rows,
                b: &packed_b,
                b_kp: 1,
                panels: 1,
                b_pair: UNITS_NR,
            };
            // SAFETY: the CPU has the units (checked above); packed as `bf16_gemm` does.
            let tile = |t: Tile<'_, u32>| unsafe { units_tile(t) };
            drive(
                (1, 1, 1),
                &packed,
                &mut out.view_mut(),
                true,
                (UNITS_MR, UNITS_NR),
                &tile,
            );
            out[[0, 0]]
        };
        let ulp = f32::EPSILON;
        // The odd element first, each sum rounded: 1 + ulp/2 → 1 (tie to even), twice.
        assert_eq!(units(1.0, [ulp / 2.0, ulp / 2.0], [1.0, 1.0]), 1.0);
        // acc 1, even 0.5 ulp, odd 0.75 ulp: 1 + 0.75 ulp → 1 + ulp, + 0.5 ulp → 1 + 2 ulp
        // (tie to even); even first would give 1 + 0.5 ulp → 1, then 1 + ulp.
        let three_quarters = 0.75 * ulp;
        assert_eq!(
            units(1.0, [ulp / 2.0, three_quarters], [1.0, 1.0]),
            1.0 + 2.0 * ulp
        );
        // Subnormals: an input (2⁻¹³³·2⁹⁹), an accumulator, a result (2⁻¹⁰⁰·2⁻³⁰) read or
        // written as zero, where IEEE f32 keeps them.
        let tiny = 2f32.powi(-133);
        assert_eq!(units(0.0, [tiny, 0.0], [2f32.powi(99), 0.0]), 0.0);
        assert_eq!(units(tiny, [0.0, 0.0], [0.0, 0.0]), 0.0);
        assert_eq!(
            units(0.0, [2f32.powi(-100), 0.0], [2f32.powi(-30), 0.0]),
            0.0
        );
        assert_eq!(2f32.powi(-100) * 2f32.powi(-30), 2f32.powi(-130));
        // Signed zeros and specials as IEEE: −0 + 0·1 + 0·1 = +0, ∞·0 = NaN.
        assert_eq!(units(-0.0, [0.0, 0.0], [1.0, 1.0]).to_bits(), 0);
        assert!(units(0.0, [f32::INFINITY, 0.0], [0.0, 0.0]).is_nan());
    }

    /// A definition of a product, one output at a time, on row-major slices.
    pub(super) type Reference = fn(usize, usize, usize, &[f32], &[f32], &mut [f32], bool);

    /// A product on views, and the route it reports.
    pub(super) type OnViews<'a> = &'a dyn Fn(
        &mut ArrayViewMut2<'_, f32>,
        ArrayView2<'_, f32>,
        ArrayView2<'_, f32>,
        bool,
    ) -> Bf16Route;

    /// Each of `products` held to `reference` (and to its route, where given) on operands and
    /// outputs of any strides: transposed copies read back through transposed views; an output
    /// of 3n columns of which the product takes the middle n (rows that are slices, not
    /// contiguous); and a transposed output.
    pub(super) fn any_strides(
        products: &[(OnViews<'_>, Option<Bf16Route>)],
        reference: Reference,
        seed: u64,
    ) {
        use ndarray::Array2;
        let rng = Generator::new(seed);
        // The fused multiply-adds read rows (or a transposed operand's columns) where they lie
        // in whole tiles of rows and with an even k, over two blocks of pairs in the fourth
        // shape; not in the fifth.
        let shapes = [
            (37, 65, 70),
            (70, 601, 45),
            (5, 3, 2),
            (40, 602, 70),
            (37, 66, 33),
        ];
        for (m, k, n) in shapes {
            let lhs = Array2::from_shape_vec((m, k), bf16_values(m * k, 0, &rng)).unwrap();
            let rhs = Array2::from_shape_vec((k, n), bf16_values(k * n, -2, &rng)).unwrap();
            let old = Array2::from_shape_vec((m, n), bf16_values(m * n, 1, &rng)).unwrap();
            let (lhs_t, rhs_t) = (
                lhs.t().as_standard_layout().into_owned(),
                rhs.t().as_standard_layout().into_owned(),
            );
            // `lhs` as columns 1..=k of a wider matrix: rows k + 3 apart, the first unaligned;
            // transposed, its columns m + 3 apart; and as the rows of a matrix read backwards.
            let mut lhs_wider = Array2::from_elem((m, k + 3), f32::NAN);
            lhs_wider.slice_mut(s![.., 1..=k]).assign(&lhs);
            let mut lhs_t_wider = Array2::from_elem((k, m + 3), f32::NAN);
            lhs_t_wider.slice_mut(s![.., 1..=m]).assign(&lhs.t());
            let lhs_backwards = lhs.slice(s![..;-1, ..]).as_standard_layout().into_owned();
            for accumulate in [false, true] {
                let mut expected = old.clone();
                reference(
                    m,
                    k,
                    n,
                    lhs.as_slice().unwrap(),
                    rhs.as_slice().unwrap(),
                    expected.as_slice_mut().unwrap(),
                    accumulate,
                );
                for ((l, r), (product, route)) in [
                    (lhs.view(), rhs.view()),
                    (lhs_t.t(), rhs.view()),
                    (lhs.view(), rhs_t.t()),
                    (lhs_t.t(), rhs_t.t()),
                    (lhs_wider.slice(s![.., 1..=k]), rhs.view()),
                    (lhs_t_wider.slice(s![.., 1..=m]).reversed_axes(), rhs.view()),
                    (lhs_backwards.slice(s![..;-1, ..]), rhs.view()),
                ]
                .into_iter()
                .flat_map(|operands| products.iter().map(move |p| (operands, p)))
                {
                    let case = format!("{m}×{k}×{n} {:?} {:?}", l.strides(), r.strides());
                    let mut wide = Array2::from_elem((m, 3 * n), f32::NAN);
                    wide.slice_mut(s![.., n..2 * n]).assign(&old);
                    let mut columns = wide.slice_mut(s![.., n..2 * n]);
                    let got = product(&mut columns, l, r, accumulate);
                    assert!(route.is_none_or(|route| route == got), "{case}: {got:?}");
                    assert_eq!(columns, expected, "{case}");
                    let mut transposed = old.t().as_standard_layout().into_owned();
                    product(&mut transposed.view_mut().reversed_axes(), l, r, accumulate);
                    assert_eq!(transposed.t(), expected, "{case}, a transposed output");
                }
            }
        }
    }

    #[test]
    fn operands_and_outputs_of_any_strides_are_read_where_they_lie() {
        let portable: OnViews<'_> = &|out, l, r, accumulate| {
            bf16_gemm_portable_into(out, l, r, accumulate);
            Bf16Route::Portable
        };
        let [units, split]: [OnViews<'_>; 2] = [
            &|out, l, r, accumulate| {
                with_pairs_tile(PairsTile::Units, || bf16_gemm_into(out, l, r, accumulate))
            },
            &|out, l, r, accumulate| {
                with_pairs_tile(PairsTile::Split, || bf16_gemm_into(out, l, r, accumulate))
            },
        ];
        let products = [
            (units, Some(routed(PairsTile::Units))),
            (split, Some(routed(PairsTile::Split))),
            (portable, None),
        ];
        any_strides(&products, reference, 14);
    }

    /// A prepared operand's product by its leading rows and columns is the product by that
    /// block as a view, bit for bit: prefixes that end inside a block of KC pairs and a
    /// panel, an odd prefix (not a pair: the view path) and the odd whole, a transposed
    /// operand (the attention's `kᵀ`), accumulating or not, on 1 and 3 threads.
    #[test]
    fn a_prepared_operand_multiplies_as_the_view_of_its_leading_block() {
        units_or_say_so();
        let rng = Generator::new(31);
        let (rows, cols) = (1101, 70); // 551 pairs: blocks of 256, 256 and 39; 3 panels
        let stored = bf16_values(rows * cols, 0, &rng);
        let stored_t = bf16_values(cols * rows, 0, &rng);
        let plain = ArrayView2::from_shape((rows, cols), &stored).unwrap();
        let transposed = ArrayView2::from_shape((cols, rows), &stored_t).unwrap();
        for (what, rhs) in [("rows", plain), ("transposed", transposed.t())] {
            let prepared = Bf16Rhs::new(rhs);
            let cases = [
                (600, 40),
                (1100, 70),
                (1101, 70),
                (64, 32),
                (601, 7),
                (2, 1),
            ];
            for ((k, n), threads) in cases.into_iter().flat_map(|c| [(c, 1), (c, 3)]) {
                let m = 19;
                let lhs = bf16_values(m * k, 0, &rng);
                let lhs = ArrayView2::from_shape((m, k), &lhs).unwrap();
                let old = Array2::from_shape_vec((m, n), bf16_values(m * n, 2, &rng)).unwrap();
                for accumulate in [false, true] {
                    let leading = rhs.slice(s![..k, ..n]);
                    let mut expected = old.clone();
                    bf16_gemm_into(&mut expected.view_mut(), lhs, leading, accumulate);
                    for tile in TILES {
                        let mut out = old.clone();
                        let route = on(threads, || {
                            with_pairs_tile(tile, || {
                                prepared.product_into(&mut out.view_mut(), lhs, accumulate)
                            })
                        });
                        let case = format!("{what}, leading {k}×{n}, {threads} threads, {tile:?}");
                        assert_eq!(
                            bits(out.as_slice().unwrap()),
                            bits(expected.as_slice().unwrap()),
                            "{case}"
                        );
                        // A prefix that cuts a pair takes the view's path; every other, the
                        // units' packing.
                        let pair_whole = k % 2 == 0 || k == rows;
                        let expected_route = if pair_whole {
                            routed(tile)
                        } else {
                            let mut out = old.clone();
                            with_pairs_tile(tile, || {
                                bf16_gemm_into(&mut out.view_mut(), lhs, leading, accumulate)
                            })
                        };
                        assert_eq!(route, expected_route, "{case}");
                    }
                }
            }
        }
        // A prefix that cuts a pair must not read the row past it. From an old −0, the
        // products −0·1 keep the sum at −0 and the pad (0, 0) past k = 3 adds +0: +0. Row 3,
        // −1, in the pad's place would add 0·(−1) = −0 and leave −0.
        let rhs = ndarray::arr2(&[[1.0f32], [1.0], [1.0], [-1.0]]);
        let lhs = [-0.0f32; 3];
        let lhs = ArrayView2::from_shape((1, 3), &lhs).unwrap();
        let mut out = Array2::from_elem((1, 1), -0.0f32);
        Bf16Rhs::new(rhs.view()).product_into(&mut out.view_mut(), lhs, true);
        assert_eq!(out[[0, 0]].to_bits(), 0.0f32.to_bits());
    }

    /// The window is the whole prepared operand's: a value out of it past the block a
    /// product reads sends that product to the view's path (which checks the block alone),
    /// with the same bits.
    #[test]
    fn a_prepared_operand_out_of_the_window_past_the_block_read_takes_the_views_path() {
        let inside = inside();
        let rng = Generator::new(32);
        let (rows, cols, m, k, n) = (40, 33, 9, 20, 17);
        let mut stored = bf16_values(rows * cols, 0, &rng);
        stored[rows * cols - 1] = f32::NAN;
        let rhs = ArrayView2::from_shape((rows, cols), &stored).unwrap();
        let lhs = bf16_values(m * k, 0, &rng);
        let lhs = ArrayView2::from_shape((m, k), &lhs).unwrap();
        let mut expected = Array2::zeros((m, n));
        let leading = rhs.slice(s![..k, ..n]);
        assert_eq!(
            bf16_gemm_into(&mut expected.view_mut(), lhs, leading, false),
            inside
        );
        let mut out = Array2::from_elem((m, n), f32::NAN);
        let route = Bf16Rhs::new(rhs).product_into(&mut out.view_mut(), lhs, false);
        assert_eq!(route, inside);
        assert_eq!(
            bits(out.as_slice().unwrap()),
            bits(expected.as_slice().unwrap())
        );
        // The whole operand, NaN included: the portable path, IEEE's NaN in the last column.
        let lhs = bf16_values(m * rows, 0, &rng);
        let lhs = ArrayView2::from_shape((m, rows), &lhs).unwrap();
        let mut expected = Array2::zeros((m, cols));
        bf16_gemm_into(&mut expected.view_mut(), lhs, rhs, false);
        let mut out = Array2::zeros((m, cols));
        let route = Bf16Rhs::new(rhs).product_into(&mut out.view_mut(), lhs, false);
        assert_eq!(route, Bf16Route::Portable);
        assert!(out.column(cols - 1).iter().all(|x| x.is_nan()));
        assert_eq!(
            bits(out.as_slice().unwrap()),
            bits(expected.as_slice().unwrap())
        );
    }

    #[test]
    fn the_kernel_is_a_product_kernel_for_both_element_types() {
        let rng = Generator::new(13);
        let (m, k, n) = (40, 21, 9);
        let lhs = bf16_values(m * k, 0, &rng);
        let rhs = bf16_values(k * n, 0, &rng);
        let mut expected = vec![0.0; m * n];
        reference(m, k, n, &lhs, &rhs, &mut expected, false);
        let mut out = vec![f32::NAN; m * n];
        Bf16Products.product_f32(m, k, n, &lhs, &rhs, &mut out, false);
        assert_eq!(bits(&out), bits(&expected));
        // f64: the plain product (integers, so any order agrees).
        let lhs: Vec<f64> = (0..m * k).map(|i| (i % 7) as f64 - 3.0).collect();
        let rhs: Vec<f64> = (0..k * n).map(|i| (i % 5) as f64 - 2.0).collect();
        let mut out = vec![1.0; m * n];
        Bf16Products.product_f64(m, k, n, &lhs, &rhs, &mut out, true);
        for i in 0..m {
            for j in 0..n {
                let sum: f64 = (0..k).map(|p| lhs[i * k + p] * rhs[p * n + j]).sum();
                assert_eq!(out[i * n + j], 1.0 + sum);
            }
        }
        assert!(Bf16Products.spreads_itself());
    }
}
