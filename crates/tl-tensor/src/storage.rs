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
}

impl<E: Element> Buffer<E> {
    pub(crate) fn new(array: ArrayD<E>) -> Self {
        let bytes = array.len() * std::mem::size_of::<E>();
        memory::on_alloc(bytes);
        Self {
            array,
            bytes,
            version: 0,
        }
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
