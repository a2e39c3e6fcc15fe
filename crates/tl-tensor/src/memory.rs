//! A meter of live tensor storage: the bytes held by tensor values and gradients, now and at
//! their peak — the analogue of `torch.cuda.memory_allocated` / `max_memory_allocated`.
//!
//! The meter is per thread. A [`Tensor`](crate::Tensor) never leaves the thread that made it,
//! so every allocation and free of its storage is seen by the same thread's meter, and tests
//! running in parallel threads do not disturb each other's figures.
//!
//! # Tags
//!
//! Every allocation carries a [`Tag`]: what [`Kind`] of storage it is, which unit of the
//! model owns it, and a label naming its role. The [recorded](record) events carry the tags,
//! so a timeline says not only how many bytes are live but whose and what they are (the
//! plan's tables are sums of tags). The tags come from scope guards set where the knowledge
//! lives — [`owner_scope`] by the model's unit hook, [`kind_scope`] by an optimizer or by
//! data parallelism's buffers, [`label_scope`] by the layer that makes an activation — and
//! from the engine itself for what only it knows: a parameter's storage is
//! [`Kind::Weights`], a gradient is [`Kind::GradientsInFlight`] while a backward sweep
//! carries it and [`Kind::Gradients`] once it lands in a leaf's `.grad` (a
//! [`EventKind::Retag`] event), and every op's backward runs in the owner and label scope
//! its forward ran in.
//!
//! ```
//! use tl_tensor::{Tensor, memory::{self, Kind, EventKind}};
//! let ((), events) = memory::record(|| {
//!     let w = {
//!         let _block = memory::owner_scope(Some(3));
//!         Tensor::<f32>::param(tl_tensor::ndarray::ArrayD::ones(vec![4]))
//!     };
//!     let y = {
//!         let _label = memory::label_scope("norm outputs");
//!         w.mul_scalar(2.0)
//!     };
//!     y.sum_all().backward();
//! });
//! let tags: Vec<_> = events.iter().map(|e| (e.kind, e.tag.kind, e.tag.owner, e.tag.label)).collect();
//! assert_eq!(tags[0], (EventKind::Alloc, Kind::Weights, Some(3), ""));
//! assert_eq!(tags[1], (EventKind::Alloc, Kind::Activations, None, "norm outputs"));
//! // The gradient of w lands in its `.grad`: retagged, owned by w's unit.
//! let landed = events.iter().find(|e| e.kind == EventKind::Retag).unwrap();
//! assert_eq!((landed.tag.kind, landed.tag.owner, landed.bytes), (Kind::Gradients, Some(3), 16));
//! ```

use std::cell::{Cell, RefCell};

/// What a piece of storage is for: the first axis of a [`Tag`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// Parameters' values (made by [`Tensor::param`](crate::Tensor::param) and its kin).
    Weights,
    /// Gradients accumulated in leaves' `.grad`.
    Gradients,
    /// Gradients a backward sweep is carrying, not yet in a leaf (or never: an
    /// intermediate's).
    GradientsInFlight,
    /// An optimizer's state (AdamW's moments, a sharded optimizer's master copy).
    OptimizerState,
    /// Results of ops: what a forward pass makes, saved for backward or not. The default.
    #[default]
    Activations,
    /// Buffers that data parallelism sends and receives through.
    Communication,
    /// Anything else a step makes and drops at once.
    Temporaries,
}

/// Which part of a training step made a piece of storage: the second axis of a timeline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// Outside any stage named below (building a model, between steps).
    #[default]
    Other,
    /// A forward pass.
    Forward,
    /// A backward sweep (set by the sweep itself).
    Backward,
    /// A checkpointed segment's forward pass run again during backward.
    Recompute,
    /// Reducing gradients over ranks.
    Reduction,
    /// The optimizer's update (and the checks before it).
    Update,
    /// Gathering sharded weights over ranks.
    Gather,
}

/// Whose and what a piece of storage is, and when it was made: see the [module
/// docs](self).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Tag {
    /// What it is for.
    pub kind: Kind,
    /// The model's unit that owns it (as the model's unit hook numbers its units), if any.
    pub owner: Option<usize>,
    /// The role the code that made it gave it (`"norm outputs"`, say); empty without one.
    pub label: &'static str,
    /// The part of the step that made it.
    pub stage: Stage,
    /// The micro-batch (from 0) whose forward or backward made it, if any.
    pub micro_batch: Option<usize>,
}

/// Whether an [`Event`] is an allocation, a free, or a change of tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// Storage was allocated.
    Alloc,
    /// Storage was freed.
    Free,
    /// Live storage changed its tag (a gradient landing in a leaf); no bytes moved.
    Retag,
}

/// One allocation or free seen by the meter, for timelines (see [`record`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// Allocation, free or change of tag.
    pub kind: EventKind,
    /// Bytes allocated, freed or retagged.
    pub bytes: usize,
    /// Live bytes right after the event.
    pub live_after: usize,
    /// The storage's tag (for a retag, its new one).
    pub tag: Tag,
    /// For a retag, the tag the storage had before.
    pub previous: Option<Tag>,
}

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
    static RECORDING: RefCell<Option<Vec<Event>>> = const { RefCell::new(None) };
    static SCOPE: Cell<Tag> = const {
        Cell::new(Tag {
            kind: Kind::Activations,
            owner: None,
            label: "",
            stage: Stage::Other,
            micro_batch: None,
        })
    };
}

/// The tag an allocation made now gets: the innermost scopes' kind, owner and label.
pub fn current_tag() -> Tag {
    SCOPE.with(Cell::get)
}

/// Restores the tag scope in force when it was made, when dropped.
#[must_use = "the scope ends as soon as the guard is dropped"]
pub struct TagScope {
    previous: Tag,
}

