//! The element types a collective moves (f32 and f64), and type-erased views of their slices
//! so that [`Communicator`](crate::Communicator) stays usable as a trait object.
//!
//! A view may also be shape-only ([`Slice::Shape`], [`SliceMut::Shape`]): an element type and
//! a length, no values. That is what a planner passes when it runs the trainer's step on
//! shapes; [`Single`](crate::Single) and [`Phantom`](crate::Phantom) take such buffers, the
//! backends that move bytes refuse them.

use std::ops::Range;

use bytemuck::Pod;
use tl_numerics::{Format, Round};

use crate::error::{CollectiveError, Result};

mod sealed {
    /// What the crate needs of an element beyond the public bounds: exact conversions to and
    /// from f64, in which a sum in a 16-bit format is computed before it is rounded.
    pub trait Sealed: tl_numerics::Round {
        /// The value as an f64 (exact).
        fn widen(self) -> f64;
        /// An f64 as this type: exact for every value of bf16 and fp16.
        fn narrow(wide: f64) -> Self;
    }
    impl Sealed for f32 {
        #[inline]
        fn widen(self) -> f64 {
            f64::from(self)
        }
        #[inline]
        fn narrow(wide: f64) -> Self {
            wide as f32
        }
    }
    impl Sealed for f64 {
        #[inline]
        fn widen(self) -> f64 {
            self
        }
        #[inline]
        fn narrow(wide: f64) -> Self {
            wide
        }
    }
}

/// The reduction of a reducing collective.
///
/// ```
/// use tl_collective::{ReduceOp, reference_all_reduce};
/// use tl_numerics::Format;
///
/// // Three ranks hold 1, 2^-8 and 2^-8, all bf16 values. The ring adds rank 2's value to
/// // rank 1's first: 2^-7, exact; then 1 + 2^-7, a bf16 value. One rounding of the exact
/// // sum gives the same here; see `reference_all_reduce` for where they differ.
/// let inputs = [vec![1.0f32], vec![2f32.powi(-8)], vec![2f32.powi(-8)]];
/// let refs: Vec<&[f32]> = inputs.iter().map(|x| x.as_slice()).collect();
/// assert_eq!(reference_all_reduce(&refs, ReduceOp::SumIn(Format::Bf16)), [1.0078125]);
/// assert_eq!(ReduceOp::SumIn(Format::Bf16).wire_bytes(tl_collective::ElementType::F32), 2);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Elementwise sum, in the order the backend documents.
    Sum,
    /// Elementwise maximum; a NaN on any rank makes the result NaN (so an overflow check
    /// cannot miss it).
    Max,
    /// Elementwise sum in a 16-bit format, as a GPU's ring all-reduce of a bf16 or fp16
    /// tensor computes it: each rank's values are rounded to the format first (nothing
    /// changes for values the format holds), and each addition of the ring — the partial
    /// sum received and the local value — is rounded to the nearest value of the format,
    /// ties to even. The values travel as 16 bits each, so a collective sends half the
    /// bytes of an f32 one. Only [`Format::Bf16`] and [`Format::Fp16`]: a collective given
    /// an fp8 format fails with [`CollectiveError::UnsupportedReduction`].
    SumIn(Format),
}

impl ReduceOp {
    /// Bytes each element takes on the wire when a buffer of `element` is reduced with this
    /// op: the element's own size, or the format's for [`SumIn`](ReduceOp::SumIn) (2).
    pub const fn wire_bytes(self, element: ElementType) -> usize {
        match self {
            ReduceOp::Sum | ReduceOp::Max => element.bytes(),
            ReduceOp::SumIn(format) => {
                ((format.exponent_bits() + format.precision_bits()) / 8) as usize
            }
        }
    }

    /// The 16-bit format of [`SumIn`](ReduceOp::SumIn), `None` for the others.
    pub const fn format(self) -> Option<Format> {
        match self {
            ReduceOp::SumIn(format) => Some(format),
            ReduceOp::Sum | ReduceOp::Max => None,
        }
    }
}

/// Refuses a [`ReduceOp::SumIn`] of an fp8 format for the collective `name`.
pub(crate) fn check_op(op: ReduceOp, name: &'static str) -> Result<()> {
    match op {
        ReduceOp::SumIn(format @ (Format::E4M3 | Format::E5M2)) => {
            Err(CollectiveError::UnsupportedReduction { op: name, format })
        }
        ReduceOp::Sum | ReduceOp::Max | ReduceOp::SumIn(Format::Bf16 | Format::Fp16) => Ok(()),
    }
}

