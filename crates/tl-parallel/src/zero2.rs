//! [`Zero2AdamW`]: ZeRO stage 2 — the gradients reduce-scattered as backward produces them,
//! each rank keeping only its shard of them, and AdamW's moments and update sharded the same
//! way.
//!
//! **Ownership.** The parameters are laid out in the buckets DDP uses ([`plan`]: reverse
//! parameter order, every bucket but the last full). Rank `r` owns the elements
//! [`shard_range`]`(len, N, r)` of every bucket, where `len` is the bucket's length — for the
//! last bucket plus the three slots DDP appends to it (loss, flag, underflows), left at zero
//! here. Those are exactly the chunks DDP's ring all-reduce adds up for that rank, in the
//! same order, so a rank's reduce-scattered shard holds the bits DDP's all-reduce gives
//! those elements.
//!
//! **When it communicates.** The micro-batches before the last accumulate full local
//! gradients and communicate nothing, as in DDP. During the last micro-batch's backward each
//! parameter's gradient-ready hook marks it done; as soon as every parameter of the next
//! bucket is done, its gradients are copied (weighted by this rank's share `n_r/B`) into a
//! bucket buffer, each parameter's full gradient is dropped once all of its segments are
//! copied, and the bucket is reduce-scattered. Buckets go strictly in order, so every rank
//! issues the same collectives in the same order even if its backward reaches the
//! parameters differently. When backward is done, any bucket still waiting (a parameter no
//! gradient reached) is reduced, and one small all-reduce makes the loss, the non-finite
//! flag and the underflows global. After the update, one all-gather per bucket gives every
//! rank the updated weights.
//!
//! **What the step sees.** [`Optimizer::parameters`] are this rank's 1-D shard pieces, so
//! tl-precision's step checks, unscales, clips and steps the shards only. The overflow
//! decision ([`StepObserver::all_finite`](tl_precision::StepObserver::all_finite)) comes from
//! the flags summed over the ranks, and the clip norm's sum of squares from an all-reduce of
//! the ranks' sums (one more collective, when clipping).
//!
//! **Memory.** A rank holds the full parameters, its shard of the gradients, moments and
//! master weights, and during backward only the gradients not yet reduced plus one bucket.
//!
//! The gradient-ready hooks are armed only during the last backward of a step run through
//! [`DataParallel::train_step`]. Each parameter must be reached by exactly one backward
//! sweep then (true of a model without shared weights, checkpointed or not); a gradient
//! that arrives after its bucket was reduced would be lost, so it panics.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ops::Range;
use std::rc::{Rc, Weak};

use tl_collective::shard_range;
use tl_precision::grad_is_finite;
use tl_tensor::memory::{self, Stage};
use tl_tensor::ndarray::ArrayD;
use tl_tensor::optim::{AdamW, AdamWState, Optimizer};
use tl_tensor::{Element, Tensor};

use crate::bucket::{STEP_EXTRAS, Segment, fill_bucket, plan};
use crate::ddp::{DataParallel, GradElement, StepSummary, step_extras};
use crate::error::{ParallelError, Result};
use crate::link::{Pending, SharedLink};
use crate::metered::{Metered, Wire, common_owner, communication, labels};
use crate::overlap::MAX_IN_FLIGHT;
use crate::runs::{bucket_len, read_run, set_grad_with, write_run};
use crate::shard_step::{release_copied, shard_pieces};
use crate::zero::{adamw_like, load_shard, master_shard, moment_elements, whole_state};

/// One bucket: its segments, its length on the wire and this rank's chunk of it.
struct Bucket {
    segments: Vec<Segment>,
    /// The bucket's elements, plus [`STEP_EXTRAS`] for the last one.
    wire_len: usize,
    /// This rank's chunk, `shard_range(wire_len, N, r)`.
    chunk: Range<usize>,
    /// Indices of the pieces that lie in this bucket, in chunk order.
    pieces: Vec<usize>,
}

/// A run of one parameter inside this rank's chunk of one bucket.
struct Piece<E: Element> {
    param: usize,
    /// First element of the run in the parameter.
    start: usize,
    /// Where the run sits in the bucket's chunk.
    chunk_offset: usize,
    /// The run's master copy, a 1-D parameter of the inner AdamW; its gradient is this
    /// rank's reduced shard.
    values: Tensor<E>,
}

