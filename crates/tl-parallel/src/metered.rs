//! [`Metered`]: a flat buffer of data parallelism (a bucket, a shard, a gathered run) on
//! tl-tensor's memory meter, so that a rank's figures include what tl-parallel itself holds,
//! not only tensors.
//!
//! A buffer of a [meta](tl_tensor::meta) run has a length and no values: it is counted on
//! the meter as the real one is, at the same moments, and a collective gets it as a
//! shape-only slice ([`Slice::Shape`]), which [`Phantom`](tl_collective::Phantom) counts as
//! the ring would send it. Code that moves values asks for them ([`Metered::values`]) and
//! has nothing to do on a meta buffer.

use std::ops::Range;

use tl_collective::{Slice, SliceMut};
use tl_tensor::Tensor;
use tl_tensor::memory::{self, Kind, Tag};

use crate::ddp::GradElement;

/// The labels of tl-parallel's buffers and shards on the meter.
pub mod labels {
    /// Weighted gradients on their way into a reduction (DDP's all-reduce, a ZeRO
    /// reduce-scatter's input).
    pub const GRADIENT_BUCKET: &str = "gradient bucket";
    /// A rank's shard of a reduce-scatter's result.
    pub const REDUCED_SHARD: &str = "reduced shard";
    /// A rank's shard of the weights on its way into an all-gather.
    pub const SHARD_TO_GATHER: &str = "shard to gather";
    /// Weights all-gathered from every rank's shard.
    pub const GATHERED_WEIGHTS: &str = "gathered weights";
    /// Rank 0's weights on their way to every rank.
    pub const BROADCAST_WEIGHTS: &str = "broadcast weights";
    /// Optimizer moments gathered from every rank's shard, to save them whole.
    pub const GATHERED_MOMENTS: &str = "gathered moments";
    /// ZeRO-1 and ZeRO-2's 1-D copy of a piece of a parameter in the rank's shard, which
    /// the shard's AdamW updates.
    pub const MASTER_SHARD: &str = "master shard";
    /// Tensor parallelism: the sum over the group of every rank's partial result (a
    /// row-parallel layer's output, reduced in place of a copy).
    pub const TENSOR_PARALLEL_SUM: &str = "tensor-parallel sum";
    /// Sequence parallelism: the whole sequence all-gathered from every rank's rows (before
    /// a column-parallel layer; a gradient in backward).
    pub const SEQUENCE_GATHERED: &str = "sequence gathered";
    /// Sequence parallelism: a rank's rows of a reduce-scattered sum (after a row-parallel
    /// layer; a gradient in backward).
    pub const SEQUENCE_SCATTERED: &str = "sequence scattered";
    /// Tensor parallelism: every rank's columns of a column-parallel output, gathered
    /// before they are interleaved into the whole output.
    pub const OUTPUT_GATHERED: &str = "output gathered";
    /// Sequence parallelism: the gradients of the parameters every rank holds whole,
    /// summed over the group.
    pub const SEQUENCE_PARALLEL_GRADIENTS: &str = "sequence-parallel gradients";
    /// The vocabulary-parallel cross-entropy's per-row statistics (the maximum logit, the
    /// sum of exponentials and the target's logit) on their way through an all-reduce.
    pub const VOCABULARY_STATISTICS: &str = "vocabulary statistics";
    /// Pipeline parallelism: the activations a stage received from the stage before (its
    /// input, kept until its backward).
    pub const PIPELINE_ACTIVATION: &str = "pipeline activation";
    /// Pipeline parallelism: the gradient a stage received for its output, or computed for
    /// its input and about to send back.
    pub const PIPELINE_GRADIENT: &str = "pipeline gradient";
}

/// The tag of a communication buffer labelled `label`, owned by the model's unit `owner`
/// (made in the current stage and micro-batch).
pub(crate) fn communication(label: &'static str, owner: Option<usize>) -> Tag {
    Tag {
        kind: Kind::Communication,
        owner,
        label,
        ..memory::current_tag()
    }
}

/// The unit that owns every one of `tensors`, if they have one in common.
pub(crate) fn common_owner<'a, E: GradElement>(
    mut tensors: impl Iterator<Item = &'a Tensor<E>>,
) -> Option<usize> {
    let owner = tensors.next()?.memory_tag().owner;
    tensors
        .all(|tensor| tensor.memory_tag().owner == owner)
        .then_some(owner)
        .flatten()
}

/// A buffer of `E` whose length is counted on this thread's memory meter, with the tag it
/// was made with, while it lives; holding values, or for a meta run only its length.
pub(crate) struct Metered<E: GradElement> {
    /// The values; empty when meta.
    values: Vec<E>,
    len: usize,
    meta: bool,
    tag: Tag,
}

impl<E: GradElement> Metered<E> {
    /// An empty buffer (nothing on the meter) tagged `tag`, meta when `meta`.
    pub(crate) fn new(meta: bool, tag: Tag) -> Self {
        Self {
            values: Vec::new(),
            len: 0,
            meta,
            tag,
        }
    }

    /// `len` zeros (`len` elements of shape when meta), tagged `tag`.
    pub(crate) fn zeros(len: usize, meta: bool, tag: Tag) -> Self {
        let mut buffer = Self::new(meta, tag);
        buffer.reset(len);
        buffer
    }

    /// Makes the buffer `len` zeros, reusing its allocation (the meter follows the length:
    /// the old length freed, the new one allocated).
    pub(crate) fn reset(&mut self, len: usize) {
        memory::on_free_tagged(self.bytes(), self.tag);
        if !self.meta {
            self.values.clear();
            self.values.resize(len, E::zero());
        }
        self.len = len;
        memory::on_alloc_tagged(self.bytes(), self.tag);
    }

