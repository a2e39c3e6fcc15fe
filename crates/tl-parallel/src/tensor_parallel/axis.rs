//! [`TensorAxis`]: the tensor-parallel group beside a data-parallel one, as the data-parallel
//! step sees it. The ranks of the group hold different slices of the split parameters and
//! the same replicated ones, so what a step decides must span the group: skip on an overflow
//! anywhere, and clip by the norm of the whole model's gradients.
//!
//! Every stage of data parallelism drives the same axis: [`DataParallel`](crate::DataParallel)
//! at ZeRO stages 0 to 2 and [`Zero3`](crate::Zero3)'s own step. They differ only in what the
//! optimizer's parameters are — whole parameters (stages 0 and 1) or 1-D runs of them (the
//! shards of stages 2 and 3) — so the axis takes its flags by the *model's* parameter order
//! and asks the stage which parameter each of the optimizer's parameters belongs to.

use tl_tensor::Tensor;

use crate::ddp::GradElement;
use crate::error::ParallelError;
use crate::tensor_parallel::TensorParallel;

/// The tensor-parallel group of a split model, for the data-parallel step beside it (see the
/// [module docs](self)).
pub(crate) struct TensorAxis {
    tp: TensorParallel,
    /// By the model's parameter order: whether every rank of the group holds the parameter
    /// whole (counted once in the norm) rather than a slice of it.
    replicated: Vec<bool>,
    /// By the model's parameter order: whether the parameter's gradient is this rank's share,
    /// to be summed over the group before the step (sequence parallelism's replicated
    /// parameters). Empty: none is.
    shares: Vec<bool>,
    /// The sum of squares of the current gradients of the optimizer's parameters that are
    /// (runs of) replicated ones, set when the step's gradients are ready; it reads the
    /// tensors when asked, after any unscaling.
    replicated_sum: Option<Box<dyn Fn() -> f64>>,
    /// The error of a failed sum of the shares, until [`take_error`](Self::take_error).
    failed: Option<ParallelError>,
}

impl TensorAxis {
    /// The group `tp`, with the model's `replicated` flags.
    pub(crate) fn new(tp: TensorParallel, replicated: Vec<bool>) -> Self {
        Self {
            tp,
            replicated,
            shares: Vec::new(),
            replicated_sum: None,
            failed: None,
        }
    }

    /// Flags the parameters whose gradients are shares (by the model's order).
    pub(crate) fn set_shares(&mut self, shares: Vec<bool>) {
        self.shares = shares;
    }

    /// The same group and flags, with no step's state: for a stage that runs its own step
    /// ([`Zero3`](crate::Zero3)) on the group a `DataParallel` was given.
    pub(crate) fn fresh(&self) -> Self {
        Self {
            tp: self.tp.clone(),
            replicated: self.replicated.clone(),
            shares: self.shares.clone(),
            replicated_sum: None,
            failed: None,
        }
    }

    /// When the step's gradients are ready: sums the shares over the group, in one
    /// all-reduce (on failure keeping the error and making every gradient NaN, so the step
    /// refuses them), and notes which gradients the norm counts once. `params` are the
    /// optimizer's parameters, `params[i]` a run of the model's parameter `owner(i)`.
    ///
    /// A run of a share is a share of the same run of the whole gradient: the sum is
    /// linear, so it may come before or after the data-parallel reduction.
    ///
    /// # Panics
    /// If `owner` names a parameter past the flags.
    pub(crate) fn gradients_ready<E: GradElement>(
        &mut self,
        params: &[Tensor<E>],
        owner: impl Fn(usize) -> usize,
    ) {
        let owners: Vec<usize> = (0..params.len()).map(owner).collect();
        assert!(
            owners.iter().all(|&p| p < self.replicated.len()),
            "TensorAxis: one replicated flag per parameter of the model"
        );
        if !self.shares.is_empty() {
            let shares: Vec<Tensor<E>> = (params.iter().zip(&owners))
                .filter(|&(_, &p)| self.shares[p])
                .map(|(param, _)| param.clone())
                .collect();
            if !shares.is_empty()
                && let Err(error) = self.tp.all_reduce_gradients(&shares)
            {
                self.failed.get_or_insert(error);
                for param in params {
                    crate::runs::ensure_grad(param);
                    param.update_grad(|g| g.fill(E::nan()));
                }
            }
        }
        let whole: Vec<Tensor<E>> = (params.iter().zip(&owners))
            .filter(|&(_, &p)| self.replicated[p])
            .map(|(param, _)| param.clone())
            .collect();
        self.replicated_sum = Some(Box::new(move || {
            // A meta gradient has no values: its norm is 0, as the step's own is.
            (whole.iter().filter(|param| !param.grad_is_meta()))
                .map(|param| {
                    param.with_grad(|grad| {
                        grad.map_or(0.0, |g| g.iter().map(|&v| v.to_f64() * v.to_f64()).sum())
                    })
                })
                .sum()
        }));
    }

    /// Finite on every rank of the group, given this rank's verdict: one overflow anywhere
    /// skips the step everywhere. A failed collective counts as an overflow.
    pub(crate) fn all_finite(&self, finite: bool) -> bool {
        let mut flag = [if finite { 0.0f32 } else { 1.0 }];
        let agreed = self
            .tp
            .call(|comm| comm.all_reduce((&mut flag[..]).into(), tl_collective::ReduceOp::Max));
        agreed.is_ok() && flag[0] == 0.0
    }

    /// The whole model's sum of squares, from this rank's `local` sum over the optimizer's
    /// parameters: the replicated parameters are counted by rank 0 of the group alone, the
    /// sum is made global over the data-parallel group by `over_data` (the identity when
    /// every data-parallel rank holds the same reduced gradients, a sum when each holds a
    /// shard), then summed over the group. NaN if a collective fails.
    pub(crate) fn total_sum_squares(&self, local: f64, over_data: impl FnOnce(f64) -> f64) -> f64 {
        let own = match self.tp.rank() {
            0 => local,
            _ => local - self.replicated_sum.as_ref().map_or(0.0, |sum| sum()),
        };
        let mut sum = [over_data(own)];
        let summed = self
            .tp
            .call(|comm| comm.all_reduce_sum((&mut sum[..]).into()));
        if summed.is_ok() { sum[0] } else { f64::NAN }
    }

    /// The error of a failed sum of the shares, once.
    pub(crate) fn take_error(&mut self) -> Option<ParallelError> {
        self.failed.take()
    }
}
