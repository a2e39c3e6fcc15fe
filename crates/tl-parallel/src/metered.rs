//! [`Metered`]: a communication buffer on tl-tensor's memory meter, so that a rank's figures
//! include what data parallelism itself holds (buckets, gathered weights), not only tensors.

use std::ops::{Deref, DerefMut};

use tl_tensor::memory;

/// A `Vec` of `E` whose length is counted on this thread's memory meter while it lives.
pub(crate) struct Metered<E: Copy + Default> {
    data: Vec<E>,
}

impl<E: Copy + Default> Metered<E> {
    /// An empty buffer (nothing on the meter).
    pub(crate) fn new() -> Self {
        Self { data: Vec::new() }
    }

    /// `len` zeros.
    pub(crate) fn zeros(len: usize) -> Self {
        let mut buffer = Self::new();
        buffer.reset(len);
        buffer
    }

    /// Makes the buffer `len` zeros, reusing its allocation (the meter follows the length).
    pub(crate) fn reset(&mut self, len: usize) {
        memory::on_free(self.bytes());
        self.data.clear();
        self.data.resize(len, E::default());
        memory::on_alloc(self.bytes());
    }

    /// Appends values (the extras of the last bucket), on the meter too.
    pub(crate) fn extend(&mut self, values: impl IntoIterator<Item = E>) {
        memory::on_free(self.bytes());
        self.data.extend(values);
        memory::on_alloc(self.bytes());
    }

    fn bytes(&self) -> usize {
        self.data.len() * size_of::<E>()
    }
}

impl<E: Copy + Default> Deref for Metered<E> {
    type Target = [E];
    fn deref(&self) -> &[E] {
        &self.data
    }
}

impl<E: Copy + Default> DerefMut for Metered<E> {
    fn deref_mut(&mut self) -> &mut [E] {
        &mut self.data
    }
}

impl<E: Copy + Default> Drop for Metered<E> {
    fn drop(&mut self) {
        memory::on_free(self.bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_on_the_meter_while_it_lives() {
        let base = memory::live_bytes();
        let mut buffer = Metered::<f32>::zeros(10);
        assert_eq!(memory::live_bytes(), base + 40);
        buffer.reset(4);
        buffer.extend([1.0, 2.0]);
        assert_eq!(memory::live_bytes(), base + 24);
        drop(buffer);
        assert_eq!(memory::live_bytes(), base);
    }
}
