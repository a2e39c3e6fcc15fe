//! A pipeline schedule as data: for each rank, the ordered list of what it does in one
//! optimizer step ([`Action`]s), as PyTorch's `_Action` lists and DeepSpeed's
//! `PipeInstruction` streams are. The generators ([`Schedule::new`]) write the lists of
//! GPipe, 1F1B, interleaved 1F1B and ZB-H1; [`simulate`](super::simulate) runs any list
//! without communicating, to check it and to time it.
//!
//! **Stages.** The model is cut into `p · v` stages of consecutive blocks. Rank `r` of the
//! `p` ranks holds stages `r, r + p, r + 2p, …` (`v` of them: Megatron's interleaved layout;
//! `v = 1` but for the interleaved schedule). Stage 0 has the embedding and stage `pv − 1`
//! the norm, the head and the loss. Activations flow from stage `s` to `s + 1`, gradients
//! back from `s + 1` to `s`.
//!
//! **Communication.** A compute action is preceded by the receive it needs and followed by
//! the send it enables. A send does not wait for its receive (an `isend`, or a socket's
//! buffer): only a receive blocks. Every message is matched by what it carries — its kind,
//! stage and micro-batch — not by its order on the link.

use std::fmt;

use super::ScheduleError;

/// Which schedule a [`Schedule`] follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// Every micro-batch's forward, then every backward (Huang et al., 2019): a stage holds
    /// the activations of all `m` micro-batches at once.
    GPipe,
    /// One forward, one backward (PipeDream-Flush; Narayanan et al., 2021): after a warm-up
    /// of `p − 1 − r` forwards rank `r` alternates, so it holds at most `p − r` micro-batches'
    /// activations. The same bubble as GPipe.
    OneFOneB,
    /// 1F1B over `v` stages per rank (Narayanan et al., 2021, Megatron-LM): the bubble is
    /// `v` times smaller, for `v` times the messages. `m` must be a multiple of `p`.
    Interleaved,
    /// ZB-H1 (Qi et al., 2023): each backward split into the input's gradient (`B`, which
    /// the previous stage waits for) and the weights' (`W`, which nobody waits for); `W`s
    /// fill the bubbles 1F1B leaves. Every rank holds up to `p` micro-batches' activations
    /// (until their `W`), 1F1B's largest (its first rank's).
    ZeroBubbleH1,
}

