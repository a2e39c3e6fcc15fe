//! [`DataParallel`]: DDP on the [`StepObserver`] seam of tl-precision's training step.
//!
//! Every rank holds the whole model and runs [`train_step_mixed_observed`] on its own share
//! of the global batch ([`batch_share`](crate::batch_share)). Nothing is communicated while
//! the micro-batches run. When the last backward is done, [`StepObserver::gradients_ready`]
//! sums the ranks' gradients, each weighted by its share of the rows, in buckets of about
//! [`DEFAULT_BUCKET_BYTES`] filled in reverse parameter order (the order backward produces
//! the gradients). Three scalars ([`STEP_EXTRAS`](crate::STEP_EXTRAS)) ride in the last
//! bucket, so they cost no collective of their own: this rank's part of the global loss,
//! whether its gradients were all finite, and its count of flushed gradient underflows.
//!
//! After the reduction every rank holds the same gradients, bit for bit (the ring adds in a
//! fixed order), so what the step computes from them is global without further talk: the
//! clip norm ([`StepObserver::total_sum_squares`] returns the local sum, which is already
//! the global one) and the loss scaler's overflow decision ([`StepObserver::all_finite`]
//! answers "finite on every rank" from the flags summed in the last bucket). An inf on one
//! rank therefore skips the step on every rank, and every rank's scale stays equal.
//!
//! Overlap with backward ([`DataParallel::with_overlap`]): the observer arms the
//! parameters' gradient-ready hooks around the last micro-batch's backward and starts each
//! bucket's all-reduce on a communication thread as soon as its gradients are complete,
//! while backward goes on ([`overlap`](crate::overlap)). Without it the reduction runs once,
//! after the last backward. When a [`Zero2AdamW`](crate::Zero2AdamW) shards the gradients,
//! the hooks reduce-scatter each bucket as soon as its gradients are complete, so that they
//! can be freed: on the communication thread with overlap, blocking the rank without.

use std::cell::Cell;
use std::rc::{Rc, Weak};

use tl_collective::{CommStats, Communicator};
use tl_precision::{
    MicroBatch, Precision, StepObserver, StepPhase, StepReport, train_step_mixed_observed,
    underflow_count,
};
use tl_tensor::memory::{self, Stage};
use tl_tensor::nn::Module;
use tl_tensor::optim::Optimizer;
use tl_tensor::{Element, Tensor};

use crate::bucket::{
    DEFAULT_BUCKET_BYTES, STEP_EXTRAS, fill_bucket, plan, reduces_in_backward, write_bucket,
};
use crate::decide::{all_ranks_finite, global_sum_squares};
use crate::error::{ParallelError, Result};
use crate::link::{Link, SharedLink};
use crate::metered::{Metered, communication, labels};
use crate::overlap::{Overlap, OverlappedReduction};
use crate::runs::{bucket_len, ensure_grad, read_run, write_run};
use crate::tensor_parallel::TensorParallel;
use crate::tensor_parallel::axis::TensorAxis;
use crate::zero2::GradientShards;

/// An element type whose gradients [`DataParallel`] can reduce: `f32` or `f64`, a tensor
/// element that is also a collective's element (and may travel to the communication
/// thread).
pub trait GradElement: Element + tl_collective::Element + Send + 'static {}

impl<T: Element + tl_collective::Element + Send + 'static> GradElement for T {}

/// What the last step's reduction established, the same on every rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepSummary {
    /// The loss of the global batch, `Σ_i (n_i/B)·L_i` over every micro-batch of every rank,
    /// when [`DataParallel::train_step`] recorded the micro-batch losses (`None` when the
    /// observer was used directly). Summed in the gradients' element type.
    pub global_loss: Option<f64>,
    /// Ranks whose gradients held an inf or NaN before the reduction.
    pub nonfinite_ranks: u64,
    /// Gradient values the 16-bit casts flushed to zero, over all ranks.
    pub underflows: u64,
}

