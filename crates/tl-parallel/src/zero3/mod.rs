//! [`Zero3`]: ZeRO stage 3 — the parameters themselves partitioned over the ranks, along
//! with their gradients and AdamW's moments; a unit's whole parameters exist only while
//! the unit computes.
//!
//! **Units.** The caller groups the parameters into *units* (the embedding, each block, the
//! head). A unit's parameters, flattened in their order and concatenated, are `U` elements;
//! rank `r` keeps the elements [`shard_range`]`(U, N, r)` of its values (the master copy
//! AdamW updates), of its gradient and of both moments. The full values of every unit are
//! [released](Tensor::release_value) between uses.
//!
//! **When it communicates.** [`UnitRunner::run_unit`] all-gathers a unit's values just
//! before its forward and releases them right after. A checkpointed unit's forward (no
//! graph) does the same; its rerun during backward gathers them again and keeps them for
//! the unit's backward, which follows at once (as FSDP does not reshard after a
//! recomputed forward). It puts an identity op on the output whose VJP all-gathers them
//! again before the unit's backward starts (a no-op after a rerun), so the ops that saved
//! them find them. Each parameter's gradient-ready
//! hook counts the unit's parameters done; when all are, the unit's gradients (weighted by
//! this rank's share `n_r/B`) are reduce-scattered into this rank's gradient shard, the
//! full gradients dropped and the values released. This happens in the backward of every
//! micro-batch, the shards accumulating. After the last one, one small all-reduce makes
//! the loss, the non-finite flag and the underflows global, as in ZeRO-2. Every rank runs
//! the units in the same order, so every rank issues the same collectives in that order.
//!
//! **Prefetch** (on a [`DataParallel`] that overlaps, [`DataParallel::with_overlap`]): while
//! a unit computes, the gather of the next one is under way on the communication thread —
//! the unit after it in a forward pass, the unit before it in backward (whether its
//! backward or its checkpointed rerun comes first). One gather is ahead at a time; a
//! prefetch that the next gather does not want is waited for and dropped, and so is one
//! still there when the shards change (the update, a loaded state). A rank then holds two
//! units' whole values at once where it held one; a gather copies, so the values, and the
//! training, are the same bits.
//!
//! A caller that runs the passes itself (a pipeline's schedule, each micro-batch's forward
//! and backward apart) brackets them with [`Zero3::begin_step`] and the step's
//! [`Zero3::observer`]: the units communicate exactly as above.
//!
//! Per micro-batch and unit a rank sends `(N−1)/N·U` elements for each of the two gathers
//! (a checkpointed unit's too) and the reduce-scatter: `3(N−1)/N·P` over a model of `P`
//! elements, against DDP's `2(N−1)/N·P` per step; the update itself sends nothing.
//!
//! **Why it matches DDP.** With one micro-batch per rank each element of the reduced
//! gradient is the sum over the ranks of the same weighted local gradients DDP sums; at
//! N = 2 that sum is one addition, which does not depend on the order, so the training is
//! bit for bit DDP's. At N > 2 the ring adds the ranks' values in an order that depends on
//! where the element's chunk lies, and a unit's chunks lie elsewhere than a DDP bucket's;
//! with several micro-batches the shard adds the micro-batches' reduced sums, DDP reduces
//! their local sum. Those differ by rounding.
//!
//! **Limits.** Every parameter of a unit must get a gradient in each backward that reaches
//! the unit (a unit whose parameter is unused never completes), and a parameter belongs to
//! one unit and is used only inside [`UnitRunner::run_unit`] for it.

use std::cell::{Cell, RefCell};
use std::ops::Range;
use std::rc::{Rc, Weak};

use tl_collective::{Communicator, shard_range};
use tl_precision::{
    DynamicLossScaler, MicroBatch, Precision, StepObserver, StepPhase, StepReport, grad_is_finite,
    train_step_mixed_observed,
};
use tl_tensor::kernels::finite::all_finite;
use tl_tensor::memory::{self, Kind, Stage, Tag};
use tl_tensor::ndarray::ArrayD;
use tl_tensor::nn::Module;
use tl_tensor::optim::{AdamW, AdamWState, Optimizer};
use tl_tensor::{Element, Tensor};

use crate::ddp::{
    DataParallel, GradElement, StepSummary, global_report, recording_loss, step_extras,
};
use crate::decide::{all_ranks_finite, global_sum_squares};
use crate::error::{ParallelError, Result};
use crate::link::{Link, Pending, SharedLink};
use crate::metered::{Metered, Wire, common_owner, communication, labels};
use crate::runs::{read_run, set_grad_with, write_run};
use crate::shard_step::shard_pieces;
use crate::tensor_parallel::axis::TensorAxis;
use crate::zero::{adamw_like, load_shard, whole_from, whole_state};

