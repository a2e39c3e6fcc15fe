//! The AMX order: products of bf16 values summed as Intel's AMX tiles sum them
//! (`tdpbf16ps`), on the tiles where the CPU has them and portably everywhere else.
//!
//! # What the tiles compute
//! One `tdpbf16ps` takes up to 16 pairs (32 values) of the inner dimension. Probed on an
//! Intel Xeon with AMX-BF16 (the tests below hold the tiles to it), each output keeps *two*
//! f32 sums that start from +0, one over the even inner indices and one over the odd ones,
//! each addition rounded to nearest even; at the end of the instruction the two are added,
//! rounded, and that sum is added to the accumulator, rounded again. (The newer revisions of
//! Intel's pseudocode fit this: a zeroed temporary of two f32 lanes per output, added
//! horizontally at the end. The probes, not the manual, are what this module relies on.)
//!
//! ```text
//! for each block of 32 inner indices (the last one shorter):
//!     e = +0;  o = +0
//!     for i in the block:  if i is even { e ← rne(e + a[i]·b[i]) } else { o ← rne(o + a[i]·b[i]) }
//!     acc ← rne(acc + rne(e + o))
//! ```
//!
//! The instruction's older pseudocode (one running sum, the even element of each pair first)
//! is not what the hardware does: with `acc = 1` and the four products `2⁻²⁴, 0, 2⁻²⁴, 0`,
//! one running sum rounds each `1 + 2⁻²⁴` back to 1 (a tie, to even), while the tiles give
//! `1 + 2⁻²³` (the even sum is `2⁻²³`, added once). Eight thousand random probes of 2 to 32
//! values, exponents 40 apart, matched the two-sum order bit for bit and no one-sum order.
//!
//! A GEMM that runs one `tdpbf16ps` per 32 values of the inner dimension, in order, starting
//! from the first, computes exactly the loop above for every output; it depends on `k` alone,
//! like the units' order of the parent module. The units' window applies unchanged: inside
//! it every sum is a sum of products, a multiple of the same power of two and below the same
//! bound, whatever the order, so the tiles' flushing of subnormals cannot show and both paths
//! compute the same IEEE operations. A zero past an odd `k` or past a block adds `+0` to a sum
//! that is never `−0` (it starts from `+0`), so the padding changes no bit.

#[cfg(target_arch = "x86_64")]
use std::arch::asm;
use std::sync::OnceLock;

use super::{PORTABLE_MR, PORTABLE_NR, Tile};
#[cfg(target_arch = "x86_64")]
use super::{UNITS_NR, units_available};

/// Rows of the tiles' output block: one AMX tile is 16 rows of 16 f32 values; a call takes
/// 16 rows × UNITS_NR (two tiles) per step down the panel, two steps at once where it can
/// (four accumulating tiles, the two operand tiles of each side).
#[cfg(target_arch = "x86_64")]
pub(super) const AMX_MR: usize = 16;

/// Pairs of the inner dimension in one `tdpbf16ps`: a tile row of 64 bytes.
pub(super) const AMX_PAIRS: usize = 16;