/// Data-parallel training over a [`Communicator`]: a [`StepObserver`] that reduces the
/// gradients of a step over the ranks (see the [module docs](self)).
///
/// A failed collective cannot be returned from [`gradients_ready`](StepObserver::
/// gradients_ready), so it is recorded, the gradients are set to NaN and
/// [`all_finite`](StepObserver::all_finite) answers `false`: the step changes no parameter
/// (without a loss scaler it fails with a non-finite gradient; with one it is skipped). The
/// caller must then check [`take_error`](Self::take_error); [`train_step`](Self::train_step)
/// does it and returns the collective's error. The communicator is closed after a failure:
/// the run must stop.
pub struct DataParallel {
    link: SharedLink,
    bucket_bytes: usize,
    /// This rank's weight `n_r/B` in the sum of the gradients.
    weight: f64,
    /// `Σ_i (n_i/B)·L_i` of this rank's micro-batches, written by `train_step`'s loss.
    local_loss: Rc<Cell<f64>>,
    loss_recorded: bool,
    summary: Option<StepSummary>,
    /// The ZeRO-2 optimizer whose shards receive the gradients, if any: while it lives,
    /// steps reduce-scatter instead of all-reducing.
    sharded: Option<Weak<dyn GradientShards>>,
    /// Micro-batches of the step `train_step` is running, to arm ZeRO-2's hooks for the
    /// last backward.
    micro_batches: Option<usize>,
    /// The tensor-parallel group beside this data-parallel one, if the model is split.
    tensor: Option<TensorAxis>,
    /// Whether steps reduce their buckets while backward goes on.
    overlap: bool,
    /// The overlapped reduction of the step `train_step` is running.
    overlapped: Option<Rc<dyn OverlappedReduction>>,
}

impl DataParallel {
    /// Data parallelism over `comm`, with buckets of [`DEFAULT_BUCKET_BYTES`] and equal
    /// shares (weight `1/world_size`) until [`begin_step`](Self::begin_step) says otherwise.
    pub fn new(comm: Box<dyn Communicator>) -> Self {
        let weight = 1.0 / comm.world_size() as f64;
        Self {
            link: Link::shared(comm),
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            weight,
            local_loss: Rc::new(Cell::new(0.0)),
            loss_recorded: false,
            summary: None,
            sharded: None,
            micro_batches: None,
            tensor: None,
            overlap: false,
            overlapped: None,
        }
    }

    /// Reduces each bucket of a step run by [`train_step`](Self::train_step) as soon as the
    /// last backward has produced its gradients, on a communication thread, while backward
    /// goes on (`true`); or all of them after backward (`false`, the default). The sums are
    /// the same bits either way (see [`overlap`](crate::overlap)). ZeRO-2 reduce-scatters
    /// its buckets on the thread too, and a [`Zero3`](crate::Zero3) made on this
    /// `DataParallel` gathers the next unit there while a unit computes. A rank holds up to
    /// [`MAX_IN_FLIGHT`](crate::MAX_IN_FLIGHT) bucket buffers more while they are under
    /// way.
    ///
    /// The thread runs only where it can: more than one rank, a communicator whose calls may
    /// run beside others' ([`Communicator::concurrent_calls`]), outside meta mode; elsewhere
    /// the collectives start at the same points and run at once (the same buffers held as
    /// long, so `tinyllm plan` still equals the meter). Not with a tensor-parallel group
    /// ([`with_tensor_parallel`](Self::with_tensor_parallel)): its sums of shares come
    /// before the reduction, which then runs after backward as without overlap.
    pub fn with_overlap(mut self, overlap: bool) -> Self {
        self.link.borrow_mut().set_threaded(overlap);
        self.overlap = overlap;
        self
    }

    /// Whether steps overlap their reduction with backward ([`with_overlap`]
    /// (Self::with_overlap)); `threaded()` says whether on a thread of its own.
    pub fn overlaps(&self) -> bool {
        self.overlap
    }

    /// Wall-clock time the communication thread has spent in collectives while the rank
    /// computed (zero without one): what overlap hid, where the rank did not wait for it.
    pub fn overlapped_communication_time(&self) -> std::time::Duration {
        self.link.borrow().overlapped()
    }

