//! NumPy broadcasting, and its adjoint: summing a gradient back to an operand's shape.
//! Every op that broadcasts calls these two, so un-broadcasting lives in one place.

use ndarray::{ArrayD, Axis, IxDyn};

use crate::Element;

/// The shape two operands broadcast to: dimensions aligned from the right, each pair equal
/// or one of them 1.
///
/// # Panics
/// When the shapes do not broadcast, naming `op` and both shapes.
pub(crate) fn broadcast_shape(op: &str, lhs: &[usize], rhs: &[usize]) -> Vec<usize> {
    let ndim = lhs.len().max(rhs.len());
    let dim = |shape: &[usize], i: usize| {
        let offset = ndim - shape.len();
        if i < offset { 1 } else { shape[i - offset] }
    };
    (0..ndim)
        .map(|i| match (dim(lhs, i), dim(rhs, i)) {
            (a, b) if a == b => a,
            (1, b) => b,
            (a, 1) => a,
            _ => panic!("{op}: shapes {lhs:?} and {rhs:?} do not broadcast"),
        })
        .collect()
}

/// Sums `grad` (shaped like a broadcast result) down to `shape`: over the leading
/// dimensions `shape` lacks and over every dimension where `shape` has 1.
pub(crate) fn unbroadcast<E: Element>(grad: ArrayD<E>, shape: &[usize]) -> ArrayD<E> {
    if grad.shape() == shape {
        return grad;
    }
    let mut grad = grad;
    let extra = grad.ndim() - shape.len();
    for _ in 0..extra {
        grad = grad.sum_axis(Axis(0));
    }
    for (axis, &size) in shape.iter().enumerate() {
        if size == 1 && grad.shape()[axis] != 1 {
            grad = grad.sum_axis(Axis(axis)).insert_axis(Axis(axis));
        }
    }
    debug_assert_eq!(grad.shape(), shape);
    grad.into_shape_with_order(IxDyn(shape))
        .expect("unbroadcast keeps the element count")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_align_from_the_right() {
        assert_eq!(broadcast_shape("add", &[2, 3, 4], &[4]), vec![2, 3, 4]);
        assert_eq!(broadcast_shape("add", &[2, 1, 4], &[3, 1]), vec![2, 3, 4]);
        assert_eq!(broadcast_shape("add", &[], &[5]), vec![5]);
    }

    #[test]
    #[should_panic(expected = "mul: shapes [2, 3] and [4] do not broadcast")]
    fn mismatch_names_op_and_shapes() {
        broadcast_shape("mul", &[2, 3], &[4]);
    }

    #[test]
    fn unbroadcast_sums_the_broadcast_axes() {
        let grad = ArrayD::<f64>::ones(IxDyn(&[2, 3, 4]));
        let reduced = unbroadcast(grad, &[3, 1]);
        assert_eq!(reduced.shape(), &[3, 1]);
        assert!(reduced.iter().all(|&g| g == 8.0));
    }
}
