//! Pipeline parallelism's schedules: consecutive stages of the model on different ranks,
//! micro-batches streamed through them.
//!
//! - [`schedule`](mod@schedule): a [`Schedule`] is data — each rank's ordered list of
//!   [`Action`]s in a step — written by the generators of GPipe, 1F1B, interleaved 1F1B and
//!   ZB-H1 ([`ScheduleKind`]), or by hand.
//! - [`simulate`](mod@simulate): runs a schedule without communicating, checks that it is
//!   complete and cannot deadlock (naming the first action that breaks it), and times it:
//!   each rank's idle share (the bubble) and the activations it holds at once.
//! - [`execute`](mod@execute): runs a rank's list on the stages of the model it holds,
//!   with point-to-point messages between the stages.

pub mod execute;
pub mod schedule;
pub mod simulate;

pub use execute::{Executed, StageModel, Timed, execute};
pub use schedule::{Action, Schedule, ScheduleKind};
pub use simulate::{Costs, RankTimeline, Simulation, simulate, simulate_with};

/// What is wrong with a schedule, or with the sizes asked of a generator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// A generator cannot make a schedule of these sizes.
    #[error("{schedule}: {value} {what}: {reason}")]
    Invalid {
        /// The schedule asked for.
        schedule: ScheduleKind,
        /// Which size.
        what: &'static str,
        /// Its value.
        value: usize,
        /// Why it cannot be.
        reason: String,
    },
    /// No schedule has this name.
    #[error("unknown schedule {name:?}: one of gpipe, 1f1b, interleaved, zb-h1")]
    UnknownSchedule {
        /// The name given.
        name: String,
    },
    /// An action breaks a rule of the step (see [`simulate`](mod@simulate)).
    #[error("rank {rank}, action {index} ({action}): {reason}")]
    Inconsistent {
        /// The rank whose list holds it.
        rank: usize,
        /// Its place in the list.
        index: usize,
        /// The action.
        action: Action,
        /// The rule it breaks.
        reason: String,
    },
    /// Something a step must do is not in any list.
    #[error("rank {rank} never does {missing} (its list has {index} actions)")]
    Incomplete {
        /// The rank that should.
        rank: usize,
        /// What is missing.
        missing: String,
        /// The length of its list.
        index: usize,
    },
    /// Every rank with actions left waits for a message that never comes.
    #[error(
        "deadlock: rank {rank} waits forever at action {index} ({action}): its message is \
         never sent, or sent only after a receive that waits on this rank"
    )]
    Deadlock {
        /// The first rank that waits.
        rank: usize,
        /// The receive it waits in.
        action: Action,
        /// Its place in the rank's list.
        index: usize,
    },
}
