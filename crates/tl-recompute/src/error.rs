//! [`RecomputeError`]: everything a caller of this crate can get wrong, and the one failure
//! that only shows up at backward time (a segment whose rerun does not reproduce it).

use thiserror::Error;

/// The errors of tl-recompute.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RecomputeError {
    /// An argument that no schedule or stack can accept (a stack of zero layers, a budget of
    /// zero layers).
    #[error("invalid {name}: {value} ({reason})")]
    InvalidArgument {
        /// The argument's name.
        name: &'static str,
        /// The value given, as text.
        value: String,
        /// Why it is rejected.
        reason: String,
    },

    /// No schedule of `n_layers` layers fits in `mem_budget_layers` units: with `k` segments
    /// the best peak covers at most `B + (B − 1) + … + (B − k + 1)` layers, so a budget `B`
    /// reaches `B(B + 1)/2` layers at most.
    #[error(
        "no checkpoint schedule of {n_layers} layers fits in a budget of {mem_budget_layers} \
         layers; the smallest budget that fits is {min_budget}"
    )]
    BudgetTooSmall {
        /// The number of layers to schedule.
        n_layers: usize,
        /// The budget asked for, in units of one layer's stored input.
        mem_budget_layers: usize,
        /// The smallest budget under which some schedule fits.
        min_budget: usize,
    },

    /// A schedule (list of segment starts) that does not describe a split of the stack.
    #[error("invalid schedule {schedule:?} for {n_layers} layers: {reason}")]
    InvalidSchedule {
        /// The segment starts given.
        schedule: Vec<usize>,
        /// The number of layers in the stack.
        n_layers: usize,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// In verified mode, a segment's rerun during backward produced an output whose bits
    /// differ from the forward pass's: a random draw that was not replayed (a generator
    /// missing from `rngs`), or state changed between the forward and the backward pass.
    /// The gradients of that backward pass are not those of the forward pass.
    #[error(
        "checkpoint verification failed in {segment}: the recomputed output differs from the \
         forward pass's ({detail}); a random draw was not replayed (is its generator in \
         `rngs`?) or state changed between the forward and the backward pass"
    )]
    RecomputeMismatch {
        /// The segment's name ("segment 2 (layers 4..6)" in `checkpoint_sequential`).
        segment: String,
        /// What differs: the shapes, or the fingerprints of the bits.
        detail: String,
    },
}

/// The `Result` of tl-recompute.
pub type Result<T> = std::result::Result<T, RecomputeError>;