/// Whether this CPU has AMX tiles with bf16 products and the operating system lets this
/// process use them (it asks once, the first time; Linux hands out the tiles' 8 KiB of state
/// per process on request). Also needs the AVX-512 units the packing runs on.
pub fn amx_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::__cpuid_count;
    if !units_available() {
        return false;
    }
    let leaf7 = __cpuid_count(7, 0);
    let (amx_bf16, amx_tile) = ((leaf7.edx >> 22) & 1 == 1, (leaf7.edx >> 24) & 1 == 1);
    let osxsave = (__cpuid_count(1, 0).ecx >> 27) & 1 == 1;
    if !(amx_bf16 && amx_tile && osxsave) {
        return false;
    }
    let (low, _high): (u32, u32);
    // SAFETY: `xgetbv` with ECX = 0 reads XCR0, which the OS enables when OSXSAVE is set
    // (checked above); it touches no memory.
    unsafe {
        asm!("xgetbv", in("ecx") 0, out("eax") low, out("edx") _high,
             options(nomem, nostack, preserves_flags));
    }
    // XTILECFG (bit 17) and XTILEDATA (bit 18) enabled by the OS.
    if low & (0b11 << 17) != 0b11 << 17 {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    const SYS_ARCH_PRCTL: i64 = 158;
    let status: i64;
    // SAFETY: the arch_prctl system call asking for the tile data feature; it reads and
    // writes no memory of ours. `syscall` clobbers RCX and R11.
    unsafe {
        asm!("syscall",
             inlateout("rax") SYS_ARCH_PRCTL => status,
             in("rdi") ARCH_REQ_XCOMP_PERM,
             in("rsi") XFEATURE_XTILEDATA,
             lateout("rcx") _, lateout("r11") _,
             options(nostack));
    }
    status == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// The tiles' shapes, loaded by `ldtilecfg`: palette 1, all eight tiles 16 rows of 64 bytes.
/// Tiles 0–3 accumulate a 32×32 block of the output, 4–5 hold two 16-row blocks of the left
/// operand, 6–7 two 16-column blocks of the right operand.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

#[cfg(target_arch = "x86_64")]
static CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// `tileloadd tmmN, [ptr + stride]`: 16 rows of 64 bytes, `stride` bytes apart.
#[cfg(target_arch = "x86_64")]
macro_rules! load {
    ($tile:literal, $ptr:expr, $stride:expr) => {
        asm!(concat!("tileloadd tmm", $tile, ", [{p} + {s}*1]"),
             p = in(reg) $ptr, s = in(reg) $stride, options(nostack, readonly))
    };
}

/// `tilestored [ptr + stride], tmmN`.
#[cfg(target_arch = "x86_64")]
macro_rules! store {
    ($tile:literal, $ptr:expr, $stride:expr) => {
        asm!(concat!("tilestored [{p} + {s}*1], tmm", $tile),
             p = in(reg) $ptr, s = in(reg) $stride, options(nostack))
    };
}

/// `tdpbf16ps tmmC, tmmA, tmmB`.
#[cfg(target_arch = "x86_64")]
macro_rules! dot {
    ($c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem)
        )
    };
}

