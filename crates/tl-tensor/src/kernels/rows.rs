//! Row helpers shared by the kernels: copying a matrix whose rows are contiguous slices, and
//! sums of a row in a fixed order of independent partial sums.

use ndarray::{Array2, ArrayView2, ArrayViewMut2};

use crate::Element;

/// A copy of `x` as a contiguous matrix, a row at a time (nothing is written twice: the buffer
/// is not zeroed first). Fast when each row is a slice — a head's columns of a `[T, d]`
/// matrix — where ndarray's `as_standard_layout` walks a general element iterator.
///
/// ```
/// use tl_tensor::kernels::rows::contiguous;
/// use tl_tensor::ndarray::{Array2, s};
/// let x = Array2::from_shape_fn((2, 4), |(i, j)| (10 * i + j) as f32);
/// assert_eq!(contiguous(x.slice(s![.., 1..3])), x.slice(s![.., 1..3]));
/// ```
pub fn contiguous<E: Element>(x: ArrayView2<'_, E>) -> Array2<E> {
    let mut data = Vec::with_capacity(x.len());
    for row in x.rows() {
        match row.as_slice() {
            Some(row) => data.extend_from_slice(row),
            None => data.extend(row.iter().copied()),
        }
    }
    Array2::from_shape_vec(x.raw_dim(), data).expect("one value per element")
}

/// `dst = src` for matrices whose rows are contiguous (a head's `hd` columns of a `[T, d]`
/// matrix, or a whole matrix): one `copy_from_slice` per row. At the capstone's shapes
/// ndarray's general copies of such views cost far more: `as_standard_layout` (an element
/// iterator) took about 30% of the attention's time, and `assign` still 9% in a profile.
///
/// # Panics
/// If the shapes differ.
///
/// ```
/// use tl_tensor::kernels::rows::copy_rows;
/// use tl_tensor::ndarray::{Array2, s};
/// let mut x = Array2::<f32>::zeros((2, 4));
/// copy_rows(x.slice_mut(s![.., 2..]), Array2::ones((2, 2)).view());
/// assert_eq!(x.row(1).to_vec(), [0.0, 0.0, 1.0, 1.0]);
/// ```
pub fn copy_rows<E: Element>(mut dst: ArrayViewMut2<'_, E>, src: ArrayView2<'_, E>) {
    assert_eq!(dst.dim(), src.dim(), "copy_rows: shapes differ");
    for (mut to, from) in dst.rows_mut().into_iter().zip(src.rows()) {
        match (to.as_slice_mut(), from.as_slice()) {
            (Some(to), Some(from)) => to.copy_from_slice(from),
            _ => to.assign(&from),
        }
    }
}

/// Independent partial sums in [`lane_sum`] and [`lane_dot`]. One running sum is a chain of
/// dependent additions, one every four cycles, and was half of the attention's forward task's
/// own time in a profile; eight independent ones fill the vector registers.
const LANES: usize = 8;

/// `Σ_j a_j·b_j` in a fixed order: the `j`-th product of each full group of eight goes to
/// partial sum `j`, the partial sums are added in order, then the tail. The result depends
/// on the inputs alone (never on which thread runs the row).
///
/// # Panics
/// If the lengths differ.
///
/// ```
/// use tl_tensor::kernels::rows::lane_dot;
/// assert_eq!(lane_dot(&[1.0_f32, 2.0, 3.0], &[4.0, 5.0, 6.0]), 32.0);
/// ```
pub fn lane_dot<E: Element>(a: &[E], b: &[E]) -> E {
    assert_eq!(a.len(), b.len(), "lane_dot: lengths differ");
    let mut lanes = [E::zero(); LANES];
    let (a_groups, b_groups) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (a_tail, b_tail) = (a_groups.remainder(), b_groups.remainder());
    for (a_group, b_group) in a_groups.zip(b_groups) {
        for ((lane, &x), &y) in lanes.iter_mut().zip(a_group).zip(b_group) {
            *lane += x * y;
        }
    }
    let sum = lanes.iter().fold(E::zero(), |sum, &lane| sum + lane);
    a_tail
        .iter()
        .zip(b_tail)
        .fold(sum, |sum, (&x, &y)| sum + x * y)
}

