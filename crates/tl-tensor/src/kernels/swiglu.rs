//! The loops of the SwiGLU gate `y = silu(g)·u = g·σ(g)·u`, with `σ(g) = 1 / (1 + e^(−g))`,
//! and of its VJP,
//!
//! ```text
//! ū = ȳ·g·σ(g)          ḡ = ȳ·u·σ(g)·(1 + g·(1 − σ(g)))
//! ```
//!
//! each product and sum rounded in the order written (left to right), `e^x` being
//! [`exp`](super::exp::exp)'s.
//!
//! The portable loops ([`swiglu`], [`swiglu_grads`]) work a chunk in passes: the negated
//! gate, its exponentials (vectorised by [`Element::exp_in_place`]), the logistic values,
//! then the products. Compiled for the baseline x86-64 target, every pass but the
//! exponentials runs four lanes wide, and the gate's loops took three times as long as a
//! pass over their memory does on the capstone. For `f32` on AVX-512F
//! ([`Element::swiglu`], [`Element::swiglu_grads`]) each value goes through all of it in
//! registers, sixteen at a time.
//!
//! **Both give the same bits**: negation is exact, the exponential is the same function
//! in both (see [`exp`](super::exp)), and a division, a product or a sum of the same two
//! operands rounds alike in any width; nothing is fused into a multiply-add.

use std::mem::MaybeUninit;

use super::written::write_each;
use crate::Element;

/// σ(g) = 1 / (1 + e^(−g)) for every `g` of `gate`, written into `out` (of the same length)
/// with the vectorized [`Element::exp_in_place`]; returns `out`, initialised. For very
/// negative `g`, e^(−g) overflows to +∞ and σ is exactly 0, never NaN.
fn logistic_into<'a, E: Element>(gate: &[E], out: &'a mut [MaybeUninit<E>]) -> &'a mut [E] {
    let out = write_each(out, gate.iter().map(|&g| -g));
    E::exp_in_place(out);
    for s in out.iter_mut() {
        *s = E::one() / (E::one() + *s);
    }
    out
}

/// Writes `g·σ(g)·u` for every `g` of `gate` and `u` of `up` into `out`, and returns it
/// initialised. The portable version of [`Element::swiglu`].
///
/// # Panics
/// If the three differ in length.
///
/// ```
/// use std::mem::MaybeUninit;
/// use tl_tensor::kernels::swiglu::swiglu;
/// let mut out = [MaybeUninit::uninit(); 2];
/// let y = swiglu(&[0.0_f64, 2.0], &[5.0, 3.0], &mut out);
/// assert_eq!(y[0], 0.0); // silu(0) = 0
/// assert_eq!(y[1], 2.0 * (1.0 / (1.0 + (-2.0_f64).exp())) * 3.0);
/// ```
pub fn swiglu<'a, E: Element>(gate: &[E], up: &[E], out: &'a mut [MaybeUninit<E>]) -> &'a mut [E] {
    check(gate.len(), up.len(), out.len(), "swiglu");
    let y = logistic_into(gate, out);
    for ((y, &g), &u) in y.iter_mut().zip(gate).zip(up) {
        *y = g * *y * u;
    }
    y
}

/// The gate's VJP: with `ȳ` the values of `grads` on entry, overwrites `grads` with `ḡ`,
/// writes `ū` into `up_grads` and returns it initialised. The portable version of
/// [`Element::swiglu_grads`].
///
/// # Panics
/// If the four differ in length.
///
/// ```
/// use std::mem::MaybeUninit;
/// use tl_tensor::kernels::swiglu::swiglu_grads;
/// let mut grads = [1.0_f64];
/// let mut up_grads = [MaybeUninit::uninit()];
/// let du = swiglu_grads(&mut grads, &[0.0], &[5.0], &mut up_grads);
/// assert_eq!(du[0], 0.0); // silu(0)
/// assert_eq!(grads[0], 5.0 * 0.5); // u·σ(0)·(1 + 0)
/// ```
pub fn swiglu_grads<'a, E: Element>(
    grads: &mut [E],
    gate: &[E],
    up: &[E],
    up_grads: &'a mut [MaybeUninit<E>],
) -> &'a mut [E] {
    check(gate.len(), up.len(), up_grads.len(), "swiglu_grads");
    check(gate.len(), grads.len(), up_grads.len(), "swiglu_grads");
    // σ(g) goes into ū's chunk first, then ū and ḡ are computed from it.
    let dus = logistic_into(gate, up_grads);
    for (((dg, du), &g), &u) in grads.iter_mut().zip(dus.iter_mut()).zip(gate).zip(up) {
        let (s, y) = (*du, *dg);
        *du = y * g * s;
        *dg = y * u * s * (E::one() + g * (E::one() - s));
    }
    dus
}