    /// Makes the step's decisions span the tensor-parallel group `tp` too (a model split
    /// over it, each rank of this data-parallel group being one slice of it): a step is
    /// skipped on every rank of the mesh when any rank's gradients overflow, and the clip
    /// norm is that of the whole model's gradients — the split parameters' slices summed
    /// over `tp`, the `replicated` ones (by the model's parameter order, that of the
    /// optimizer given to the steps or to a ZeRO stage made on this `DataParallel`: those
    /// every rank of `tp` holds whole, such as norms) counted once.
    ///
    /// The gradients are reduced over this data-parallel group alone, as before (or
    /// reduce-scattered, at ZeRO-2 and 3); the tensor-parallel group's own reductions happen
    /// inside the model's ops.
    pub fn with_tensor_parallel(mut self, tp: TensorParallel, replicated: Vec<bool>) -> Self {
        self.tensor = Some(TensorAxis::new(tp, replicated));
        self
    }

    /// Under sequence parallelism: sums over the tensor-parallel group the gradients of the
    /// parameters flagged in `shares` (by the model's parameter order) when the step's
    /// gradients are ready, before anything reads them (before the data-parallel reduction;
    /// at ZeRO-2 and 3 after it, on this rank's shard of them) — the parameters every rank holds whole but trains on its own rows of the sequence
    /// only (a norm's gain), whose gradient on each rank is a share of the whole one
    /// ([`TensorParallel::all_reduce_gradients`], one all-reduce a step, as Megatron makes
    /// it). Being replicated, they are counted once in the clip norm, as before.
    ///
    /// A failed sum is kept for [`take_error`](Self::take_error) and makes the gradients
    /// NaN, as a failed reduction does.
    ///
    /// # Panics
    /// Unless [`with_tensor_parallel`](Self::with_tensor_parallel) came first.
    pub fn with_sequence_parallel(mut self, shares: Vec<bool>) -> Self {
        let tensor = (self.tensor.as_mut())
            .expect("DataParallel::with_sequence_parallel: call with_tensor_parallel first");
        tensor.set_shares(shares);
        self
    }

