//! The passes a training step makes over every gradient value before it updates, each
//! vectorised: [`all_finite`] (no infinity, no NaN) and its forms on the rayon pool,
//! [`all_finite_on_pool`] and [`array_all_finite`], and [`sum_squares`] (the square of the
//! norm that clipping measures), on the pool.
//!
//! The step runs them over all ten million of the capstone's gradients at its end, where
//! nothing else is left to run beside them: one thread walking them alone would leave the
//! others waiting (on two cores, about 2% of an fp32 capstone step).

use ndarray::ArrayD;
use rayon::prelude::*;

use crate::Element;

/// Independent lanes of a pass: enough for the compiler to fill a vector register, and for
/// a sum, enough that no addition waits on the one before it.
const LANES: usize = 16;

/// Values per rayon task: 256 KiB of `f32`, so that handing a chunk to the pool costs
/// little. Fixed, so that a sum splits the same way on any number of threads.
const CHUNK: usize = 1 << 16;

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

/// [`all_finite`] on the current rayon pool, a chunk of values per task.
///
/// ```
/// use tl_tensor::kernels::finite::all_finite_on_pool;
/// let mut values = vec![1.0f32; 200_000];
/// assert!(all_finite_on_pool(&values));
/// values[199_999] = f32::NAN;
/// assert!(!all_finite_on_pool(&values));
/// ```
pub fn all_finite_on_pool<E: Element>(values: &[E]) -> bool {
    values.par_chunks(CHUNK).all(all_finite)
}

/// Whether every value of `array` is finite: [`all_finite_on_pool`] over its memory when
/// that is one slice (any order of the axes), else one value at a time.
///
/// ```
/// use tl_tensor::kernels::finite::array_all_finite;
/// use tl_tensor::ndarray::arr2;
/// let x = arr2(&[[1.0f32, 2.0], [f32::NAN, 4.0]]);
/// assert!(!array_all_finite(&x.clone().into_dyn()));
/// // Transposed in place: not in standard order, still one slice of memory.
/// assert!(!array_all_finite(&x.clone().reversed_axes().into_dyn()));
/// assert!(array_all_finite(&x.column(1).to_owned().into_dyn()));
/// ```
pub fn array_all_finite<E: Element>(array: &ArrayD<E>) -> bool {
    match array.as_slice_memory_order() {
        Some(values) => all_finite_on_pool(values),
        None => array.iter().all(|v| v.is_finite()),
    }
}

/// `Σ x²` over `values`, each square and sum in `f64`, on the current rayon pool.
///
/// The order of the additions is a function of the length alone: chunks of 65,536 values,
/// each summed in 16 interleaved lanes (value `i` of a chunk into lane `i mod 16`, the
/// lanes then added in order, then the chunk's last `len mod 16` values one by one), and
/// the chunks' sums added in order. So the result has the same bits on any number of
/// threads. An `f32`'s square is exact in `f64`, and no sum of them can overflow it; a
/// non-finite value gives a non-finite sum.
///
/// ```
/// use tl_tensor::kernels::finite::sum_squares;
/// assert_eq!(sum_squares(&[3.0f32, 4.0]), 25.0);
/// assert_eq!(sum_squares::<f32>(&[]), 0.0);
/// assert!(sum_squares(&[1.0f32, f32::INFINITY]).is_infinite());
/// ```
pub fn sum_squares<E: Element>(values: &[E]) -> f64 {
    let chunks: Vec<f64> = values.par_chunks(CHUNK).map(chunk_sum_squares).collect();
    chunks.into_iter().fold(0.0, |sum, chunk| sum + chunk)
}

/// One chunk's sum of squares, in the order [`sum_squares`] documents.
fn chunk_sum_squares<E: Element>(values: &[E]) -> f64 {
    let mut lanes = [0.0f64; LANES];
    let chunks = values.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            let v = v.to_f64();
            *lane += v * v;
        }
    }
    let lanes = lanes.into_iter().fold(0.0, |sum, lane| sum + lane);
    rest.iter()
        .fold(lanes, |sum, &v| sum + v.to_f64() * v.to_f64())
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

    /// The order [`sum_squares`] documents, written out one addition at a time.
    fn sum_squares_by_definition(values: &[f32]) -> f64 {
        let mut total = 0.0;
        for chunk in values.chunks(CHUNK) {
            let whole = chunk.len() / LANES * LANES;
            let mut lanes = [0.0f64; LANES];
            for (i, &v) in chunk[..whole].iter().enumerate() {
                lanes[i % LANES] += f64::from(v) * f64::from(v);
            }
            let mut sum = 0.0;
            for lane in lanes {
                sum += lane;
            }
            for &v in &chunk[whole..] {
                sum += f64::from(v) * f64::from(v);
            }
            total += sum;
        }
        total
    }

    #[test]
    fn sums_of_squares_add_in_the_documented_order_on_any_pool() {
        // Values of very different sizes, so that another order of the additions would
        // round differently; lengths around a lane, a chunk and several chunks.
        let rng = crate::Generator::new(7);
        let values: Vec<f32> = (0..3 * CHUNK + 37)
            .map(|i| (rng.next_f64() as f32 - 0.5) * [1.0, 1e-4, 1e4][i % 3])
            .collect();
        for len in [
            0,
            1,
            15,
            16,
            17,
            1000,
            CHUNK - 1,
            CHUNK,
            CHUNK + 1,
            values.len(),
        ] {
            let values = &values[..len];
            let expected = sum_squares_by_definition(values);
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let sum = pool.install(|| sum_squares(values));
                assert_eq!(
                    sum.to_bits(),
                    expected.to_bits(),
                    "{len} values on {threads}"
                );
            }
        }
        // One value in the serial order differs: the test can tell orders apart.
        let serial: f64 = values.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        assert_ne!(serial.to_bits(), sum_squares(&values).to_bits());
    }

    #[test]
    fn a_bad_value_in_any_chunk_is_found_on_the_pool() {
        let values = vec![0.5f32; 2 * CHUNK + 5];
        assert!(all_finite_on_pool(&values));
        for at in [0, CHUNK - 1, CHUNK, 2 * CHUNK + 4] {
            for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                let mut values = values.clone();
                values[at] = bad;
                assert!(!all_finite_on_pool(&values), "{at} {bad}");
                assert!(!sum_squares(&values).is_finite(), "{at} {bad}");
            }
        }
    }
}
