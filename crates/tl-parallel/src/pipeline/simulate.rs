//! [`simulate`]: runs a [`Schedule`] without communicating — each rank walks its list, a
//! compute action takes the time [`Costs`] gives it, a send takes no time of the sender's
//! and its message arrives `latency` later, a receive waits for its message. It checks the
//! schedule and times it:
//!
//! - **Complete and consistent.** Every stage runs the forward and the backward of every
//!   micro-batch once, on the rank that holds the stage; a forward comes after the receive
//!   of its input, a backward after its forward and the receive of its output's gradient, a
//!   weight gradient after its input gradient; every send has one receive and every
//!   receive one send. The first action that breaks a rule is named.
//! - **No deadlock.** When no rank can go on and some have actions left, every one of them
//!   waits on a receive whose send never comes (or comes after a receive that waits on it):
//!   the first such receive is named.
//! - **Timed.** Each rank's busy and idle time until the last rank ends, and the most
//!   micro-batches' activations it held at once (from a stage's forward to the end of its
//!   backward, or of its weight gradient when the backward is split).

use std::collections::HashMap;

use super::ScheduleError;
use super::schedule::{Action, Schedule};

/// How long each kind of action takes, in any unit (integers keep the simulation exact).
/// Costs are those of one stage; for an interleaved schedule, of one of a rank's `v`
/// stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Costs {
    /// A stage's forward pass.
    pub forward: u64,
    /// A stage's whole backward pass (`input + weight` when it is split).
    pub backward: u64,
    /// The input's gradient alone (zero-bubble's `B`).
    pub backward_input: u64,
    /// The weights' gradient alone (zero-bubble's `W`).
    pub backward_weight: u64,
    /// From a send to its message's arrival.
    pub latency: u64,
}

impl Costs {
    /// The usual assumption of the papers: a backward takes twice a forward, half of it
    /// the input's gradient and half the weights', and messages take no time.
    pub const UNIT: Costs = Costs {
        forward: 1,
        backward: 2,
        backward_input: 1,
        backward_weight: 1,
        latency: 0,
    };

    fn of(&self, action: Action) -> u64 {
        match action {
            Action::Forward { .. } => self.forward,
            Action::Backward { .. } => self.backward,
            Action::BackwardInput { .. } => self.backward_input,
            Action::BackwardWeight { .. } => self.backward_weight,
            _ => 0,
        }
    }
}

/// One rank's part of a simulated step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankTimeline {
    /// Each action with its start and end time, in the rank's order.
    pub spans: Vec<(Action, u64, u64)>,
    /// Time spent computing.
    pub busy: u64,
    /// Time spent waiting, until the step's end ([`Simulation::makespan`]).
    pub idle: u64,
    /// The most micro-batches (of any of the rank's stages) whose activations it held at
    /// once.
    pub peak_activations: usize,
}

impl RankTimeline {
    /// The rank's idle share of the step: `idle / (busy + idle)`.
    pub fn idle_fraction(&self) -> f64 {
        self.idle as f64 / (self.busy + self.idle) as f64
    }

    /// The bubble as Narayanan et al. count it: idle time over compute time, `idle / busy`
    /// (`(p − 1)/m` for GPipe and 1F1B).
    pub fn bubble_ratio(&self) -> f64 {
        self.idle as f64 / self.busy as f64
    }
}

/// A simulated step: each rank's timeline and the step's length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Simulation {
    /// Rank by rank.
    pub ranks: Vec<RankTimeline>,
    /// When the last rank ends.
    pub makespan: u64,
}

/// What a message carries: activations (forward) or gradients (backward), of a stage's
/// output, for a micro-batch. The sending stage names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Message {
    Activation { from: usize, micro_batch: usize },
    Gradient { from: usize, micro_batch: usize },
}

/// Runs `schedule` with `costs` (see the [module docs](self)).
///
/// # Errors
/// [`ScheduleError::Inconsistent`] naming the rank, the action and the rule it breaks;
/// [`ScheduleError::Deadlock`] naming the first receive that would wait forever.
///
/// ```
/// use tl_parallel::pipeline::{Costs, Schedule, ScheduleKind, simulate};
/// // 1F1B over 4 ranks, 8 micro-batches: the bubble is (p − 1)/m of the compute.
/// let schedule = Schedule::new(ScheduleKind::OneFOneB, 4, 8, 1)?;
/// let run = simulate(&schedule, Costs::UNIT)?;
/// assert!(run.ranks.iter().all(|r| r.bubble_ratio() == 3.0 / 8.0));
/// assert_eq!(run.ranks[0].peak_activations, 4); // p − r
/// # Ok::<(), tl_parallel::pipeline::ScheduleError>(())
/// ```
pub fn simulate(schedule: &Schedule, costs: Costs) -> Result<Simulation, ScheduleError> {
    simulate_with(schedule, &|_, action| costs.of(action), costs.latency)
}

