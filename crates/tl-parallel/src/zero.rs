//! [`ShardedAdamW`]: ZeRO stage 1 — AdamW's moments and its update partitioned over the
//! ranks, the updated weights all-gathered.
//!
//! The parameters, flattened in their order and concatenated, are `P` elements; rank `r`
//! owns the elements [`shard_range`]`(P, N, r)`, which may cut a parameter in two. Each rank
//! keeps AdamW's two moments for its shard only (`2P/N` elements instead of `2P`), applies
//! the update to its shard of the (replicated, already reduced) gradient, and one
//! all-gather of the `P` weights gives every rank the whole updated model.
//!
//! The update of each element is tl-tensor's [`AdamW`] itself, run on one 1-D tensor per
//! piece of a parameter in the shard: its arithmetic is elementwise, with coefficients that
//! depend only on the hyperparameters and the parameter's step count, so every element gets
//! the bits DDP's full AdamW would give it, and the gather copies them. ZeRO-1 is therefore
//! bit for bit DDP at the same N.
//!
//! Cost: the gradients are still all-reduced in full (as PyTorch's `ZeroRedundancyOptimizer`
//! does), so a step sends the all-reduce's `2(N−1)/N·P` elements plus the gather's
//! `(N−1)/N·P`, the gather in rounds of about a bucket so that its buffer stays a bucket.
//! [`Zero2AdamW`](crate::Zero2AdamW) reduce-scatters the gradients instead, which saves the
//! difference, and the gradients' memory.
//!
//! Saving and resuming: [`ShardedAdamW::full_state`] gathers the shards into the state an
//! unsharded [`AdamW`] on the same parameters would have, and
//! [`ShardedAdamW::load_full_state`] keeps this rank's part of such a state. The saved file
//! therefore does not depend on the world size that wrote it: a run saved on 2 ranks resumes
//! on 1 or on 4.

use std::ops::Range;

use tl_collective::shard_range;
use tl_tensor::Tensor;
use tl_tensor::memory::{self, Kind, Stage, Tag};
use tl_tensor::ndarray::ArrayD;
use tl_tensor::optim::{AdamW, AdamWParamState, AdamWState, Optimizer};
use tl_tensor::{Element, TensorError};

use crate::bucket::Segment;
use crate::ddp::{DataParallel, GradElement};
use crate::error::{ParallelError, Result};
use crate::link::SharedLink;
use crate::metered::{Metered, common_owner, communication, labels};
use crate::runs::{read_run, write_run};
use crate::shard_step::{shard_pieces, take_pieces};

/// AdamW with its state and update partitioned over the ranks of a [`DataParallel`] (ZeRO
/// stage 1; see the [module docs](self)). An [`Optimizer`]: pass it to
/// [`DataParallel::train_step`] in place of the [`AdamW`] it was made from.
///
/// The step consumes the model's gradients: each is dropped as soon as this rank's piece of
/// it is taken. The weights are gathered in rounds of about a bucket; a failed round is kept
/// for [`DataParallel::take_error`] (which `train_step` checks) and leaves the parameters of
/// the rounds after it as they were. This rank's moments have moved, so the run must stop,
/// as after any failed collective.
pub struct ShardedAdamW<E: GradElement> {
    parameters: Vec<Tensor<E>>,
    link: SharedLink,
    shard: Range<usize>,
    /// The pieces of the parameters in this rank's shard, in order.
    pieces: Vec<Segment>,
    /// Their master copies, 1-D parameters of the inner AdamW.
    masters: Vec<Tensor<E>>,
    inner: AdamW<E>,
    total: usize,
    /// Elements per rank in one round of the weights' all-gather: a bucket over the ranks.
    round: usize,
    /// Whether the parameters are [meta](tl_tensor::meta): the buffers hold no values.
    meta: bool,
}

