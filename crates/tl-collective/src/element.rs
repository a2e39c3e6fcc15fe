//! The element types a collective moves (f32 and f64), and type-erased views of their slices
//! so that [`Communicator`](crate::Communicator) stays usable as a trait object.
//!
//! A view may also be shape-only ([`Slice::Shape`], [`SliceMut::Shape`]): an element type and
//! a length, no values. That is what a planner passes when it runs the trainer's step on
//! shapes; [`Single`](crate::Single) and [`Phantom`](crate::Phantom) take such buffers, the
//! backends that move bytes refuse them.

use std::ops::Range;

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

/// The element type of a buffer, named at run time: what a shape-only buffer holds instead
/// of values.
///
/// ```
/// use tl_collective::{Element, ElementType};
///
/// assert_eq!(f64::TYPE, ElementType::F64);
/// assert_eq!((ElementType::F32.bytes(), ElementType::F32.name()), (4, "f32"));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementType {
    /// `f32`.
    F32,
    /// `f64`.
    F64,
}

impl ElementType {
    /// Bytes per element.
    pub const fn bytes(self) -> usize {
        match self {
            ElementType::F32 => size_of::<f32>(),
            ElementType::F64 => size_of::<f64>(),
        }
    }

    /// `f32` or `f64`: the name on the wire and in errors ([`Element::NAME`]).
    pub const fn name(self) -> &'static str {
        match self {
            ElementType::F32 => f32::NAME,
            ElementType::F64 => f64::NAME,
        }
    }
}

/// `f32` or `f64`: the elements a collective can move. Sealed: the wire format and the MPI
/// datatypes are only defined for these two.
pub trait Element: Pod + PartialOrd + std::ops::Add<Output = Self> + sealed::Sealed {
    /// The type's name on the wire and in errors.
    const NAME: &'static str;

    /// The type as a value, for shape-only buffers.
    const TYPE: ElementType;

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
    const TYPE: ElementType = ElementType::F32;
    fn view(xs: &[Self]) -> Slice<'_> {
        Slice::F32(xs)
    }
    fn view_mut(xs: &mut [Self]) -> SliceMut<'_> {
        SliceMut::F32(xs)
    }
}

impl Element for f64 {
    const NAME: &'static str = "f64";
    const TYPE: ElementType = ElementType::F64;
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
/// Made from a slice with `.into()` (`comm.all_gather(shard.into(), out.into())`), or
/// shape-only with [`Slice::shape`].
#[derive(Debug)]
pub enum Slice<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f64 elements.
    F64(&'a [f64]),
    /// A buffer of `len` elements of type `element` that has no values: it costs what the
    /// real one would, and moves nothing. [`RingComm`](crate::RingComm) and `MpiComm`
    /// refuse it.
    Shape {
        /// The type of the elements.
        element: ElementType,
        /// Number of elements.
        len: usize,
    },
}

/// A mutable slice of f32 or f64: the buffer or output of a collective, type-erased.
///
/// Made from a slice with `.into()` (`comm.all_reduce_sum(grads.into())`), or shape-only
/// with [`SliceMut::shape`].
#[derive(Debug)]
pub enum SliceMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// f64 elements.
    F64(&'a mut [f64]),
    /// A buffer of `len` elements of type `element` that has no values (see
    /// [`Slice::Shape`]).
    Shape {
        /// The type of the elements.
        element: ElementType,
        /// Number of elements.
        len: usize,
    },
}

impl Slice<'_> {
    /// A shape-only buffer of `len` elements of type `T`.
    ///
    /// ```
    /// use tl_collective::Slice;
    ///
    /// let shape = Slice::shape::<f32>(7_000_000_000);
    /// assert_eq!((shape.len(), shape.element(), shape.is_shape()), (7_000_000_000, "f32", true));
    /// ```
    pub fn shape<T: Element>(len: usize) -> Self {
        Slice::Shape {
            element: T::TYPE,
            len,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Slice::F32(xs) => xs.len(),
            Slice::F64(xs) => xs.len(),
            Slice::Shape { len, .. } => *len,
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn element_type(&self) -> ElementType {
        match self {
            Slice::F32(_) => ElementType::F32,
            Slice::F64(_) => ElementType::F64,
            Slice::Shape { element, .. } => *element,
        }
    }

    /// `f32` or `f64`.
    pub fn element(&self) -> &'static str {
        self.element_type().name()
    }

    /// Whether the buffer is shape-only (has no values).
    pub fn is_shape(&self) -> bool {
        matches!(self, Slice::Shape { .. })
    }
}

impl SliceMut<'_> {
    /// A shape-only buffer of `len` elements of type `T`.
    ///
    /// ```
    /// use tl_collective::{Communicator, Single, SliceMut};
    ///
    /// let mut comm = Single::new();
    /// comm.all_reduce_sum(SliceMut::shape::<f64>(1 << 40))?; // no values, nothing allocated
    /// # Ok::<(), tl_collective::CollectiveError>(())
    /// ```
    pub fn shape<T: Element>(len: usize) -> Self {
        SliceMut::Shape {
            element: T::TYPE,
            len,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            SliceMut::F32(xs) => xs.len(),
            SliceMut::F64(xs) => xs.len(),
            SliceMut::Shape { len, .. } => *len,
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn element_type(&self) -> ElementType {
        match self {
            SliceMut::F32(_) => ElementType::F32,
            SliceMut::F64(_) => ElementType::F64,
            SliceMut::Shape { element, .. } => *element,
        }
    }

    /// `f32` or `f64`.
    pub fn element(&self) -> &'static str {
        self.element_type().name()
    }

    /// Whether the buffer is shape-only (has no values).
    pub fn is_shape(&self) -> bool {
        matches!(self, SliceMut::Shape { .. })
    }
}

impl<'a> Slice<'a> {
    /// The elements `range` of the buffer (of its shape, for a shape-only one).
    pub(crate) fn part(self, range: Range<usize>) -> Slice<'a> {
        match self {
            Slice::F32(xs) => Slice::F32(&xs[range]),
            Slice::F64(xs) => Slice::F64(&xs[range]),
            Slice::Shape { element, len } => {
                assert!(range.end <= len, "part {range:?} of {len} elements");
                Slice::Shape {
                    element,
                    len: range.len(),
                }
            }
        }
    }
}