mod unit;

/// A run of one parameter inside this rank's shard of its unit.
struct Piece<E: Element> {
    /// Index of the parameter over all units.
    param: usize,
    /// First element of the run in the parameter.
    start: usize,
    /// Where the run sits in the unit's shard.
    shard_offset: usize,
    /// The run's master values, a 1-D parameter of the inner AdamW; its gradient is this
    /// rank's reduced shard.
    values: Tensor<E>,
}

/// A group of parameters gathered and released together.
struct Unit {
    /// Indices of its parameters, in flattening order.
    params: Vec<usize>,
    /// Elements of all its parameters.
    len: usize,
    /// This rank's elements, `shard_range(len, N, r)`.
    shard: Range<usize>,
    /// Indices of its pieces, in shard order.
    pieces: Vec<usize>,
    /// Parameters whose gradient is complete in the current backward sweep.
    ready: usize,
}

/// What the runner, the identity ops' VJPs and the gradient-ready hooks share.
struct Core<E: GradElement> {
    link: SharedLink,
    parameters: Vec<Tensor<E>>,
    units: Vec<Unit>,
    pieces: Vec<Piece<E>>,
    /// This rank's weight `n_r/B`.
    weight: E,
    /// Whether every local gradient reduced in this step was finite.
    finite: bool,
    /// Whether the parameters are [meta](tl_tensor::meta): the buffers hold no values.
    meta: bool,
    /// Whether the next unit's gather starts while a unit computes.
    prefetch: bool,
    /// That gather, while it is under way or not yet used.
    prefetched: Option<Gathering<E>>,
}

/// A unit's all-gather: this rank's shard, the whole values as they arrive, the call.
struct Gathering<E: GradElement> {
    unit: usize,
    local: Metered<E>,
    gathered: Metered<E>,
    pending: Pending<(Wire<E>, Wire<E>)>,
}

impl<E: GradElement> Core<E> {
    /// All-gathers unit `index`'s values into its parameters, unless they are there: from
    /// the prefetch if it is this unit's (a prefetch of another unit is waited for and
    /// dropped), or at once.
    fn gather(&mut self, index: usize) {
        let unit = &self.units[index];
        if unit
            .params
            .iter()
            .all(|&p| !self.parameters[p].is_released())
        {
            return;
        }
        let gathering = match self.prefetched.take() {
            Some(prefetched) if prefetched.unit == index => prefetched,
            other => {
                if let Some(other) = other {
                    self.finish_gather(other, false);
                }
                self.start_gather(index)
            }
        };
        self.finish_gather(gathering, true);
    }

    /// Starts gathering unit `index + 1` or `index - 1` (`next`) while unit `index`
    /// computes, when prefetching, unless its values are there or a prefetch is under way.
    fn prefetch(&mut self, next: Option<usize>) {
        let Some(next) = next.filter(|&n| self.prefetch && n < self.units.len()) else {
            return;
        };
        let released = (self.units[next].params.iter()).any(|&p| self.parameters[p].is_released());
        if self.prefetched.is_none() && released {
            self.prefetched = Some(self.start_gather(next));
        }
    }

    /// Waits for a prefetch under way and drops it: before the shards change (an update, a
    /// loaded state), so that no gather of the old values is used after.
    fn drop_prefetch(&mut self) {
        if let Some(prefetched) = self.prefetched.take() {
            self.finish_gather(prefetched, false);
        }
    }

    /// Copies this rank's shard of unit `index` into a buffer and starts the all-gather.
    fn start_gather(&mut self, index: usize) -> Gathering<E> {
        let _gather = memory::stage_scope(Stage::Gather);
        let unit = &self.units[index];
        let owner = common_owner(unit.params.iter().map(|&p| &self.parameters[p]));
        let tag = |label| communication(label, owner);
        let mut local = Metered::zeros(unit.shard.len(), self.meta, tag(labels::SHARD_TO_GATHER));
        if let Some(values) = local.values_mut() {
            for &p in &unit.pieces {
                let piece = &self.pieces[p];
                let run = piece.shard_offset..piece.shard_offset + piece.values.numel();
                read_run(&piece.values.value(), 0, &mut values[run]);
            }
        }
        let mut gathered = Metered::zeros(unit.len, self.meta, tag(labels::GATHERED_WEIGHTS));
        // The call is the unit's, even when it starts while another unit computes.
        let _unit = memory::tag_scope(Tag {
            owner,
            ..memory::current_tag()
        });
        let pending = (self.link.borrow_mut()).start(
            (local.take(), gathered.take()),
            |comm, (local, gathered)| comm.all_gather(local.view(), gathered.view_mut()),
        );
        Gathering {
            unit: index,
            local,
            gathered,
            pending,
        }
    }