/// The tiles' kernel: `t.tiles` blocks of AMX_MR rows × UNITS_NR columns down one panel, two
/// at a time, one `tdpbf16ps` per block of AMX_PAIRS pairs and 16 × 16 outputs. A last block
/// of fewer pairs is copied with zeros after it into buffers of whole tiles.
///
/// # Safety
/// [`amx_available`] is true; `t.a` holds `t.tiles`·AMX_MR rows of `t.pairs` pairs, rows
/// `t.a_row` apart and pairs adjacent (`t.a_step` = 1); `t.b` `t.pairs` rows of UNITS_NR
/// pairs; `t.c` addresses `t.tiles`·AMX_MR rows of UNITS_NR writable f32 values `t.ldc` apart
/// (initialised unless `t.zero`).
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn amx_tile(t: Tile<'_, u32>) {
    debug_assert_eq!(t.a_step, 1);
    debug_assert!(t.a.len() >= (t.tiles * AMX_MR - 1) * t.a_row + t.pairs);
    debug_assert!(t.b.len() >= t.pairs * UNITS_NR);
    let (whole, tail) = (t.pairs / AMX_PAIRS, t.pairs % AMX_PAIRS);
    let (a_stride, c_stride) = (4 * t.a_row, 4 * t.ldc);
    let b_stride = 4 * UNITS_NR;
    // SAFETY (this function): the caller's contract covers every address read or written;
    // the tiles are this thread's, configured here and released at the end.
    unsafe {
        configure();
        let mut tile = 0;
        while tile < t.tiles {
            let two = t.tiles - tile >= 2;
            let a0 = t.a.as_ptr().add(tile * AMX_MR * t.a_row);
            let a1 = a0.wrapping_add(AMX_MR * t.a_row);
            let c0 = t.c.add(tile * AMX_MR * t.ldc);
            let c1 = c0.wrapping_add(AMX_MR * t.ldc);
            if t.zero {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem)
                );
            } else {
                load!(0, c0, c_stride);
                load!(1, c0.add(16), c_stride);
                if two {
                    load!(2, c1, c_stride);
                    load!(3, c1.add(16), c_stride);
                }
            }
            for block in 0..whole {
                let b = t.b.as_ptr().add(block * AMX_PAIRS * UNITS_NR);
                load!(6, b, b_stride);
                load!(7, b.add(16), b_stride);
                load!(4, a0.add(block * AMX_PAIRS), a_stride);
                dot!(0, 4, 6);
                dot!(1, 4, 7);
                if two {
                    load!(5, a1.add(block * AMX_PAIRS), a_stride);
                    dot!(2, 5, 6);
                    dot!(3, 5, 7);
                }
            }
            if tail > 0 {
                let mut a = [0u32; 2 * AMX_MR * AMX_PAIRS];
                let mut b = [0u32; AMX_PAIRS * UNITS_NR];
                let rows = if two { 2 * AMX_MR } else { AMX_MR };
                for (r, a) in a.chunks_exact_mut(AMX_PAIRS).take(rows).enumerate() {
                    let from = a0.add(r * t.a_row + whole * AMX_PAIRS);
                    a[..tail].copy_from_slice(std::slice::from_raw_parts(from, tail));
                }
                let from = t.b.as_ptr().add(whole * AMX_PAIRS * UNITS_NR);
                b[..tail * UNITS_NR]
                    .copy_from_slice(std::slice::from_raw_parts(from, tail * UNITS_NR));
                let (a, b) = (a.as_ptr(), b.as_ptr());
                load!(6, b, b_stride);
                load!(7, b.add(16), b_stride);
                load!(4, a, 4 * AMX_PAIRS);
                dot!(0, 4, 6);
                dot!(1, 4, 7);
                if two {
                    load!(5, a.add(AMX_MR * AMX_PAIRS), 4 * AMX_PAIRS);
                    dot!(2, 5, 6);
                    dot!(3, 5, 7);
                }
            }
            store!(0, c0, c_stride);
            store!(1, c0.add(16), c_stride);
            if two {
                store!(2, c1, c_stride);
                store!(3, c1.add(16), c_stride);
            }
            tile += if two { 2 } else { 1 };
        }
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Whether this thread's tiles hold [`CONFIG`]. Loading a configuration and releasing
    /// the tiles cost about 50 ns, a tenth of a call on the attention's small products, so a
    /// thread configures its tiles once and keeps them: nothing else in the process uses
    /// them, and Linux saves and restores them with the thread.
    static CONFIGURED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Loads [`CONFIG`] into this thread's tiles, the first time.
///
/// # Safety
/// [`amx_available`] is true.
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn configure() {
    if !CONFIGURED.get() {
        // SAFETY: the CPU has the tiles and this process may use them (the caller's
        // contract); `CONFIG` is a valid palette-1 configuration, read whole.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
        CONFIGURED.set(true);
    }
}