    /// The same with buckets of `bytes` (at least one element each).
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes;
        self
    }

    /// Makes the steps hand their gradients to `shards` (ZeRO-2), which reduce-scatter them
    /// instead of this observer all-reducing them.
    pub(crate) fn shard_gradients(&mut self, shards: &Rc<dyn GradientShards>) {
        self.sharded = Some(Rc::downgrade(shards));
    }

    /// The stage that shards the gradients, while its optimizer lives.
    fn sharded(&self) -> Option<Rc<dyn GradientShards>> {
        self.sharded.as_ref()?.upgrade()
    }

    /// The tensor-parallel group the step's decisions span, afresh, for a stage that runs
    /// its own step on this `DataParallel`'s group (ZeRO-3).
    pub(crate) fn tensor_axis(&self) -> Option<TensorAxis> {
        self.tensor.as_ref().map(TensorAxis::fresh)
    }

    /// Whether the step's decisions span a tensor-parallel group too
    /// ([`with_tensor_parallel`](Self::with_tensor_parallel)): then even a data-parallel
    /// group of one takes the observed step.
    pub fn spans_tensor(&self) -> bool {
        self.tensor.is_some()
    }

    /// The communicator, for the pieces that share it.
    pub(crate) fn link(&self) -> SharedLink {
        Rc::clone(&self.link)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.link.borrow().rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.link.borrow().world_size()
    }

    /// The communicator's counters (collectives called, bytes sent).
    pub fn stats(&self) -> CommStats {
        self.link.borrow().stats()
    }

    /// Wall-clock time this rank has spent inside collectives (waiting for its peers
    /// included): what communication costs a step that does not overlap it.
    pub fn communication_time(&self) -> std::time::Duration {
        self.link.borrow().busy()
    }

    /// Runs `collective` on the communicator the data-parallel pieces share, for what a
    /// training loop agrees on between steps (a stop request, a fingerprint of the config).
    ///
    /// # Errors
    /// [`ParallelError::Collective`] naming this rank if it fails, or if an earlier
    /// collective failed (the communicator is closed after a failure).
    pub fn with_communicator<T>(
        &mut self,
        collective: impl FnOnce(&mut dyn Communicator) -> tl_collective::Result<T>,
    ) -> Result<T> {
        let done = self.link.borrow_mut().call(collective);
        match done {
            Some(value) => Ok(value),
            None => Err(self
                .take_error()
                .unwrap_or_else(|| ParallelError::Collective {
                    rank: self.rank(),
                    source: tl_collective::CollectiveError::Closed,
                })),
        }
    }

    /// What the last reduction established, once a step has reduced its gradients.
    pub fn summary(&self) -> Option<StepSummary> {
        self.summary
    }

    /// The first collective error since the last call, if any (see the type's docs): the
    /// tensor-parallel group's sum of shares first.
    pub fn take_error(&mut self) -> Option<ParallelError> {
        if let Some(error) = self.tensor.as_mut().and_then(TensorAxis::take_error) {
            return Some(error);
        }
        let rank = self.rank();
        self.link
            .borrow_mut()
            .take_error()
            .map(|source| ParallelError::Collective { rank, source })
    }

    /// Makes every rank's `params` equal to rank 0's (the initial weights of a run), in
    /// buckets as the gradients are.
    ///
    /// # Errors
    /// [`ParallelError::Collective`] if a broadcast fails.
    pub fn broadcast_parameters<E: GradElement>(&mut self, params: &[Tensor<E>]) -> Result<()> {
        let numels: Vec<usize> = params.iter().map(Tensor::numel).collect();
        let meta = params.iter().any(Tensor::is_meta);
        let mut buf = Metered::new(meta, communication(labels::BROADCAST_WEIGHTS, None));
        for bucket in plan(&numels, self.capacity::<E>()) {
            buf.reset(bucket_len(&bucket));
            if let Some(values) = buf.values_mut() {
                let mut offset = 0;
                for s in &bucket {
                    let run = &mut values[offset..offset + s.len];
                    read_run(&params[s.param].value(), s.start, run);
                    offset += s.len;
                }
            }
            let view = buf.view_mut();
            let sent = self.link.borrow_mut().call(|comm| comm.broadcast(view, 0));
            if sent.is_none() {
                return Err(self
                    .take_error()
                    .expect("a failed broadcast keeps its error"));
            }
            if let Some(values) = buf.values() {
                let mut offset = 0;
                for s in &bucket {
                    let run = &values[offset..offset + s.len];
                    params[s.param].update_value(|value| write_run(value, s.start, run));
                    offset += s.len;
                }
            }
        }
        Ok(())
    }

    /// Declares this rank's rows and the global batch's rows for the next step: its
    /// gradient enters the sum with weight `local_rows/global_rows`.
    /// [`train_step`](Self::train_step) calls it; call it yourself when you use the observer
    /// directly with unequal shares.
    ///
    /// # Errors
    /// [`ParallelError::RowsOutsideBatch`] if `local_rows` is zero or greater than
    /// `global_rows` (nothing changes).
    pub fn begin_step(&mut self, local_rows: usize, global_rows: usize) -> Result<()> {
        self.weight =
            crate::batch::replica_weight(self.rank(), self.world_size(), local_rows, global_rows)?;
        self.local_loss.set(0.0);
        self.loss_recorded = false;
        self.summary = None;
        Ok(())
    }

    /// Adds `loss` (this rank's micro-batches' losses, each weighted by its share of the
    /// global batch's rows) to the step's loss, which the reduction sums over the ranks: for
    /// a caller that accumulates the gradients its own way (a pipeline's last stage) and
    /// then ends the step with this observer, after [`begin_step`](Self::begin_step).
    pub fn record_loss(&mut self, loss: f64) {
        self.local_loss.set(self.local_loss.get() + loss);
        self.loss_recorded = true;
    }

    /// `report`, of a step this observer ended, with the global batch's loss and
    /// underflows the reduction summed over the ranks.
    pub fn global_report(&self, report: StepReport) -> StepReport {
        global_report(report, self.summary)
    }

    /// One data-parallel training step: [`train_step_mixed_observed`] on this rank's
    /// `micro_batches` with `self` as the observer, whose report holds the global batch's
    /// loss and underflows, the same on every rank (and so do `skipped`, `scale` and
    /// `grad_norm`). `global_rows` is the rows of all ranks' micro-batches together.
    ///
    /// # Errors
    /// [`ParallelError::Collective`] if a collective failed (no parameter changed); the
    /// step's own errors as [`ParallelError::Precision`]; [`ParallelError::RowsOutsideBatch`]
    /// if this rank's micro-batches have no rows or more than `global_rows`. An error a rank
    /// hits before the reduction (these, an empty micro-batch) leaves the other ranks waiting
    /// in it until their communicator's timeout.
    #[allow(clippy::too_many_arguments)]
    pub fn train_step<E, M, B, F, O>(
        &mut self,
        model: &M,
        micro_batches: &[B],
        global_rows: usize,
        loss_fn: F,
        opt: &mut O,
        precision: Precision,
        scaler: Option<&mut tl_precision::DynamicLossScaler>,
        clip: Option<f64>,
    ) -> Result<StepReport>
    where
        E: GradElement,
        M: Module<E> + ?Sized,
        B: MicroBatch,
        F: FnMut(&M, &B) -> Tensor<E>,
        O: Optimizer<E> + ?Sized,
    {
        self.begin_step(micro_batches.iter().map(B::rows).sum(), global_rows)?;
        self.loss_recorded = true;
        let recording_loss = recording_loss(loss_fn, Rc::clone(&self.local_loss), global_rows);
        self.micro_batches = Some(micro_batches.len());
        if self.overlap && self.tensor.is_none() && self.sharded().is_none() {
            let overlap = Overlap::new(self.link(), opt.parameters(), self.capacity::<E>());
            self.overlapped = Some(overlap);
        }
        let result = train_step_mixed_observed(
            model,
            micro_batches,
            recording_loss,
            opt,
            precision,
            scaler,
            clip,
            self,
        );
        self.micro_batches = None;
        self.overlapped = None;
        if let Some(error) = self.take_error() {
            return Err(error);
        }
        Ok(global_report(result?, self.summary))
    }

    /// Elements of `E` per bucket.
    pub(crate) fn capacity<E>(&self) -> usize {
        (self.bucket_bytes / size_of::<E>()).max(1)
    }

    /// Sums the weighted gradients of `params` over the ranks, bucket by bucket, with the
    /// extras in the last bucket; `None` if a collective failed (the link keeps the error).
    fn reduce_gradients<E: GradElement>(&mut self, params: &[Tensor<E>]) -> Option<()> {
        let numels: Vec<usize> = params.iter().map(Tensor::numel).collect();
        let buckets = plan(&numels, self.capacity::<E>());
        let weight = E::from_f64(self.weight);
        let meta = params.iter().any(|p| p.is_meta() || p.grad_is_meta());
        let mut finite = true;
        let mut buf = Metered::new(meta, communication(labels::GRADIENT_BUCKET, None));
        for (index, bucket) in buckets.iter().enumerate() {
            buf.reset(bucket_len(bucket));
            if let Some(values) = buf.values_mut() {
                finite &= fill_bucket(params, bucket, weight, values);
            }
            let last = index + 1 == buckets.len();
            let extras = last.then(|| step_extras::<E>(self.local_loss.get(), !finite));
            if let Some(extras) = extras {
                buf.extend(extras);
            }
            let view = buf.view_mut();
            self.link
                .borrow_mut()
                .call(|comm| comm.all_reduce_sum(view))?;
            match buf.values() {
                Some(values) => write_bucket(params, bucket, values),
                None => bucket.iter().for_each(|s| ensure_grad(&params[s.param])),
            }
            if let Some(extras) = extras {
                // A meta run sums nothing: every rank is taken to hold what this one holds,
                // as the phantom communicator leaves a buffer.
                let summed = buf
                    .values()
                    .map_or(&extras[..], |v| &v[v.len() - STEP_EXTRAS..]);
                self.summary = Some(StepSummary::of_extras(summed, self.loss_recorded));
            }
        }
        Some(())
    }
}

