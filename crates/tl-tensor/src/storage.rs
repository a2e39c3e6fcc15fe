//! Metered storage: an n-dimensional array whose bytes are counted by [`crate::memory`] from
//! the moment it is made until it is dropped; or, in [meta mode](crate::meta), the shape of
//! one, counted the same and holding no values.

use ndarray::ArrayD;

use crate::Element;
use crate::memory::{self, Tag};

/// An array of tensor data, counted by the memory meter while it lives.
///
/// The byte count is taken once, at creation: code holding a `&mut` may change values but
/// never the number of elements. Every such change bumps the buffer's version, so a
/// [`WeakValue`](crate::tensor::WeakValue) taken before it no longer matches.
pub(crate) struct Buffer<E: Element> {
    array: ArrayD<E>,
    bytes: usize,
    version: u64,
    /// The shape the values had, while they are released (see [`Buffer::release`]).
    released: Option<Vec<usize>>,
    /// The shape of a meta buffer, which never holds values (see [`Buffer::meta`]).
    meta: Option<Vec<usize>>,
    /// Whose and what the storage is, on the meter.
    tag: Tag,
}

impl<E: Element> Buffer<E> {
    /// A buffer holding `array`, with the meter's [current tag](memory::current_tag).
    pub(crate) fn new(array: ArrayD<E>) -> Self {
        Self::new_tagged(array, memory::current_tag())
    }

    /// A buffer holding `array`, tagged `tag` on the meter.
    pub(crate) fn new_tagged(array: ArrayD<E>, tag: Tag) -> Self {
        let bytes = array.len() * std::mem::size_of::<E>();
        memory::on_alloc_tagged(bytes, tag);
        Self {
            array,
            bytes,
            version: 0,
            released: None,
            meta: None,
            tag,
        }
    }

    /// A buffer with a shape and no values, counted on the meter as if it held
    /// `shape`'s elements, with the meter's [current tag](memory::current_tag).
    pub(crate) fn meta(shape: &[usize]) -> Self {
        Self::meta_tagged(shape, memory::current_tag())
    }

    /// [`Buffer::meta`] tagged `tag`.
    pub(crate) fn meta_tagged(shape: &[usize], tag: Tag) -> Self {
        let bytes = shape.iter().product::<usize>() * std::mem::size_of::<E>();
        memory::on_alloc_tagged(bytes, tag);
        Self {
            array: ArrayD::zeros(ndarray::IxDyn(&[0])),
            bytes,
            version: 0,
            released: None,
            meta: Some(shape.to_vec()),
            tag,
        }
    }

    /// The storage's tag on the meter.
    pub(crate) fn tag(&self) -> Tag {
        self.tag
    }

    /// Tags the storage `tag` from now on (a retag event on the meter).
    pub(crate) fn set_tag(&mut self, tag: Tag) {
        memory::on_retag(self.bytes, self.tag, tag);
        self.tag = tag;
    }

    /// The shape of the values, or the shape they had while they are released, or a meta
    /// buffer's shape.
    pub(crate) fn shape(&self) -> &[usize] {
        self.released
            .as_deref()
            .or(self.meta.as_deref())
            .unwrap_or(self.array.shape())
    }

    /// Whether this is a meta buffer (a shape, no values).
    pub(crate) fn is_meta(&self) -> bool {
        self.meta.is_some()
    }

    /// Drops the values, keeping the shape and the bytes on the meter: the buffer is meta
    /// from now on. What accumulating a meta gradient into a real one leaves.
    pub(crate) fn make_meta(&mut self) {
        if self.meta.is_none() {
            self.meta = Some(self.shape().to_vec());
            self.array = ArrayD::zeros(ndarray::IxDyn(&[0]));
            self.version += 1;
        }
    }

    /// Whether the values are released.
    pub(crate) fn is_released(&self) -> bool {
        self.released.is_some()
    }

    /// Drops the values, keeping their shape, and takes their bytes off the meter; the
    /// array is empty (one axis of length 0) until [`restore`](Self::restore).
    ///
    /// # Panics
    /// If the values are released already.
    pub(crate) fn release(&mut self) {
        assert!(
            !self.is_released(),
            "release: the value is released already"
        );
        self.released = Some(self.shape().to_vec());
        self.array = ArrayD::zeros(ndarray::IxDyn(&[0]));
        memory::on_free_tagged(self.bytes, self.tag);
        self.bytes = 0;
        self.version += 1;
    }

    /// Puts values back into a released buffer, counting them on the meter again.
    ///
    /// # Panics
    /// If the values are not released, or `array`'s shape is not the one they had, or the
    /// buffer is meta (see [`restore_meta`](Self::restore_meta)).
    pub(crate) fn restore(&mut self, array: ArrayD<E>) {
        assert!(
            self.meta.is_none(),
            "restore: a meta buffer takes no values (restore_meta counts it back)"
        );
        let shape = self
            .released
            .take()
            .expect("restore: the value is not released");
        assert_eq!(
            array.shape(),
            shape.as_slice(),
            "restore: the values must have the released shape"
        );
        self.bytes = array.len() * std::mem::size_of::<E>();
        self.tag = now(self.tag);
        memory::on_alloc_tagged(self.bytes, self.tag);
        self.array = array;
        self.version += 1;
    }

    /// Counts a released meta buffer on the meter again, as [`restore`](Self::restore)
    /// would with values of its shape.
    ///
    /// # Panics
    /// If the buffer is not released, or not meta.
    pub(crate) fn restore_meta(&mut self) {
        assert!(self.meta.is_some(), "restore_meta: the buffer holds values");
        let shape = self
            .released
            .take()
            .expect("restore_meta: the value is not released");
        self.bytes = shape.iter().product::<usize>() * std::mem::size_of::<E>();
        self.tag = now(self.tag);
        memory::on_alloc_tagged(self.bytes, self.tag);
        self.version += 1;
    }

    /// How many in-place updates the values have been through.
    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    /// The bytes this buffer holds on the meter.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(crate) fn array(&self) -> &ArrayD<E> {
        &self.array
    }

    /// Mutable access for in-place updates (optimizer steps, gradient accumulation).
    ///
    /// # Panics
    /// If the closure changes the number of elements, which would break the meter, or the
    /// buffer is meta (it has no values to update: callers skip the update).
    pub(crate) fn update<T>(&mut self, f: impl FnOnce(&mut ArrayD<E>) -> T) -> T {
        assert!(
            self.meta.is_none(),
            "an in-place update of a meta tensor: it has no values (check is_meta first)"
        );
        let len = self.array.len();
        self.version += 1;
        let out = f(&mut self.array);
        assert_eq!(
            self.array.len(),
            len,
            "an in-place update must not change the number of elements"
        );
        out
    }
}

/// `tag` with the stage and micro-batch of now: what storage allocated again (restored
/// after a release) is tagged with — the same storage, made at another moment.
fn now(tag: Tag) -> Tag {
    let current = memory::current_tag();
    Tag {
        stage: current.stage,
        micro_batch: current.micro_batch,
        ..tag
    }
}

impl<E: Element> Drop for Buffer<E> {
    fn drop(&mut self) {
        memory::on_free_tagged(self.bytes, self.tag);
    }
}

impl<E: Element> Buffer<E> {
    /// Gives the array back, uncounted from now on.
    ///
    /// # Panics
    /// If the buffer is meta.
    pub(crate) fn into_array(mut self) -> ArrayD<E> {
        assert!(
            self.meta.is_none(),
            "into_array: a meta buffer has no values"
        );
        memory::on_free_tagged(self.bytes, self.tag);
        self.bytes = 0;
        std::mem::take(&mut self.array)
    }
}
