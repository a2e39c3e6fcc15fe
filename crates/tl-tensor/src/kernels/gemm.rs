//! General matrix multiply on strided 2-D views, through the `gemm` crate.

use ndarray::{ArrayView2, ArrayViewMut2};

use crate::Element;

/// `out = lhs · rhs` (or `out += lhs · rhs` with `accumulate`), for any strides of the three
/// views — a transposed operand is a view with swapped strides, never a copy.
///
/// # Panics
/// If the shapes do not chain: `lhs` is m×k, `rhs` k×n, `out` m×n.
pub fn gemm_into<E: Element>(
    out: &mut ArrayViewMut2<'_, E>,
    lhs: ArrayView2<'_, E>,
    rhs: ArrayView2<'_, E>,
    accumulate: bool,
) {
    let (m, k) = lhs.dim();
    let (k2, n) = rhs.dim();
    assert!(
        k == k2 && out.dim() == (m, n),
        "gemm: cannot multiply {:?} by {:?} into {:?}",
        lhs.shape(),
        rhs.shape(),
        out.shape()
    );
    if m == 0 || n == 0 {
        return;
    }
    let parallelism = if m * n * k >= 64 * 64 * 64 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    let [out_rs, out_cs] = [out.strides()[0], out.strides()[1]];
    let [lhs_rs, lhs_cs] = [lhs.strides()[0], lhs.strides()[1]];
    let [rhs_rs, rhs_cs] = [rhs.strides()[0], rhs.strides()[1]];
    // SAFETY: the three pointers come from live ndarray views whose shapes were checked
    // above to be m×k, k×n and m×n, and whose strides (in elements) are passed unchanged, so
    // every element gemm reads or writes lies inside its view. `out` is a unique borrow, so
    // it aliases neither operand. E is f32 or f64, types gemm supports.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            out_cs,
            out_rs,
            accumulate,
            lhs.as_ptr(),
            lhs_cs,
            lhs_rs,
            rhs.as_ptr(),
            rhs_cs,
            rhs_rs,
            E::one(),
            E::one(),
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array2, arr2};

    #[test]
    fn strided_operands_and_accumulation() {
        let a = arr2(&[[1.0f64, 2.0], [3.0, 4.0], [5.0, 6.0]]); // 3×2
        let b = arr2(&[[1.0f64, 0.0, 2.0], [0.0, 1.0, 3.0]]); // 2×3
        let mut out = Array2::<f64>::zeros((3, 3));
        gemm_into(&mut out.view_mut(), a.view(), b.view(), false);
        assert_eq!(out, a.dot(&b));
        // aᵀ·aᵀᵀ through transposed views, accumulated onto the previous result.
        let mut acc = a.t().dot(&a);
        gemm_into(&mut acc.view_mut(), a.t(), a.view(), true);
        assert_eq!(acc, a.t().dot(&a) * 2.0);
    }

    #[test]
    fn large_product_matches_naive() {
        let (m, k, n) = (70, 90, 80);
        let a = Array2::from_shape_fn((m, k), |(i, j)| ((i * 7 + j * 3) % 11) as f64 - 5.0);
        let b = Array2::from_shape_fn((k, n), |(i, j)| ((i * 5 + j * 2) % 13) as f64 - 6.0);
        let mut out = Array2::<f64>::zeros((m, n));
        gemm_into(&mut out.view_mut(), a.view(), b.view(), false);
        assert_eq!(out, a.dot(&b));
    }
}