/// [`swiglu`] for `f32`, on AVX-512F when the CPU has it.
pub(crate) fn swiglu_f32<'a>(
    gate: &[f32],
    up: &[f32],
    out: &'a mut [MaybeUninit<f32>],
) -> &'a mut [f32] {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        check(gate.len(), up.len(), out.len(), "swiglu");
        // SAFETY: the CPU supports AVX-512F, checked just above; the lengths agree.
        unsafe { avx512::swiglu(gate, up, out) };
        // SAFETY: `avx512::swiglu` wrote every element of `out` (its contract).
        return unsafe { out.assume_init_mut() };
    }
    swiglu(gate, up, out)
}

/// [`swiglu_grads`] for `f32`, on AVX-512F when the CPU has it.
pub(crate) fn swiglu_grads_f32<'a>(
    grads: &mut [f32],
    gate: &[f32],
    up: &[f32],
    up_grads: &'a mut [MaybeUninit<f32>],
) -> &'a mut [f32] {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        check(gate.len(), up.len(), up_grads.len(), "swiglu_grads");
        check(gate.len(), grads.len(), up_grads.len(), "swiglu_grads");
        // SAFETY: the CPU supports AVX-512F, checked just above; the lengths agree.
        unsafe { avx512::swiglu_grads(grads, gate, up, up_grads) };
        // SAFETY: `avx512::swiglu_grads` wrote every element of `up_grads` (its contract).
        return unsafe { up_grads.assume_init_mut() };
    }
    swiglu_grads(grads, gate, up, up_grads)
}

