//! `e^x` over a slice of `f32`, in SIMD registers.
//!
//! A softmax over attention scores evaluates `e^x` once per score, tens of millions of times
//! per training step, and the C library's `expf` is a call per element that the compiler
//! cannot vectorize. This is the classic Cody–Waite reduction with a degree-6 polynomial
//! (as in Cephes' `expf`), written without branches so that the loop vectorizes:
//!
//! ```text
//! n = round(x / ln 2)          r = x − n·ln 2  (ln 2 split in two, so r is nearly exact)
//! e^x = 2^n · e^r              e^r ≈ 1 + r + r²·p(r) on |r| ≤ ln 2 / 2
//! ```
//!
//! The result is within 1 ulp of the true value over the whole range, subnormal results
//! included (2^n is applied in two halves so that neither underflows; the tests check every
//! 211th f32 from −104 to 89 against `f64::exp`). `e^x` is +∞ above about 88.72, 0 below
//! about −103.97, and NaN for NaN. The code uses no fused multiply-add, so the AVX-512
//! version (intrinsics, one `vscalefps` for the scaling), the AVX2 loop (chosen at run time)
//! and the portable one give the same bits, on every f32 (an ignored test checks all 2³²;
//! a NaN counts as one value, as Rust leaves its sign and payload unspecified). Sixteen
//! lanes instead of eight take about a quarter less time on rows of 64 to 511 scores (the
//! softmax's), where the exponentials are 5% of a capstone step.

/// Replaces every `x` of `xs` by `e^x` (see the module documentation for the accuracy).
///
/// ```
/// use tl_tensor::kernels::exp::exp_in_place;
/// let mut xs = [0.0f32, 1.0, -1.0, f32::NEG_INFINITY, 100.0];
/// exp_in_place(&mut xs);
/// assert_eq!(xs[0], 1.0);
/// assert!((xs[1] - std::f32::consts::E).abs() <= 2.0 * f32::EPSILON * xs[1]);
/// assert!((xs[2] - 1.0 / std::f32::consts::E).abs() <= 2.0 * f32::EPSILON * xs[2]);
/// assert_eq!(xs[3..], [0.0, f32::INFINITY]);
/// ```
pub fn exp_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F, checked just above.
        unsafe { exp_avx512(xs) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        unsafe { exp_avx2(xs) };
        return;
    }
    exp_loop(xs);
}

/// The loop compiled for AVX2 (8 lanes); the arithmetic is the portable loop's.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn exp_avx2(xs: &mut [f32]) {
    exp_loop(xs);
}

/// Sixteen lanes of AVX-512F, written out: the portable arithmetic step for step, with the
/// last step's `2^half · 2^(n−half)` done by one `vscalefps`, and the tail of fewer than
/// sixteen values in one masked load and store.
///
/// The same bits as the portable loop: `er` lies in about [0.7, 1.5] and `half` in
/// [−75, 64], so `er · 2^half` is exact and the portable code rounds once, at its second
/// product, to the nearest f32 of `er · 2^n`; `vscalefps` computes `er · 2^n` exactly and
/// rounds it once (to nearest, subnormals kept: Rust never sets the flush-to-zero modes).
/// `vmaxps`/`vminps` return their second operand when either is NaN, so a NaN passes the
/// clamps as it does the portable comparisons.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_avx512(xs: &mut [f32]) {
    use std::arch::x86_64::{
        _mm512_loadu_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_storeu_ps,
    };
    let mut chunks = xs.chunks_exact_mut(16);
    for chunk in &mut chunks {
        // SAFETY: the chunk holds 16 values.
        unsafe {
            let x = _mm512_loadu_ps(chunk.as_ptr());
            _mm512_storeu_ps(chunk.as_mut_ptr(), exp16(x));
        }
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let mask = (1u16 << tail.len()) - 1;
        // SAFETY: the mask covers the tail's values only; masked-off lanes touch no memory.
        unsafe {
            let x = _mm512_maskz_loadu_ps(mask, tail.as_ptr());
            _mm512_mask_storeu_ps(tail.as_mut_ptr(), mask, exp16(x));
        }
    }
}