    /// Waits for a gather and, when `restore`, gives the unit's released parameters their
    /// values (NaN if it failed).
    fn finish_gather(&mut self, gathering: Gathering<E>, restore: bool) {
        let _gather = memory::stage_scope(Stage::Gather);
        let Gathering {
            unit: index,
            mut local,
            mut gathered,
            pending,
        } = gathering;
        let sent = match self.link.borrow_mut().wait(pending) {
            Some(((wire_local, wire_gathered), ok)) => {
                local.restore(wire_local);
                gathered.restore(wire_gathered);
                ok
            }
            None => false,
        };
        if !sent && let Some(values) = gathered.values_mut() {
            // NaN values keep the shapes right and make the step refuse what follows.
            values.iter_mut().for_each(|v| *v = E::nan());
        }
        if !restore {
            return;
        }
        let mut offset = 0;
        for &p in &self.units[index].params {
            let param = &self.parameters[p];
            let len = param.numel();
            if param.is_released() {
                match gathered.values() {
                    Some(values) => {
                        let values = values[offset..offset + len].to_vec();
                        let array =
                            ArrayD::from_shape_vec(param.shape(), values).expect("its shape");
                        param.restore_value(array);
                    }
                    None => param.restore_meta(),
                }
            }
            offset += len;
        }
    }

    /// Releases unit `index`'s full values.
    fn release(&self, index: usize) {
        for &p in &self.units[index].params {
            let param = &self.parameters[p];
            if !param.is_released() {
                param.release_value();
            }
        }
    }

    /// Reduce-scatters unit `index`'s weighted gradients, adding this rank's shard into
    /// its pieces' gradients and dropping the full ones.
    // Called from unit.rs only, whose bodies are a learner's to write (stubs call nothing).
    #[allow(dead_code)]
    fn reduce(&mut self, index: usize) {
        let _reduction = memory::stage_scope(Stage::Reduction);
        let Core {
            link,
            parameters,
            units,
            pieces,
            weight,
            finite,
            meta,
            ..
        } = self;
        let unit = &units[index];
        let owner = common_owner(unit.params.iter().map(|&p| &parameters[p]));
        let tag = |label| communication(label, owner);
        let mut buf = Metered::zeros(unit.len, *meta, tag(labels::GRADIENT_BUCKET));
        let mut offset = 0;
        for &p in &unit.params {
            let param = &parameters[p];
            let len = param.numel();
            if let Some(values) = buf.values_mut() {
                let run = &mut values[offset..offset + len];
                param.with_grad(|grad| grad.map(|g| read_run(g, 0, run)));
                *finite &= all_finite(run);
                run.iter_mut().for_each(|v| *v *= *weight);
            }
            param.set_grad(None);
            offset += len;
        }
        let mut shard = Metered::zeros(unit.shard.len(), *meta, tag(labels::REDUCED_SHARD));
        let sent = link
            .borrow_mut()
            .call(|comm| comm.reduce_scatter_sum(buf.view(), shard.view_mut()));
        drop(buf);
        if sent.is_none()
            && let Some(values) = shard.values_mut()
        {
            values.iter_mut().for_each(|v| *v = E::nan());
        }
        for &p in &unit.pieces {
            let piece = &pieces[p];
            let len = piece.values.numel();
            if piece.values.with_grad(|g| g.is_none()) {
                set_grad_with(&piece.values, || ArrayD::zeros(vec![len]));
            }
            if let Some(values) = shard.values() {
                let run = &values[piece.shard_offset..piece.shard_offset + len];
                piece.values.update_grad(|g| {
                    g.iter_mut().zip(run).for_each(|(g, &r)| *g += r);
                });
            }
        }
    }
}

/// A handle for running units, to capture in a loss function: see
/// [`Zero3::runner`]. Cheap to clone.
#[derive(Clone)]
pub struct UnitRunner<E: GradElement> {
    // Read in unit.rs only, whose bodies are a learner's to write (stubs read nothing).
    #[allow(dead_code)]
    core: Rc<RefCell<Core<E>>>,
}

/// `output`, the output of unit `unit`'s forward, through an identity op whose backward
/// gathers the unit's whole values again before the unit's own backward reads them (a
/// no-op when they are there, after a checkpointed unit's rerun) and starts the prefetch
/// of the unit before it. What [`UnitRunner::run_unit`] returns under grad mode.
fn gathered_again_in_backward<E: GradElement>(
    core: &Rc<RefCell<Core<E>>>,
    output: Tensor<E>,
    unit: usize,
) -> Tensor<E> {
    let weak: Weak<RefCell<Core<E>>> = Rc::downgrade(core);
    // A backward over tensors, so that a meta run gathers as a real one does.
    Tensor::from_op_tensors(&output, &[&output], move |grad_out| {
        let held = hold(grad_out);
        if let Some(core) = weak.upgrade() {
            let mut core = core.borrow_mut();
            core.gather(unit);
            core.prefetch(unit.checked_sub(1));
        }
        vec![Some(in_flight_copy(&held))]
    })
}