impl<'a> SliceMut<'a> {
    /// The elements `range` of the buffer (of its shape, for a shape-only one).
    pub(crate) fn part(self, range: Range<usize>) -> SliceMut<'a> {
        match self {
            SliceMut::F32(xs) => SliceMut::F32(&mut xs[range]),
            SliceMut::F64(xs) => SliceMut::F64(&mut xs[range]),
            SliceMut::Shape { element, len } => {
                assert!(range.end <= len, "part {range:?} of {len} elements");
                SliceMut::Shape {
                    element,
                    len: range.len(),
                }
            }
        }
    }
}

/// Copies `input` into `output` when both have values; with a shape-only side there is
/// nothing to copy and `output` keeps what it holds. The caller has checked that the element
/// types and lengths agree.
pub(crate) fn copy_values(input: Slice<'_>, output: SliceMut<'_>) {
    match (input, output) {
        (Slice::F32(src), SliceMut::F32(dst)) => dst.copy_from_slice(src),
        (Slice::F64(src), SliceMut::F64(dst)) => dst.copy_from_slice(src),
        (Slice::Shape { .. }, _) | (_, SliceMut::Shape { .. }) => {}
        (src, dst) => unreachable!(
            "copy_values: {} into {} after the element types were checked",
            src.element(),
            dst.element()
        ),
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

    #[test]
    fn a_shape_only_view_has_a_length_and_a_type_and_no_values() {
        let shape = SliceMut::shape::<f64>(10);
        assert_eq!((shape.len(), shape.element()), (10, "f64"));
        assert!(shape.is_shape() && !shape.is_empty());
        let part = shape.part(3..7);
        assert!(matches!(
            part,
            SliceMut::Shape {
                element: ElementType::F64,
                len: 4
            }
        ));
        let mut real = [1.0f32, 2.0];
        let real = SliceMut::from(&mut real[..]);
        assert_eq!(
            (real.element_type(), real.is_shape()),
            (ElementType::F32, false)
        );
        assert_eq!(Slice::shape::<f32>(0).element_type().bytes(), 4);
        assert!(Slice::shape::<f32>(0).is_empty());
    }

    #[test]
    #[should_panic(expected = "part 3..7 of 5 elements")]
    fn a_part_past_the_end_of_a_shape_panics_as_a_slice_would() {
        Slice::shape::<f32>(5).part(3..7);
    }
}
