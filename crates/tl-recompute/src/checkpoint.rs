//! [`checkpoint`]: one graph node that stands for a whole segment and reruns it during
//! backward instead of keeping its activations.

use tl_tensor::{
    Element, Generator, GeneratorState, ModeSnapshot, Tensor, enable_grad, is_grad_enabled, no_grad,
};

use crate::keep::FrameGuard;
use crate::verify::{Fingerprint, report};

/// How a checkpoint node behaves beyond the default.
///
/// ```
/// use tl_recompute::CheckpointOptions;
/// let options = CheckpointOptions::verified("block 3");
/// assert!(options.verify);
/// assert_eq!(options.segment, "block 3");
/// assert!(!CheckpointOptions::default().verify);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointOptions {
    /// Compare the rerun's output with the forward pass's, bit for bit, and report a
    /// [`RecomputeMismatch`](crate::RecomputeError::RecomputeMismatch) when they differ (see
    /// [`backward_verified`](crate::backward_verified) for how it is reported).
    pub verify: bool,
    /// The segment's name in error messages.
    pub segment: String,
}

impl Default for CheckpointOptions {
    fn default() -> Self {
        Self {
            verify: false,
            segment: "checkpointed segment".to_owned(),
        }
    }
}

impl CheckpointOptions {
    /// Verified mode, reporting mismatches under the name `segment`.
    pub fn verified(segment: impl Into<String>) -> Self {
        Self {
            verify: true,
            segment: segment.into(),
        }
    }
}

/// Runs `f(inputs)` without keeping its intermediate values, and recomputes them during
/// backward: activation checkpointing of one segment.
///
/// `f` runs once with grad mode off, so nothing inside it is recorded, and the result is a
/// single node whose parents are the `inputs` *and* the `params` that `f` reads. When backward
/// reaches the node, it reruns `f` with grad mode on from fresh leaf copies of the inputs,
/// backpropagates the incoming gradient through that rerun — the parameters' gradients
/// accumulate into their `.grad` there — and passes the inputs' gradients on. The rerun
/// performs the same operations on the same values, so every gradient equals, bit for bit,
/// the one of running `f` directly.
///
/// - `params`: every tensor `f` reads besides its inputs that should learn. They must be
///   parents of the node: with a data input that does not require grad, a node whose only
///   parents are the inputs would not be recorded and the segment would silently stop
///   learning.
/// - `rngs`: every generator `f` draws from (dropout). Their states are recorded before the
///   forward run, set back for the rerun so it draws the same masks, and then restored to
///   where the stream had got to, so later draws are exactly those of a run without
///   checkpointing.
/// - Non-tensor arguments (sizes, scales, flags) are captured by the closure. A tensor may
///   appear twice in `inputs`; each use gets its own gradient, and the two are summed.
/// - Under [`no_grad`], or when neither an input nor a parameter requires grad, this is a
///   plain call of `f`.
///
/// Results that the segment's ops mark with [`keep_for_rerun`](crate::keep_for_rerun) are
/// kept by the node from the forward pass on and handed back to the rerun, which skips
/// computing them (selective checkpointing).
///
/// The thread's modes at forward time (grad mode aside: the matmul override that autocast
/// installs) are put back for the rerun, so a forward pass under autocast is recomputed
/// under autocast even when backward is called outside it.
///
/// ```
/// use tl_recompute::checkpoint;
/// use tl_tensor::Tensor;
/// let w = Tensor::<f64>::param(tl_tensor::ndarray::arr2(&[[2.0]]).into_dyn());
/// let x = Tensor::from_vec(vec![3.0], &[1, 1])?; // data: no gradient
/// let weight = w.clone();
/// let square = move |xs: &[Tensor<f64>]| xs[0].matmul(&weight).powi(2);
/// let y = checkpoint(square, &[x], &[w.clone()], &[]);
/// // y = (x·w)² = 36, dy/dw = 2(x·w)·x = 2 · 6 · 3 = 36
/// assert_eq!(y.item(), 36.0);
/// y.sum_all().backward();
/// assert_eq!(w.grad().unwrap()[[0, 0]], 36.0);
/// # Ok::<(), tl_tensor::TensorError>(())
/// ```
pub fn checkpoint<E, F>(
    f: F,
    inputs: &[Tensor<E>],
    params: &[Tensor<E>],
    rngs: &[Generator],
) -> Tensor<E>
where
    E: Element,
    F: Fn(&[Tensor<E>]) -> Tensor<E> + 'static,
{
    checkpoint_with(f, inputs, params, rngs, &CheckpointOptions::default())
}