// The identity op's backward shows the meter what it showed when it was a backward over
// values, so real runs keep the figures they had (it could pass the gradient on without
// the copy, a little less memory, at the price of changing them): tl-tensor
// counts such a backward's incoming gradient off and on again before it runs (`hold`), and
// its result in a buffer of its own before the incoming one goes (`in_flight_copy`, then
// `held` dropped). A meta gradient goes the same way, with no values to copy.

/// `grad`, its storage counted off the meter and on again.
fn hold<E: GradElement>(grad: Tensor<E>) -> Tensor<E> {
    let values = (!grad.is_meta()).then(|| grad.to_array());
    grad.release_value();
    match values {
        Some(values) => grad.restore_value(values),
        None => grad.restore_meta(),
    }
    grad
}

/// A copy of `grad` (its shape, when meta) tagged as a gradient a backward sweep carries.
fn in_flight_copy<E: GradElement>(grad: &Tensor<E>) -> Tensor<E> {
    let _in_flight = memory::tag_scope(Tag {
        kind: Kind::GradientsInFlight,
        label: "",
        ..memory::current_tag()
    });
    match grad.is_meta() {
        true => Tensor::meta(&grad.shape()),
        false => Tensor::from_array(grad.to_array()),
    }
}

/// The piece `start..start + len` of `param`'s values (its shape, for a meta parameter): a
/// 1-D leaf for the shard's AdamW, owned by the parameter's unit. Under ZeRO-3 nothing else
/// keeps the weights, so the meter counts it as [`Weights`](Kind::Weights).
fn weights_shard<E: GradElement>(param: &Tensor<E>, start: usize, len: usize) -> Tensor<E> {
    let _owner = memory::owner_scope(param.memory_tag().owner);
    if param.is_meta() {
        return Tensor::meta_param(&[len]);
    }
    let mut run = vec![E::zero(); len];
    read_run(&param.value(), start, &mut run);
    Tensor::param(ArrayD::from_shape_vec(vec![len], run).expect("1-D"))
}

/// ZeRO stage 3 over a communicator: the units' parameters, gradients and AdamW state
/// sharded (see the [module docs](self)), and the data-parallel step that trains them.
pub struct Zero3<E: GradElement> {
    core: Rc<RefCell<Core<E>>>,
    inner: AdamW<E>,
    /// `Σ_i (n_i/B)·L_i` of this rank's micro-batches.
    local_loss: Rc<Cell<f64>>,
    /// The tensor-parallel group of a split model, from the `DataParallel` this stage was
    /// made on ([`Zero3::on`]): each step's observer takes a fresh copy.
    tensor: Option<TensorAxis>,
}

