//! Metered storage: an n-dimensional array whose bytes are counted by [`crate::memory`] from
//! the moment it is made until it is dropped.

use ndarray::ArrayD;

use crate::Element;
use crate::memory;

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
}

impl<E: Element> Buffer<E> {
    pub(crate) fn new(array: ArrayD<E>) -> Self {
        let bytes = array.len() * std::mem::size_of::<E>();
        memory::on_alloc(bytes);
        Self {
            array,
            bytes,
            version: 0,
            released: None,
        }
    }

    /// The shape of the values, or the shape they had while they are released.
    pub(crate) fn shape(&self) -> &[usize] {
        self.released.as_deref().unwrap_or(self.array.shape())
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
        self.released = Some(self.array.shape().to_vec());
        self.array = ArrayD::zeros(ndarray::IxDyn(&[0]));
        memory::on_free(self.bytes);
        self.bytes = 0;
        self.version += 1;
    }

    /// Puts values back into a released buffer, counting them on the meter again.
    ///
    /// # Panics
    /// If the values are not released, or `array`'s shape is not the one they had.
    pub(crate) fn restore(&mut self, array: ArrayD<E>) {
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
        memory::on_alloc(self.bytes);
        self.array = array;
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
    /// If the closure changes the number of elements, which would break the meter.
    pub(crate) fn update<T>(&mut self, f: impl FnOnce(&mut ArrayD<E>) -> T) -> T {
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

impl<E: Element> Drop for Buffer<E> {
    fn drop(&mut self) {
        memory::on_free(self.bytes);
    }
}

impl<E: Element> Buffer<E> {
    /// Gives the array back, uncounted from now on.
    pub(crate) fn into_array(mut self) -> ArrayD<E> {
        memory::on_free(self.bytes);
        self.bytes = 0;
        std::mem::take(&mut self.array)
    }
}