/// This rank's [`STEP_EXTRAS`], in their order: its part of the global loss, whether its
/// gradients held an inf or a NaN, its flushed underflows.
pub(crate) fn step_extras<E: GradElement>(local_loss: f64, nonfinite: bool) -> [E; STEP_EXTRAS] {
    [
        E::from_f64(local_loss),
        if nonfinite { E::one() } else { E::zero() },
        E::from_f64(underflow_count() as f64),
    ]
}

impl StepSummary {
    /// What the [`STEP_EXTRAS`] summed over the ranks say (the loss only when it was
    /// recorded).
    pub(crate) fn of_extras<E: GradElement>(extras: &[E], loss_recorded: bool) -> Self {
        StepSummary {
            global_loss: loss_recorded.then(|| extras[0].to_f64()),
            nonfinite_ranks: extras[1].to_f64() as u64,
            underflows: extras[2].to_f64() as u64,
        }
    }
}

/// `report` with the global batch's loss and underflows from `summary`, when there is one.
pub(crate) fn global_report(mut report: StepReport, summary: Option<StepSummary>) -> StepReport {
    if let Some(summary) = summary {
        report.loss = summary.global_loss.unwrap_or(report.loss);
        report.underflows = summary.underflows;
    }
    report
}

impl<E: GradElement> StepObserver<E> for DataParallel {
    /// Arms ZeRO-2's gradient-ready hooks around the last micro-batch's backward, when a
    /// [`Zero2AdamW`](crate::Zero2AdamW) shards this step's gradients.
    fn phase<R>(&mut self, phase: StepPhase, run: impl FnOnce(&mut Self) -> R) -> R {
        let StepPhase::Backward { micro_batch } = phase else {
            return run(self);
        };
        let last = (self.micro_batches).is_some_and(|m| reduces_in_backward(micro_batch, m));
        if let Some(overlapped) = self.overlapped.clone()
            && last
        {
            overlapped.arm(self.weight);
            let out = run(self);
            overlapped.disarm();
            return out;
        }
        match self.sharded() {
            Some(shards) if last => {
                shards.arm(self.weight, self.overlap);
                let out = run(self);
                shards.disarm();
                out
            }
            _ => run(self),
        }
    }

