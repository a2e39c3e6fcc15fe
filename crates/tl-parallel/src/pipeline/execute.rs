//! [`execute`]: runs one rank's list of a [`Schedule`] on the stages it holds, sending
//! activations and gradients to the neighbouring stages over a pipeline group's
//! point-to-point messages ([`Communicator::send`]/[`recv`](Communicator::recv)).
//!
//! The model is the caller's, behind [`StageModel`]: the executor asks it for a stage's
//! forward on a micro-batch and does everything else a schedule says.
//!
//! - **Forward.** Stage 0 starts from the micro-batch itself; a later stage from the
//!   activation received, made a leaf that requires grad. The output is kept, with the
//!   input, until the backward; it is sent on as it is (the next stage receives exactly
//!   these values).
//! - **Backward.** The last stage's output is the micro-batch's loss, already weighted and
//!   scaled by the model as the step's backward needs it: the sweep starts from it. An
//!   earlier stage's sweep starts from the gradient received for its output. The input
//!   leaf's gradient is what goes back to the stage before; then the micro-batch's tensors
//!   are dropped, so a stage holds exactly the micro-batches between their forward and
//!   their backward, as the simulator counts them.
//! - **Messages.** Each is tagged with its kind, receiving stage and micro-batch, so a rank
//!   can receive in its own order whatever arrives first (sends never wait, see
//!   [`Communicator::send`]).
//! - **The end.** [`Action::ReduceGradients`] and [`Action::OptimizerStep`] are the
//!   caller's: the executor stops at them, with every gradient of the rank's stages
//!   accumulated into its parameters and every message sent.
//!
//! **Bit for bit.** Every stage's backwards run in micro-batch order in GPipe, 1F1B and the
//! interleaved schedule, so a parameter's gradient is the same sum, in the same order, as
//! one process's accumulation over the micro-batches: with the same weighting, the
//! pipeline's gradients are one process's to the bit.
//!
//! **A split backward** (zero-bubble's `I` and `W`): `I` is tl-tensor's
//! [`backward_input_from`](Tensor::backward_input_from), which computes the gradient of
//! the stage's input — what the stage before waits for — and leaves the parameters' for
//! `W` ([`WeightGradients::run`]). A micro-batch's activations are held from its forward
//! to its `W`. The two halves give the plain backward's gradients bit for bit, and the
//! `W`s of a stage run in micro-batch order, so ZB-H1 gives one process's bits too.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tl_collective::{Communicator, MAX_TAG, Slice, SliceMut};
use tl_tensor::{Tensor, WeightGradients, memory};

use super::schedule::{Action, Schedule};
use crate::GradElement;
use crate::error::{ParallelError, Result};
use crate::metered::labels;

/// The stages of the model a rank holds, as the executor runs them.
pub trait StageModel<E: GradElement> {
    /// The error of a stage's forward; the executor's own errors convert into it.
    type Error: From<ParallelError>;

    /// The shape of the activation that enters `stage` (from `stage − 1`) on
    /// `micro_batch`: what its receive reads.
    fn input_shape(&self, stage: usize, micro_batch: usize) -> Vec<usize>;

    /// `stage`'s forward on `micro_batch`: from `input`, the activation received (a leaf
    /// that requires grad), or from the micro-batch itself on stage 0 (`None`). Returns the
    /// activation to send on, or on the last stage the loss backward starts from (a
    /// one-element tensor: the micro-batch's loss weighted by its share of the step's
    /// batch, times the loss scale).
    ///
    /// # Errors
    /// Whatever stops the forward; the step then stops.
    fn forward(
        &self,
        stage: usize,
        micro_batch: usize,
        input: Option<&Tensor<E>>,
    ) -> std::result::Result<Tensor<E>, Self::Error>;
}

/// One compute action as it ran: from when it started to when it ended, since the step's
/// start, on this rank's clock.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timed {
    /// The action.
    pub action: Action,
    /// When it started.
    pub start: Duration,
    /// When it ended.
    pub end: Duration,
}

/// What one rank's part of a step did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Executed {
    /// Every action but the step's last two, with when it started and ended: receives
    /// include their wait.
    pub timeline: Vec<Timed>,
    /// The most micro-batches whose activations this rank held at once.
    pub peak_activations: usize,
}

impl Executed {
    /// Time spent computing: forwards and backwards.
    pub fn busy(&self) -> Duration {
        self.timeline
            .iter()
            .filter(|t| t.action.computes())
            .map(|t| t.end - t.start)
            .sum()
    }

