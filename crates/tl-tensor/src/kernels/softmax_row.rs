//! The passes of a softmax over one row of scores, `p_j = e^(scale·s_j − m) / Σ_k e^(scale·s_k − m)`
//! with `m` the row's largest `scale·s`: what a fused attention does for every query row.
//!
//! Written as separate loops, a row costs five passes: the maximum, the shift, the
//! exponentials, their sum, the normalisation. The baseline x86-64 build compiles the
//! maximum to four lanes with a NaN test per step, and it took longer than the exponentials
//! themselves in a profile of the attention's forward pass. Here the maximum is one pass and
//! the shift, the exponentials and their sum another (with the normalisation folded in when
//! the sum is already known, as in the backward pass's recomputation):
//!
//! - [`scaled_max`]: the largest `scale·x` of a row;
//! - [`scaled_exp`]: `x ← e^(scale·x − shift)`, optionally then `x ← x·factor`, returning
//!   the sum of the exponentials in the order of [`lane_sum`];
//! - [`scaled_grad`], the backward pass's row: `dp ← scale·p·(dp − Σ_j dp_j·p_j)`, the
//!   gradient of the scores from that of the probabilities, the sum in [`lane_dot`]'s order.
//!
//! Each has a portable version, generic over the element type, and for `f32` a sixteen-lane
//! AVX-512 version chosen at run time ([`Element::scaled_max`], [`Element::scaled_exp`],
//! [`Element::scaled_grad`]).
//! **Both give the same bits**: every value is computed by the same operations in the same
//! order (the exponential is [`exp`](super::exp::exp)'s, the sum keeps
//! [`lane_sum`]'s eight partial sums), and a maximum is exact in any order. The one freedom
//! is the sign of a zero maximum, which changes no probability: `x − 0` and `x − (−0)` are
//! the same number but for `x = ±0`, whose exponential is 1 either way.

use super::rows::{lane_dot, lane_sum};
use crate::Element;

/// The largest `scale·x` over `xs`, NaNs ignored (as `max` ignores them); −∞ for an empty
/// row or one of NaNs only. The portable version of [`Element::scaled_max`].
///
/// ```
/// use tl_tensor::kernels::softmax_row::scaled_max;
/// assert_eq!(scaled_max(&[1.0_f64, f64::NAN, 3.0], 0.5), 1.5);
/// assert_eq!(scaled_max::<f32>(&[], 2.0), f32::NEG_INFINITY);
/// ```
pub fn scaled_max<E: Element>(xs: &[E], scale: E) -> E {
    xs.iter().fold(E::neg_infinity(), |m, &x| m.max(x * scale))
}

/// Replaces every `x` of `xs` by `e^(scale·x − shift)`, then, with a `factor`, by that times
/// `factor`; returns the sum of the exponentials (before the factor) in the order of
/// [`lane_sum`]. The portable version of [`Element::scaled_exp`].
///
/// ```
/// use tl_tensor::kernels::softmax_row::scaled_exp;
/// let mut row = [0.0_f64, 2.0];
/// let sum = scaled_exp(&mut row, 0.5, 1.0, Some(2.0));
/// assert_eq!(sum, (-1.0_f64).exp() + 1.0);
/// assert_eq!(row, [2.0 * (-1.0_f64).exp(), 2.0]);
/// ```
pub fn scaled_exp<E: Element>(xs: &mut [E], scale: E, shift: E, factor: Option<E>) -> E {
    for x in xs.iter_mut() {
        *x = *x * scale - shift;
    }
    E::exp_in_place(xs);
    let sum = lane_sum(xs);
    if let Some(factor) = factor {
        for x in xs.iter_mut() {
            *x *= factor;
        }
    }
    sum
}

/// Replaces every `dp` of `grads` by `scale·p·(dp − dot)`, with `p` the matching value of
/// `probs` and `dot = Σ_j dp_j·p_j` in the order of [`lane_dot`]: a softmax row's VJP (with
/// the scores' scale). The portable version of [`Element::scaled_grad`].
///
/// # Panics
/// If the rows differ in length.
///
/// ```
/// use tl_tensor::kernels::softmax_row::scaled_grad;
/// let mut grads = [1.0_f64, 3.0];
/// scaled_grad(&mut grads, &[0.25, 0.75], 2.0); // dot = 2.5
/// assert_eq!(grads, [2.0 * 0.25 * -1.5, 2.0 * 0.75 * 0.5]);
/// ```
pub fn scaled_grad<E: Element>(grads: &mut [E], probs: &[E], scale: E) {
    let dot = lane_dot(grads, probs);
    for (d, &p) in grads.iter_mut().zip(probs) {
        *d = scale * p * (*d - dot);
    }
}

