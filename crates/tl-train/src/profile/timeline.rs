//! [`Timeline`]: the live tensor bytes of recorded training steps, allocation by allocation,
//! cut into the phases of each step.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use tl_tensor::memory;

use crate::model::Checkpointing;

/// A part of a training step, in the order a step runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The previous step's gradients are dropped (freed, not zero-filled).
    ZeroGrad,
    /// A micro-batch's forward pass and loss: activations pile up.
    Forward,
    /// Its backward pass: activations are released as gradients are made.
    Backward,
    /// Clipping, the loss scaler's check when there is one, and the AdamW update.
    Optimizer,
}

impl Phase {
    /// Every phase, in step order.
    pub const ALL: [Phase; 4] = [
        Phase::ZeroGrad,
        Phase::Forward,
        Phase::Backward,
        Phase::Optimizer,
    ];

    /// A short name: `"zero grad"`, `"forward"`, `"backward"` or `"optimizer"`.
    pub const fn name(self) -> &'static str {
        match self {
            Phase::ZeroGrad => "zero grad",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }
}

/// One phase of one step: which, and the range of the timeline's events it produced.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// The recorded step it belongs to, from 0.
    pub step: usize,
    /// The phase.
    pub phase: Phase,
    /// The micro-batch, for forward and backward phases.
    pub micro_batch: Option<usize>,
    /// Indices into [`Timeline::events`].
    pub events: Range<usize>,
}

/// Whether a [`MemoryEvent`] allocated or freed storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventKind {
    /// Storage was allocated.
    Alloc,
    /// Storage was freed.
    Free,
}

/// One allocation or free of tensor storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryEvent {
    /// Allocation or free.
    pub kind: EventKind,
    /// Bytes allocated or freed.
    pub bytes: u64,
    /// The run's live bytes right after it.
    pub live: u64,
}

/// The live tensor bytes of a run over its recorded steps.
///
/// Bytes are counted from the run's own start: whatever was live on the thread before the
/// run built its model is left out, so the figures are the run's alone.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    /// What the run was (`"plain"`, `"per-block checkpointing"`, ...).
    pub label: String,
    /// How the run's blocks kept their activations.
    pub checkpointing: Checkpointing,
    /// Live bytes when the first recorded step began.
    pub start_live: u64,
    /// Every allocation and free, in order.
    pub events: Vec<MemoryEvent>,
    /// The phases, in order; together they cover `events` without gaps.
    pub spans: Vec<Span>,
    /// The loss of each recorded step (the rows-weighted mean over its micro-batches).
    pub losses: Vec<f64>,
    /// The wall time of each recorded step, in seconds, the meter's recording included
    /// (absent from profiles of earlier builds).
    #[serde(default)]
    pub step_seconds: Vec<f64>,
}

/// The highest live bytes of a timeline, and where.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peak {
    /// The bytes.
    pub bytes: u64,
    /// The event right after which they were live; `None` when nothing rose above the
    /// start.
    pub event: Option<usize>,
}

impl Timeline {
    /// An empty timeline starting at `start_live` bytes.
    pub(super) fn new(label: String, checkpointing: Checkpointing, start_live: u64) -> Self {
        Self {
            label,
            checkpointing,
            start_live,
            events: Vec::new(),
            spans: Vec::new(),
            losses: Vec::new(),
            step_seconds: Vec::new(),
        }
    }

    /// What the first micro-batch's forward pass left alive for its backward: live bytes at
    /// the end of the first forward span less those at its start (the activations every
    /// op saved, the checkpoints' inputs and kept results, the loss). `None` if no forward
    /// was recorded.
    pub fn held_for_backward(&self) -> Option<u64> {
        let span = self
            .spans
            .iter()
            .find(|span| span.phase == Phase::Forward)?;
        let start = self.live_before(span.events.start);
        Some(self.live_before(span.events.end).saturating_sub(start))
    }

    /// The most the optimizer's update allocated above what was live when it began, over
    /// the recorded steps: its temporaries beyond the gradients (`None` without an update).
    pub fn update_extra(&self) -> Option<u64> {
        self.spans
            .iter()
            .filter(|span| span.phase == Phase::Optimizer)
            .map(|span| self.span_peak(span) - self.live_before(span.events.start))
            .max()
    }

    /// The median of [`Timeline::step_seconds`], as `tinyllm bench` takes it (`None` when
    /// no step was timed).
    pub fn median_step_seconds(&self) -> Option<f64> {
        crate::bench::Spread::of(&self.step_seconds).map(|spread| spread.median)
    }

    /// Appends the meter's `events` of one phase, with live bytes taken relative to `base`.
    pub(super) fn push_phase(
        &mut self,
        step: usize,
        phase: Phase,
        micro_batch: Option<usize>,
        events: &[memory::Event],
        base: usize,
    ) {
        let first = self.events.len();
        // A retag moves no bytes: the timeline of live bytes has no place for it.
        self.events.extend(events.iter().filter_map(|event| {
            let kind = match event.kind {
                memory::EventKind::Alloc => EventKind::Alloc,
                memory::EventKind::Free => EventKind::Free,
                memory::EventKind::Retag => return None,
            };
            Some(MemoryEvent {
                kind,
                bytes: event.bytes as u64,
                live: event.live_after.saturating_sub(base) as u64,
            })
        }));
        self.spans.push(Span {
            step,
            phase,
            micro_batch,
            events: first..self.events.len(),
        });
    }