    /// From the first action's start to the last one's end.
    pub fn span(&self) -> Duration {
        match (self.timeline.first(), self.timeline.last()) {
            (Some(first), Some(last)) => last.end - first.start,
            _ => Duration::ZERO,
        }
    }
}

/// What a message carries.
#[derive(Clone, Copy)]
enum Carries {
    Activation = 0,
    Gradient = 1,
}

/// The tag of a message to `stage` on `micro_batch`.
fn tag(carries: Carries, stage: usize, micro_batch: usize, stages: usize) -> u32 {
    ((micro_batch * stages + stage) * 2 + carries as usize) as u32
}

/// A micro-batch between its forward and its backward on a stage.
struct Held<E: GradElement> {
    input: Option<Tensor<E>>,
    output: Tensor<E>,
}

/// Runs rank `rank`'s actions of `schedule` (up to its gradient reduction) on `model`,
/// with `comm` the pipeline group (rank `r` of it holds the stages `schedule` gives rank
/// `r`). See the [module docs](self).
///
/// # Errors
/// [`ParallelError::Pipeline`] if the schedule holds a rank that is not `comm`'s, or has
/// more messages than tags; [`ParallelError::Collective`] if a message
/// fails; the model's errors. The rank's gradients are then partial: the step must not be
/// applied.
pub fn execute<E: GradElement, M: StageModel<E> + ?Sized>(
    schedule: &Schedule,
    comm: &mut dyn Communicator,
    model: &M,
) -> std::result::Result<Executed, M::Error> {
    let rank = comm.rank();
    check(schedule, comm)?;
    let stages = schedule.stages();
    let last = stages - 1;
    let failed = |source| ParallelError::Collective { rank, source };
    let clock = Instant::now();
    let mut inputs: HashMap<(usize, usize), Tensor<E>> = HashMap::new();
    let mut gradients: HashMap<(usize, usize), Tensor<E>> = HashMap::new();
    let mut held: HashMap<(usize, usize), Held<E>> = HashMap::new();
    let mut outgoing: HashMap<(usize, usize), Tensor<E>> = HashMap::new();
    // Micro-batches past their `I`, waiting for their `W`.
    let mut weights: HashMap<(usize, usize), WeightGradients> = HashMap::new();
    let mut executed = Executed::default();
    for &action in schedule.actions(rank) {
        let start = clock.elapsed();
        match action {
            Action::ReduceGradients | Action::OptimizerStep => break,
            Action::RecvActivation { stage, micro_batch } => {
                let shape = model.input_shape(stage, micro_batch);
                let from = schedule.rank_of(stage - 1);
                let tag = tag(Carries::Activation, stage, micro_batch, stages);
                let input = {
                    let _label = memory::label_scope(labels::PIPELINE_ACTIVATION);
                    receive::<E>(comm, &shape, from, tag).map_err(failed)?
                };
                input.set_requires_grad(true);
                inputs.insert((stage, micro_batch), input);
            }
            Action::Forward { stage, micro_batch } => {
                let input = inputs.remove(&(stage, micro_batch));
                let output = model.forward(stage, micro_batch, input.as_ref())?;
                held.insert((stage, micro_batch), Held { input, output });
                let holding = held.len() + weights.len();
                executed.peak_activations = executed.peak_activations.max(holding);
            }
            Action::SendActivation { stage, micro_batch } => {
                let output = &held[&(stage, micro_batch)].output;
                let to = schedule.rank_of(stage + 1);
                let tag = tag(Carries::Activation, stage + 1, micro_batch, stages);
                send(comm, output, to, tag).map_err(failed)?;
            }
            Action::RecvGradient { stage, micro_batch } => {
                let shape = held[&(stage, micro_batch)].output.shape();
                let from = schedule.rank_of(stage + 1);
                let tag = tag(Carries::Gradient, stage, micro_batch, stages);
                let _label = memory::label_scope(labels::PIPELINE_GRADIENT);
                let gradient = receive::<E>(comm, &shape, from, tag).map_err(failed)?;
                gradients.insert((stage, micro_batch), gradient);
            }
            Action::Backward { stage, micro_batch }
            | Action::BackwardInput { stage, micro_batch } => {
                let _micro_batch = memory::micro_batch_scope(Some(micro_batch));
                let _backward = memory::stage_scope(memory::Stage::Backward);
                let Held { input, output } = held
                    .remove(&(stage, micro_batch))
                    .expect("a checked schedule runs a forward before its backward");
                let gradient = (stage != last).then(|| {
                    gradients
                        .remove(&(stage, micro_batch))
                        .expect("a checked schedule receives a gradient before its backward")
                });
                let split = matches!(action, Action::BackwardInput { .. });
                match (&gradient, split) {
                    (None, false) => output.backward(),
                    (Some(gradient), false) => output.backward_from(gradient),
                    (None, true) => {
                        weights.insert((stage, micro_batch), output.backward_input());
                    }
                    (Some(gradient), true) => {
                        let rest = output.backward_input_from(gradient);
                        weights.insert((stage, micro_batch), rest);
                    }
                }
                drop((output, gradient));
                if let Some(input) = input {
                    let _label = memory::label_scope(labels::PIPELINE_GRADIENT);
                    outgoing.insert((stage, micro_batch), input_gradient(&input));
                }
            }
            Action::BackwardWeight { stage, micro_batch } => {
                let _micro_batch = memory::micro_batch_scope(Some(micro_batch));
                let _backward = memory::stage_scope(memory::Stage::Backward);
                weights
                    .remove(&(stage, micro_batch))
                    .expect("a checked schedule runs an input's gradient before its weights'")
                    .run();
            }
            Action::SendGradient { stage, micro_batch } => {
                let gradient = outgoing
                    .remove(&(stage, micro_batch))
                    .expect("a checked schedule sends a gradient after its backward");
                let to = schedule.rank_of(stage - 1);
                let tag = tag(Carries::Gradient, stage - 1, micro_batch, stages);
                send(comm, &gradient, to, tag).map_err(failed)?;
            }
        }
        executed.timeline.push(Timed {
            action,
            start,
            end: clock.elapsed(),
        });
    }
    comm.flush().map_err(failed)?;
    Ok(executed)
}