impl ScheduleKind {
    /// Every kind, in the order above.
    pub const ALL: [ScheduleKind; 4] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZeroBubbleH1,
    ];

    /// The name the CLI takes: `gpipe`, `1f1b`, `interleaved`, `zb-h1`.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZeroBubbleH1 => "zb-h1",
        }
    }

    /// The papers' bubble (idle over compute time) with equal stages and a backward twice
    /// a forward, split into equal halves (`F = I = W`), for `p` ranks, `m` micro-batches
    /// and `v` stages a rank; with its source and formula, as printed. Narayanan et al.
    /// (2021): `(p − 1)/m` for GPipe and 1F1B, `(1/v)(p − 1)/m` interleaved. Qi et al.
    /// (2023): `(p − 1)(F + I − W)/(m(F + I + W))` for ZB-H1, `(p − 1)/(3m)` here.
    ///
    /// ```
    /// use tl_parallel::pipeline::ScheduleKind;
    /// assert_eq!(ScheduleKind::Interleaved.paper_bubble(4, 8, 2).0, 3.0 / 16.0);
    /// assert_eq!(ScheduleKind::ZeroBubbleH1.paper_bubble(4, 8, 1).0, 3.0 / 24.0);
    /// ```
    pub fn paper_bubble(self, p: usize, m: usize, v: usize) -> (f64, &'static str) {
        let (p, m, v) = (p as f64, m as f64, v as f64);
        match self {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB => {
                ((p - 1.0) / m, "Narayanan et al. 2021, (p - 1)/m")
            }
            ScheduleKind::Interleaved => {
                ((p - 1.0) / (v * m), "Narayanan et al. 2021, (1/v)(p - 1)/m")
            }
            ScheduleKind::ZeroBubbleH1 => (
                (p - 1.0) / (3.0 * m),
                "Qi et al. 2023, (p - 1)(F + I - W)/(m(F + I + W))",
            ),
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ScheduleKind {
    type Err = ScheduleError;

    fn from_str(name: &str) -> Result<Self, ScheduleError> {
        Self::ALL
            .into_iter()
            .find(|kind| kind.name() == name)
            .ok_or_else(|| ScheduleError::UnknownSchedule {
                name: name.to_string(),
            })
    }
}

/// One thing a rank does in a step. `stage` is the stage it concerns (the receiving stage
/// for a receive, the sending one for a send) and `micro_batch` the micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// The stage's forward pass on the micro-batch (on the last stage, the loss too).
    Forward {
        /// The stage.
        stage: usize,
        /// The micro-batch.
        micro_batch: usize,
    },
    /// The stage's whole backward pass: the gradients of its input and of its weights.
    Backward {
        /// The stage.
        stage: usize,
        /// The micro-batch.
        micro_batch: usize,
    },
    /// The gradient of the stage's input alone (zero-bubble's `B`).
    BackwardInput {
        /// The stage.
        stage: usize,
        /// The micro-batch.
        micro_batch: usize,
    },
    /// The gradient of the stage's weights alone (zero-bubble's `W`), after its `B`.
    BackwardWeight {
        /// The stage.
        stage: usize,
        /// The micro-batch.
        micro_batch: usize,
    },
    /// Sends the stage's output activations to stage `stage + 1`.
    SendActivation {
        /// The sending stage.
        stage: usize,
        /// The micro-batch.
        micro_batch: usize,
    },
    /// Receives the stage's input activations from stage `stage − 1`.
    RecvActivation {
        /// The receiving stage.
        stage: usize,
        /// The micro-batch.
        micro_batch: usize,
    },
    /// Sends the gradient of the stage's input to stage `stage − 1`.
    SendGradient {
        /// The sending stage.
        stage: usize,
        /// The micro-batch.
        micro_batch: usize,
    },
    /// Receives the gradient of the stage's output from stage `stage + 1`.
    RecvGradient {
        /// The receiving stage.
        stage: usize,
        /// The micro-batch.
        micro_batch: usize,
    },
    /// Every micro-batch's gradients are in: reduce them over the data-parallel group (and
    /// agree with the other stages on the step: the loss scaler's overflow, the clip norm).
    ReduceGradients,
    /// The optimizer's update.
    OptimizerStep,
}

impl Action {
    /// The stage and micro-batch the action concerns, `None` for the step's last two.
    pub fn work(self) -> Option<(usize, usize)> {
        match self {
            Action::Forward { stage, micro_batch }
            | Action::Backward { stage, micro_batch }
            | Action::BackwardInput { stage, micro_batch }
            | Action::BackwardWeight { stage, micro_batch }
            | Action::SendActivation { stage, micro_batch }
            | Action::RecvActivation { stage, micro_batch }
            | Action::SendGradient { stage, micro_batch }
            | Action::RecvGradient { stage, micro_batch } => Some((stage, micro_batch)),
            Action::ReduceGradients | Action::OptimizerStep => None,
        }
    }

    /// Whether it computes (rather than communicates or ends the step).
    pub fn computes(self) -> bool {
        matches!(
            self,
            Action::Forward { .. }
                | Action::Backward { .. }
                | Action::BackwardInput { .. }
                | Action::BackwardWeight { .. }
        )
    }
}

impl fmt::Display for Action {
    /// PyTorch's short form: `3F1` is stage 3's forward of micro-batch 1; `B`, `I` (input
    /// gradient), `W` (weight gradient), `SEND_F`, `RECV_F`, `SEND_B`, `RECV_B`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (stage, micro_batch) = match self.work() {
            Some(work) => work,
            None => {
                return f.write_str(match self {
                    Action::ReduceGradients => "REDUCE_GRAD",
                    _ => "STEP",
                });
            }
        };
        let code = match self {
            Action::Forward { .. } => "F",
            Action::Backward { .. } => "B",
            Action::BackwardInput { .. } => "I",
            Action::BackwardWeight { .. } => "W",
            Action::SendActivation { .. } => "SEND_F",
            Action::RecvActivation { .. } => "RECV_F",
            Action::SendGradient { .. } => "SEND_B",
            Action::RecvGradient { .. } => "RECV_B",
            Action::ReduceGradients | Action::OptimizerStep => unreachable!("handled above"),
        };
        write!(f, "{stage}{code}{micro_batch}")
    }
}

/// A pipeline schedule: each rank's actions in one optimizer step (see the
/// [module docs](self)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    kind: Option<ScheduleKind>,
    ranks: usize,
    stages_per_rank: usize,
    micro_batches: usize,
    actions: Vec<Vec<Action>>,
}