/// [`simulate`] with each action's own time: `cost(rank, action)` (0 for a message, which
/// takes `latency` to arrive), as a run measured them, so that stages of unequal times
/// (the first with the embedding, the last with the head and the loss) are timed as they
/// ran.
///
/// # Errors
/// As [`simulate`].
pub fn simulate_with(
    schedule: &Schedule,
    cost: &dyn Fn(usize, Action) -> u64,
    latency: u64,
) -> Result<Simulation, ScheduleError> {
    let costs = Costs {
        latency,
        ..Costs::UNIT
    };
    check(schedule)?;
    let p = schedule.ranks();
    let mut next = vec![0usize; p];
    let mut clock = vec![0u64; p];
    let mut spans: Vec<Vec<(Action, u64, u64)>> = vec![Vec::new(); p];
    // When each message arrives, once it is sent.
    let mut arrivals: HashMap<Message, u64> = HashMap::new();
    loop {
        let mut moved = false;
        for rank in 0..p {
            while let Some(&action) = schedule.actions(rank).get(next[rank]) {
                let start = match receives(action) {
                    Some(message) => match arrivals.get(&message) {
                        Some(&arrival) => clock[rank].max(arrival),
                        None => break,
                    },
                    None => clock[rank],
                };
                let end = start
                    + if action.computes() {
                        cost(rank, action)
                    } else {
                        0
                    };
                if let Some(message) = sends(action) {
                    arrivals.insert(message, end + costs.latency);
                }
                spans[rank].push((action, start, end));
                clock[rank] = end;
                next[rank] += 1;
                moved = true;
            }
        }
        if (0..p).all(|r| next[r] == schedule.actions(r).len()) {
            break;
        }
        if !moved {
            let rank = (0..p)
                .find(|&r| next[r] < schedule.actions(r).len())
                .expect("a rank with actions left");
            return Err(ScheduleError::Deadlock {
                rank,
                action: schedule.actions(rank)[next[rank]],
                index: next[rank],
            });
        }
    }
    let makespan = clock.iter().copied().max().unwrap_or(0);
    let ranks = spans
        .into_iter()
        .map(|spans| {
            let busy = (spans.iter())
                .filter(|(action, ..)| action.computes())
                .map(|(_, start, end)| end - start)
                .sum();
            let peak_activations = peak_held(&spans);
            RankTimeline {
                busy,
                idle: makespan - busy,
                peak_activations,
                spans,
            }
        })
        .collect();
    Ok(Simulation { ranks, makespan })
}

/// The message `action` waits for, if it is a receive.
fn receives(action: Action) -> Option<Message> {
    match action {
        Action::RecvActivation { stage, micro_batch } => Some(Message::Activation {
            from: stage.checked_sub(1)?,
            micro_batch,
        }),
        Action::RecvGradient { stage, micro_batch } => Some(Message::Gradient {
            from: stage + 1,
            micro_batch,
        }),
        _ => None,
    }
}

/// The message `action` sends, if it is a send.
fn sends(action: Action) -> Option<Message> {
    match action {
        Action::SendActivation { stage, micro_batch } => Some(Message::Activation {
            from: stage,
            micro_batch,
        }),
        Action::SendGradient { stage, micro_batch } => Some(Message::Gradient {
            from: stage,
            micro_batch,
        }),
        _ => None,
    }
}

/// The most micro-batches whose activations a rank held at once: from each forward to the
/// end of the backward that frees them (the weight gradient's, when split).
fn peak_held(spans: &[(Action, u64, u64)]) -> usize {
    let mut held = 0usize;
    let mut peak = 0;
    for (action, ..) in spans {
        match action {
            Action::Forward { .. } => {
                held += 1;
                peak = peak.max(held);
            }
            Action::Backward { .. } | Action::BackwardWeight { .. } => held -= 1,
            _ => {}
        }
    }
    peak
}