/// What the executor refuses before any action: a schedule of another pipeline size, tags
/// that do not fit.
fn check(schedule: &Schedule, comm: &dyn Communicator) -> Result<()> {
    let invalid = |reason: String| {
        Err(ParallelError::Pipeline {
            rank: comm.rank(),
            reason,
        })
    };
    if schedule.ranks() != comm.world_size() {
        return invalid(format!(
            "the schedule is for {} ranks, the pipeline group has {}",
            schedule.ranks(),
            comm.world_size()
        ));
    }
    let largest = tag(
        Carries::Gradient,
        schedule.stages() - 1,
        schedule.micro_batches().saturating_sub(1),
        schedule.stages(),
    );
    if largest > MAX_TAG {
        return invalid(format!(
            "{} stages × {} micro-batches need {} message tags, over the {} every backend \
             has",
            schedule.stages(),
            schedule.micro_batches(),
            u64::from(largest) + 1,
            u64::from(MAX_TAG) + 1
        ));
    }
    Ok(())
}

/// The gradient that reached the input leaf (zeros if none did: a stage whose output
/// does not depend on its input).
fn input_gradient<E: GradElement>(input: &Tensor<E>) -> Tensor<E> {
    let shape = input.shape();
    match input.grad() {
        Some(grad) if !input.grad_is_meta() => Tensor::from_array(grad),
        _ => Tensor::zeros(&shape),
    }
}

/// Sends a tensor's values (its shape only, for a meta tensor).
fn send<E: GradElement>(
    comm: &mut dyn Communicator,
    tensor: &Tensor<E>,
    to: usize,
    tag: u32,
) -> tl_collective::Result<()> {
    if tensor.is_meta() {
        return comm.send(Slice::shape::<E>(tensor.numel()), to, tag);
    }
    let values = tensor.value();
    match values.as_slice() {
        Some(contiguous) => comm.send(contiguous.into(), to, tag),
        None => {
            let copied: Vec<E> = values.iter().copied().collect();
            comm.send((&copied[..]).into(), to, tag)
        }
    }
}

/// Receives a tensor of `shape` (a meta one, under meta mode).
fn receive<E: GradElement>(
    comm: &mut dyn Communicator,
    shape: &[usize],
    from: usize,
    tag: u32,
) -> tl_collective::Result<Tensor<E>> {
    let numel = shape.iter().product();
    if tl_tensor::meta::is_meta_mode() {
        comm.recv(SliceMut::shape::<E>(numel), from, tag)?;
        return Ok(Tensor::zeros(shape));
    }
    let mut values = vec![E::default(); numel];
    comm.recv((&mut values[..]).into(), from, tag)?;
    Ok(Tensor::from_vec(values, shape).expect("as many values as the shape holds"))
}