/// What the optimizer and the gradient-ready hooks share.
pub(crate) struct Core<E: GradElement> {
    /// This core, for the hooks [`GradientShards::arm`] sets.
    this: Weak<RefCell<Core<E>>>,
    link: SharedLink,
    parameters: Vec<Tensor<E>>,
    buckets: Vec<Bucket>,
    pieces: Vec<Piece<E>>,
    /// Segments per parameter over all buckets.
    segments_of: Vec<usize>,
    /// Segments of each parameter not yet copied in this step.
    remaining: Vec<usize>,
    /// Whether each parameter's gradient is complete in this step's last backward.
    ready: Vec<bool>,
    /// The next bucket to reduce.
    next: usize,
    /// This rank's weight `n_r/B`.
    weight: E,
    /// Whether every gradient copied so far was finite.
    finite: bool,
    /// Whether the parameters are [meta](tl_tensor::meta): the buffers hold no values.
    meta: bool,
    /// Whether this step's reduce-scatters may stay under way while backward goes on.
    overlap: bool,
    /// Reduce-scatters under way, oldest first.
    in_flight: VecDeque<ShardInFlight<E>>,
}

impl<E: GradElement> Core<E> {
    /// Back to the start of a step.
    fn reset(&mut self) {
        self.remaining.clone_from(&self.segments_of);
        self.ready.iter_mut().for_each(|r| *r = false);
        self.next = 0;
        self.finite = true;
        self.in_flight.clear();
    }

    /// Reduces every bucket from `next` on whose parameters are all ready (all of them when
    /// `flush`).
    fn advance(&mut self, flush: bool) {
        while self.next < self.buckets.len() {
            let ready = self.buckets[self.next]
                .segments
                .iter()
                .all(|s| self.ready[s.param]);
            if !(ready || flush) {
                break;
            }
            self.reduce(self.next);
            self.next += 1;
        }
    }

    /// Copies bucket `index`'s weighted gradients into a buffer, drops the gradients that
    /// are fully copied, and starts the reduce-scatter; without overlap, completes it at
    /// once, so that the rank holds one bucket at a time. With overlap, at most
    /// [`MAX_IN_FLIGHT`] are under way: the oldest is completed before another starts.
    fn reduce(&mut self, index: usize) {
        let _reduction = memory::stage_scope(Stage::Reduction);
        if self.overlap {
            while self.in_flight.len() >= MAX_IN_FLIGHT {
                self.complete_oldest();
            }
        }
        let Core {
            link,
            parameters,
            buckets,
            remaining,
            weight,
            finite,
            meta,
            ..
        } = self;
        let bucket = &buckets[index];
        let owner = common_owner(bucket.segments.iter().map(|s| &parameters[s.param]));
        let mut input = Metered::zeros(
            bucket.wire_len,
            *meta,
            communication(labels::GRADIENT_BUCKET, owner),
        );
        if let Some(values) = input.values_mut() {
            *finite &= fill_bucket(parameters, &bucket.segments, *weight, values);
        }
        release_copied(parameters, &bucket.segments, remaining);
        let mut shard = Metered::zeros(
            bucket.chunk.len(),
            *meta,
            communication(labels::REDUCED_SHARD, owner),
        );
        let pending = link
            .borrow_mut()
            .start((input.take(), shard.take()), |comm, (input, shard)| {
                comm.reduce_scatter_sum(input.view(), shard.view_mut())
            });
        self.in_flight.push_back(ShardInFlight {
            index,
            input,
            shard,
            pending,
        });
        if !self.overlap {
            self.complete_oldest();
        }
    }

    /// Waits for the oldest reduce-scatter under way and gives its pieces their shard of
    /// it (NaN if it failed).
    fn complete_oldest(&mut self) {
        let ShardInFlight {
            index,
            mut input,
            mut shard,
            pending,
        } = self.in_flight.pop_front().expect("a bucket is under way");
        let sent = match self.link.borrow_mut().wait(pending) {
            Some(((wire_in, wire_shard), ok)) => {
                input.restore(wire_in);
                shard.restore(wire_shard);
                ok
            }
            None => false,
        };
        drop(input);
        for &p in &self.buckets[index].pieces {
            let piece = &self.pieces[p];
            let len = piece.values.numel();
            set_grad_with(&piece.values, || {
                let grad = match (sent, shard.values()) {
                    (true, Some(shard)) => {
                        shard[piece.chunk_offset..piece.chunk_offset + len].to_vec()
                    }
                    // Half-reduced gradients must not reach the optimizer.
                    _ => vec![E::nan(); len],
                };
                ArrayD::from_shape_vec(vec![len], grad).expect("1-D")
            });
        }
    }
}

/// A bucket whose reduce-scatter is under way: its input and this rank's shard of the sum.
struct ShardInFlight<E: GradElement> {
    index: usize,
    input: Metered<E>,
    shard: Metered<E>,
    pending: Pending<(Wire<E>, Wire<E>)>,
}