/// The rules of the [module docs](self), checked on the lists alone.
fn check(schedule: &Schedule) -> Result<(), ScheduleError> {
    let (p, stages, m) = (
        schedule.ranks(),
        schedule.stages(),
        schedule.micro_batches(),
    );
    let inconsistent = |rank: usize, index: usize, action: Action, reason: String| {
        Err(ScheduleError::Inconsistent {
            rank,
            index,
            action,
            reason,
        })
    };
    // Per (stage, micro-batch): what has been done so far on its rank.
    #[derive(Clone, Copy, Default)]
    struct Done {
        received_input: bool,
        forward: bool,
        received_gradient: bool,
        input_gradient: bool,
        whole_backward: bool,
        weight_gradient: bool,
        sent_output: bool,
        sent_gradient: bool,
    }
    let mut done = vec![vec![Done::default(); m]; stages];
    for rank in 0..p {
        let mut ended = false;
        for (index, &action) in schedule.actions(rank).iter().enumerate() {
            let Some((stage, micro_batch)) = action.work() else {
                let order_ok = match action {
                    Action::ReduceGradients => !ended,
                    _ => true,
                };
                if !order_ok {
                    return inconsistent(rank, index, action, "the step's end twice".into());
                }
                ended |= action == Action::OptimizerStep;
                continue;
            };
            if ended {
                return inconsistent(rank, index, action, "after the optimizer step".into());
            }
            if stage >= stages || micro_batch >= m {
                return inconsistent(
                    rank,
                    index,
                    action,
                    format!("the step has {stages} stages and {m} micro-batches"),
                );
            }
            if schedule.rank_of(stage) != rank {
                return inconsistent(
                    rank,
                    index,
                    action,
                    format!("stage {stage} is on rank {}", schedule.rank_of(stage)),
                );
            }
            let (first, last) = (stage == 0, stage + 1 == stages);
            let d = &mut done[stage][micro_batch];
            let broken = match action {
                Action::RecvActivation { .. } if first => Some("the first stage reads its input"),
                Action::RecvActivation { .. } if d.received_input => Some("received twice"),
                Action::RecvActivation { .. } => {
                    d.received_input = true;
                    None
                }
                Action::Forward { .. } if d.forward => Some("a second forward"),
                Action::Forward { .. } if !first && !d.received_input => {
                    Some("a forward before its input is received")
                }
                Action::Forward { .. } => {
                    d.forward = true;
                    None
                }
                Action::SendActivation { .. } if last => Some("the last stage sends no output"),
                Action::SendActivation { .. } if !d.forward || d.sent_output => {
                    Some("a send of an output not computed, or sent twice")
                }
                Action::SendActivation { .. } => {
                    d.sent_output = true;
                    None
                }
                Action::RecvGradient { .. } if last => {
                    Some("the last stage's gradient is the loss's")
                }
                Action::RecvGradient { .. } if d.received_gradient => Some("received twice"),
                Action::RecvGradient { .. } => {
                    d.received_gradient = true;
                    None
                }
                Action::Backward { .. } | Action::BackwardInput { .. }
                    if d.input_gradient || d.whole_backward =>
                {
                    Some("a second backward")
                }
                Action::Backward { .. } | Action::BackwardInput { .. } if !d.forward => {
                    Some("a backward before its forward")
                }
                Action::Backward { .. } | Action::BackwardInput { .. }
                    if !last && !d.received_gradient =>
                {
                    Some("a backward before its output's gradient is received")
                }
                Action::Backward { .. } => {
                    d.whole_backward = true;
                    None
                }
                Action::BackwardInput { .. } => {
                    d.input_gradient = true;
                    None
                }
                Action::BackwardWeight { .. } if !d.input_gradient || d.weight_gradient => {
                    Some("a weight gradient before its input gradient, or twice")
                }
                Action::BackwardWeight { .. } => {
                    d.weight_gradient = true;
                    None
                }
                Action::SendGradient { .. } if first => Some("the first stage sends no gradient"),
                Action::SendGradient { .. }
                    if !(d.whole_backward || d.input_gradient) || d.sent_gradient =>
                {
                    Some("a send of a gradient not computed, or sent twice")
                }
                Action::SendGradient { .. } => {
                    d.sent_gradient = true;
                    None
                }
                Action::ReduceGradients | Action::OptimizerStep => unreachable!("no work"),
            };
            if let Some(reason) = broken {
                return inconsistent(rank, index, action, reason.into());
            }
        }
        let last_two = schedule.actions(rank).iter().rev().take(2).copied();
        if !last_two.eq([Action::OptimizerStep, Action::ReduceGradients]) {
            let index = schedule.actions(rank).len();
            return Err(ScheduleError::Incomplete {
                rank,
                missing: "the step's end: REDUCE_GRAD then STEP, last".into(),
                index,
            });
        }
    }
    // Everything done once, every message sent and received.
    for (stage, micro_batches) in done.iter().enumerate() {
        let (first, last) = (stage == 0, stage + 1 == stages);
        for (micro_batch, d) in micro_batches.iter().enumerate() {
            let backward = d.whole_backward || (d.input_gradient && d.weight_gradient);
            let missing = if !d.forward {
                Some(Action::Forward { stage, micro_batch })
            } else if !backward {
                Some(match d.input_gradient {
                    true => Action::BackwardWeight { stage, micro_batch },
                    false => Action::Backward { stage, micro_batch },
                })
            } else if !last && !d.sent_output {
                Some(Action::SendActivation { stage, micro_batch })
            } else if !first && !d.sent_gradient {
                Some(Action::SendGradient { stage, micro_batch })
            } else {
                None
            };
            if let Some(action) = missing {
                return Err(ScheduleError::Incomplete {
                    rank: schedule.rank_of(stage),
                    missing: action.to_string(),
                    index: schedule.actions(schedule.rank_of(stage)).len(),
                });
            }
        }
    }
    Ok(())
}