    /// Live bytes just before event `index` (the start for the first event).
    pub fn live_before(&self, index: usize) -> u64 {
        match index.checked_sub(1) {
            Some(previous) => self.events[previous].live,
            None => self.start_live,
        }
    }

    /// The highest live bytes over the whole timeline, the start included.
    pub fn peak(&self) -> Peak {
        self.events.iter().enumerate().fold(
            Peak {
                bytes: self.start_live,
                event: None,
            },
            |peak, (index, event)| {
                if event.live > peak.bytes {
                    Peak {
                        bytes: event.live,
                        event: Some(index),
                    }
                } else {
                    peak
                }
            },
        )
    }

    /// The highest live bytes during `span`, counting the level it started from.
    pub fn span_peak(&self, span: &Span) -> u64 {
        self.events[span.events.clone()]
            .iter()
            .map(|event| event.live)
            .fold(self.live_before(span.events.start), u64::max)
    }

    /// The highest live bytes during any span of `phase`, or `None` if none was recorded.
    pub fn phase_peak(&self, phase: Phase) -> Option<u64> {
        self.spans
            .iter()
            .filter(|span| span.phase == phase)
            .map(|span| self.span_peak(span))
            .max()
    }

    /// The span holding event `index`.
    pub fn span_of(&self, index: usize) -> Option<&Span> {
        self.spans.iter().find(|span| span.events.contains(&index))
    }

    /// How many allocations and how many frees the timeline holds.
    pub fn counts(&self) -> (usize, usize) {
        let allocs = self
            .events
            .iter()
            .filter(|event| event.kind == EventKind::Alloc)
            .count();
        (allocs, self.events.len() - allocs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: memory::EventKind, bytes: usize, live_after: usize) -> memory::Event {
        memory::Event {
            kind,
            bytes,
            live_after,
            tag: Default::default(),
            previous: None,
        }
    }

    /// A made-up step on top of 1000 bytes of someone else's tensors: the run starts at 100
    /// of its own, allocates 50 and 30 in forward, frees 30 and 50 and allocates 20 in
    /// backward, and the optimizer touches nothing.
    fn timeline() -> Timeline {
        use memory::EventKind::{Alloc, Free};
        let mut timeline = Timeline::new("plain".into(), Checkpointing::Off, 100);
        let forward = [event(Alloc, 50, 1150), event(Alloc, 30, 1180)];
        let backward = [
            event(Free, 30, 1150),
            event(Alloc, 20, 1170),
            event(Free, 50, 1120),
        ];
        timeline.push_phase(0, Phase::Forward, Some(0), &forward, 1000);
        timeline.push_phase(0, Phase::Backward, Some(0), &backward, 1000);
        timeline.push_phase(0, Phase::Optimizer, None, &[], 1000);
        timeline
    }

    #[test]
    fn live_bytes_are_the_runs_own_and_spans_tile_the_events() {
        let timeline = timeline();
        let live: Vec<u64> = timeline.events.iter().map(|e| e.live).collect();
        assert_eq!(live, [150, 180, 150, 170, 120]);
        let ranges: Vec<Range<usize>> = timeline.spans.iter().map(|s| s.events.clone()).collect();
        assert_eq!(ranges, [0..2, 2..5, 5..5]);
        assert_eq!(timeline.counts(), (3, 2));
        assert_eq!(timeline.live_before(0), 100);
        assert_eq!(timeline.live_before(3), 150);
    }

    #[test]
    fn the_peak_is_the_highest_level_and_each_phase_has_its_own() {
        let timeline = timeline();
        assert_eq!(
            timeline.peak(),
            Peak {
                bytes: 180,
                event: Some(1)
            }
        );
        assert_eq!(timeline.span_of(1).unwrap().phase, Phase::Forward);
        // Backward starts at 180, the level forward left: that is its peak too.
        assert_eq!(timeline.phase_peak(Phase::Forward), Some(180));
        assert_eq!(timeline.phase_peak(Phase::Backward), Some(180));
        // An empty phase peaks at the level it starts from.
        assert_eq!(timeline.phase_peak(Phase::Optimizer), Some(120));
        assert_eq!(timeline.phase_peak(Phase::ZeroGrad), None);
    }

    #[test]
    fn a_timeline_that_never_rises_peaks_at_its_start() {
        let mut timeline = Timeline::new("flat".into(), Checkpointing::PerBlock, 64);
        let free = [event(memory::EventKind::Free, 64, 0)];
        timeline.push_phase(0, Phase::ZeroGrad, None, &free, 0);
        assert_eq!(
            timeline.peak(),
            Peak {
                bytes: 64,
                event: None
            }
        );
    }
}