/// What [`DataParallel`] asks of a stage that shards the gradients of its steps (ZeRO-2's
/// [`Zero2AdamW`], through its core): the step's reduction, taken over.
pub(crate) trait GradientShards {
    /// Arms the gradient-ready hooks for one backward (the last micro-batch's), with this
    /// rank's weight `n_r/B`, so that each bucket is reduce-scattered as soon as its
    /// gradients are complete: left under way while backward goes on when `overlap`.
    fn arm(&self, weight: f64, overlap: bool);

    /// Removes the hooks [`arm`](Self::arm) set.
    fn disarm(&self);

    /// After every backward of the step: reduces what is left, then makes the loss, the
    /// flag and the underflows global. `None` if a collective failed.
    fn finish(&self, weight: f64, local_loss: f64, loss_recorded: bool) -> Option<StepSummary>;

    /// Sets the shards' gradients to NaN (after a failed collective).
    fn poison(&self);

    /// The parameter (by the order of the optimizer the stage was made from) whose run the
    /// `piece`-th of the stage's own parameters holds.
    fn parameter_of_piece(&self, piece: usize) -> usize;
}

impl<E: GradElement> GradientShards for RefCell<Core<E>> {
    fn arm(&self, weight: f64, overlap: bool) {
        {
            // A step that failed before its gradients were reduced may have left state
            // behind.
            let mut core = self.borrow_mut();
            core.reset();
            core.weight = E::from_f64(weight);
            core.overlap = overlap;
        }
        let core = self.borrow();
        for (index, param) in core.parameters.iter().enumerate() {
            let this = Weak::clone(&core.this);
            param.set_grad_ready_hook(Some(Rc::new(move || {
                if let Some(core) = this.upgrade() {
                    let mut core = core.borrow_mut();
                    assert!(
                        !core.ready[index],
                        "ZeRO-2: parameter {index} got a second gradient in the last \
                         backward, after its bucket may have been reduced (shared weights \
                         are not supported)"
                    );
                    core.ready[index] = true;
                    core.advance(false);
                }
            })));
        }
    }

    fn disarm(&self) {
        for param in &self.borrow().parameters {
            param.set_grad_ready_hook(None);
        }
    }

    fn finish(&self, weight: f64, local_loss: f64, loss_recorded: bool) -> Option<StepSummary> {
        let _reduction = memory::stage_scope(Stage::Reduction);
        let mut core = self.borrow_mut();
        core.weight = E::from_f64(weight);
        core.advance(true);
        while !core.in_flight.is_empty() {
            core.complete_oldest();
        }
        core.overlap = false;
        let shard_finite = core.pieces.iter().all(|p| grad_is_finite(&p.values));
        let flag = !(core.finite && shard_finite);
        core.reset();
        let mut extras = step_extras::<E>(local_loss, flag);
        core.link.borrow_mut().call(|comm| {
            comm.all_reduce_sum(<E as tl_collective::Element>::view_mut(&mut extras))
        })?;
        Some(StepSummary::of_extras(&extras, loss_recorded))
    }

    fn parameter_of_piece(&self, piece: usize) -> usize {
        self.borrow().pieces[piece].param
    }

    fn poison(&self) {
        for piece in &self.borrow().pieces {
            let len = piece.values.numel();
            set_grad_with(&piece.values, || ArrayD::from_elem(vec![len], E::nan()));
        }
    }
}

/// AdamW with the gradients, the moments and the update partitioned over the ranks of a
/// [`DataParallel`] (ZeRO stage 2; see the [module docs](self)). Pass it to
/// [`DataParallel::train_step`] of the `DataParallel` it was made with; that `DataParallel`
/// then reduce-scatters instead of all-reducing.
pub struct Zero2AdamW<E: GradElement> {
    core: Rc<RefCell<Core<E>>>,
    /// The pieces' master copies, the inner AdamW's parameters.
    shards: Vec<Tensor<E>>,
    inner: AdamW<E>,
}

