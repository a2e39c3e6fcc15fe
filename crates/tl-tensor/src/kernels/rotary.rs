//! The inner loop of a rotary position embedding: every pair `(x[2i], x[2i+1])` of a row
//! of heads turned by its angle `θ_i`,
//!
//! ```text
//! y[2i]     = x[2i]·cos θ − x[2i+1]·sin θ
//! y[2i + 1] = x[2i]·sin θ + x[2i+1]·cos θ
//! ```
//!
//! Written pair by pair, the loop reads its values two apart and its tables one apart, which
//! a vector unit can only do with shuffles. With *pair tables* — `cos` repeated,
//! `c = [cos θ_0, cos θ_0, cos θ_1, cos θ_1, ..]`, and `sin` signed, `s = [−sin θ_0,
//! sin θ_0, ..]` — every element is `y[j] = x[j]·c[j] + x[j ^ 1]·s[j]`: one pass in which
//! each lane reads its own table entries and its neighbour's value, which AVX-512 swaps in
//! one instruction.
//!
//! **The bits are the formula's.** `x[2i+1]·(−sin θ)` is exactly `−(x[2i+1]·sin θ)`, and
//! `a + (−b)` is exactly `a − b`; `y[2i+1]`'s two products are added in the other order, and
//! a sum of two terms does not depend on it. Each product is rounded, then the sum, as the
//! formula is written: no fused multiply-add. The inverse rotation (by `−θ`, a rotary
//! embedding's VJP) is the same loop with `s` negated.

use std::mem::MaybeUninit;

use super::written::{write_each, write_rows};
use crate::Element;

/// Pair tables for the angles `angles` (of `f64`, rounded once to `E`): `(c, s)` of twice
/// the length, `c[2i] = c[2i+1] = cos θ_i`, `s[2i] = −sin θ_i`, `s[2i+1] = sin θ_i`; with
/// `inverse`, the tables of `−θ_i` (`s` negated).
///
/// ```
/// use tl_tensor::kernels::rotary::pair_tables;
/// let (c, s) = pair_tables::<f64>(&[0.0, std::f64::consts::FRAC_PI_2], false);
/// assert_eq!(c[..2], [1.0, 1.0]);
/// assert_eq!(s[2..], [-1.0, 1.0]);
/// ```
pub fn pair_tables<E: Element>(angles: &[f64], inverse: bool) -> (Vec<E>, Vec<E>) {
    let cos = angles.iter().flat_map(|a| [E::from_f64(a.cos()); 2]);
    let sin = angles.iter().flat_map(|a| {
        let sin = E::from_f64(a.sin());
        if inverse { [sin, -sin] } else { [-sin, sin] }
    });
    (cos.collect(), sin.collect())
}

/// Writes into `out` every head of `src` (a row of heads side by side, each as long as the
/// tables) with each pair turned by the angle of the pair tables `cos`, `sin` (see
/// [`pair_tables`]): `out[j] = src[j]·cos[j] + src[j ^ 1]·sin[j]`, indices within a head.
/// Returns `out`, initialised. The portable version of [`Element::rotate_pairs`].
///
/// # Panics
/// If the tables differ in length or are of odd length, or if `src` and `out` differ in
/// length or are not a whole number of heads.
///
/// ```
/// use std::mem::MaybeUninit;
/// use tl_tensor::kernels::rotary::{pair_tables, rotate_pairs};
/// let (c, s) = pair_tables::<f64>(&[std::f64::consts::FRAC_PI_2], false);
/// let mut out = [MaybeUninit::uninit(); 4];
/// // Two heads of one pair each, both turned a quarter: (1, 0) → (0, 1).
/// let y = rotate_pairs(&[1.0, 0.0, 0.0, 2.0], &mut out, &c, &s);
/// assert!((y[0] - 0.0).abs() < 1e-16 && y[1] == 1.0 && y[2] == -2.0);
/// ```
pub fn rotate_pairs<'a, E: Element>(
    src: &[E],
    out: &'a mut [MaybeUninit<E>],
    cos: &[E],
    sin: &[E],
) -> &'a mut [E] {
    let head = check(src, out, cos, sin);
    write_rows(out, head, |h, out| {
        let src = &src[h * head..(h + 1) * head];
        write_rows(out, 2, |i, pair| {
            let (x0, x1) = (src[2 * i], src[2 * i + 1]);
            let (c, s) = (&cos[2 * i..2 * i + 2], &sin[2 * i..2 * i + 2]);
            write_each(pair, [x0 * c[0] + x1 * s[0], x1 * c[1] + x0 * s[1]])
        })
    })
}