    /// Reduces the gradients (see the [type's docs](DataParallel) for a failure).
    fn gradients_ready(&mut self, params: &[Tensor<E>]) {
        let _reduction = memory::stage_scope(Stage::Reduction);
        if let Some(shards) = self.sharded() {
            // The gradients are in the shards once the last buckets are reduced; the
            // optimizer's parameters are runs of the model's.
            let local_loss = self.local_loss.get();
            self.summary = shards.finish(self.weight, local_loss, self.loss_recorded);
            if self.summary.is_none() {
                shards.poison();
            }
            if let Some(tensor) = &mut self.tensor {
                tensor.gradients_ready(params, |piece| shards.parameter_of_piece(piece));
            }
            return;
        }
        if let Some(overlapped) = self.overlapped.take() {
            let local_loss = self.local_loss.get();
            self.summary = overlapped.finish(self.weight, local_loss, self.loss_recorded);
            if self.summary.is_none() {
                for param in params {
                    ensure_grad(param);
                    param.update_grad(|g| g.fill(E::nan()));
                }
            }
            return;
        }
        if let Some(tensor) = &mut self.tensor {
            tensor.gradients_ready(params, |param| param);
        }
        if self.reduce_gradients(params).is_none() {
            // Half-reduced gradients must not reach the optimizer: NaN makes the step refuse
            // them whether or not it has a loss scaler.
            for param in params {
                ensure_grad(param);
                param.update_grad(|g| g.fill(E::nan()));
            }
        }
    }

    /// Finite on every rank: no rank flagged an inf or NaN, no collective failed, and the
    /// reduced gradients (`local`, the same on every rank) are finite; with a
    /// tensor-parallel group, on every rank of it too.
    fn all_finite(&mut self, local: bool) -> bool {
        let failed = self.link.borrow().failed();
        let finite = all_ranks_finite(local, failed, self.summary);
        match &self.tensor {
            Some(tensor) => tensor.all_finite(finite),
            None => finite,
        }
    }

