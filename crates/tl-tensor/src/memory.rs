//! A meter of live tensor storage: the bytes held by tensor values and gradients, now and at
//! their peak — the analogue of `torch.cuda.memory_allocated` / `max_memory_allocated`.
//!
//! The meter is per thread. A [`Tensor`](crate::Tensor) never leaves the thread that made it,
//! so every allocation and free of its storage is seen by the same thread's meter, and tests
//! running in parallel threads do not disturb each other's figures.

use std::cell::{Cell, RefCell};

/// Whether an [`Event`] is an allocation or a free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// Storage was allocated.
    Alloc,
    /// Storage was freed.
    Free,
}

/// One allocation or free seen by the meter, for timelines (see [`record`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// Allocation or free.
    pub kind: EventKind,
    /// Bytes allocated or freed.
    pub bytes: usize,
    /// Live bytes right after the event.
    pub live_after: usize,
}

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
    static RECORDING: RefCell<Option<Vec<Event>>> = const { RefCell::new(None) };
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

fn note(kind: EventKind, bytes: usize, live_after: usize) {
    RECORDING.with(|r| {
        if let Ok(mut guard) = r.try_borrow_mut()
            && let Some(events) = guard.as_mut()
        {
            events.push(Event {
                kind,
                bytes,
                live_after,
            });
        }
    });
}

/// Counts `bytes` of storage that is not a tensor's but belongs to this thread's figures (a
/// communication buffer of data parallelism, say), as allocated now. Pair every call with an
/// [`on_free`] of the same bytes when the storage goes, or the meter drifts.
pub fn on_alloc(bytes: usize) {
    if bytes == 0 {
        return;
    }
    let live = LIVE.with(|live| {
        let now = live.get() + bytes;
        live.set(now);
        now
    });
    PEAK.with(|peak| peak.set(peak.get().max(live)));
    note(EventKind::Alloc, bytes, live);
}

/// Counts `bytes` counted by [`on_alloc`] as freed now.
pub fn on_free(bytes: usize) {
    if bytes == 0 {
        return;
    }
    let live = LIVE.with(|live| {
        let now = live.get().saturating_sub(bytes);
        live.set(now);
        now
    });
    note(EventKind::Free, bytes, live);
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