impl<E: GradElement> ShardedAdamW<E> {
    /// Shards `adamw` (its parameters and hyperparameters) over `ddp`'s ranks.
    ///
    /// # Errors
    /// [`ParallelError::OptimizerHasState`] if `adamw` has already stepped (its moments are
    /// not sharded: start from a fresh one, or load the state after sharding is supported).
    ///
    /// ```
    /// use tl_collective::Single;
    /// use tl_parallel::{DataParallel, ShardedAdamW};
    /// use tl_tensor::nn::{Linear, Module};
    /// use tl_tensor::optim::{AdamW, Optimizer};
    /// use tl_tensor::Generator;
    ///
    /// let ddp = DataParallel::new(Box::new(Single::new()));
    /// let model = Linear::<f32>::new(3, 2, true, &Generator::new(0));
    /// let opt = ShardedAdamW::new(&ddp, AdamW::new(model.parameters(), 1e-3)?)?;
    /// assert_eq!(opt.shard(), 0..8); // a world of one owns all 3·2 + 2 elements
    /// assert_eq!(opt.parameters().len(), 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(ddp: &DataParallel, adamw: AdamW<E>) -> Result<Self> {
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
        let total = parameters.iter().map(Tensor::numel).sum();
        let shard = shard_range(total, world_size, rank);
        let pieces = shard_pieces(&whole(&parameters), shard.clone());
        let masters: Vec<Tensor<E>> = pieces
            .iter()
            .map(|p| master_shard(p.len, parameters[p.param].memory_tag().owner, meta))
            .collect();
        let inner = adamw_like(&adamw, masters.clone())?;
        Ok(Self {
            parameters,
            link,
            shard,
            pieces,
            masters,
            inner,
            total,
            round: (ddp.capacity::<E>() / world_size).max(1),
            meta,
        })
    }

    /// This rank's elements of the flattened parameters.
    pub fn shard(&self) -> Range<usize> {
        self.shard.clone()
    }

    /// Elements of optimizer state this rank holds: two moments per element of its shard
    /// (after the first step).
    pub fn state_elements(&self) -> usize {
        moment_elements(&self.inner)
    }

    /// The whole optimizer state, as an unsharded [`AdamW`] on the same parameters would
    /// have it: the moments of every element and every parameter's step count. A collective:
    /// every rank must call it, and every rank receives the whole state (rank 0 saves it).
    ///
    /// Three collectives: an all-gather of each moment and an all-reduce (max) of the
    /// parameters' step counts, since a parameter may lie wholly in another rank's shard.
    /// A parameter that has not stepped yet is `None`, as in [`AdamW::state_dict`].
    ///
    /// # Errors
    /// [`ParallelError::Collective`] if a collective fails (the link keeps no error then:
    /// it is returned here).
    pub fn full_state(&mut self) -> Result<AdamWState> {
        let pieces = self.inner.state_dict();
        let shard_len = self.shard.len();
        let mut local_avg = vec![E::zero(); shard_len];
        let mut local_avg_sq = vec![E::zero(); shard_len];
        let mut steps = vec![0.0f64; self.parameters.len()];
        let mut offset = 0;
        for (piece, saved) in self.pieces.iter().zip(&pieces.params) {
            let len = piece.len;
            if let Some(saved) = saved {
                let to_e = |src: &[f64], dst: &mut [E]| {
                    dst.iter_mut()
                        .zip(src)
                        .for_each(|(d, &s)| *d = E::from_f64(s));
                };
                to_e(&saved.exp_avg, &mut local_avg[offset..offset + len]);
                to_e(&saved.exp_avg_sq, &mut local_avg_sq[offset..offset + len]);
                steps[piece.param] = saved.step as f64;
            }
            offset += len;
        }
        let mut exp_avg = vec![E::zero(); self.total];
        let mut exp_avg_sq = vec![E::zero(); self.total];
        let gathered = {
            let mut link = self.link.borrow_mut();
            link.call(|comm| {
                comm.all_gather(
                    <E as tl_collective::Element>::view(&local_avg),
                    <E as tl_collective::Element>::view_mut(&mut exp_avg),
                )?;
                comm.all_gather(
                    <E as tl_collective::Element>::view(&local_avg_sq),
                    <E as tl_collective::Element>::view_mut(&mut exp_avg_sq),
                )?;
                comm.all_reduce(
                    tl_collective::SliceMut::F64(&mut steps),
                    tl_collective::ReduceOp::Max,
                )
            })
        };
        if gathered.is_none() {
            let rank = self.link.borrow().rank();
            let source = self
                .link
                .borrow_mut()
                .take_error()
                .expect("a failed collective keeps its error");
            return Err(ParallelError::Collective { rank, source });
        }
        let mut offset = 0;
        let params = self
            .parameters
            .iter()
            .zip(&steps)
            .map(|(param, &step)| {
                let range = offset..offset + param.numel();
                offset = range.end;
                let to_f64 = |v: &[E]| v.iter().map(|&x| Element::to_f64(x)).collect();
                (step > 0.0).then(|| AdamWParamState {
                    step: step as u64,
                    exp_avg: to_f64(&exp_avg[range.clone()]),
                    exp_avg_sq: to_f64(&exp_avg_sq[range]),
                })
            })
            .collect();
        Ok(AdamWState {
            shapes: self.parameters.iter().map(Tensor::shape).collect(),
            params,
            ..pieces
        })
    }

    /// Loads a whole AdamW state (from [`full_state`](Self::full_state) at any world size,
    /// or from a plain [`AdamW::state_dict`]), keeping this rank's shard of the moments.
    /// Local: no collective.
    ///
    /// # Errors
    /// [`ParallelError::Tensor`] with [`TensorError::StateMismatch`] if the state is for other
    /// parameters (their number, a shape, a moment's length), or
    /// [`TensorError::InvalidArgument`] for a bad hyperparameter. On error nothing changes.
    pub fn load_full_state(&mut self, state: &AdamWState) -> Result<()> {
        let layout = self.pieces.iter().map(|p| (p.param, p.start, p.len));
        load_shard(&mut self.inner, &self.parameters, state, layout)
    }

    /// All-gathers the updated shards (`local`) into the parameters, in rounds of at most
    /// `round` elements per rank, so the buffer is about a bucket, not the whole model.
    ///
    /// Round `j` takes elements `j·round ..` of every rank's shard. Shards differ by at
    /// most one element, longer ones first, so every round's pieces have the lengths
    /// [`shard_range`] gives its total, as an all-gather requires.
    fn gather(&self, local: &Metered<E>) {
        let world_size = self.link.borrow().world_size();
        let shards: Vec<Range<usize>> = (0..world_size)
            .map(|r| shard_range(self.total, world_size, r))
            .collect();
        let rounds = shards[0].len().div_ceil(self.round);
        let owner = common_owner(self.parameters.iter());
        let mut gathered = Metered::new(self.meta, communication(labels::GATHERED_WEIGHTS, owner));
        for j in 0..rounds {
            let pieces: Vec<Range<usize>> = shards
                .iter()
                .map(|s| {
                    let start = (s.start + j * self.round).min(s.end);
                    start..(start + self.round).min(s.end)
                })
                .collect();
            let own = &pieces[shards.iter().position(|s| *s == self.shard).expect("mine")];
            let mine = local.part(own.start - self.shard.start..own.end - self.shard.start);
            gathered.reset(pieces.iter().map(Range::len).sum());
            let sent = self
                .link
                .borrow_mut()
                .call(|comm| comm.all_gather(mine, gathered.view_mut()));
            if sent.is_none() {
                return;
            }
            if let Some(values) = gathered.values() {
                let mut offset = 0;
                for piece in &pieces {
                    self.write_flat(piece.start, &values[offset..offset + piece.len()]);
                    offset += piece.len();
                }
            }
        }
    }

    /// Writes `run` over the flattened parameters' elements from `start` on.
    fn write_flat(&self, start: usize, run: &[E]) {
        let mut offset = 0;
        for param in &self.parameters {
            let range = offset..offset + param.numel();
            offset = range.end;
            let lo = start.max(range.start);
            let hi = (start + run.len()).min(range.end);
            if lo < hi {
                param.update_value(|value| {
                    write_run(value, lo - range.start, &run[lo - start..hi - start]);
                });
            }
        }
    }
}