/// `Σ_j (a_j·b_j)·c_j`, in the order of [`lane_dot`]: an RMS norm's VJP takes the dot
/// product of the output gradient, the gain and the input this way.
///
/// # Panics
/// If the lengths differ.
///
/// ```
/// use tl_tensor::kernels::rows::lane_triple_dot;
/// assert_eq!(lane_triple_dot(&[1.0_f32, 2.0], &[3.0, 4.0], &[5.0, 6.0]), 63.0);
/// ```
pub fn lane_triple_dot<E: Element>(a: &[E], b: &[E], c: &[E]) -> E {
    assert!(
        a.len() == b.len() && b.len() == c.len(),
        "lane_triple_dot: lengths {}, {} and {} differ",
        a.len(),
        b.len(),
        c.len()
    );
    let mut lanes = [E::zero(); LANES];
    let groups = a.chunks_exact(LANES).zip(b.chunks_exact(LANES));
    for ((a_group, b_group), c_group) in groups.zip(c.chunks_exact(LANES)) {
        for (((lane, &x), &y), &z) in lanes.iter_mut().zip(a_group).zip(b_group).zip(c_group) {
            *lane += x * y * z;
        }
    }
    let sum = lanes.iter().fold(E::zero(), |sum, &lane| sum + lane);
    let full = a.len() / LANES * LANES;
    let tails = a[full..].iter().zip(&b[full..]).zip(&c[full..]);
    tails.fold(sum, |sum, ((&x, &y), &z)| sum + x * y * z)
}

/// `Σ_j x_j`, in the order of [`lane_dot`].
///
/// ```
/// use tl_tensor::kernels::rows::lane_sum;
/// assert_eq!(lane_sum(&[1.0_f64; 11]), 11.0);
/// ```
pub fn lane_sum<E: Element>(xs: &[E]) -> E {
    let mut lanes = [E::zero(); LANES];
    let groups = xs.chunks_exact(LANES);
    let tail = groups.remainder();
    for group in groups {
        for (lane, &x) in lanes.iter_mut().zip(group) {
            *lane += x;
        }
    }
    let sum = lanes.iter().fold(E::zero(), |sum, &lane| sum + lane);
    tail.iter().fold(sum, |sum, &x| sum + x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::s;

    #[test]
    fn lane_sums_add_every_element_once_tails_included() {
        // Small whole numbers add exactly in any order, so a dropped, repeated or misplaced
        // element (in the groups of eight or in the tail) changes the result.
        for n in 0..=27_u32 {
            let xs: Vec<f64> = (1..=n).map(f64::from).collect();
            let ys: Vec<f64> = (1..=n).map(|i| f64::from(i % 5 + 1)).collect();
            assert_eq!(lane_sum(&xs), f64::from(n * (n + 1) / 2), "sum of 1..={n}");
            let dot: f64 = xs.iter().zip(&ys).map(|(x, y)| x * y).sum();
            assert_eq!(lane_dot(&xs, &ys), dot, "dot of length {n}");
            let zs: Vec<f64> = (1..=n).map(|i| f64::from(i % 3) - 1.0).collect();
            let triple: f64 = xs
                .iter()
                .zip(&ys)
                .zip(&zs)
                .map(|((x, y), z)| x * y * z)
                .sum();
            assert_eq!(
                lane_triple_dot(&xs, &ys, &zs),
                triple,
                "triple of length {n}"
            );
        }
    }

    #[test]
    fn the_triple_dot_adds_in_the_order_of_the_dot() {
        // Random f32 values of mixed magnitudes round differently in different orders: with a
        // factor of ones the triple dot must give lane_dot's bits (and lane_sum's with two).
        let mut state = 7_u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1e4_f32.powi((state % 3) as i32)
        };
        for n in [7, 8, 9, 31, 320] {
            let (a, b): (Vec<f32>, Vec<f32>) = (0..n).map(|_| (next(), next())).unzip();
            let ones = vec![1.0_f32; n];
            assert_eq!(
                lane_triple_dot(&a, &b, &ones).to_bits(),
                lane_dot(&a, &b).to_bits()
            );
            assert_eq!(
                lane_triple_dot(&ones, &a, &ones).to_bits(),
                lane_sum(&a).to_bits()
            );
            assert_eq!(
                lane_triple_dot(&b, &ones, &a).to_bits(),
                lane_dot(&b, &a).to_bits()
            );
        }
        // Not the running sum: 1 + 2^24 + 1 loses both ones, lane 0 adds them first.
        let mut big = [0.0_f32; 16];
        (big[0], big[1], big[8]) = (1.0, 16_777_216.0, 1.0);
        let ones = [1.0_f32; 16];
        assert_eq!(big.iter().fold(0.0, |s, &x| s + x), 16_777_216.0);
        assert_eq!(lane_triple_dot(&big, &ones, &ones), 16_777_218.0);
    }

    #[test]
    fn copy_rows_copies_strided_columns_into_place() {
        // Columns 2..5 of a 4 × 7 matrix, copied out and back into another matrix's columns.
        let source = Array2::from_shape_fn((4, 7), |(i, j)| (10 * i + j) as f64);
        let head = contiguous(source.slice(s![.., 2..5]));
        assert_eq!(head, source.slice(s![.., 2..5]));
        let mut target = Array2::<f64>::zeros((4, 7));
        copy_rows(target.slice_mut(s![.., 2..5]), head.view());
        assert_eq!(target.slice(s![.., 2..5]), source.slice(s![.., 2..5]));
        assert!(target.slice(s![.., ..2]).iter().all(|&x| x == 0.0));
        assert!(target.slice(s![.., 5..]).iter().all(|&x| x == 0.0));
    }
}