/// [`rotate_pairs`] for `f32`, on AVX-512F when the CPU has it.
pub(crate) fn rotate_pairs_f32<'a>(
    src: &[f32],
    out: &'a mut [MaybeUninit<f32>],
    cos: &[f32],
    sin: &[f32],
) -> &'a mut [f32] {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        let head = check(src, out, cos, sin);
        if head > 0 {
            // SAFETY: the CPU supports AVX-512F, checked just above; `check` vouches for the
            // lengths.
            unsafe { avx512::rotate_pairs(src, out, cos, sin) };
        }
        // SAFETY: `avx512::rotate_pairs` wrote every element of every head (its contract),
        // and `check` made sure the heads tile `out` (an empty `out` has nothing to write).
        return unsafe { out.assume_init_mut() };
    }
    rotate_pairs(src, out, cos, sin)
}

/// Checks the lengths of [`rotate_pairs`]'s arguments; returns the head size.
fn check<E>(src: &[E], out: &[MaybeUninit<E>], cos: &[E], sin: &[E]) -> usize {
    let head = cos.len();
    let whole = if head == 0 {
        src.is_empty()
    } else {
        src.len().is_multiple_of(head)
    };
    assert!(
        sin.len() == head && head.is_multiple_of(2) && src.len() == out.len() && whole,
        "rotate_pairs: tables of {} and {}, a row of {} into {}",
        head,
        sin.len(),
        src.len(),
        out.len()
    );
    head
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        __m512, _mm512_add_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_mul_ps,
        _mm512_permute_ps,
    };
    use std::mem::MaybeUninit;

    /// [`super::rotate_pairs`] in sixteen lanes, head by head, a head's last chunk masked.
    /// A pair never straddles two chunks (a head and a chunk both start at an even index),
    /// so `vpermilps` swapping the neighbours of each pair within a chunk gives `x[j ^ 1]`.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `cos` and `sin` of one even, positive length that
    /// divides `src`'s, and `out` as long as `src`. On return every element of `out` is
    /// written.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rotate_pairs(
        src: &[f32],
        out: &mut [MaybeUninit<f32>],
        cos: &[f32],
        sin: &[f32],
    ) {
        let head = cos.len();
        for (src, out) in src.chunks_exact(head).zip(out.chunks_exact_mut(head)) {
            for start in (0..head).step_by(16) {
                let mask = if head - start >= 16 {
                    u16::MAX
                } else {
                    (1u16 << (head - start)) - 1
                };
                // SAFETY: the mask covers elements `start..min(start + 16, head)` of the head,
                // inside `src`, `cos`, `sin` and `out`; masked-off lanes touch no memory.
                unsafe {
                    let load = |xs: &[f32]| _mm512_maskz_loadu_ps(mask, xs[start..].as_ptr());
                    let x: __m512 = load(src);
                    let swapped = _mm512_permute_ps::<0b10_11_00_01>(x);
                    let y = _mm512_add_ps(
                        _mm512_mul_ps(x, load(cos)),
                        _mm512_mul_ps(swapped, load(sin)),
                    );
                    _mm512_mask_storeu_ps(out[start..].as_mut_ptr().cast(), mask, y);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values::{SPECIALS, bits, uniform};

    /// The rotation pair by pair, as the module documentation writes it, with `sin θ`
    /// negated for the inverse.
    fn by_the_formula(src: &[f32], angles: &[f64], inverse: bool) -> Vec<f32> {
        let head = 2 * angles.len();
        let mut out = vec![0.0; src.len()];
        for (src, out) in src.chunks_exact(head).zip(out.chunks_exact_mut(head)) {
            for (i, angle) in angles.iter().enumerate() {
                let (c, s) = (angle.cos() as f32, angle.sin() as f32);
                let s = if inverse { -s } else { s };
                let (x1, x2) = (src[2 * i], src[2 * i + 1]);
                out[2 * i] = x1 * c - x2 * s;
                out[2 * i + 1] = x1 * s + x2 * c;
            }
        }
        out
    }

    /// Rows of 1 to 3 heads of every even size up to 40 (every tail of sixteen lanes), values
    /// random but for specials every few: NaN, ±∞, ±0, subnormals, the largest finite.
    fn rows() -> impl Iterator<Item = (Vec<f32>, Vec<f64>)> {
        let mut next = uniform(99);
        let mut cases = Vec::new();
        for head in (2..=40).step_by(2) {
            for heads in 1..=3 {
                for special_every in [0, 5] {
                    let angles: Vec<f64> =
                        (0..head / 2).map(|_| f64::from(next()) * 1000.0).collect();
                    let row = (0..head * heads)
                        .map(|j| match special_every {
                            n if n > 0 && j % n == 0 => SPECIALS[j / n % SPECIALS.len()],
                            _ if j % 13 == 12 => f32::MAX,
                            _ => next() * 20.0 - 10.0,
                        })
                        .collect();
                    cases.push((row, angles));
                }
            }
        }
        cases.into_iter()
    }

    #[test]
    fn the_pair_tables_give_the_formula_bit_for_bit() {
        for (row, angles) in rows() {
            for inverse in [false, true] {
                let (cos, sin) = pair_tables::<f32>(&angles, inverse);
                let mut out = vec![MaybeUninit::uninit(); row.len()];
                let y = rotate_pairs(&row, &mut out, &cos, &sin);
                let expected = by_the_formula(&row, &angles, inverse);
                assert_eq!(bits(y), bits(&expected), "{row:?} by {angles:?}");
            }
        }
    }

    #[test]
    fn the_avx512_loop_is_the_portable_one_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            for (row, angles) in rows() {
                for inverse in [false, true] {
                    let (cos, sin) = pair_tables::<f32>(&angles, inverse);
                    let mut out = vec![MaybeUninit::uninit(); row.len()];
                    let fast = bits(rotate_pairs_f32(&row, &mut out, &cos, &sin));
                    let mut out = vec![MaybeUninit::uninit(); row.len()];
                    let portable = bits(rotate_pairs(&row, &mut out, &cos, &sin));
                    assert_eq!(fast, portable, "{row:?} by {angles:?}");
                }
            }
            return;
        }
        eprintln!("this CPU has no AVX-512F: its rotation is not tested here");
    }

    #[test]
    fn the_inverse_undoes_the_rotation_to_rounding() {
        let angles = [0.3, 2.0, -1.0];
        let row = [1.0_f64, -2.0, 0.5, 4.0, 3.0, 0.25];
        let (cos, sin) = pair_tables::<f64>(&angles, false);
        let (cos_back, sin_back) = pair_tables::<f64>(&angles, true);
        let mut out = [MaybeUninit::uninit(); 6];
        let turned = rotate_pairs(&row, &mut out, &cos, &sin).to_vec();
        let mut out = [MaybeUninit::uninit(); 6];
        let back = rotate_pairs(&turned, &mut out, &cos_back, &sin_back);
        for (b, x) in back.iter().zip(row) {
            assert!((b - x).abs() < 1e-15, "{back:?} against {row:?}");
        }
    }

    #[test]
    fn heads_of_nothing_rotate_to_nothing() {
        let out = rotate_pairs_f32(&[], &mut [], &[], &[]);
        assert!(out.is_empty());
        assert!(rotate_pairs::<f64>(&[], &mut [], &[], &[]).is_empty());
    }

    #[test]
    #[should_panic(expected = "rotate_pairs: tables of 4 and 4, a row of 6 into 6")]
    fn a_row_is_a_whole_number_of_heads() {
        let (cos, sin) = pair_tables::<f32>(&[0.0, 1.0], false);
        rotate_pairs_f32(&[0.0; 6], &mut [MaybeUninit::uninit(); 6], &cos, &sin);
    }
}