impl<E: GradElement> Zero3<E> {
    /// Shards `units` (groups of parameters, the same values on every rank) over `comm`'s
    /// ranks, with `adamw`'s hyperparameters, and releases their full values: from now on
    /// they are there only inside [`UnitRunner::run_unit`] or after
    /// [`gather_full_parameters`](Self::gather_full_parameters).
    ///
    /// # Errors
    /// [`ParallelError::OptimizerHasState`] if `adamw` has stepped (load a state with
    /// [`load_full_state`](Self::load_full_state) instead).
    ///
    /// ```
    /// use tl_collective::Single;
    /// use tl_parallel::Zero3;
    /// use tl_precision::Precision;
    /// use tl_tensor::losses::mse;
    /// use tl_tensor::nn::{Linear, Module};
    /// use tl_tensor::optim::AdamW;
    /// use tl_tensor::{Generator, Tensor};
    ///
    /// let model = Linear::<f32>::new(3, 1, true, &Generator::new(0));
    /// let adamw = AdamW::new(model.parameters(), 1e-2)?;
    /// let mut zero3 = Zero3::new(Box::new(Single::new()), vec![model.parameters()], &adamw)?;
    /// assert!(model.weight().is_released()); // there only while the unit runs
    /// let runner = zero3.runner();
    /// let batch = (Tensor::ones(&[4, 3]), Tensor::zeros(&[4, 1]));
    /// let loss = |m: &Linear<f32>, (x, t): &(Tensor<f32>, Tensor<f32>)| {
    ///     mse(&runner.run_unit(0, || m.forward(x)), t)
    /// };
    /// let report = zero3.train_step(&model, &[batch], 4, loss, Precision::Fp32, None, None)?;
    /// assert!(report.loss.is_finite() && !report.skipped);
    /// zero3.gather_full_parameters()?; // whole values, e.g. to save them
    /// assert_eq!(model.weight().to_vec().len(), 3);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(
        comm: Box<dyn Communicator>,
        units: Vec<Vec<Tensor<E>>>,
        adamw: &AdamW<E>,
    ) -> Result<Self> {
        Self::on_link(Link::shared(comm), units, adamw, None)
    }

    /// [`Zero3::new`] on the communicator of `ddp`, which keeps serving the run's other
    /// collectives (agreement, reports) between steps; its counters and
    /// [`communication_time`](DataParallel::communication_time) include this stage's.
    ///
    /// When `ddp` spans a tensor-parallel group ([`DataParallel::with_tensor_parallel`]),
    /// so do this stage's steps: the units' parameters (in order) are then the model's,
    /// which the flags given there follow.
    ///
    /// # Errors
    /// As [`Zero3::new`].
    pub fn on(ddp: &DataParallel, units: Vec<Vec<Tensor<E>>>, adamw: &AdamW<E>) -> Result<Self> {
        let zero3 = Self::on_link(ddp.link(), units, adamw, ddp.tensor_axis())?;
        zero3.core.borrow_mut().prefetch = ddp.overlaps();
        Ok(zero3)
    }

    fn on_link(
        link: SharedLink,
        units: Vec<Vec<Tensor<E>>>,
        adamw: &AdamW<E>,
        tensor: Option<TensorAxis>,
    ) -> Result<Self> {
        if adamw.state_dict().params.iter().any(Option::is_some) {
            return Err(ParallelError::OptimizerHasState);
        }
        let (rank, world_size) = {
            let link = link.borrow();
            (link.rank(), link.world_size())
        };
        let meta = units.iter().flatten().any(Tensor::is_meta);
        let mut parameters = Vec::new();
        let mut planned = Vec::new();
        let mut pieces = Vec::new();
        for unit_params in units {
            let len = unit_params.iter().map(Tensor::numel).sum();
            let shard = shard_range(len, world_size, rank);
            let first = parameters.len();
            let mut unit = Unit {
                params: (first..first + unit_params.len()).collect(),
                len,
                shard: shard.clone(),
                pieces: Vec::new(),
                ready: 0,
            };
            let mut shard_offset = 0;
            for piece in shard_pieces(&whole_from(first, &unit_params), shard) {
                unit.pieces.push(pieces.len());
                let param = &unit_params[piece.param - first];
                pieces.push(Piece {
                    param: piece.param,
                    start: piece.start,
                    shard_offset,
                    values: weights_shard(param, piece.start, piece.len),
                });
                shard_offset += piece.len;
            }
            parameters.extend(unit_params);
            planned.push(unit);
        }
        let inner = adamw_like(adamw, pieces.iter().map(|p| p.values.clone()).collect())?;
        let core = Rc::new(RefCell::new(Core {
            link,
            parameters,
            units: planned,
            pieces,
            weight: E::from_f64(1.0 / world_size as f64),
            finite: true,
            meta,
            prefetch: false,
            prefetched: None,
        }));
        let weak = Rc::downgrade(&core);
        {
            let core = core.borrow();
            for (index, unit) in core.units.iter().enumerate() {
                core.release(index);
                for &p in &unit.params {
                    let weak = weak.clone();
                    core.parameters[p].set_grad_ready_hook(Some(Rc::new(move || {
                        if let Some(core) = weak.upgrade() {
                            core.borrow_mut().gradient_ready(index);
                        }
                    })));
                }
            }
        }
        Ok(Self {
            core,
            inner,
            local_loss: Rc::new(Cell::new(0.0)),
            tensor,
        })
    }

    /// A handle for the loss function to run the units with.
    pub fn runner(&self) -> UnitRunner<E> {
        UnitRunner {
            core: Rc::clone(&self.core),
        }
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.core.borrow().link.borrow().rank()
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.core.borrow().link.borrow().world_size()
    }

    /// This rank's communication counters.
    pub fn stats(&self) -> tl_collective::CommStats {
        self.core.borrow().link.borrow().stats()
    }

    /// The parameter (its index over all the units' parameters, in order) whose run the
    /// `piece`-th of this rank's shard [parameters](Optimizer::parameters) holds: to name
    /// the weight behind a shard's non-finite gradient.
    ///
    /// # Panics
    /// If `piece` is not below the number of this rank's pieces.
    pub fn parameter_of_piece(&self, piece: usize) -> usize {
        self.core.borrow().pieces[piece].param
    }

    /// The first parameter (as [`parameter_of_piece`](Self::parameter_of_piece) numbers
    /// them) whose values in this rank's shard are not all finite. Local: each rank sees
    /// only its shard, so every rank must learn the answer of the others (one small
    /// all-reduce) before acting on it.
    pub fn nonfinite_parameter(&self) -> Option<usize> {
        let core = self.core.borrow();
        core.pieces
            .iter()
            .find(|p| !all_finite(p.values.value().as_slice().expect("a 1-D piece")))
            .map(|p| p.param)
    }

    /// Elements of the parameters this rank keeps: its shard of every unit.
    pub fn shard_elements(&self) -> usize {
        self.inner.parameters().iter().map(Tensor::numel).sum()
    }

    /// One data-parallel step, as [`DataParallel::train_step`](crate::DataParallel::train_step)
    /// with the model's units run through [`runner`](Self::runner) by `loss_fn`: the report's
    /// loss and underflows are the global batch's, and `skipped`, `scale` and `grad_norm`
    /// the same on every rank.
    ///
    /// # Errors
    /// As `DataParallel::train_step`.
    #[allow(clippy::too_many_arguments)]
    pub fn train_step<M, B, F>(
        &mut self,
        model: &M,
        micro_batches: &[B],
        global_rows: usize,
        loss_fn: F,
        precision: Precision,
        scaler: Option<&mut DynamicLossScaler>,
        clip: Option<f64>,
    ) -> Result<StepReport>
    where
        M: Module<E> + ?Sized,
        B: MicroBatch,
        F: FnMut(&M, &B) -> Tensor<E>,
    {
        let local_rows: usize = micro_batches.iter().map(B::rows).sum();
        self.begin_step(local_rows, global_rows)?;
        let recording_loss = recording_loss(loss_fn, Rc::clone(&self.local_loss), global_rows);
        let mut observer = self.observer();
        let result = train_step_mixed_observed(
            model,
            micro_batches,
            recording_loss,
            &mut self.inner,
            precision,
            scaler,
            clip,
            &mut observer,
        );
        if let Some(error) = observer.take_error() {
            return Err(error);
        }
        Ok(observer.global_report(result?))
    }

    /// Begins a step whose forward and backward passes the caller runs itself (a pipeline's
    /// schedule does), through [`runner`](Self::runner) as [`train_step`](Self::train_step)
    /// runs them: this rank's micro-batches hold `local_rows` of the global batch's
    /// `global_rows`, and its gradients enter the reduce-scatters weighted by
    /// `local_rows/global_rows`. Every micro-batch's backward reduces the units it reaches;
    /// end the step with [`observer`](Self::observer), after
    /// [`record_loss`](Self::record_loss).
    ///
    /// # Errors
    /// [`ParallelError::RowsOutsideBatch`] if `local_rows` is zero or greater than
    /// `global_rows` (nothing changes).
    pub fn begin_step(&mut self, local_rows: usize, global_rows: usize) -> Result<()> {
        let weight =
            crate::batch::replica_weight(self.rank(), self.world_size(), local_rows, global_rows)?;
        let mut core = self.core.borrow_mut();
        core.weight = E::from_f64(weight);
        core.finite = true;
        core.units.iter_mut().for_each(|u| u.ready = 0);
        self.local_loss.set(0.0);
        Ok(())
    }

    /// Adds `loss` (this rank's micro-batches' losses, each weighted by its share of the
    /// global batch's rows) to the step's loss, which the observer sums over the ranks.
    pub fn record_loss(&self, loss: f64) {
        self.local_loss.set(self.local_loss.get() + loss);
    }

    /// The observer that ends the step begun with [`begin_step`](Self::begin_step), for
    /// tl-precision's `finish_step_observed` with this `Zero3` as the optimizer: the
    /// gradients are in the shards already, so it makes the loss, the non-finite flag and
    /// the underflows global (one all-reduce), and the clip norm (one more).
    pub fn observer(&self) -> Zero3Observer<E> {
        Zero3Observer {
            core: Rc::clone(&self.core),
            local_loss: Rc::clone(&self.local_loss),
            summary: None,
            tensor: self.tensor.as_ref().map(TensorAxis::fresh),
        }
    }

    /// The first collective error met since the last call, if any.
    fn take_error(&self) -> Option<ParallelError> {
        let core = self.core.borrow();
        let mut link = core.link.borrow_mut();
        let rank = link.rank();
        link.take_error()
            .map(|source| ParallelError::Collective { rank, source })
    }

    /// All-gathers every unit, so that every rank holds the whole values (to save them, or
    /// to evaluate without [`UnitRunner`]); [`release_full_parameters`]
    /// (Self::release_full_parameters) frees them again. A collective per unit.
    ///
    /// # Errors
    /// [`ParallelError::Collective`] if a gather failed.
    pub fn gather_full_parameters(&self) -> Result<()> {
        let units = self.core.borrow().units.len();
        for unit in 0..units {
            self.core.borrow_mut().gather(unit);
        }
        self.take_error().map_or(Ok(()), Err)
    }

    /// Runs `read(unit)` for each unit in order with that unit's whole values present on
    /// every rank: gathered before, released after, so a rank holds one unit whole at a time
    /// (to save the model without holding all of it). A collective per unit.
    ///
    /// # Errors
    /// [`ParallelError::Collective`] if a gather failed; `read` is not called from then on.
    pub fn for_each_unit_gathered(&self, mut read: impl FnMut(usize)) -> Result<()> {
        let units = self.core.borrow().units.len();
        for unit in 0..units {
            self.core.borrow_mut().gather(unit);
            if let Some(error) = self.take_error() {
                self.core.borrow().release(unit);
                return Err(error);
            }
            read(unit);
            self.core.borrow().release(unit);
        }
        Ok(())
    }

    /// Releases every unit's whole values (after
    /// [`gather_full_parameters`](Self::gather_full_parameters)). Local.
    pub fn release_full_parameters(&self) {
        let core = self.core.borrow();
        (0..core.units.len()).for_each(|unit| core.release(unit));
    }

    /// The whole AdamW state, as an unsharded [`AdamW`] on all the units' parameters in
    /// order would have it; every rank receives it. Two all-gathers per unit and one
    /// all-reduce of the step counts.
    ///
    /// # Errors
    /// [`ParallelError::Collective`] if a collective fails.
    pub fn full_state(&self) -> Result<AdamWState> {
        let saved = self.inner.state_dict();
        let core = self.core.borrow();
        let mut moments = [
            vec![Vec::new(); core.parameters.len()],
            vec![Vec::new(); core.parameters.len()],
        ];
        let mut steps = vec![0.0f64; core.parameters.len()];
        for (piece, state) in core.pieces.iter().zip(&saved.params) {
            if let Some(state) = state {
                steps[piece.param] = state.step as f64;
            }
        }
        let mut link = core.link.borrow_mut();
        for unit in &core.units {
            for (moment, full) in moments.iter_mut().enumerate() {
                let tag = communication(labels::GATHERED_MOMENTS, None);
                let mut local = Metered::<E>::zeros(unit.shard.len(), core.meta, tag);
                if let Some(local) = local.values_mut() {
                    for &p in &unit.pieces {
                        if let Some(state) = &saved.params[p] {
                            let values = [&state.exp_avg, &state.exp_avg_sq][moment];
                            let offset = core.pieces[p].shard_offset;
                            for (dst, &src) in local[offset..].iter_mut().zip(values) {
                                *dst = E::from_f64(src);
                            }
                        }
                    }
                }
                let mut gathered = Metered::<E>::zeros(unit.len, core.meta, tag);
                link.call(|comm| comm.all_gather(local.view(), gathered.view_mut()));
                let mut offset = 0;
                for &p in &unit.params {
                    let len = core.parameters[p].numel();
                    full[p] = match gathered.values() {
                        Some(values) => values[offset..offset + len]
                            .iter()
                            .map(|&v| Element::to_f64(v))
                            .collect(),
                        None => vec![0.0; len],
                    };
                    offset += len;
                }
            }
        }
        link.call(|comm| {
            comm.all_reduce(
                tl_collective::SliceMut::F64(&mut steps),
                tl_collective::ReduceOp::Max,
            )
        });
        if let Some(source) = link.take_error() {
            let rank = link.rank();
            return Err(ParallelError::Collective { rank, source });
        }
        let [exp_avg, exp_avg_sq] = moments;
        Ok(whole_state(
            &core.parameters,
            exp_avg,
            exp_avg_sq,
            &steps,
            saved,
        ))
    }

    /// Loads a whole AdamW state (saved at any world size), keeping this rank's shard.
    /// Local: no collective.
    ///
    /// # Errors
    /// As [`ShardedAdamW::load_full_state`](crate::ShardedAdamW::load_full_state).
    pub fn load_full_state(&mut self, state: &AdamWState) -> Result<()> {
        self.core.borrow_mut().drop_prefetch();
        let core = self.core.borrow();
        let layout = core
            .pieces
            .iter()
            .map(|p| (p.param, p.start, p.values.numel()));
        load_shard(&mut self.inner, &core.parameters, state, layout)
    }

    /// Loads whole parameter values (every rank the same, e.g. from a checkpoint), in the
    /// units' order, keeping this rank's shard. Local. The full values stay released.
    ///
    /// # Panics
    /// If `values` does not hold one array per parameter, shaped like it.
    pub fn load_full_parameters(&self, values: &[ArrayD<E>]) {
        self.core.borrow_mut().drop_prefetch();
        let core = self.core.borrow();
        assert_eq!(
            values.len(),
            core.parameters.len(),
            "one array per parameter"
        );
        for (param, value) in core.parameters.iter().zip(values) {
            assert_eq!(param.shape(), value.shape(), "parameter shape");
        }
        for piece in core.pieces.iter().filter(|piece| !piece.values.is_meta()) {
            piece.values.update_value(|v| {
                let mut run = vec![E::zero(); v.len()];
                read_run(&values[piece.param], piece.start, &mut run);
                write_run(v, 0, &run);
            });
        }
    }
}

