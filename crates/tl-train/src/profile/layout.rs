//! A common x axis for timelines that record the same phases with different numbers of
//! events.
//!
//! A checkpointed run makes more allocations than a plain one (its backward reruns each
//! block's forward), so plotting both against their own event index would put their
//! backward passes in different places. Instead each phase gets one interval of the axis,
//! as wide as the largest number of events any run made in it, and each run spreads its
//! events evenly over the interval. Within a phase x still counts events (of the busier
//! run), and phase boundaries line up across runs. A phase in which no run allocates
//! (AdamW updates in place) would have no width at all, so every phase is given at least
//! 2% of the busiest run's events: on a chart about 870 pixels wide, room for its name
//! written turned along it.

use std::ops::Range;

use super::timeline::{Span, Timeline};

/// The least width of a phase, as a share of the events of the busiest run.
const MIN_PHASE_SHARE: f64 = 0.02;

/// Timelines placed on a common x axis.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    /// The x interval of each span (the spans every timeline shares, in order).
    pub spans: Vec<Range<f64>>,
    /// Each timeline's `(x, live bytes)` points: the start, then one per event.
    pub points: Vec<Vec<(f64, u64)>>,
}

/// Places `timelines` on one x axis (see the module's documentation).
///
/// # Panics
/// If the timelines do not have the same spans (step, phase and micro-batch) in the same
/// order: they would not be runs of one step config.
///
/// ```
/// use tl_train::model::{Checkpointing, Preset};
/// use tl_train::profile::{ProfileConfig, align, compare};
/// use tl_train::train::{DataSource, TrainConfig};
///
/// let mut train = TrainConfig::for_preset(Preset::Tiny);
/// train.data = DataSource::Builtin { seed: 0, bytes: 20_000 };
/// (train.micro_batch, train.accum, train.checkpointing) = (2, 1, Checkpointing::PerBlock);
/// let profile = compare(&ProfileConfig { train, steps: 1 })?;
/// let layout = align(&profile.runs);
/// // Both runs end where the last phase ends.
/// let end = layout.spans.last().unwrap().end;
/// assert!(layout.points.iter().all(|run| run.last().unwrap().0 == end));
/// # Ok::<(), tl_train::TrainError>(())
/// ```
pub fn align(timelines: &[Timeline]) -> Layout {
    let Some(first) = timelines.first() else {
        return Layout {
            spans: Vec::new(),
            points: Vec::new(),
        };
    };
    let key = |span: &Span| (span.step, span.phase, span.micro_batch);
    for timeline in timelines {
        assert!(
            timeline.spans.len() == first.spans.len()
                && timeline
                    .spans
                    .iter()
                    .map(key)
                    .eq(first.spans.iter().map(key)),
            "align: `{}` and `{}` do not record the same phases",
            first.label,
            timeline.label
        );
    }
    let most_events = timelines.iter().map(|t| t.events.len()).max().unwrap_or(0);
    let min_width = (MIN_PHASE_SHARE * most_events as f64).max(1.0);
    let mut spans = Vec::with_capacity(first.spans.len());
    let mut x = 0.0;
    for index in 0..first.spans.len() {
        let events = timelines
            .iter()
            .map(|t| t.spans[index].events.len())
            .max()
            .unwrap_or(0);
        let width = (events as f64).max(min_width);
        spans.push(x..x + width);
        x += width;
    }
    let points = timelines
        .iter()
        .map(|timeline| {
            let mut points = Vec::with_capacity(timeline.events.len() + 1);
            points.push((0.0, timeline.start_live));
            for (span, interval) in timeline.spans.iter().zip(&spans) {
                let count = span.events.len();
                let step = (interval.end - interval.start) / count.max(1) as f64;
                for (k, event) in timeline.events[span.events.clone()].iter().enumerate() {
                    points.push((interval.start + step * (k + 1) as f64, event.live));
                }
                if count == 0 {
                    // Carry the level across a phase without events.
                    points.push((interval.end, timeline.live_before(span.events.start)));
                }
            }
            points
        })
        .collect();
    Layout { spans, points }
}

#[cfg(test)]
mod tests {
    use tl_tensor::memory::{Event, EventKind};

    use super::*;
    use crate::model::Checkpointing;
    use crate::profile::Phase;

    /// A timeline of one forward, one backward and an empty optimizer phase, with the given
    /// live levels after each event.
    fn timeline(forward: &[usize], backward: &[usize]) -> Timeline {
        let events = |levels: &[usize]| -> Vec<Event> {
            levels
                .iter()
                .map(|&live_after| Event {
                    kind: EventKind::Alloc,
                    bytes: 1,
                    live_after,
                    tag: Default::default(),
                    previous: None,
                })
                .collect()
        };
        let mut timeline = Timeline::new("t".into(), Checkpointing::Off, 10);
        timeline.push_phase(0, Phase::Forward, Some(0), &events(forward), 0);
        timeline.push_phase(0, Phase::Backward, Some(0), &events(backward), 0);
        timeline.push_phase(0, Phase::Optimizer, None, &[], 0);
        timeline
    }

    #[test]
    fn each_phase_is_as_wide_as_its_busiest_run_and_the_others_stretch() {
        let plain = timeline(&[20, 30], &[25, 15]);
        let checkpointed = timeline(&[20, 12], &[22, 30, 26, 18, 14, 15]);
        let layout = align(&[plain, checkpointed]);
        // Forward: 2 events in both; backward: 6 in the checkpointed run; the empty optimizer
        // phase gets the minimum of one unit (2% of 8 events is less).
        assert_eq!(layout.spans, [0.0..2.0, 2.0..8.0, 8.0..9.0]);
        // The plain run's two backward events spread over 6 units: at 5 and 8.
        assert_eq!(
            layout.points[0],
            [
                (0.0, 10),
                (1.0, 20),
                (2.0, 30),
                (5.0, 25),
                (8.0, 15),
                (9.0, 15)
            ]
        );
        assert_eq!(layout.points[1][3..6], [(3.0, 22), (4.0, 30), (5.0, 26)]);
        assert_eq!(layout.points[1].last(), Some(&(9.0, 15)));
    }

    #[test]
    #[should_panic(expected = "do not record the same phases")]
    fn timelines_of_different_steps_cannot_be_aligned() {
        let mut other = timeline(&[1], &[1]);
        other.spans.pop();
        align(&[timeline(&[1], &[1]), other]);
    }
}
