//! [`all_finite`]: whether a slice holds no infinity and no NaN, in one vectorised pass.

use crate::Element;

/// Independent lanes of the check: enough for the compiler to fill a vector register.
const LANES: usize = 16;

/// Whether every value of `values` is finite.
///
/// `v · 0` is exactly ±0 for a finite `v` and NaN for an infinity or a NaN (IEEE 754 does
/// not let a compiler fold it to 0), and a NaN survives every addition, so the lanes' sums are all 0 exactly when every value is
/// finite. Unlike `iter().all(is_finite)`, nothing branches per value and the lanes do not
/// depend on each other, so the pass runs at memory speed: the check a mixed-precision step
/// makes over every gradient.
///
/// ```
/// use tl_tensor::kernels::finite::all_finite;
/// assert!(all_finite(&[1.0f32, -3.5, f32::MAX, 0.0]));
/// assert!(!all_finite(&[1.0f32, f32::INFINITY]));
/// assert!(!all_finite(&[f32::NAN; 40]));
/// assert!(all_finite::<f64>(&[]));
/// ```
pub fn all_finite<E: Element>(values: &[E]) -> bool {
    let mut lanes = [E::zero(); LANES];
    let chunks = values.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += v * E::zero();
        }
    }
    lanes.iter().all(|lane| *lane == E::zero()) && rest.iter().all(|v| v.is_finite())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_bad_value_anywhere_is_found() {
        for len in [0, 1, 15, 16, 17, 100] {
            let clean = vec![1.5f32; len];
            assert!(all_finite(&clean), "{len}");
            for at in 0..len {
                for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                    let mut values = clean.clone();
                    values[at] = bad;
                    assert!(!all_finite(&values), "{len} {at} {bad}");
                }
            }
        }
        // The largest finite values, whose product with 0 is still 0.
        assert!(all_finite(&[f32::MAX, f32::MIN, f32::MIN_POSITIVE, -0.0]));
        assert!(!all_finite(&[f64::MAX, f64::INFINITY, 0.0]));
    }
}