/// `parameters` as whole runs, laid end to end, for [`shard_pieces`]; the first numbered
/// `first`.
pub(crate) fn whole_from<E: Element>(first: usize, parameters: &[Tensor<E>]) -> Vec<Segment> {
    (parameters.iter().enumerate())
        .map(|(i, p)| Segment {
            param: first + i,
            start: 0,
            len: p.numel(),
        })
        .collect()
}

fn whole<E: Element>(parameters: &[Tensor<E>]) -> Vec<Segment> {
    whole_from(0, parameters)
}

/// An [`AdamW`] over `parameters` (a rank's shard pieces) with `adamw`'s hyperparameters.
pub(crate) fn adamw_like<E: Element>(
    adamw: &AdamW<E>,
    parameters: Vec<Tensor<E>>,
) -> tl_tensor::Result<AdamW<E>> {
    let (beta1, beta2) = adamw.betas();
    AdamW::new(parameters, adamw.learning_rate())
        .and_then(|o| o.with_betas(beta1, beta2))
        .and_then(|o| o.with_eps(adamw.eps()))
        .and_then(|o| o.with_weight_decay(adamw.weight_decay()))
}

/// A master copy of `len` elements of a parameter owned by the model's unit `owner`: a 1-D
/// leaf of zeros (its shape only when `meta`) for a sharded AdamW to update, tagged on the
/// meter as optimizer state labelled [`MASTER_SHARD`](labels::MASTER_SHARD).
pub(crate) fn master_shard<E: Element>(len: usize, owner: Option<usize>, meta: bool) -> Tensor<E> {
    let _tag = memory::tag_scope(Tag {
        kind: Kind::OptimizerState,
        owner,
        label: labels::MASTER_SHARD,
        ..memory::current_tag()
    });
    let piece = match meta {
        true => Tensor::meta(&[len]),
        false => Tensor::from_array(ArrayD::zeros(vec![len])),
    };
    piece.set_requires_grad(true);
    piece
}