    /// The reduced gradients are replicated, so this rank's sum is the global one; under
    /// ZeRO-2 each rank holds a shard, and the sums are added over the ranks. With a
    /// tensor-parallel group, the slices' sums are added over it and the replicated
    /// parameters counted once ([`TensorAxis::total_sum_squares`]).
    fn total_sum_squares(&mut self, local: f64) -> f64 {
        let sharded = self.sharded().is_some();
        let link = &self.link;
        let over_data = |sum: f64| {
            global_sum_squares(sum, sharded, |sum| {
                (link.borrow_mut())
                    .call(|comm| comm.all_reduce_sum_f64(sum))
                    .unwrap_or(f64::NAN)
            })
        };
        match &self.tensor {
            Some(tensor) => tensor.total_sum_squares(local, over_data),
            None => over_data(local),
        }
    }
}

/// `loss_fn`, adding each micro-batch's loss to `local_loss` weighted by its share `n_i/B`
/// of the global batch's `global_rows`: the same weights, in the same order, as one
/// process's accumulation, so the sum over the ranks is the global batch's loss.
pub(crate) fn recording_loss<E, M, B, F>(
    mut loss_fn: F,
    local_loss: Rc<Cell<f64>>,
    global_rows: usize,
) -> impl FnMut(&M, &B) -> Tensor<E>
where
    E: GradElement,
    M: ?Sized,
    B: MicroBatch,
    F: FnMut(&M, &B) -> Tensor<E>,
{
    move |model: &M, micro_batch: &B| {
        let loss = loss_fn(model, micro_batch);
        let weight = micro_batch.rows() as f64 / global_rows as f64;
        local_loss.set(local_loss.get() + weight * loss.item().to_f64());
        loss
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_collective::Single;
    use tl_tensor::ndarray::arr1;

    #[test]
    fn a_share_outside_the_global_batch_is_an_error_that_changes_nothing() {
        let mut ddp = DataParallel::new(Box::new(Single::new()));
        for (local, global) in [(0, 4), (5, 4)] {
            let error = ddp.begin_step(local, global).unwrap_err();
            assert!(
                matches!(error, ParallelError::RowsOutsideBatch { .. }),
                "{error}"
            );
        }
        assert_eq!(ddp.weight, 1.0);
    }

    #[test]
    fn a_world_of_one_weights_its_gradient_by_its_share_and_folds_the_extras() {
        // Rows 3 of 4: the gradient 2 becomes 2·3/4 = 1.5; one bucket, one collective.
        let mut ddp = DataParallel::new(Box::new(Single::new()));
        let w = Tensor::<f64>::param(arr1(&[1.0]).into_dyn());
        w.set_grad(Some(arr1(&[2.0]).into_dyn()));
        ddp.begin_step(3, 4).unwrap();
        StepObserver::gradients_ready(&mut ddp, std::slice::from_ref(&w));
        assert_eq!(w.grad().unwrap()[0], 1.5);
        assert_eq!(ddp.stats().collectives, 1);
        let summary = ddp.summary().unwrap();
        assert_eq!((summary.global_loss, summary.nonfinite_ranks), (None, 0));
        assert!(StepObserver::<f64>::all_finite(&mut ddp, true));
    }

    #[test]
    fn a_non_finite_gradient_is_flagged_for_every_rank() {
        let mut ddp = DataParallel::new(Box::new(Single::new()));
        let w = Tensor::<f32>::param(arr1(&[1.0, 1.0]).into_dyn());
        w.set_grad(Some(arr1(&[f32::INFINITY, 0.0]).into_dyn()));
        StepObserver::gradients_ready(&mut ddp, std::slice::from_ref(&w));
        assert_eq!(ddp.summary().unwrap().nonfinite_ranks, 1);
        // Even a caller that claims its gradients are finite hears "not finite".
        assert!(!StepObserver::<f32>::all_finite(&mut ddp, true));
    }
}
