//! The element types a collective moves (f32 and f64), and type-erased views of their slices
//! so that [`Communicator`](crate::Communicator) stays usable as a trait object.

use bytemuck::Pod;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// The reduction of a reducing collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Elementwise sum, in the order the backend documents.
    Sum,
    /// Elementwise maximum; a NaN on any rank makes the result NaN (so an overflow check
    /// cannot miss it).
    Max,
}

/// `f32` or `f64`: the elements a collective can move. Sealed: the wire format and the MPI
/// datatypes are only defined for these two.
pub trait Element: Pod + PartialOrd + std::ops::Add<Output = Self> + sealed::Sealed {
    /// The type's name on the wire and in errors.
    const NAME: &'static str;

    /// Wraps a shared slice in the type-erased view.
    fn view(xs: &[Self]) -> Slice<'_>;

    /// Wraps a mutable slice in the type-erased view.
    fn view_mut(xs: &mut [Self]) -> SliceMut<'_>;

    /// `op(a, b)`; for [`ReduceOp::Max`] a NaN in either wins.
    #[inline]
    fn reduce(op: ReduceOp, a: Self, b: Self) -> Self {
        match op {
            ReduceOp::Sum => a + b,
            ReduceOp::Max => {
                // `a != a` is the NaN test that needs no extra trait bound.
                #[allow(clippy::eq_op)]
                if a != a || a > b { a } else { b }
            }
        }
    }
}

impl Element for f32 {
    const NAME: &'static str = "f32";
    fn view(xs: &[Self]) -> Slice<'_> {
        Slice::F32(xs)
    }
    fn view_mut(xs: &mut [Self]) -> SliceMut<'_> {
        SliceMut::F32(xs)
    }
}

impl Element for f64 {
    const NAME: &'static str = "f64";
    fn view(xs: &[Self]) -> Slice<'_> {
        Slice::F64(xs)
    }
    fn view_mut(xs: &mut [Self]) -> SliceMut<'_> {
        SliceMut::F64(xs)
    }
}

/// `op(dst[i], src[i])` into `dst`, elementwise.
pub(crate) fn reduce_into<T: Element>(op: ReduceOp, dst: &mut [T], src: &[T]) {
    match op {
        // The plain loop for the sum lets the compiler vectorise it.
        ReduceOp::Sum => dst.iter_mut().zip(src).for_each(|(d, &s)| *d = *d + s),
        ReduceOp::Max => dst
            .iter_mut()
            .zip(src)
            .for_each(|(d, &s)| *d = T::reduce(op, *d, s)),
    }
}

/// A shared slice of f32 or f64: the input of a collective, type-erased.
///
/// Made from a slice with `.into()` (`comm.all_gather(shard.into(), out.into())`).
#[derive(Debug)]
pub enum Slice<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f64 elements.
    F64(&'a [f64]),
}

/// A mutable slice of f32 or f64: the buffer or output of a collective, type-erased.
///
/// Made from a slice with `.into()` (`comm.all_reduce_sum(grads.into())`).
#[derive(Debug)]
pub enum SliceMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// f64 elements.
    F64(&'a mut [f64]),
}

impl Slice<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Slice::F32(xs) => xs.len(),
            Slice::F64(xs) => xs.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `f32` or `f64`.
    pub fn element(&self) -> &'static str {
        match self {
            Slice::F32(_) => f32::NAME,
            Slice::F64(_) => f64::NAME,
        }
    }
}

impl SliceMut<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            SliceMut::F32(xs) => xs.len(),
            SliceMut::F64(xs) => xs.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `f32` or `f64`.
    pub fn element(&self) -> &'static str {
        match self {
            SliceMut::F32(_) => f32::NAME,
            SliceMut::F64(_) => f64::NAME,
        }
    }
}

impl<'a, T: Element> From<&'a [T]> for Slice<'a> {
    fn from(xs: &'a [T]) -> Self {
        T::view(xs)
    }
}

impl<'a, T: Element> From<&'a mut [T]> for Slice<'a> {
    fn from(xs: &'a mut [T]) -> Self {
        T::view(xs)
    }
}

impl<'a, T: Element> From<&'a Vec<T>> for Slice<'a> {
    fn from(xs: &'a Vec<T>) -> Self {
        T::view(xs)
    }
}

impl<'a, T: Element> From<&'a mut [T]> for SliceMut<'a> {
    fn from(xs: &'a mut [T]) -> Self {
        T::view_mut(xs)
    }
}

impl<'a, T: Element> From<&'a mut Vec<T>> for SliceMut<'a> {
    fn from(xs: &'a mut Vec<T>) -> Self {
        T::view_mut(xs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_propagates_nan_from_either_side() {
        assert!(f32::reduce(ReduceOp::Max, f32::NAN, 1.0).is_nan());
        assert!(f32::reduce(ReduceOp::Max, 1.0, f32::NAN).is_nan());
        assert_eq!(f64::reduce(ReduceOp::Max, 2.0, 3.0), 3.0);
        assert_eq!(f64::reduce(ReduceOp::Max, 3.0, -1.0), 3.0);
    }
}