impl Schedule {
    /// The schedule `kind` over `ranks` ranks (`p`) with `micro_batches` micro-batches (`m`)
    /// a step and `stages_per_rank` stages on each rank (`v`: above 1 only for
    /// [`ScheduleKind::Interleaved`]).
    ///
    /// # Errors
    /// [`ScheduleError::Invalid`] naming the size and the reason when `p`, `m` or `v` is 0,
    /// `v > 1` for a schedule that is not interleaved, `m < p` for 1F1B-like schedules (their
    /// warm-up fills the pipeline with `p` micro-batches; fewer would leave a stage waiting
    /// for one that does not exist), or `m` is not a multiple of `p` for the interleaved one.
    ///
    /// ```
    /// use tl_parallel::pipeline::{Schedule, ScheduleKind};
    /// let schedule = Schedule::new(ScheduleKind::OneFOneB, 2, 3, 1)?;
    /// let last: Vec<String> = schedule.actions(1).iter().map(|a| a.to_string()).collect();
    /// assert_eq!(
    ///     last,
    ///     ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1",
    ///      "1RECV_F2", "1F2", "1B2", "1SEND_B2", "REDUCE_GRAD", "STEP"]
    /// );
    /// # Ok::<(), tl_parallel::pipeline::ScheduleError>(())
    /// ```
    pub fn new(
        kind: ScheduleKind,
        ranks: usize,
        micro_batches: usize,
        stages_per_rank: usize,
    ) -> Result<Self, ScheduleError> {
        let invalid = |what: &'static str, value: usize, reason: String| {
            Err(ScheduleError::Invalid {
                schedule: kind,
                what,
                value,
                reason,
            })
        };
        let (p, m, v) = (ranks, micro_batches, stages_per_rank);
        if p == 0 {
            return invalid("ranks", p, "a pipeline needs at least one rank".into());
        }
        if m == 0 {
            return invalid("micro-batches", m, "a step needs at least one".into());
        }
        if v == 0 {
            return invalid("stages per rank", v, "each rank holds at least one".into());
        }
        if v > 1 && kind != ScheduleKind::Interleaved {
            return invalid(
                "stages per rank",
                v,
                format!(
                    "only the interleaved schedule puts several stages on a rank; {kind} puts one"
                ),
            );
        }
        if kind != ScheduleKind::GPipe && m < p {
            return invalid(
                "micro-batches",
                m,
                format!(
                    "{kind} fills the pipeline of {p} stages with {p} micro-batches before \
                     the first backward, so a step needs at least {p}"
                ),
            );
        }
        if kind == ScheduleKind::Interleaved && !m.is_multiple_of(p) {
            return invalid(
                "micro-batches",
                m,
                format!(
                    "the interleaved schedule sends micro-batches round the {p} ranks in \
                     groups of {p}, so their number must be a multiple of {p}"
                ),
            );
        }
        let orders: Vec<Vec<Action>> = match kind {
            ScheduleKind::GPipe => (0..p).map(|r| gpipe(r, m)).collect(),
            ScheduleKind::OneFOneB => (0..p).map(|r| one_f_one_b(r, p, m)).collect(),
            ScheduleKind::Interleaved => (0..p).map(|r| interleaved(r, p, m, v)).collect(),
            ScheduleKind::ZeroBubbleH1 => (0..p).map(|r| zero_bubble_h1(r, p, m)).collect(),
        };
        let last = p * v - 1;
        let actions = orders
            .into_iter()
            .map(|order| with_communication(&order, last))
            .collect();
        Ok(Self {
            kind: Some(kind),
            ranks: p,
            stages_per_rank: v,
            micro_batches: m,
            actions,
        })
    }

    /// A schedule written by hand (or edited): `actions[r]` is rank `r`'s list. Nothing is
    /// checked here; [`simulate`](super::simulate) checks it.
    ///
    /// # Panics
    /// If `actions` is empty or `stages_per_rank` is 0.
    pub fn from_actions(
        actions: Vec<Vec<Action>>,
        micro_batches: usize,
        stages_per_rank: usize,
    ) -> Self {
        assert!(!actions.is_empty(), "Schedule::from_actions: no rank");
        assert!(stages_per_rank > 0, "Schedule::from_actions: no stage");
        Self {
            kind: None,
            ranks: actions.len(),
            stages_per_rank,
            micro_batches,
            actions,
        }
    }

    /// The generator that wrote it, `None` for a schedule made by hand.
    pub fn kind(&self) -> Option<ScheduleKind> {
        self.kind
    }

    /// Ranks (`p`).
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Stages on each rank (`v`).
    pub fn stages_per_rank(&self) -> usize {
        self.stages_per_rank
    }

    /// Stages in all (`p · v`).
    pub fn stages(&self) -> usize {
        self.ranks * self.stages_per_rank
    }

    /// Micro-batches a step (`m`).
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// The rank that holds stage `stage`.
    pub fn rank_of(&self, stage: usize) -> usize {
        stage % self.ranks
    }

    /// Rank `rank`'s actions, in order.
    ///
    /// # Panics
    /// If `rank` is not below [`ranks`](Self::ranks).
    pub fn actions(&self, rank: usize) -> &[Action] {
        &self.actions[rank]
    }

    /// Every rank's actions.
    pub fn all_actions(&self) -> &[Vec<Action>] {
        &self.actions
    }
}