/// The name of a reducing collective (`base` is `all_reduce` or `reduce_scatter`) in
/// headers and errors: `all_reduce_sum`, `reduce_scatter_max`, `all_reduce_sum_bf16`, ...
pub(crate) fn reduce_name(base: &'static str, op: ReduceOp) -> &'static str {
    let all = base == "all_reduce";
    match (all, op) {
        (true, ReduceOp::Sum) => "all_reduce_sum",
        (true, ReduceOp::Max) => "all_reduce_max",
        (true, ReduceOp::SumIn(Format::Bf16)) => "all_reduce_sum_bf16",
        (true, ReduceOp::SumIn(Format::Fp16)) => "all_reduce_sum_fp16",
        (true, ReduceOp::SumIn(Format::E4M3)) => "all_reduce_sum_e4m3",
        (true, ReduceOp::SumIn(Format::E5M2)) => "all_reduce_sum_e5m2",
        (false, ReduceOp::Sum) => "reduce_scatter_sum",
        (false, ReduceOp::Max) => "reduce_scatter_max",
        (false, ReduceOp::SumIn(Format::Bf16)) => "reduce_scatter_sum_bf16",
        (false, ReduceOp::SumIn(Format::Fp16)) => "reduce_scatter_sum_fp16",
        (false, ReduceOp::SumIn(Format::E4M3)) => "reduce_scatter_sum_e4m3",
        (false, ReduceOp::SumIn(Format::E5M2)) => "reduce_scatter_sum_e5m2",
    }
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
/// datatypes are only defined for these two. Both are [`Round`]: a sum in a 16-bit format
/// rounds them.
pub trait Element:
    Pod + PartialOrd + std::ops::Add<Output = Self> + Round + sealed::Sealed
{
    /// The type's name on the wire and in errors.
    const NAME: &'static str;

    /// The type as a value, for shape-only buffers.
    const TYPE: ElementType;

    /// Wraps a shared slice in the type-erased view.
    fn view(xs: &[Self]) -> Slice<'_>;

    /// Wraps a mutable slice in the type-erased view.
    fn view_mut(xs: &mut [Self]) -> SliceMut<'_>;

    /// `op(a, b)`; for [`ReduceOp::Max`] a NaN in either wins; for
    /// [`ReduceOp::SumIn`] the sum rounded once to the format (computed in f64, see
    /// [`sum_in`]).
    #[inline]
    fn reduce(op: ReduceOp, a: Self, b: Self) -> Self {
        match op {
            ReduceOp::Sum => a + b,
            ReduceOp::SumIn(format) => sum_in(format, a, b),
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

/// `a + b` rounded to the nearest value of `format`, ties to even: what `__hadd` computes on
/// two bf16 or fp16 values.
///
/// The sum is formed in f64 and rounded once from there. That is the correctly rounded
/// sum: two fp16 values are multiples of `2^-24` below `2^16` in magnitude, so their sum
/// is a multiple of `2^-24` below `2^17`, 41 bits, and f64 holds it exactly. Two bf16
/// values can be too far apart for f64 (`2^100 + 2^-100`); then the f64 sum is rounded
/// twice, first to 53 bits, but a first rounding to at least `2p + 2` bits never changes
/// the second's result for a sum of two `p`-bit numbers (Figueroa, "When is double rounding
/// innocuous?", 1995), and `53 ≥ 2·8 + 2`. The tests check it against an exact error term.
///
/// ```
/// use tl_collective::sum_in;
/// use tl_numerics::Format;
///
/// // 1 + 2^-8 is the tie between the bf16 neighbours 1 and 1 + 2^-7: to the even, 1.
/// assert_eq!(sum_in(Format::Bf16, 1.0f32, 2f32.powi(-8)), 1.0);
/// assert_eq!(sum_in(Format::Fp16, 65504.0f64, 16.0), f64::INFINITY); // at fp16's overflow
/// ```
#[inline]
pub fn sum_in<T: Element>(format: Format, a: T, b: T) -> T {
    T::narrow((a.widen() + b.widen()).round_to(format))
}

/// `op(dst[i], src[i])` into `dst`, elementwise.
pub(crate) fn reduce_into<T: Element>(op: ReduceOp, dst: &mut [T], src: &[T]) {
    match op {
        // The plain loop for the sum lets the compiler vectorise it.
        ReduceOp::Sum => dst.iter_mut().zip(src).for_each(|(d, &s)| *d = *d + s),
        ReduceOp::Max | ReduceOp::SumIn(_) => dst
            .iter_mut()
            .zip(src)
            .for_each(|(d, &s)| *d = T::reduce(op, *d, s)),
    }
}

/// Rounds a rank's own values to the format of a [`ReduceOp::SumIn`] before they enter the
/// sum (the other ops take them as they are).
pub(crate) fn prepare<T: Element>(op: ReduceOp, values: &mut [T]) {
    if let ReduceOp::SumIn(format) = op {
        tl_numerics::round_slice(values, format);
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

impl Slice<'_> {
    /// The values as bytes, `None` for a shape-only buffer.
    pub(crate) fn bytes(&self) -> Option<&[u8]> {
        match self {
            Slice::F32(xs) => Some(bytemuck::cast_slice(xs)),
            Slice::F64(xs) => Some(bytemuck::cast_slice(xs)),
            Slice::Shape { .. } => None,
        }
    }

    /// Bytes of the values, whether or not the buffer holds them.
    pub(crate) fn byte_len(&self) -> usize {
        self.len() * self.element_type().bytes()
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

impl SliceMut<'_> {
    /// The values as bytes, `None` for a shape-only buffer.
    pub(crate) fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        match self {
            SliceMut::F32(xs) => Some(bytemuck::cast_slice_mut(xs)),
            SliceMut::F64(xs) => Some(bytemuck::cast_slice_mut(xs)),
            SliceMut::Shape { .. } => None,
        }
    }

    /// The same buffer, borrowed again for a shorter time.
    pub(crate) fn reborrow(&mut self) -> SliceMut<'_> {
        match self {
            SliceMut::F32(xs) => SliceMut::F32(xs),
            SliceMut::F64(xs) => SliceMut::F64(xs),
            SliceMut::Shape { element, len } => SliceMut::Shape {
                element: *element,
                len: *len,
            },
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

/// [`prepare`] on a view's values (nothing for a shape-only one).
pub(crate) fn prepare_view(op: ReduceOp, data: &mut SliceMut<'_>) {
    match data {
        SliceMut::F32(xs) => prepare(op, xs),
        SliceMut::F64(xs) => prepare(op, xs),
        SliceMut::Shape { .. } => {}
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

    /// Knuth's TwoSum: `s = fl(a + b)` and the rounding error `e`, with `s + e = a + b`
    /// exactly (for finite `s`).
    fn two_sum(a: f64, b: f64) -> (f64, f64) {
        let s = a + b;
        let b_virtual = s - a;
        let e = (a - (s - b_virtual)) + (b - b_virtual);
        (s, e)
    }

    /// The two 16-bit values at the bit patterns drawn by a xorshift stream.
    fn pairs(format: Format, count: usize) -> impl Iterator<Item = (f64, f64)> {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let value = move |bits: u16| -> f64 {
            let x = match format {
                Format::Bf16 => f32::from_bits(u32::from(bits) << 16),
                _ => half::f16::from_bits(bits).to_f32(),
            };
            f64::from(x)
        };
        std::iter::repeat_with(move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (value(state as u16), value((state >> 16) as u16))
        })
        .filter(|(a, b)| a.is_finite() && b.is_finite())
        .take(count)
    }

    #[test]
    fn the_f64_sum_rounded_once_is_the_correctly_rounded_16_bit_sum() {
        for format in Format::SIXTEEN_BIT {
            let mut inexact = 0;
            for (a, b) in pairs(format, 1 << 20) {
                let (s, e) = two_sum(a, b);
                let got = sum_in(format, a, b);
                if e == 0.0 || !s.is_finite() {
                    assert_eq!(got.to_bits(), s.round_to(format).to_bits(), "{a:e} + {b:e}");
                    continue;
                }
                // The exact sum lies strictly between s and its f64 neighbour towards e (or
                // on their midpoint); rounding is monotone, so when both round alike, so
                // does the exact sum, and that is what one rounding of s must give.
                inexact += 1;
                let beyond = if e > 0.0 { s.next_up() } else { s.next_down() };
                let (near, far) = (s.round_to(format), beyond.round_to(format));
                assert_eq!(near.to_bits(), far.to_bits(), "{a:e} + {b:e}: a boundary");
                assert_eq!(got.to_bits(), near.to_bits(), "{a:e} + {b:e}");
            }
            match format {
                // Multiples of 2^-24 below 2^17: f64 holds every sum.
                Format::Fp16 => assert_eq!(inexact, 0),
                // Exponents far apart: the double rounding happens, and is innocuous.
                _ => assert!(inexact > 1000, "{inexact} inexact f64 sums"),
            }
        }
    }

    #[test]
    fn only_the_16_bit_formats_have_a_sum_and_it_sends_two_bytes() {
        for format in Format::SIXTEEN_BIT {
            check_op(ReduceOp::SumIn(format), "all_reduce").unwrap();
            assert_eq!(ReduceOp::SumIn(format).wire_bytes(ElementType::F64), 2);
        }
        for format in Format::FP8 {
            let err = check_op(ReduceOp::SumIn(format), "all_reduce_sum_e4m3").unwrap_err();
            assert!(
                matches!(err, CollectiveError::UnsupportedReduction { format: f, .. } if f == format)
            );
        }
        assert_eq!(ReduceOp::Sum.wire_bytes(ElementType::F64), 8);
        assert_eq!(ReduceOp::Max.format(), None);
        assert_eq!(
            reduce_name("reduce_scatter", ReduceOp::SumIn(Format::Fp16)),
            "reduce_scatter_sum_fp16"
        );
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