/// [`exp`] of sixteen values (see [`exp_avx512`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::{
        _mm512_add_ps, _mm512_max_ps, _mm512_min_ps, _mm512_mul_ps, _mm512_scalef_ps,
        _mm512_set1_ps, _mm512_sub_ps,
    };
    let c = _mm512_set1_ps;
    let (add, sub, mul) = (_mm512_add_ps, _mm512_sub_ps, _mm512_mul_ps);
    let clamped = _mm512_min_ps(c(89.0), _mm512_max_ps(c(-104.0), x));
    let shifted = add(mul(clamped, c(LOG2_E)), c(ROUND));
    let n = sub(shifted, c(ROUND));
    let r = sub(sub(clamped, mul(n, c(LN2_HI))), mul(n, c(LN2_LO)));
    let mut p = c(P[0]);
    for &coefficient in &P[1..] {
        p = add(mul(p, r), c(coefficient));
    }
    let er = add(add(mul(mul(p, r), r), r), c(1.0));
    _mm512_scalef_ps(er, n)
}

#[inline(always)]
fn exp_loop(xs: &mut [f32]) {
    for x in xs.iter_mut() {
        *x = exp(*x);
    }
}

const LOG2_E: f32 = std::f32::consts::LOG2_E;
// ln 2 = LN2_HI + LN2_LO, with LN2_HI short enough that n·LN2_HI is exact.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
// Adding and subtracting 1.5·2^23 rounds to the nearest integer (ties to even).
const ROUND: f32 = 12_582_912.0;
/// The polynomial `p(r)` of `e^r ≈ 1 + r + r²·p(r)`, highest degree first (Horner's order).
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` for one value, bit for bit what [`exp_in_place`] computes.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // Beyond these, e^x is +∞ or rounds to 0; clamping keeps n within the exponent range.
    // A NaN fails both tests and propagates through the arithmetic below (a final select
    // would compile to a masked store, which is slow on AMD cores).
    let clamped = if x < -104.0 { -104.0 } else { x };
    let clamped = if clamped > 89.0 { 89.0 } else { clamped };
    let shifted = clamped * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = (clamped - n * LN2_HI) - n * LN2_LO;
    let p = P[1..]
        .iter()
        .fold(P[0], |p, &coefficient| p * r + coefficient);
    let er = (p * r) * r + r + 1.0;
    // n as an integer: `shifted` and ROUND share their exponent, so their significands
    // differ by exactly n.
    let n = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    // 2^n as two powers of two, each a normal f32 for n in [−150, 128].
    let half = n >> 1;
    let scale = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    er * scale(half) * scale(n - half)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The distance between `a` and `b` in units in the last place of `b` as an f32.
    fn ulps(a: f32, b: f64) -> f64 {
        let b32 = b as f32;
        if a == b32 {
            return 0.0; // the correctly rounded value, +∞ beyond f32's range included
        }
        let ulp = if b32.is_normal() {
            // 2^e · 2^-23 for b32 in [2^e, 2^(e+1)).
            f64::from(f32::from_bits(b32.abs().to_bits() & 0x7f80_0000)) * f64::from(f32::EPSILON)
        } else {
            f64::from(f32::from_bits(1)) // the subnormal spacing, 2^-149
        };
        (f64::from(a) - b).abs() / ulp
    }

    #[test]
    fn within_one_ulp_of_the_true_exponential_over_the_whole_range() {
        // Every 211th f32 from -104 to 89 (about 10 million values), against f64's exp.
        let negative = (0x8000_0000..=(-104f32).to_bits()).step_by(211);
        let positive = (0..=89f32.to_bits()).step_by(211);
        let xs: Vec<f32> = negative.chain(positive).map(f32::from_bits).collect();
        let mut ys = xs.clone();
        exp_in_place(&mut ys);
        let worst = xs
            .iter()
            .zip(&ys)
            .map(|(&x, &y)| (ulps(y, f64::from(x).exp()), x))
            .fold((0.0, 0.0), |w, e| if e.0 > w.0 { e } else { w });
        assert!(worst.0 <= 1.0, "{} ulp at x = {}", worst.0, worst.1);
    }

    #[test]
    fn the_edges_overflow_underflow_and_keep_nan() {
        let mut xs = [88.7, 88.8, -87.0, -103.0, -104.5, f32::INFINITY, f32::NAN];
        exp_in_place(&mut xs);
        assert!(xs[0].is_finite() && xs[0] > 3.3e38);
        assert_eq!(xs[1], f32::INFINITY);
        assert!(xs[2].is_normal());
        assert!(xs[3] > 0.0 && !xs[3].is_normal()); // a subnormal, not flushed
        assert_eq!(xs[4..6], [0.0, f32::INFINITY]);
        assert!(xs[6].is_nan());
    }

    #[test]
    fn every_compiled_loop_and_the_portable_one_agree_bit_for_bit() {
        // Lengths that leave every kind of remainder after 8 and 16 lanes.
        let xs: Vec<f32> = (0..100_003)
            .map(|i| (i as f32 - 60_000.0) * 0.0017)
            .collect();
        let mut portable = xs.clone();
        exp_loop(&mut portable);
        type Loop = fn(&mut [f32]);
        let mut loops: Vec<(&str, Loop)> = vec![("chosen at run time", exp_in_place)];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2.
                loops.push(("AVX2", |xs| unsafe { exp_avx2(xs) }));
            } else {
                eprintln!("this CPU has no AVX2: its loop is not tested here");
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU supports AVX-512F.
                loops.push(("AVX-512", |xs| unsafe { exp_avx512(xs) }));
            } else {
                eprintln!("this CPU has no AVX-512F: its loop is not tested here");
            }
        }
        for (name, exp) in loops {
            for len in [xs.len(), 1, 7, 15, 17, 33] {
                let mut ys = xs[..len].to_vec();
                exp(&mut ys);
                let same = ys
                    .iter()
                    .zip(&portable)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{name}, {len} values");
            }
        }
    }

    /// The same bits, or both NaN: Rust leaves a NaN's sign and payload unspecified.
    #[cfg(target_arch = "x86_64")]
    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    /// The AVX-512 loop scales by `vscalefps` where the portable code multiplies twice:
    /// every 61st f32 bit pattern (infinities, NaNs, subnormals and results that round to
    /// subnormals included) and every tail length, against the single-value function.
    #[test]
    fn the_avx512_loop_is_the_portable_exp_on_every_61st_f32() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            let mut specials = vec![f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, -0.0];
            // Around the clamps and where results turn subnormal, then zero.
            for edge in [-104.0_f32, 89.0, -87.34, -103.28, -103.97, 88.72] {
                let bits = edge.to_bits();
                specials.extend((bits - 40..bits + 40).map(f32::from_bits));
            }
            let xs: Vec<f32> = (0..=u32::MAX)
                .step_by(61)
                .map(f32::from_bits)
                .chain(specials)
                .collect();
            let mut fast = xs.clone();
            // SAFETY: the CPU supports AVX-512F.
            unsafe { exp_avx512(&mut fast) };
            for (x, y) in xs.iter().zip(&fast) {
                assert!(same(*y, exp(*x)), "e^{x:e}: {y:e}");
            }
            for len in 0..=33 {
                let mut tail = xs[1_000_000..1_000_000 + len].to_vec();
                // SAFETY: as above.
                unsafe { exp_avx512(&mut tail) };
                let expected = &fast[1_000_000..][..len];
                assert!(
                    tail.iter().zip(expected).all(|(a, b)| same(*a, *b)),
                    "{len} values"
                );
            }
        } else {
            eprintln!("this CPU has no AVX-512F: its loop is not tested here");
        }
    }

    /// Every one of the 2³² f32 values, in blocks of 2²⁰: about two minutes in a release build.
    /// `cargo test --release -p tl-tensor --lib exp -- --ignored`
    #[test]
    #[ignore = "exhaustive; run by hand after changing the exponential"]
    fn the_avx512_loop_is_the_portable_exp_on_every_f32() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            let mut block = vec![0.0_f32; 1 << 20];
            for start in (0..=u32::MAX).step_by(1 << 20) {
                for (i, x) in block.iter_mut().enumerate() {
                    *x = f32::from_bits(start + i as u32);
                }
                // SAFETY: the CPU supports AVX-512F.
                unsafe { exp_avx512(&mut block) };
                for (i, y) in block.iter().enumerate() {
                    let x = f32::from_bits(start + i as u32);
                    assert!(same(*y, exp(x)), "e^{x:e}: {y:e}");
                }
            }
        } else {
            eprintln!("this CPU has no AVX-512F: its loop is not tested here");
        }
    }

    #[test]
    fn the_slice_and_the_single_value_agree_bit_for_bit() {
        let xs: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.173).collect();
        let mut ys = xs.clone();
        exp_in_place(&mut ys);
        for (x, y) in xs.iter().zip(ys) {
            assert_eq!(exp(*x).to_bits(), y.to_bits());
        }
    }
}