/// [`scaled_max`] for `f32`, on AVX-512F when the CPU has it.
pub(crate) fn scaled_max_f32(xs: &[f32], scale: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F, checked just above.
        return unsafe { avx512::scaled_max(xs, scale) };
    }
    scaled_max(xs, scale)
}

/// [`scaled_exp`] for `f32`, on AVX-512F when the CPU has it.
pub(crate) fn scaled_exp_f32(xs: &mut [f32], scale: f32, shift: f32, factor: Option<f32>) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F, checked just above.
        return unsafe { avx512::scaled_exp(xs, scale, shift, factor) };
    }
    scaled_exp(xs, scale, shift, factor)
}

/// [`scaled_grad`] for `f32`, on AVX-512F when the CPU has it.
pub(crate) fn scaled_grad_f32(grads: &mut [f32], probs: &[f32], scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        assert_eq!(grads.len(), probs.len(), "lane_dot: lengths differ");
        // SAFETY: the CPU supports AVX-512F, checked just above; the rows are as long.
        return unsafe { avx512::scaled_grad(grads, probs, scale) };
    }
    scaled_grad(grads, probs, scale)
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        __m256, __m512, _mm256_add_ps, _mm256_castpd_ps, _mm256_setzero_ps, _mm256_storeu_ps,
        _mm512_castps_pd, _mm512_castps512_ps256, _mm512_extractf64x4_pd, _mm512_loadu_ps,
        _mm512_mask_loadu_ps, _mm512_mask_max_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps,
        _mm512_max_ps, _mm512_mul_ps, _mm512_reduce_max_ps, _mm512_set1_ps, _mm512_storeu_ps,
        _mm512_sub_ps,
    };

    use crate::kernels::exp::exp16;

    /// [`super::scaled_max`] in sixteen lanes: `vmaxps` returns its second operand when
    /// either is NaN, so `max(v, m)` keeps the running maximum past a NaN, as `f32::max` does.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scaled_max(xs: &[f32], scale: f32) -> f32 {
        let scale = _mm512_set1_ps(scale);
        let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut chunks = xs.chunks_exact(16);
        for chunk in &mut chunks {
            // SAFETY: the chunk holds 16 values.
            let v = _mm512_mul_ps(unsafe { _mm512_loadu_ps(chunk.as_ptr()) }, scale);
            max = _mm512_max_ps(v, max);
        }
        let tail = chunks.remainder();
        if !tail.is_empty() {
            let mask = (1u16 << tail.len()) - 1;
            // SAFETY: the mask covers the tail's values only; masked-off lanes read nothing.
            let v = unsafe { _mm512_mask_loadu_ps(max, mask, tail.as_ptr()) };
            // Lanes past the tail keep the running maximum.
            max = _mm512_mask_max_ps(max, mask, _mm512_mul_ps(v, scale), max);
        }
        _mm512_reduce_max_ps(max)
    }

    /// Lanes 8 to 15 (AVX-512F alone has no 32-bit-lane extract of eight, so through f64).
    #[target_feature(enable = "avx512f")]
    fn high_half(x: __m512) -> __m256 {
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x)))
    }

    /// [`super::scaled_exp`] in sixteen lanes. The sum keeps [`lane_sum`]'s order: eight
    /// partial sums, the `j`-th value of each full group of eight going to sum `j` (a chunk
    /// of sixteen is two groups, added low half first), the partial sums then added in order,
    /// then the values past the last full group one by one.
    ///
    /// [`lane_sum`]: crate::kernels::rows::lane_sum
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scaled_exp(
        xs: &mut [f32],
        scale: f32,
        shift: f32,
        factor: Option<f32>,
    ) -> f32 {
        let (scale, shift) = (_mm512_set1_ps(scale), _mm512_set1_ps(shift));
        let factor = factor.map(|f| _mm512_set1_ps(f));
        let exponentials = |x: __m512| exp16(_mm512_sub_ps(_mm512_mul_ps(x, scale), shift));
        let scaled = |e: __m512| factor.map_or(e, |f| _mm512_mul_ps(e, f));
        let mut lanes: __m256 = _mm256_setzero_ps();
        let mut chunks = xs.chunks_exact_mut(16);
        for chunk in &mut chunks {
            // SAFETY: the chunk holds 16 values.
            let e = exponentials(unsafe { _mm512_loadu_ps(chunk.as_ptr()) });
            lanes = add_groups(lanes, e);
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(chunk.as_mut_ptr(), scaled(e)) };
        }
        let tail = chunks.into_remainder();
        let mut rest = [0.0_f32; 16];
        if !tail.is_empty() {
            let mask = (1u16 << tail.len()) - 1;
            // SAFETY: the mask covers the tail's values only; masked-off lanes touch nothing.
            let e = exponentials(unsafe { _mm512_maskz_loadu_ps(mask, tail.as_ptr()) });
            if tail.len() >= 8 {
                lanes = _mm256_add_ps(lanes, _mm512_castps512_ps256(e));
            }
            // SAFETY: `rest` holds 16 values; the tail's, as above.
            unsafe {
                _mm512_storeu_ps(rest.as_mut_ptr(), e);
                _mm512_mask_storeu_ps(tail.as_mut_ptr(), mask, scaled(e));
            }
        }
        finish_sum(lanes, &rest[tail.len() / 8 * 8..tail.len()])
    }

    /// The eight partial sums of [`lane_sum`]'s order plus one chunk of sixteen: its low
    /// group of eight, then its high group.
    ///
    /// [`lane_sum`]: crate::kernels::rows::lane_sum
    #[target_feature(enable = "avx512f")]
    fn add_groups(lanes: __m256, chunk: __m512) -> __m256 {
        _mm256_add_ps(
            _mm256_add_ps(lanes, _mm512_castps512_ps256(chunk)),
            high_half(chunk),
        )
    }

    /// The partial sums added in order, then `rest`'s values one by one.
    #[target_feature(enable = "avx512f")]
    fn finish_sum(lanes: __m256, rest: &[f32]) -> f32 {
        let mut partial = [0.0_f32; 8];
        // SAFETY: `partial` holds 8 values.
        unsafe { _mm256_storeu_ps(partial.as_mut_ptr(), lanes) };
        let sum = partial.iter().fold(0.0, |sum, &lane| sum + lane);
        rest.iter().fold(sum, |sum, &x| sum + x)
    }

    /// [`super::scaled_grad`] in sixteen lanes, its dot product in [`lane_dot`]'s order (as
    /// [`scaled_exp`]'s sum keeps [`lane_sum`]'s).
    ///
    /// [`lane_dot`]: crate::kernels::rows::lane_dot
    /// [`lane_sum`]: crate::kernels::rows::lane_sum
    ///
    /// # Safety
    /// The CPU must support AVX-512F, and the rows must be as long.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scaled_grad(grads: &mut [f32], probs: &[f32], scale: f32) {
        let full = grads.len() / 16 * 16;
        let tail = grads.len() - full;
        let mask = (1u16 << tail) - 1;
        // SAFETY (the loads and stores below): a full chunk holds 16 values of each row;
        // the mask covers the tail's values only, and masked-off lanes touch nothing.
        let load = |xs: &[f32], at: usize| unsafe { _mm512_loadu_ps(xs[at..].as_ptr()) };
        let load_tail = |xs: &[f32]| unsafe { _mm512_maskz_loadu_ps(mask, xs[full..].as_ptr()) };
        let mut lanes = _mm256_setzero_ps();
        for at in (0..full).step_by(16) {
            lanes = add_groups(lanes, _mm512_mul_ps(load(grads, at), load(probs, at)));
        }
        let mut rest = [0.0_f32; 16];
        if tail > 0 {
            let products = _mm512_mul_ps(load_tail(grads), load_tail(probs));
            if tail >= 8 {
                lanes = _mm256_add_ps(lanes, _mm512_castps512_ps256(products));
            }
            // SAFETY: `rest` holds 16 values.
            unsafe { _mm512_storeu_ps(rest.as_mut_ptr(), products) };
        }
        let dot = _mm512_set1_ps(finish_sum(lanes, &rest[tail / 8 * 8..tail]));
        let scale = _mm512_set1_ps(scale);
        let grad =
            |d: __m512, p: __m512| _mm512_mul_ps(_mm512_mul_ps(scale, p), _mm512_sub_ps(d, dot));
        for at in (0..full).step_by(16) {
            let y = grad(load(grads, at), load(probs, at));
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(grads[at..].as_mut_ptr(), y) };
        }
        if tail > 0 {
            let y = grad(load_tail(grads), load_tail(probs));
            // SAFETY: as above.
            unsafe { _mm512_mask_storeu_ps(grads[full..].as_mut_ptr(), mask, y) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values::{SPECIALS, bits, uniform};

    /// Rows of every length up to 70 (every tail after 8 and 16 lanes), with NaNs, infinities,
    /// signed zeros, subnormals and values whose exponentials overflow or vanish, scaled by
    /// positive, negative and zero factors: the AVX-512 passes against the portable ones, bit
    /// for bit (the maximum by value, as its zero's sign is free).
    #[test]
    fn the_avx512_passes_are_the_portable_ones_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            let specials: Vec<f32> = SPECIALS.iter().chain(&[120.0, -130.0]).copied().collect();
            let mut uniform = uniform(12_345);
            let mut next = || uniform() * 40.0 - 20.0;
            for len in 0..=70 {
                for special_every in [0, 3, 17] {
                    let row: Vec<f32> = (0..len)
                        .map(|i| match special_every {
                            0 => next(),
                            n if i % n == 0 => specials[(i / n) % specials.len()],
                            _ => next(),
                        })
                        .collect();
                    for scale in [0.176_776_7_f32, 1.0, -0.5, 0.0] {
                        // SAFETY: the CPU supports AVX-512F.
                        let fast_max = unsafe { avx512::scaled_max(&row, scale) };
                        let max = scaled_max(&row, scale);
                        assert!(
                            fast_max == max || (fast_max.is_nan() && max.is_nan()),
                            "max of {row:?} × {scale}: {fast_max} against {max}"
                        );
                        for factor in [None, Some(0.013_f32)] {
                            let (mut fast, mut portable) = (row.clone(), row.clone());
                            let shift = if max.is_finite() { max } else { 0.0 };
                            // SAFETY: as above.
                            let fast_sum =
                                unsafe { avx512::scaled_exp(&mut fast, scale, shift, factor) };
                            let sum = scaled_exp(&mut portable, scale, shift, factor);
                            assert_eq!(bits(&fast), bits(&portable), "{row:?} × {scale}");
                            assert_eq!(bits(&[fast_sum]), bits(&[sum]), "{row:?} × {scale}");
                        }
                    }
                }
            }
        } else {
            eprintln!("this CPU has no AVX-512F: its passes are not tested here");
        }
    }

    /// Rows of every length up to 70, gradients with specials every few values (NaN, ±∞,
    /// ±0, subnormals, large values), probabilities in [0, 1] with zeros: the AVX-512
    /// gradient against the portable one, bit for bit, and on whichever path this CPU takes
    /// against the formula with [`lane_dot`]'s sum.
    #[test]
    fn the_gradient_row_is_the_portable_one_bit_for_bit() {
        let specials: Vec<f32> = SPECIALS.iter().chain(&[3e38, -1e30]).copied().collect();
        let mut next = uniform(7);
        for len in 0..=70 {
            for special_every in [0, 4, 23] {
                let grads: Vec<f32> = (0..len)
                    .map(|i| match special_every {
                        n if n > 0 && i % n == 0 => specials[(i / n) % specials.len()],
                        _ => next() * 8.0 - 4.0,
                    })
                    .collect();
                let probs: Vec<f32> = (0..len)
                    .map(|i| if i % 9 == 4 { 0.0 } else { next() })
                    .collect();
                for scale in [0.176_776_7_f32, -2.0] {
                    let mut portable = grads.clone();
                    scaled_grad(&mut portable, &probs, scale);
                    let dot = lane_dot(&grads, &probs);
                    let formula: Vec<f32> = grads
                        .iter()
                        .zip(&probs)
                        .map(|(&d, &p)| scale * p * (d - dot))
                        .collect();
                    assert_eq!(bits(&portable), bits(&formula), "{grads:?}");
                    let mut dispatched = grads.clone();
                    scaled_grad_f32(&mut dispatched, &probs, scale);
                    assert_eq!(bits(&dispatched), bits(&portable), "{grads:?} by {probs:?}");
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("this CPU has no AVX-512F: the dispatched gradient was the portable one");
        }
    }

    /// On whichever path this CPU takes: the maximum is the portable one's, and the sum is
    /// [`lane_sum`]'s, which the test can tell apart from other orders (on some of these rows
    /// a plain left-to-right sum gives other bits).
    #[test]
    fn the_sum_keeps_the_order_of_eight_partial_sums() {
        let mut orders_differ = 0;
        for seed in 0..50_u32 {
            let mut row: Vec<f32> = (0..37_u32)
                .map(|i| ((i * 7919 + seed * 104_729) % 1601) as f32 / 100.0 - 8.0)
                .collect();
            let exponentials: Vec<f32> = row.iter().map(|&x| super::super::exp::exp(x)).collect();
            // The dispatched maximum is the portable one (a wrong maximum would cancel out of
            // the probabilities, so only a direct check sees it).
            let max = scaled_max_f32(&row, 1.5);
            assert_eq!(max, scaled_max(&row, 1.5), "seed {seed}");
            assert_eq!(max, row.iter().fold(f32::MIN, |m, &x| m.max(x)) * 1.5);
            let sum = scaled_exp_f32(&mut row, 1.0, 0.0, None);
            assert_eq!(
                sum.to_bits(),
                lane_sum(&exponentials).to_bits(),
                "seed {seed}"
            );
            let serial = exponentials.iter().fold(0.0_f32, |s, &e| s + e);
            orders_differ += usize::from(sum.to_bits() != serial.to_bits());
        }
        assert!(orders_differ > 0, "no row told the two orders apart");
    }
}