/// [`checkpoint`] with options: verified mode and the segment's name.
///
/// In verified mode the node also keeps a fingerprint of the forward output's bits and checks
/// the rerun against it; see [`backward_verified`](crate::backward_verified).
///
/// # Panics
/// During backward, in verified mode, when the rerun differs from the forward pass and the
/// backward pass was not started by [`backward_verified`](crate::backward_verified).
pub fn checkpoint_with<E, F>(
    f: F,
    inputs: &[Tensor<E>],
    params: &[Tensor<E>],
    rngs: &[Generator],
    options: &CheckpointOptions,
) -> Tensor<E>
where
    E: Element,
    F: Fn(&[Tensor<E>]) -> Tensor<E> + 'static,
{
    let needs_node = is_grad_enabled() && inputs.iter().chain(params).any(Tensor::requires_grad);
    if !needs_node {
        let _nothing_kept = FrameGuard::plain();
        return f(inputs);
    }
    let modes = ModeSnapshot::capture();
    let recorded = rng_states(rngs);
    let (forward_output, kept) = {
        let _graph_off = no_grad();
        let recording = FrameGuard::recording();
        let output = f(inputs);
        (output, recording.finish())
    };
    let fingerprint = options.verify.then(|| Fingerprint::of(&forward_output));
    // A copy, made before the segment's own output dies with this scope (a meta copy of a
    // meta output); the node's output is counted from then on.
    let (shape, tag) = (forward_output.shape(), forward_output.memory_tag());
    let value = (!forward_output.is_meta()).then(|| forward_output.to_array());
    drop(forward_output);
    // On the memory meter the copy is what it stands for: the segment's output.
    let _tag = tl_tensor::memory::tag_scope(tag);
    let value = match value {
        Some(value) => Tensor::from_array(value),
        None => Tensor::meta(&shape),
    };

    let parents: Vec<&Tensor<E>> = inputs.iter().chain(params).collect();
    let n_parents = parents.len();
    let inputs = inputs.to_vec();
    let rngs = rngs.to_vec();
    let segment = options.segment.clone();
    // A backward over tensors: the rerun and its sweep happen in a meta run as in a real one.
    Tensor::from_op_tensors(&value, &parents, move |grad_out| {
        let reached = rng_states(&rngs);
        set_rng_states(&rngs, &recorded);
        let leaves: Vec<Tensor<E>> = inputs.iter().map(rerun_copy).collect();
        let rerun_output = {
            let _recompute = tl_tensor::memory::stage_scope(tl_tensor::memory::Stage::Recompute);
            let _forward_modes = modes.enter();
            let _graph_on = enable_grad();
            let _replay = FrameGuard::replaying(kept);
            f(&leaves)
        };
        set_rng_states(&rngs, &reached);
        let verified = match &fingerprint {
            Some(expected) => expected.check(&Fingerprint::of(&rerun_output), &segment),
            None => Ok(()),
        };
        match verified {
            // A rerun that is not the forward pass has no gradient to offer (its shape may
            // not even match `grad_out`): report it and pass nothing on.
            Err(error) => report(error),
            // An `f` that ignores everything that requires grad has nothing to backpropagate.
            Ok(()) if rerun_output.requires_grad() => rerun_output.backward_from(&grad_out),
            Ok(()) => {}
        }
        // One leaf per position: an input passed twice has two leaves, each holding the
        // gradient of its own use; the outer backward adds the two. Taken, not copied.
        let mut grads: Vec<Option<Tensor<E>>> = leaves.iter().map(Tensor::take_grad).collect();
        // The parameters' gradients went straight into their `.grad` during the rerun.
        grads.resize(n_parents, None);
        grads
    })
}

/// The rerun's copy of an input: a fresh leaf sharing its storage when a gradient must flow
/// back to it, so the rerun's backward stops there instead of running on into the outer graph;
/// a constant otherwise, so no work is spent on the gradient of data.
fn rerun_copy<E: Element>(input: &Tensor<E>) -> Tensor<E> {
    if input.requires_grad() {
        input.detach_leaf()
    } else {
        input.detach()
    }
}

fn rng_states(rngs: &[Generator]) -> Vec<GeneratorState> {
    rngs.iter().map(Generator::state).collect()
}

fn set_rng_states(rngs: &[Generator], states: &[GeneratorState]) {
    for (rng, state) in rngs.iter().zip(states) {
        rng.set_state(state);
    }
}