/// GPipe on rank `rank`: every forward, then every backward, in micro-batch order.
fn gpipe(rank: usize, m: usize) -> Vec<Action> {
    let forwards = (0..m).map(|micro_batch| Action::Forward {
        stage: rank,
        micro_batch,
    });
    let backwards = (0..m).map(|micro_batch| Action::Backward {
        stage: rank,
        micro_batch,
    });
    forwards.chain(backwards).collect()
}

/// 1F1B on rank `rank` of `p`: `p − 1 − rank` forwards to fill the pipeline, then a
/// forward and a backward in turn, then the backwards left.
fn one_f_one_b(rank: usize, p: usize, m: usize) -> Vec<Action> {
    let forward = |micro_batch| Action::Forward {
        stage: rank,
        micro_batch,
    };
    let backward = |micro_batch| Action::Backward {
        stage: rank,
        micro_batch,
    };
    let warmup = (p - 1 - rank).min(m);
    let mut order: Vec<Action> = (0..warmup).map(forward).collect();
    for i in 0..m - warmup {
        order.push(forward(warmup + i));
        order.push(backward(i));
    }
    order.extend((m - warmup..m).map(backward));
    order
}

/// Megatron's interleaved 1F1B on rank `rank` of `p`, `v` stages each: the `m · v` forwards
/// go in groups of `p` micro-batches, each group through the rank's stages in turn (its
/// backwards through them in reverse), after a warm-up of `2(p − 1 − rank) + (v − 1)p`.
fn interleaved(rank: usize, p: usize, m: usize, v: usize) -> Vec<Action> {
    let micro_batch = |k: usize| (k / (p * v)) * p + k % p;
    let chunk = |k: usize| (k / p) % v;
    let forward = |k: usize| Action::Forward {
        stage: chunk(k) * p + rank,
        micro_batch: micro_batch(k),
    };
    let backward = |k: usize| Action::Backward {
        stage: (v - 1 - chunk(k)) * p + rank,
        micro_batch: micro_batch(k),
    };
    let total = m * v;
    let warmup = (2 * (p - 1 - rank) + (v - 1) * p).min(total);
    let mut order: Vec<Action> = (0..warmup).map(forward).collect();
    for i in 0..total - warmup {
        order.push(forward(warmup + i));
        order.push(backward(i));
    }
    order.extend((total - warmup..total).map(backward));
    order
}

/// ZB-H1 on rank `rank` of `p`: 1F1B's order with each backward split into `B` (the
/// input's gradient) and `W` (the weights'), where rank `r` holds back its first `r` `W`s
/// and then runs the oldest held-back one after each `B`; the rest end the step. The later
/// a stage, the sooner its `B` reaches the stage before, so the stages before it, which
/// would wait for that `B` in 1F1B, fill the wait with their held-back `W`s. A rank holds
/// at most `p` micro-batches' activations (from a forward to its `W`), 1F1B's largest.
fn zero_bubble_h1(rank: usize, p: usize, m: usize) -> Vec<Action> {
    let forward = |micro_batch| Action::Forward {
        stage: rank,
        micro_batch,
    };
    let input = |micro_batch| Action::BackwardInput {
        stage: rank,
        micro_batch,
    };
    let weight = |micro_batch| Action::BackwardWeight {
        stage: rank,
        micro_batch,
    };
    let warmup = (p - 1 - rank).min(m);
    let mut order: Vec<Action> = (0..warmup).map(forward).collect();
    let mut weights = 0;
    for i in 0..m {
        if warmup + i < m {
            order.push(forward(warmup + i));
        }
        order.push(input(i));
        if i >= rank {
            order.push(weight(weights));
            weights += 1;
        }
    }
    order.extend((weights..m).map(weight));
    order
}

/// `order` (a rank's compute actions) with the receive each needs before it, the send each
/// enables after it, and the step's end. `last` is the last stage.
fn with_communication(order: &[Action], last: usize) -> Vec<Action> {
    let mut actions = Vec::with_capacity(order.len() * 2 + 2);
    for &action in order {
        match action {
            Action::Forward { stage, micro_batch } => {
                if stage > 0 {
                    actions.push(Action::RecvActivation { stage, micro_batch });
                }
                actions.push(action);
                if stage < last {
                    actions.push(Action::SendActivation { stage, micro_batch });
                }
            }
            Action::Backward { stage, micro_batch }
            | Action::BackwardInput { stage, micro_batch } => {
                if stage < last {
                    actions.push(Action::RecvGradient { stage, micro_batch });
                }
                actions.push(action);
                if stage > 0 {
                    actions.push(Action::SendGradient { stage, micro_batch });
                }
            }
            other => actions.push(other),
        }
    }
    actions.push(Action::ReduceGradients);
    actions.push(Action::OptimizerStep);
    actions
}