impl Drop for TagScope {
    fn drop(&mut self) {
        SCOPE.with(|scope| scope.set(self.previous));
    }
}

/// Sets the whole tag of allocations made on this thread until the guard drops.
pub fn tag_scope(tag: Tag) -> TagScope {
    TagScope {
        previous: SCOPE.with(|scope| scope.replace(tag)),
    }
}

/// Tags allocations made on this thread until the guard drops as `kind` (owner and label
/// as they are).
pub fn kind_scope(kind: Kind) -> TagScope {
    tag_scope(Tag {
        kind,
        ..current_tag()
    })
}

/// Tags allocations made on this thread until the guard drops as owned by the model's unit
/// `owner` (kind and label as they are).
pub fn owner_scope(owner: Option<usize>) -> TagScope {
    tag_scope(Tag {
        owner,
        ..current_tag()
    })
}

/// Tags allocations made on this thread until the guard drops as made in `stage` (the rest
/// as it is).
pub fn stage_scope(stage: Stage) -> TagScope {
    tag_scope(Tag {
        stage,
        ..current_tag()
    })
}

/// Tags allocations made on this thread until the guard drops as made for micro-batch
/// `micro_batch` (the rest as it is).
pub fn micro_batch_scope(micro_batch: Option<usize>) -> TagScope {
    tag_scope(Tag {
        micro_batch,
        ..current_tag()
    })
}

/// Labels allocations made on this thread until the guard drops with `label` (kind and
/// owner as they are).
pub fn label_scope(label: &'static str) -> TagScope {
    tag_scope(Tag {
        label,
        ..current_tag()
    })
}

/// Bytes of tensor storage alive on this thread now.
pub fn live_bytes() -> usize {
    LIVE.with(Cell::get)
}

/// The highest [`live_bytes`] reached since the thread started or the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.with(Cell::get)
}

/// Sets the peak to the current live bytes, so the next [`peak_bytes`] measures from now.
pub fn reset_peak() {
    PEAK.with(|peak| peak.set(live_bytes()));
}

/// Runs `f` and returns its result with the peak live bytes reached during it, measured above
/// the bytes live before it started (the peak is reset first and left as `f` ended it).
pub fn measure_peak<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = live_bytes();
    reset_peak();
    let out = f();
    (out, peak_bytes() - base)
}

/// Records every allocation and free on this thread while `f` runs, for a memory timeline.
///
/// Nested recordings are not supported: an inner `record` takes the events of its span only,
/// and the outer one misses them.
pub fn record<T>(f: impl FnOnce() -> T) -> (T, Vec<Event>) {
    let previous = RECORDING.with(|r| r.replace(Some(Vec::new())));
    let out = f();
    let events = RECORDING.with(|r| r.replace(previous)).unwrap_or_default();
    (out, events)
}

fn note(kind: EventKind, bytes: usize, live_after: usize, tag: Tag, previous: Option<Tag>) {
    RECORDING.with(|r| {
        if let Ok(mut guard) = r.try_borrow_mut()
            && let Some(events) = guard.as_mut()
        {
            events.push(Event {
                kind,
                bytes,
                live_after,
                tag,
                previous,
            });
        }
    });
}

/// Counts `bytes` of storage that is not a tensor's but belongs to this thread's figures (a
/// communication buffer of data parallelism, say), as allocated now, with the
/// [current tag](current_tag). Pair every call with an [`on_free`] of the same bytes when the
/// storage goes, or the meter drifts.
pub fn on_alloc(bytes: usize) {
    on_alloc_tagged(bytes, current_tag());
}

/// Counts `bytes` counted by [`on_alloc`] as freed now (with the [current tag](current_tag):
/// see [`on_free_tagged`] to name the tag it was allocated with).
pub fn on_free(bytes: usize) {
    on_free_tagged(bytes, current_tag());
}

/// Records that `bytes` of live storage tagged `previous` are tagged `tag` from now on.
pub fn on_retag(bytes: usize, previous: Tag, tag: Tag) {
    if bytes == 0 || previous == tag {
        return;
    }
    note(EventKind::Retag, bytes, live_bytes(), tag, Some(previous));
}

/// [`on_alloc`] with the storage's tag given.
pub fn on_alloc_tagged(bytes: usize, tag: Tag) {
    if bytes == 0 {
        return;
    }
    let live = LIVE.with(|live| {
        let now = live.get() + bytes;
        live.set(now);
        now
    });
    PEAK.with(|peak| peak.set(peak.get().max(live)));
    note(EventKind::Alloc, bytes, live, tag, None);
}

/// [`on_free`] of storage allocated with `tag`.
pub fn on_free_tagged(bytes: usize, tag: Tag) {
    if bytes == 0 {
        return;
    }
    let live = LIVE.with(|live| {
        let now = live.get().saturating_sub(bytes);
        live.set(now);
        now
    });
    note(EventKind::Free, bytes, live, tag, None);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_and_free_move_live_and_peak() {
        let base = live_bytes();
        reset_peak();
        on_alloc(100);
        on_alloc(50);
        on_free(100);
        assert_eq!(live_bytes(), base + 50);
        assert_eq!(peak_bytes(), base + 150);
        reset_peak();
        assert_eq!(peak_bytes(), base + 50);
        on_free(50);
        assert_eq!(live_bytes(), base);
    }

    #[test]
    fn record_sees_events_in_order() {
        let ((), events) = record(|| {
            on_alloc(8);
            on_free(8);
        });
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].kind, EventKind::Alloc);
        assert_eq!(events[1].kind, EventKind::Free);
        assert_eq!(events[0].live_after, events[1].live_after + 8);
    }
}