/// AdamW on this rank's shard: its parameters are the shard's pieces (1-D runs of the
/// units' parameters), which [`Zero3::train_step`] steps; the whole parameters take the
/// new values at their next gather.
impl<E: GradElement> Optimizer<E> for Zero3<E> {
    fn step(&mut self) {
        self.core.borrow_mut().drop_prefetch();
        self.inner.step();
    }

    fn zero_grad(&self) {
        self.inner.zero_grad();
    }

    fn parameters(&self) -> &[Tensor<E>] {
        self.inner.parameters()
    }

    fn learning_rate(&self) -> f64 {
        self.inner.learning_rate()
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.inner.set_learning_rate(lr);
    }
}

/// The observer that ends a ZeRO-3 step ([`Zero3::observer`]): the gradients are already in
/// the shards when backward ends, so it only makes the extras, the finiteness and the clip
/// norm global (over the tensor-parallel group too, for a split model). After the step, ask
/// it for the step's [error](Self::take_error) and its [report](Self::global_report).
pub struct Zero3Observer<E: GradElement> {
    core: Rc<RefCell<Core<E>>>,
    local_loss: Rc<Cell<f64>>,
    summary: Option<StepSummary>,
    tensor: Option<TensorAxis>,
}

impl<E: GradElement> Zero3Observer<E> {
    /// The first collective error of the step, if any: the tensor-parallel group's sum of
    /// shares first, then the data-parallel group's. A step with an error changed no
    /// parameter, and the communicator is closed.
    pub fn take_error(&mut self) -> Option<ParallelError> {
        let tensor_error = self.tensor.as_mut().and_then(TensorAxis::take_error);
        tensor_error.or_else(|| {
            let core = self.core.borrow();
            let mut link = core.link.borrow_mut();
            let rank = link.rank();
            link.take_error()
                .map(|source| ParallelError::Collective { rank, source })
        })
    }