/// One tile's sums in the AMX order, for the parent's portable tile: each block of
/// AMX_PAIRS pairs summed into an even and an odd sum from +0 by fused multiply-adds, their
/// sum then added to `acc` (PORTABLE_MR rows × PORTABLE_NR columns, read from `a` and
/// `t.b` as the portable tile reads them). The pairs of a call start at a multiple of
/// AMX_PAIRS (`drive` walks blocks of KC pairs), so its blocks are the tiles' blocks.
#[inline(always)]
pub(super) fn add_blocks(acc: &mut [[f32; PORTABLE_NR]; PORTABLE_MR], a: &[f32], t: Tile<'_, f32>) {
    const MR: usize = PORTABLE_MR;
    const NR: usize = PORTABLE_NR;
    for p0 in (0..t.pairs).step_by(AMX_PAIRS) {
        let mut even_sums = [[0.0f32; NR]; MR];
        let mut odd_sums = [[0.0f32; NR]; MR];
        for p in p0..t.pairs.min(p0 + AMX_PAIRS) {
            let (even, odd) = t.b[2 * p * NR..][..2 * NR].split_at(NR);
            for r in 0..MR {
                let a = &a[r * t.a_row + p * t.a_step..][..2];
                for j in 0..NR {
                    even_sums[r][j] = a[0].mul_add(even[j], even_sums[r][j]);
                    odd_sums[r][j] = a[1].mul_add(odd[j], odd_sums[r][j]);
                }
            }
        }
        for r in 0..MR {
            for j in 0..NR {
                acc[r][j] += even_sums[r][j] + odd_sums[r][j];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use ndarray::{Array2, ArrayView2, s};

    use super::super::tests::{
        OnViews, SHAPES, any_strides, bf16_values, bits, on, outside_the_window,
    };
    use super::super::{
        Bf16Rhs, Bf16Route, amx_gemm, amx_gemm_into, amx_gemm_portable_into, bf16_gemm,
    };
    use super::*;
    use crate::Generator;

    /// The AMX order, one output at a time: per block of 32 inner indices, an even and an
    /// odd sum from +0 by IEEE f32 fused multiply-adds, their sum added to the output.
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
                for block in (0..k).step_by(2 * AMX_PAIRS) {
                    let (mut even, mut odd) = (0.0f32, 0.0f32);
                    for p in block..k.min(block + 2 * AMX_PAIRS) {
                        let (a, b) = (lhs[i * k + p], rhs[p * n + j]);
                        if p % 2 == 0 {
                            even = a.mul_add(b, even);
                        } else {
                            odd = a.mul_add(b, odd);
                        }
                    }
                    sum += even + odd;
                }
                out[i * n + j] = sum;
            }
        }
    }

    /// Whether the tiles are here; if not, the test says so and checks the portable path.
    fn tiles_or_say_so() -> bool {
        let available = amx_available();
        if !available {
            eprintln!("this CPU has no AMX-BF16 tiles: only the portable AMX order is tested here");
        }
        available
    }

    fn inside() -> Bf16Route {
        if tiles_or_say_so() {
            Bf16Route::Tiles
        } else {
            Bf16Route::Portable
        }
    }

    /// The parent's shapes, and inner sizes around whole instructions (31, 32, 33 values, a
    /// block of KC pairs and a ragged one after it), 16-row and 32-row tiles and ragged ones.
    const AMX_SHAPES: [(usize, usize, usize); 6] = [
        (2, 31, 3),
        (16, 32, 32),
        (17, 33, 33),
        (33, 64, 64),
        (48, 530, 97),
        (64, 1024, 32),
    ];

    #[test]
    fn tiles_and_portable_path_equal_the_definition_bit_for_bit() {
        let route = inside();
        let rng = Generator::new(41);
        for (m, k, n) in SHAPES.into_iter().chain(AMX_SHAPES) {
            let lhs = bf16_values(m * k, 0, &rng);
            let rhs = bf16_values(k * n, -3, &rng);
            let old = bf16_values(m * n, 2, &rng);
            for accumulate in [false, true] {
                let mut expected = old.clone();
                reference(m, k, n, &lhs, &rhs, &mut expected, accumulate);
                let mut portable = Array2::from_shape_vec((m, n), old.clone()).unwrap();
                let (l, r) = (
                    ArrayView2::from_shape((m, k), &lhs).unwrap(),
                    ArrayView2::from_shape((k, n), &rhs).unwrap(),
                );
                amx_gemm_portable_into(&mut portable.view_mut(), l, r, accumulate);
                let portable = portable.into_raw_vec_and_offset().0;
                assert_eq!(bits(&portable), bits(&expected), "portable {m}×{k}×{n}");
                for threads in [1, 3] {
                    let mut auto = old.clone();
                    let got = on(threads, || {
                        amx_gemm(m, k, n, &lhs, &rhs, &mut auto, accumulate)
                    });
                    assert_eq!(got, route, "{m}×{k}×{n}");
                    assert_eq!(bits(&auto), bits(&expected), "{m}×{k}×{n} on {threads}");
                }
            }
        }
    }

    /// The differential probe that found the order: random products of 1 to 70 values whose
    /// exponents lie 40 apart, from a random accumulator, on the tiles and by the definition.
    /// Any one-sum order, or a pair summed before it is added, fails most of them.
    #[test]
    fn random_probes_agree_with_the_two_sums() {
        let route = inside();
        let rng = Generator::new(42);
        let spread = |rng: &Generator| 2f32.powi((rng.next_normal() * 7.0) as i32);
        for case in 0..3000 {
            let k = 1 + case % 70;
            let (m, n) = (1 + case % 3, 1 + case % 5);
            let mut lhs = bf16_values(m * k, 0, &rng);
            let mut rhs = bf16_values(k * n, 0, &rng);
            for x in lhs.iter_mut().chain(rhs.iter_mut()) {
                *x *= spread(&rng);
            }
            let old: Vec<f32> = bf16_values(m * n, 3, &rng);
            let mut expected = old.clone();
            reference(m, k, n, &lhs, &rhs, &mut expected, true);
            let mut out = old;
            assert_eq!(amx_gemm(m, k, n, &lhs, &rhs, &mut out, true), route);
            assert_eq!(bits(&out), bits(&expected), "case {case}: {m}×{k}×{n}");
        }
    }

    #[test]
    fn probes_of_the_tiles() {
        if !tiles_or_say_so() {
            return;
        }
        // One output from `acc`, its k ≤ 32 values on the tiles directly (no window).
        let tiles = |acc: f32, a: &[f32], b: &[f32]| {
            use super::super::{
                ALayout, Packed, UNITS_NR, Width, drive, pack_a_units, pack_b_units,
            };
            let k = a.len();
            let (mut packed_a, mut packed_b) = (Vec::new(), Vec::new());
            let a = ArrayView2::from_shape((1, k), a).unwrap();
            let (a_len, _, _) = pack_a_units(a, &mut packed_a, AMX_MR, Width::Pairs);
            pack_b_units(ArrayView2::from_shape((k, 1), b).unwrap(), &mut packed_b);
            let mut out = ndarray::arr2(&[[acc]]);
            let packed = Packed {
                a: &packed_a[..a_len],
                m_pad: AMX_MR,
                a_pair: 1,
                a_layout: ALayout::Rows,
                b: &packed_b,
                b_kp: k.div_ceil(2),
                panels: 1,
                b_pair: UNITS_NR,
            };
            // SAFETY: the CPU has the tiles (checked above); packed as `amx_gemm` does.
            let tile = |t: Tile<'_, u32>| unsafe { amx_tile(t) };
            let size = (1, 1, k.div_ceil(2));
            drive(
                size,
                &packed,
                &mut out.view_mut(),
                true,
                (AMX_MR, UNITS_NR),
                &tile,
            );
            out[[0, 0]]
        };
        let ulp = f32::EPSILON;
        let ones = [1.0f32; 32];
        // Two sums: 1 + (ulp/2 + ulp/2) over the even values, where one running sum would
        // round 1 + ulp/2 to 1 (a tie, to even) twice.
        let half = ulp / 2.0;
        assert_eq!(tiles(1.0, &[half, 0.0, half, 0.0], &ones[..4]), 1.0 + ulp);
        // The accumulator joins last: from −1, the values 1 and 2⁻³⁰ (even, odd) make the
        // sums 1 and 2⁻³⁰, whose sum rounds to 1, and −1 + 1 = 0. The manual's older
        // pseudocode, the even product added to the accumulator first, would keep 2⁻³⁰.
        assert_eq!(tiles(-1.0, &[1.0, 2f32.powi(-30)], &ones[..2]), 0.0);
        // Even with even, odd with odd: 1 − 1 over the even values is exact, then 2⁻³⁰ is
        // added: from 0, the products 1, 2⁻³⁰, −1 (even, odd, even) give 2⁻³⁰; summing in
        // index order would give rne(1 + 2⁻³⁰) − 1 = 0.
        let tiny = 2f32.powi(-30);
        assert_eq!(tiles(0.0, &[1.0, tiny, -1.0], &ones[..3]), tiny);
        // 32 values are one instruction: from 1, 32 products of ulp/2 are added at once
        // (even and odd sums of 8 ulp each).
        assert_eq!(tiles(1.0, &[half; 32], &ones), 1.0 + 16.0 * ulp);
        // Signed zeros as IEEE with sums from +0: from −0, products −0 give +0.
        assert_eq!(tiles(-0.0, &[-0.0, -0.0], &ones[..2]).to_bits(), 0);
        // Outside the window the tiles flush subnormals: 2⁻¹⁰⁰·2⁻³⁰ is 0 on them, 2⁻¹³⁰ in
        // IEEE f32 — why such operands take the portable path.
        let flushed = tiles(0.0, &[2f32.powi(-100), 0.0], &[2f32.powi(-30), 0.0]);
        assert_eq!(flushed, 0.0);
    }

    #[test]
    fn operands_of_any_strides_and_prepared_prefixes() {
        let route = inside();
        let portable: OnViews<'_> = &|out, l, r, accumulate| {
            amx_gemm_portable_into(out, l, r, accumulate);
            Bf16Route::Portable
        };
        let products = [
            (&amx_gemm_into as OnViews<'_>, Some(route)),
            (portable, None),
        ];
        any_strides(&products, reference, 43);
        let rng = Generator::new(45);
        // A prepared operand's leading blocks, as the attention reads its keys.
        let (rows, cols) = (1101, 70);
        let stored = bf16_values(rows * cols, 0, &rng);
        let rhs = ArrayView2::from_shape((rows, cols), &stored).unwrap();
        let prepared = Bf16Rhs::amx(rhs);
        for ((k, n), threads) in [(600, 40), (1101, 70), (64, 32), (34, 7)]
            .into_iter()
            .flat_map(|c| [(c, 1), (c, 3)])
        {
            let m = 19;
            let lhs = bf16_values(m * k, 0, &rng);
            let lhs = ArrayView2::from_shape((m, k), &lhs).unwrap();
            let old = Array2::from_shape_vec((m, n), bf16_values(m * n, 2, &rng)).unwrap();
            let mut expected = old.clone();
            amx_gemm_into(&mut expected.view_mut(), lhs, rhs.slice(s![..k, ..n]), true);
            let mut out = old.clone();
            let got = on(threads, || {
                prepared.product_into(&mut out.view_mut(), lhs, true)
            });
            assert_eq!(got, route, "leading {k}×{n}");
            assert_eq!(out, expected, "leading {k}×{n} on {threads}");
        }
    }

    #[test]
    fn operands_outside_the_window_take_the_portable_path() {
        let route = inside();
        let (m, k, n) = (9, 45, 35);
        let (base, rhs) = outside_the_window(amx_gemm, reference, (m, k, n), Some(route), 44);
        // The two orders differ: the same operands in the units' order give other bits.
        let mut pairs = vec![0.0; m * n];
        let mut amx = vec![0.0; m * n];
        bf16_gemm(m, k, n, &base, &rhs, &mut pairs, false);
        amx_gemm(m, k, n, &base, &rhs, &mut amx, false);
        assert_ne!(bits(&pairs), bits(&amx));
    }
}