    /// Appends `values` (the extras of the last bucket), on the meter as [`reset`]
    /// (Self::reset) is; a meta buffer only grows.
    pub(crate) fn extend<const N: usize>(&mut self, values: [E; N]) {
        memory::on_free_tagged(self.bytes(), self.tag);
        if !self.meta {
            self.values.extend(values);
        }
        self.len += N;
        memory::on_alloc_tagged(self.bytes(), self.tag);
    }

    /// The values; `None` for a meta buffer.
    pub(crate) fn values(&self) -> Option<&[E]> {
        (!self.meta).then_some(&self.values[..])
    }

    /// The values to write; `None` for a meta buffer.
    pub(crate) fn values_mut(&mut self) -> Option<&mut [E]> {
        (!self.meta).then_some(&mut self.values[..])
    }

    /// The buffer as a collective's input (shape-only when meta).
    pub(crate) fn view(&self) -> Slice<'_> {
        self.part(0..self.len)
    }

    /// Elements `range` as a collective's input (shape-only when meta).
    ///
    /// # Panics
    /// If `range` goes past the end.
    pub(crate) fn part(&self, range: Range<usize>) -> Slice<'_> {
        assert!(range.end <= self.len, "part {range:?} of {}", self.len);
        match self.values() {
            Some(values) => <E as tl_collective::Element>::view(&values[range]),
            None => Slice::shape::<E>(range.len()),
        }
    }

    /// The buffer as a collective's output (shape-only when meta).
    pub(crate) fn view_mut(&mut self) -> SliceMut<'_> {
        let len = self.len;
        match self.values_mut() {
            Some(values) => <E as tl_collective::Element>::view_mut(values),
            None => SliceMut::shape::<E>(len),
        }
    }

    /// The buffer's contents, to be moved into a collective that runs on another thread;
    /// it stays on the meter at its length until [`Metered::restore`] or its drop.
    pub(crate) fn take(&mut self) -> Wire<E> {
        Wire {
            values: std::mem::take(&mut self.values),
            len: self.len,
            meta: self.meta,
        }
    }

    /// Puts back what [`take`](Self::take) moved out.
    ///
    /// # Panics
    /// If `wire` is not this buffer's length.
    pub(crate) fn restore(&mut self, wire: Wire<E>) {
        assert_eq!(wire.len, self.len, "a buffer comes back at its own length");
        self.values = wire.values;
    }

    fn bytes(&self) -> usize {
        self.len * size_of::<E>()
    }
}

/// A [`Metered`] buffer's contents on their way through a collective on the communication
/// thread (shape-only for a meta run, as the buffer is).
pub(crate) struct Wire<E> {
    values: Vec<E>,
    len: usize,
    meta: bool,
}

impl<E: GradElement> Wire<E> {
    /// The contents as a collective's input.
    pub(crate) fn view(&self) -> Slice<'_> {
        match self.meta {
            false => <E as tl_collective::Element>::view(&self.values),
            true => Slice::shape::<E>(self.len),
        }
    }

    /// The contents as a collective's output.
    pub(crate) fn view_mut(&mut self) -> SliceMut<'_> {
        match self.meta {
            false => <E as tl_collective::Element>::view_mut(&mut self.values),
            true => SliceMut::shape::<E>(self.len),
        }
    }
}

impl<E: GradElement> Drop for Metered<E> {
    fn drop(&mut self) {
        memory::on_free_tagged(self.bytes(), self.tag);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_tensor::memory::EventKind;

    fn bucket() -> Tag {
        communication(labels::GRADIENT_BUCKET, Some(2))
    }

    #[test]
    fn a_buffer_is_on_the_meter_while_it_lives() {
        let base = memory::live_bytes();
        let mut buffer = Metered::<f32>::zeros(10, false, bucket());
        assert_eq!(memory::live_bytes(), base + 40);
        buffer.reset(4);
        buffer.extend([1.0, 2.0]);
        assert_eq!(memory::live_bytes(), base + 24);
        assert_eq!(buffer.values(), Some(&[0.0, 0.0, 0.0, 0.0, 1.0, 2.0][..]));
        drop(buffer);
        assert_eq!(memory::live_bytes(), base);
    }

    #[test]
    fn a_meta_buffer_is_counted_as_a_real_one_and_holds_nothing() {
        let run = |meta| {
            memory::record(|| {
                let mut buffer = Metered::<f64>::zeros(6, meta, bucket());
                buffer.extend([0.0; 3]);
                assert_eq!(buffer.view().len(), 9);
                assert_eq!(buffer.values().is_none(), meta);
                assert_eq!(buffer.view().is_shape(), meta);
                assert_eq!((buffer.part(2..5).len(), buffer.view_mut().len()), (3, 9));
            })
            .1
        };
        let (real, meta) = (run(false), run(true));
        assert_eq!(real, meta);
        // Allocated, grown by the extras, freed: every event with the buffer's tag.
        let events: Vec<_> = meta.iter().map(|e| (e.kind, e.bytes, e.tag)).collect();
        assert_eq!(
            events,
            [
                (EventKind::Alloc, 48, bucket()),
                (EventKind::Free, 48, bucket()),
                (EventKind::Alloc, 72, bucket()),
                (EventKind::Free, 72, bucket()),
            ]
        );
    }

    #[test]
    fn a_free_keeps_the_tag_of_its_allocation_whatever_the_scope() {
        let buffer = Metered::<f32>::zeros(3, true, bucket());
        let ((), events) = memory::record(|| {
            let _other = memory::kind_scope(Kind::Temporaries);
            drop(buffer);
        });
        assert_eq!(events[0].tag, bucket());
    }
}