impl<E: GradElement> Zero2AdamW<E> {
    /// Shards `adamw` (its parameters and hyperparameters) over `ddp`'s ranks and makes
    /// `ddp` reduce-scatter the gradients of its steps into this optimizer's shards.
    ///
    /// # Errors
    /// [`ParallelError::OptimizerHasState`] if `adamw` has already stepped (load a saved
    /// state with [`load_full_state`](Self::load_full_state) instead).
    ///
    /// ```
    /// use tl_collective::Single;
    /// use tl_parallel::{DataParallel, Zero2AdamW};
    /// use tl_tensor::nn::{Linear, Module};
    /// use tl_tensor::optim::{AdamW, Optimizer};
    /// use tl_tensor::Generator;
    ///
    /// let mut ddp = DataParallel::new(Box::new(Single::new()));
    /// let model = Linear::<f32>::new(3, 2, true, &Generator::new(0));
    /// let opt = Zero2AdamW::new(&mut ddp, AdamW::new(model.parameters(), 1e-3)?)?;
    /// // One bucket, and a world of one owns it: one piece per parameter, 1-D.
    /// assert_eq!(opt.shard_elements(), 8);
    /// assert_eq!(opt.parameters().len(), 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(ddp: &mut DataParallel, adamw: AdamW<E>) -> Result<Self> {
        if adamw.state_dict().params.iter().any(Option::is_some) {
            return Err(ParallelError::OptimizerHasState);
        }
        let link = ddp.link();
        let (rank, world_size) = {
            let link = link.borrow();
            (link.rank(), link.world_size())
        };
        let parameters = adamw.parameters().to_vec();
        let meta = parameters.iter().any(Tensor::is_meta);
        let numels: Vec<usize> = parameters.iter().map(Tensor::numel).collect();
        let planned = plan(&numels, ddp.capacity::<E>());
        let last = planned.len() - 1;
        let mut segments_of = vec![0; parameters.len()];
        let mut pieces = Vec::new();
        let mut buckets = Vec::new();
        for (index, segments) in planned.into_iter().enumerate() {
            let len = bucket_len(&segments);
            let wire_len = len + if index == last { STEP_EXTRAS } else { 0 };
            let chunk = shard_range(wire_len, world_size, rank);
            segments.iter().for_each(|s| segments_of[s.param] += 1);
            let mut bucket_pieces = Vec::new();
            let mut chunk_offset = 0;
            for piece in shard_pieces(&segments, chunk.clone()) {
                bucket_pieces.push(pieces.len());
                pieces.push(Piece {
                    param: piece.param,
                    start: piece.start,
                    chunk_offset,
                    values: master_shard(
                        piece.len,
                        parameters[piece.param].memory_tag().owner,
                        meta,
                    ),
                });
                chunk_offset += piece.len;
            }
            buckets.push(Bucket {
                segments,
                wire_len,
                chunk,
                pieces: bucket_pieces,
            });
        }
        let shards: Vec<Tensor<E>> = pieces.iter().map(|p| p.values.clone()).collect();
        let inner = adamw_like(&adamw, shards.clone())?;
        let core = Rc::new_cyclic(|this| {
            RefCell::new(Core {
                this: Weak::clone(this),
                link,
                ready: vec![false; parameters.len()],
                remaining: segments_of.clone(),
                segments_of,
                parameters,
                buckets,
                pieces,
                next: 0,
                weight: E::zero(),
                finite: true,
                meta,
                overlap: false,
                in_flight: VecDeque::new(),
            })
        });
        let sharding: Rc<dyn GradientShards> = Rc::clone(&core) as _;
        ddp.shard_gradients(&sharding);
        Ok(Self {
            core,
            shards,
            inner,
        })
    }

    /// Elements of the parameters this rank owns: the length of its gradient shard, and of
    /// each of its two moments once it has stepped.
    pub fn shard_elements(&self) -> usize {
        self.shards.iter().map(Tensor::numel).sum()
    }

    /// Elements of optimizer state this rank holds: two moments per element of its shard
    /// (after the first step).
    pub fn state_elements(&self) -> usize {
        moment_elements(&self.inner)
    }

    /// The whole optimizer state, as an unsharded [`AdamW`] on the same parameters would
    /// have it (see [`ShardedAdamW::full_state`](crate::ShardedAdamW::full_state)): a
    /// collective, two all-gathers per bucket and one all-reduce of the step counts.
    ///
    /// # Errors
    /// [`ParallelError::Collective`] if a collective fails.
    pub fn full_state(&mut self) -> Result<AdamWState> {
        let saved = self.inner.state_dict();
        let core = self.core.borrow();
        let mut exp_avg: Vec<Vec<f64>> = core
            .parameters
            .iter()
            .map(|p| vec![0.0; p.numel()])
            .collect();
        let mut exp_avg_sq = exp_avg.clone();
        let mut steps = vec![0.0f64; core.parameters.len()];
        for (piece, state) in core.pieces.iter().zip(&saved.params) {
            if let Some(state) = state {
                steps[piece.param] = state.step as f64;
            }
        }
        let mut link = core.link.borrow_mut();
        let rank = link.rank();
        let failed = |link: &mut crate::link::Link| ParallelError::Collective {
            rank,
            source: link
                .take_error()
                .expect("a failed collective keeps its error"),
        };
        for bucket in &core.buckets {
            for (moment, full) in [(0, &mut exp_avg), (1, &mut exp_avg_sq)] {
                let tag = communication(labels::GATHERED_MOMENTS, None);
                let mut local = Metered::<E>::zeros(bucket.chunk.len(), core.meta, tag);
                if let Some(local) = local.values_mut() {
                    for &p in &bucket.pieces {
                        let piece = &core.pieces[p];
                        if let Some(state) = &saved.params[p] {
                            let values = if moment == 0 {
                                &state.exp_avg
                            } else {
                                &state.exp_avg_sq
                            };
                            for (dst, &src) in local[piece.chunk_offset..].iter_mut().zip(values) {
                                *dst = E::from_f64(src);
                            }
                        }
                    }
                }
                let mut gathered = Metered::<E>::zeros(bucket.wire_len, core.meta, tag);
                let sent = link.call(|comm| comm.all_gather(local.view(), gathered.view_mut()));
                if sent.is_none() {
                    return Err(failed(&mut link));
                }
                if let Some(gathered) = gathered.values() {
                    let mut offset = 0;
                    for s in &bucket.segments {
                        let run = &gathered[offset..offset + s.len];
                        full[s.param][s.start..s.start + s.len]
                            .iter_mut()
                            .zip(run)
                            .for_each(|(d, &v)| *d = Element::to_f64(v));
                        offset += s.len;
                    }
                }
            }
        }
        let sent = link.call(|comm| {
            comm.all_reduce(
                tl_collective::SliceMut::F64(&mut steps),
                tl_collective::ReduceOp::Max,
            )
        });
        if sent.is_none() {
            return Err(failed(&mut link));
        }
        Ok(whole_state(
            &core.parameters,
            exp_avg,
            exp_avg_sq,
            &steps,
            saved,
        ))
    }

    /// Loads a whole AdamW state (saved at any world size), keeping this rank's shard.
    ///
    /// # Errors
    /// As [`ShardedAdamW::load_full_state`](crate::ShardedAdamW::load_full_state).
    pub fn load_full_state(&mut self, state: &AdamWState) -> Result<()> {
        let core = self.core.borrow();
        let layout = core
            .pieces
            .iter()
            .map(|p| (p.param, p.start, p.values.numel()));
        load_shard(&mut self.inner, &core.parameters, state, layout)
    }
}