/// The whole state of `parameters` from their gathered moments and step counts (a step
/// count of 0: not stepped yet), with `saved`'s hyperparameters.
pub(crate) fn whole_state<E: Element>(
    parameters: &[Tensor<E>],
    exp_avg: Vec<Vec<f64>>,
    exp_avg_sq: Vec<Vec<f64>>,
    steps: &[f64],
    saved: AdamWState,
) -> AdamWState {
    let params = exp_avg
        .into_iter()
        .zip(exp_avg_sq)
        .zip(steps)
        .map(|((exp_avg, exp_avg_sq), &step)| {
            (step > 0.0).then_some(AdamWParamState {
                step: step as u64,
                exp_avg,
                exp_avg_sq,
            })
        })
        .collect();
    AdamWState {
        shapes: parameters.iter().map(Tensor::shape).collect(),
        params,
        ..saved
    }
}

/// Elements of the two moments `adamw` holds (none before its first step).
pub(crate) fn moment_elements<E: Element>(adamw: &AdamW<E>) -> usize {
    adamw
        .state_dict()
        .params
        .iter()
        .flatten()
        .map(|p| p.exp_avg.len() + p.exp_avg_sq.len())
        .sum()
}

/// Loads into `inner` — the AdamW over this rank's pieces, listed in `layout` as
/// `(parameter, first element, length)` — its shard of the whole `state` (see
/// [`shard_state`]).
pub(crate) fn load_shard<E: Element>(
    inner: &mut AdamW<E>,
    parameters: &[Tensor<E>],
    state: &AdamWState,
    layout: impl IntoIterator<Item = (usize, usize, usize)>,
) -> Result<()> {
    let layout: Vec<_> = layout.into_iter().collect();
    inner.load_state_dict(shard_state(parameters, state, &layout)?)?;
    Ok(())
}

/// The state of the 1-D pieces `layout` (`(parameter, start, len)`) cut out of the whole
/// state `state` of `parameters`, after checking that it fits them.
fn shard_state<E: Element>(
    parameters: &[Tensor<E>],
    state: &AdamWState,
    layout: &[(usize, usize, usize)],
) -> Result<AdamWState> {
    let mismatch = |parameter, expected: String, found: String| {
        ParallelError::Tensor(TensorError::StateMismatch {
            what: "AdamW state",
            parameter,
            expected,
            found,
        })
    };
    if state.shapes.len() != parameters.len() || state.params.len() != parameters.len() {
        return Err(mismatch(
            None,
            format!("{} parameters", parameters.len()),
            format!(
                "{} shapes and {} parameter states",
                state.shapes.len(),
                state.params.len()
            ),
        ));
    }
    for (index, (param, shape)) in parameters.iter().zip(&state.shapes).enumerate() {
        if param.shape() != *shape {
            return Err(mismatch(
                Some(index),
                format!("shape {:?}", param.shape()),
                format!("shape {shape:?}"),
            ));
        }
        if let Some(saved) = &state.params[index]
            && (saved.exp_avg.len() != param.numel() || saved.exp_avg_sq.len() != param.numel())
        {
            return Err(mismatch(
                Some(index),
                format!("moments of {} elements", param.numel()),
                format!(
                    "moments of {} and {} elements",
                    saved.exp_avg.len(),
                    saved.exp_avg_sq.len()
                ),
            ));
        }
    }
    Ok(AdamWState {
        shapes: layout.iter().map(|&(_, _, len)| vec![len]).collect(),
        params: layout
            .iter()
            .map(|&(param, start, len)| {
                state.params[param].as_ref().map(|saved| AdamWParamState {
                    step: saved.step,
                    exp_avg: saved.exp_avg[start..start + len].to_vec(),
                    exp_avg_sq: saved.exp_avg_sq[start..start + len].to_vec(),
                })
            })
            .collect(),
        ..state.clone()
    })
}

impl<E: GradElement> Optimizer<E> for ShardedAdamW<E> {
    /// Updates this rank's shard with AdamW, then all-gathers the weights.
    fn step(&mut self) {
        take_pieces(&self.parameters, &self.pieces, &self.masters);
        self.inner.step();
        self.inner.zero_grad();
        let _gather = memory::stage_scope(Stage::Gather);
        let owner = common_owner(self.parameters.iter());
        let mut local = Metered::zeros(
            self.shard.len(),
            self.meta,
            communication(labels::SHARD_TO_GATHER, owner),
        );
        if let Some(values) = local.values_mut() {
            let mut offset = 0;
            for master in &self.masters {
                let len = master.numel();
                read_run(&master.value(), 0, &mut values[offset..offset + len]);
                offset += len;
            }
        }
        self.gather(&local);
    }

    fn parameters(&self) -> &[Tensor<E>] {
        &self.parameters
    }

    fn learning_rate(&self) -> f64 {
        self.inner.learning_rate()
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.inner.set_learning_rate(lr);
    }
}