    /// `report`, of the step this observer ended, with the global batch's loss and
    /// underflows summed over the ranks.
    pub fn global_report(&self, report: StepReport) -> StepReport {
        global_report(report, self.summary)
    }
}

impl<E: GradElement> StepObserver<E> for Zero3Observer<E> {
    fn phase<R>(&mut self, _phase: StepPhase, run: impl FnOnce(&mut Self) -> R) -> R {
        run(self)
    }

    fn gradients_ready(&mut self, params: &[Tensor<E>]) {
        let core = self.core.borrow();
        let shard_finite = core.pieces.iter().all(|p| grad_is_finite(&p.values));
        let flag = !(core.finite && shard_finite);
        let mut extras = step_extras::<E>(self.local_loss.get(), flag);
        let sent = core
            .link
            .borrow_mut()
            .call(|comm| comm.all_reduce_sum(<E as tl_collective::Element>::view_mut(&mut extras)));
        self.summary = sent.map(|()| StepSummary::of_extras(&extras, true));
        if let Some(tensor) = self.tensor.as_mut() {
            tensor.gradients_ready(params, |piece| core.pieces[piece].param);
        }
    }

    fn all_finite(&mut self, local: bool) -> bool {
        let failed = self.core.borrow().link.borrow().failed();
        let finite = all_ranks_finite(local, failed, self.summary);
        match self.tensor.as_ref() {
            Some(tensor) => tensor.all_finite(finite),
            None => finite,
        }
    }

    fn total_sum_squares(&mut self, local: f64) -> f64 {
        let core = self.core.borrow();
        // Each rank holds a shard of the gradients.
        let over_data = |sum: f64| {
            global_sum_squares(sum, true, |sum| {
                (core.link.borrow_mut())
                    .call(|comm| comm.all_reduce_sum_f64(sum))
                    .unwrap_or(f64::NAN)
            })
        };
        match self.tensor.as_ref() {
            Some(tensor) => tensor.total_sum_squares(local, over_data),
            None => over_data(local),
        }
    }
}