/// Panics unless the three lengths agree.
fn check(a: usize, b: usize, c: usize, name: &str) {
    assert!(
        a == b && b == c,
        "{name}: operands of {a}, {b} and {c} elements"
    );
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        __m512, _mm512_add_ps, _mm512_castps_si512, _mm512_castsi512_ps, _mm512_div_ps,
        _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_mul_ps, _mm512_set1_epi32,
        _mm512_set1_ps, _mm512_sub_ps, _mm512_xor_si512,
    };
    use std::mem::MaybeUninit;

    use crate::kernels::exp::exp16;

    /// σ(g) of sixteen values: `1 / (1 + e^(−g))`, the negation a flip of the sign bit.
    #[target_feature(enable = "avx512f")]
    fn logistic(g: __m512) -> __m512 {
        let sign = _mm512_set1_epi32(i32::MIN);
        let negated = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign));
        let one = _mm512_set1_ps(1.0);
        _mm512_div_ps(one, _mm512_add_ps(one, exp16(negated)))
    }

    /// The mask of the chunk of sixteen that starts at `start` in `len` values: every lane,
    /// but in a last, partial chunk only those of its values.
    fn mask(len: usize, start: usize) -> u16 {
        match len - start {
            rest if rest >= 16 => u16::MAX,
            rest => (1u16 << rest) - 1,
        }
    }

    /// [`super::swiglu`] in sixteen lanes, the last chunk masked.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, and the three slices be as long. On return every
    /// element of `out` is written.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn swiglu(gate: &[f32], up: &[f32], out: &mut [MaybeUninit<f32>]) {
        for start in (0..gate.len()).step_by(16) {
            let mask = mask(gate.len(), start);
            // SAFETY: the mask covers values within the slices only (they are as long);
            // masked-off lanes touch nothing.
            unsafe {
                let g = _mm512_maskz_loadu_ps(mask, gate.as_ptr().add(start));
                let u = _mm512_maskz_loadu_ps(mask, up.as_ptr().add(start));
                let y = _mm512_mul_ps(_mm512_mul_ps(g, logistic(g)), u);
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(start).cast(), mask, y);
            }
        }
    }

    /// [`super::swiglu_grads`] in sixteen lanes, the last chunk masked.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, and the four slices be as long. On return every
    /// element of `up_grads` is written.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn swiglu_grads(
        grads: &mut [f32],
        gate: &[f32],
        up: &[f32],
        up_grads: &mut [MaybeUninit<f32>],
    ) {
        let one = _mm512_set1_ps(1.0);
        for start in (0..gate.len()).step_by(16) {
            let mask = mask(gate.len(), start);
            // SAFETY: as in `swiglu`.
            unsafe {
                let g = _mm512_maskz_loadu_ps(mask, gate.as_ptr().add(start));
                let u = _mm512_maskz_loadu_ps(mask, up.as_ptr().add(start));
                let y = _mm512_maskz_loadu_ps(mask, grads.as_ptr().add(start));
                let s = logistic(g);
                let du = _mm512_mul_ps(_mm512_mul_ps(y, g), s);
                let slope = _mm512_add_ps(one, _mm512_mul_ps(g, _mm512_sub_ps(one, s)));
                let dg = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(y, u), s), slope);
                _mm512_mask_storeu_ps(up_grads.as_mut_ptr().add(start).cast(), mask, du);
                _mm512_mask_storeu_ps(grads.as_mut_ptr().add(start), mask, dg);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values::{SPECIALS, bits, uniform};

    /// Rows of every length up to 40 (every tail of sixteen lanes), values random but for
    /// specials every few: NaN, ±∞, ±0, subnormals; and gates far out on both sides, where
    /// e^(−g) overflows or σ rounds to 1.
    fn rows() -> impl Iterator<Item = [Vec<f32>; 3]> {
        let mut next = uniform(38);
        let mut cases = Vec::new();
        for len in 0..=40 {
            for special_every in [0, 3, 5] {
                let mut row = |scale: f32| -> Vec<f32> {
                    (0..len)
                        .map(|j| match special_every {
                            n if n > 0 && j % n == 0 => SPECIALS[(j / n + len) % SPECIALS.len()],
                            _ if j % 11 == 10 => (next() - 0.5) * 400.0,
                            _ => (next() - 0.5) * scale,
                        })
                        .collect()
                };
                cases.push([row(20.0), row(8.0), row(2.0)]);
            }
        }
        cases.into_iter()
    }

    #[test]
    fn the_portable_loops_follow_the_formulas_bit_for_bit() {
        let logistic = |g: f32| 1.0 / (1.0 + crate::kernels::exp::exp(-g));
        for [gate, up, grads] in rows() {
            let mut out = vec![MaybeUninit::uninit(); gate.len()];
            let y = swiglu(&gate, &up, &mut out);
            let expected: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(&g, &u)| g * logistic(g) * u)
                .collect();
            assert_eq!(bits(y), bits(&expected), "swiglu of {gate:?}, {up:?}");

            let mut dg = grads.clone();
            let mut out = vec![MaybeUninit::uninit(); gate.len()];
            let du = swiglu_grads(&mut dg, &gate, &up, &mut out);
            let terms = || gate.iter().zip(&up).zip(&grads);
            let expected_du: Vec<f32> = terms().map(|((&g, _), &y)| y * g * logistic(g)).collect();
            let expected_dg: Vec<f32> = terms()
                .map(|((&g, &u), &y)| {
                    let s = logistic(g);
                    y * u * s * (1.0 + g * (1.0 - s))
                })
                .collect();
            assert_eq!(bits(du), bits(&expected_du), "ū of {gate:?}");
            assert_eq!(bits(&dg), bits(&expected_dg), "ḡ of {gate:?}");
        }
    }

    #[test]
    fn the_avx512_loops_are_the_portable_ones_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            for [gate, up, grads] in rows() {
                let mut fast = vec![MaybeUninit::uninit(); gate.len()];
                let mut portable = vec![MaybeUninit::uninit(); gate.len()];
                assert_eq!(
                    bits(swiglu_f32(&gate, &up, &mut fast)),
                    bits(swiglu(&gate, &up, &mut portable)),
                    "swiglu of {gate:?}, {up:?}"
                );
                let (mut dg_fast, mut dg_portable) = (grads.clone(), grads.clone());
                let mut fast = vec![MaybeUninit::uninit(); gate.len()];
                let mut portable = vec![MaybeUninit::uninit(); gate.len()];
                assert_eq!(
                    bits(swiglu_grads_f32(&mut dg_fast, &gate, &up, &mut fast)),
                    bits(swiglu_grads(&mut dg_portable, &gate, &up, &mut portable)),
                    "ū of {gate:?}, {up:?}, {grads:?}"
                );
                assert_eq!(bits(&dg_fast), bits(&dg_portable), "ḡ of {gate:?}");
            }
            return;
        }
        eprintln!("this CPU has no AVX-512F: its SwiGLU loops are not tested here");
    }

    #[test]
    fn a_very_negative_gate_gives_zero_not_nan() {
        for row in [vec![-200.0_f32; 17], vec![-1e30; 3]] {
            let mut out = vec![MaybeUninit::uninit(); row.len()];
            let y = swiglu_f32(&row, &vec![1.0; row.len()], &mut out);
            assert!(y.iter().all(|&y| y == 0.0), "{y:?}");
        }
    }

    #[test]
    #[should_panic(expected = "swiglu: operands of 3, 2 and 3 elements")]
    fn operands_of_different_lengths_are_refused() {
        let mut out = [MaybeUninit::uninit(); 3];
        swiglu_f32(&[1.0; 3], &[1.0; 2], &mut out);
    }
}