impl<E: GradElement> Optimizer<E> for Zero2AdamW<E> {
    /// Updates this rank's shards with AdamW, then all-gathers the weights bucket by bucket.
    fn step(&mut self) {
        let core = self.core.borrow();
        if !core.meta {
            for piece in &core.pieces {
                // The master copy starts from the replicated weights, as in ZeRO-1.
                let param = &core.parameters[piece.param];
                piece.values.update_value(|v| {
                    read_run(&param.value(), piece.start, v.as_slice_mut().expect("1-D"));
                });
            }
        }
        self.inner.step();
        self.inner.zero_grad();
        let _gather = memory::stage_scope(Stage::Gather);
        for bucket in &core.buckets {
            let owner = common_owner(bucket.segments.iter().map(|s| &core.parameters[s.param]));
            let mut local = Metered::zeros(
                bucket.chunk.len(),
                core.meta,
                communication(labels::SHARD_TO_GATHER, owner),
            );
            if let Some(values) = local.values_mut() {
                for &p in &bucket.pieces {
                    let piece = &core.pieces[p];
                    let run = piece.chunk_offset..piece.chunk_offset + piece.values.numel();
                    read_run(&piece.values.value(), 0, &mut values[run]);
                }
            }
            let mut gathered = Metered::zeros(
                bucket.wire_len,
                core.meta,
                communication(labels::GATHERED_WEIGHTS, owner),
            );
            let sent = core
                .link
                .borrow_mut()
                .call(|comm| comm.all_gather(local.view(), gathered.view_mut()));
            if sent.is_none() {
                // The link keeps the error; buckets already written are updated, the rest
                // not: the run must stop, as after any failed collective.
                return;
            }
            if let Some(values) = gathered.values() {
                let mut offset = 0;
                for s in &bucket.segments {
                    let run = &values[offset..offset + s.len];
                    core.parameters[s.param].update_value(|value| write_run(value, s.start, run));
                    offset += s.len;
                }
            }
        }
    }

    fn parameters(&self) -> &[Tensor<E>] {
        &self.shards
    }

    fn learning_rate(&self) -> f64 {
        self.inner.learning_rate()
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.inner.set_learning_rate(lr);
    }
}
