//! The training step as the [`DryRun`] runs it — `Trainer::train_step`, that is
//! tl-precision's `train_step_mixed` — and what comes out: the peak of the first step and of
//! a steady-state step, and the bytes saved for backward.

use std::collections::BTreeMap;
use std::rc::Rc;

use serde::Serialize;
use tl_collective::shard_range;

use super::collectives::Collective;
use super::dry_run::{DryRun, EXTRAS, Handle, Sharding, Tag, Zero2, Zero3, bucket_plan, tag};
use super::kind::{Layer, Phase, Stage, TensorKind};
use super::model::ShadowLlama;
use super::ops::F32;
use super::recipe::Recipe;
use super::zero::{CollectiveCalls, ZeroStage};
use crate::error::Result;
use crate::model::Checkpointing;

/// The dry run's account of one recipe: peaks, where they fall, what they hold, and what
/// the forward pass of one micro-batch leaves saved for backward.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepPrediction {
    /// How the blocks kept their activations.
    pub checkpointing: Checkpointing,
    /// Peak live bytes of a steady-state step (step 2 on: AdamW's moments exist), counted
    /// like `tl_tensor::memory::peak_bytes` after a `reset_peak` between steps.
    pub peak_bytes: u64,
    /// When that peak is reached.
    pub peak_at: Phase,
    /// What is alive at that peak, by kind (kinds with no bytes left out).
    pub peak_by_kind: Vec<(TensorKind, u64)>,
    /// Peak live bytes of the very first step of a fresh model (no moments before its
    /// update; they are allocated at its end).
    pub first_step_peak_bytes: u64,
    /// Live bytes between steps: weights and moments (the trainer drops the gradients after
    /// each update).
    pub between_steps_bytes: u64,
    /// What the steady-state update allocates above the live bytes it starts from (weights,
    /// gradients, moments): AdamW's temporaries, or ZeRO's copies and gather buffers.
    pub update_extra_bytes: u64,
    /// Bytes saved for backward at the end of one micro-batch's forward pass, by layer and
    /// kind (the model state left out).
    pub saved: Vec<SavedBytes>,
    /// The collectives of the steady-state step, in the order of their first call (none
    /// without data parallelism).
    pub collectives: Vec<CollectiveCalls>,
}

/// Bytes of one kind that one layer holds for backward at the end of the forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SavedBytes {
    /// The layer that saved them.
    pub layer: Layer,
    /// What they are.
    pub kind: TensorKind,
    /// How many.
    pub bytes: u64,
}

impl StepPrediction {
    /// All bytes saved for backward by one micro-batch's forward pass.
    pub fn saved_total(&self) -> u64 {
        self.saved.iter().map(|s| s.bytes).sum()
    }
}

/// One rank of tl-parallel's data parallelism: its stage, and which shards it owns (under
/// stage 1 `shard_range(P, world_size, rank)` of the flattened parameters, as
/// `ShardedAdamW` takes it; under stage 2 its chunk of every bucket; under stage 3 its
/// shard of every unit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OptimizerShard {
    pub(crate) stage: ZeroStage,
    pub(crate) world_size: usize,
    pub(crate) rank: usize,
    /// The reduction's bucket, which also sizes the rounds of the weights' all-gather.
    pub(crate) bucket_bytes: usize,
}

/// One tensor the replica of AdamW updates: a whole parameter, or under ZeRO the piece of
/// one inside the rank's shard, with its master copy.
struct Piece {
    /// Index of the parameter in `Module::parameters` order.
    param: usize,
    /// Bytes of the piece (of the parameter, when unsharded).
    bytes: u64,
    layer: Layer,
    /// `ShardedAdamW`'s 1-D master copy of the piece; `None` for plain AdamW.
    master: Option<Handle>,
}

/// The replica of AdamW, plain or sharded: two moments per tensor it updates, allocated by
/// its first update.
struct ShadowAdamW {
    pieces: Vec<Piece>,
    moments: Vec<Option<(Handle, Handle)>>,
    /// Under ZeRO-1: the bytes of the weights' all-gather buffer in each round (the
    /// buffers are on the meter), and this rank's shard's bytes; empty for plain AdamW.
    gather_rounds: Vec<u64>,
    shard_bytes: u64,
}

impl ShadowAdamW {
    /// Plain AdamW over every parameter.
    fn new(params: &[(&Handle, Layer)]) -> Self {
        let pieces: Vec<Piece> = params
            .iter()
            .enumerate()
            .map(|(param, (handle, layer))| Piece {
                param,
                bytes: handle.bytes,
                layer: *layer,
                master: None,
            })
            .collect();
        let moments = pieces.iter().map(|_| None).collect();
        Self {
            pieces,
            moments,
            gather_rounds: Vec::new(),
            shard_bytes: 0,
        }
    }

    /// `ShardedAdamW::new`: the pieces of the parameters inside the rank's shard of the
    /// flattened parameters, each with a master copy allocated now (`Tensor::param` of
    /// zeros, in parameter order). Empty pieces are left out.
    fn sharded(dry: &mut DryRun, params: &[(&Handle, Layer)], shard: OptimizerShard) -> Self {
        let numels: Vec<u64> = params.iter().map(|(h, _)| h.bytes / F32).collect();
        let total: u64 = numels.iter().sum();
        let own = shard_range(total as usize, shard.world_size, shard.rank);
        let (own_start, own_end) = (own.start as u64, own.end as u64);
        let mut pieces = Vec::new();
        let mut offset = 0;
        for (param, (&numel, (_, layer))) in numels.iter().zip(params).enumerate() {
            let start = offset.max(own_start);
            let end = (offset + numel).min(own_end);
            if start < end {
                let bytes = (end - start) * F32;
                let master = dry.constant(bytes, tag(*layer, TensorKind::MasterShard));
                pieces.push(Piece {
                    param,
                    bytes,
                    layer: *layer,
                    master: Some(master),
                });
            }
            offset += numel;
        }
        let moments = pieces.iter().map(|_| None).collect();
        // `ShardedAdamW::gather`: rounds of at most a bucket over the ranks per rank.
        let shards: Vec<_> = (0..shard.world_size)
            .map(|r| shard_range(total as usize, shard.world_size, r))
            .collect();
        let round = (shard.bucket_bytes / F32 as usize / shard.world_size).max(1);
        let gather_rounds = (0..shards[0].len().div_ceil(round))
            .map(|j| {
                let elements: usize = shards
                    .iter()
                    .map(|s| {
                        let start = (s.start + j * round).min(s.end);
                        (start + round).min(s.end) - start
                    })
                    .sum();
                elements as u64 * F32
            })
            .collect();
        Self {
            pieces,
            moments,
            gather_rounds,
            shard_bytes: (own_end - own_start) * F32,
        }
    }

    /// `AdamW::step` (plain): a parameter with a gradient and no moments gets two zero
    /// tensors of its size; the update itself is in place.
    ///
    /// `ShardedAdamW::step`: each piece's gradient is copied out of its parameter's `.grad`
    /// into the piece's own `.grad` (allocated as it is set), the inner AdamW allocates the
    /// moments of pieces that have none and updates in place, and its `zero_grad` frees the
    /// copies. The all-gather that follows fills a buffer of the shard's updated weights,
    /// then one buffer per round, each on the meter (tl-parallel's `Metered`).
    fn step(&mut self, dry: &mut DryRun, params: &[(&Handle, Layer)]) {
        let has_grad: Vec<bool> = self
            .pieces
            .iter()
            .map(|piece| dry.has_grad(params[piece.param].0))
            .collect();
        let sharded = self.pieces.iter().any(|piece| piece.master.is_some());
        let mut copies = Vec::new();
        if sharded {
            // Parameter by parameter: the piece's gradient is copied out, then the whole
            // gradient dropped.
            let mut pieces = self.pieces.iter().zip(&has_grad).peekable();
            for (index, (handle, _)) in params.iter().enumerate() {
                if let Some((piece, &grad)) = pieces.next_if(|(piece, _)| piece.param == index)
                    && grad
                {
                    copies.push(dry.constant(piece.bytes, tag(piece.layer, TensorKind::Gradients)));
                }
                dry.zero_grad(handle);
            }
        }
        for ((piece, moments), &grad) in self.pieces.iter().zip(&mut self.moments).zip(&has_grad) {
            if moments.is_none() && grad {
                let moment_tag = tag(piece.layer, TensorKind::AdamMoments);
                let first = dry.constant(piece.bytes, moment_tag);
                let second = dry.constant(piece.bytes, moment_tag);
                *moments = Some((first, second));
            }
        }
        copies.into_iter().for_each(|copy| dry.release(copy));
        if sharded {
            // The shard's updated weights, then the gather's buffer round by round.
            dry.phase.stage = Stage::Gather;
            let local = dry.buffer(self.shard_bytes, Layer::Head);
            let mut gathered: Option<Handle> = None;
            for &bytes in &self.gather_rounds {
                if let Some(previous) = gathered.take() {
                    dry.release(previous);
                }
                gathered = Some(dry.buffer(bytes, Layer::Head));
                dry.call("updated weights", Collective::AllGather, bytes / F32, F32);
            }
            if let Some(last) = gathered {
                dry.release(last);
            }
            dry.release(local);
        }
    }
}

/// A fresh model and optimizer in a new dry run: plain AdamW without data parallelism
/// (`shard` `None`) or under DDP, `ShardedAdamW` under stage 1; under stages 2 and 3 the
/// optimizer's state is the replica's [`Sharding`] and the AdamW returned is empty.
fn fresh(recipe: &Recipe, shard: Option<OptimizerShard>) -> (DryRun, Rc<ShadowLlama>, ShadowAdamW) {
    let mut dry = DryRun::new();
    let model = Rc::new(ShadowLlama::new(
        &mut dry,
        &recipe.model,
        recipe.micro_batch,
    ));
    let params = model.parameters();
    let adamw = match shard {
        None => ShadowAdamW::new(&params),
        Some(shard) => match shard.stage {
            ZeroStage::Ddp => ShadowAdamW::new(&params),
            ZeroStage::OptimizerStates => ShadowAdamW::sharded(&mut dry, &params, shard),
            ZeroStage::Gradients => {
                let zero2 = Zero2::new(
                    &mut dry,
                    &params,
                    shard.world_size,
                    shard.rank,
                    shard.bucket_bytes,
                );
                dry.sharding = Sharding::Zero2(zero2);
                ShadowAdamW::new(&[])
            }
            ZeroStage::Parameters => {
                let zero3 = Zero3::new(&mut dry, &model.units(), shard.world_size, shard.rank);
                dry.sharding = Sharding::Zero3(zero3);
                ShadowAdamW::new(&[])
            }
        },
    };
    drop(params);
    (dry, model, adamw)
}

/// `DataParallel::reduce_gradients` (stages 0 and 1): one buffer, reset to each bucket's
/// length in turn (the last grows by the three extras), all-reduced.
fn ddp_reduce(dry: &mut DryRun, params: &[(&Handle, Layer)], bucket_bytes: usize) {
    let numels: Vec<u64> = params.iter().map(|(h, _)| h.bytes / F32).collect();
    let capacity = (bucket_bytes as u64 / F32).max(1);
    let buckets = bucket_plan(&numels, capacity);
    let mut buffer: Option<Handle> = None;
    for (index, bucket) in buckets.iter().enumerate() {
        let len: u64 = bucket.iter().map(|s| s.2).sum();
        let layer = bucket.first().map_or(Layer::Head, |s| params[s.0].1);
        if let Some(old) = buffer.take() {
            dry.release(old);
        }
        let mut current = dry.buffer(len * F32, layer);
        let last = index + 1 == buckets.len();
        if last {
            dry.release(current);
            current = dry.buffer((len + EXTRAS) * F32, layer);
        }
        let (purpose, elements) = if last {
            ("last gradient bucket", len + EXTRAS)
        } else {
            ("gradient buckets", len)
        };
        dry.call(purpose, Collective::AllReduce, elements, F32);
        buffer = Some(current);
    }
    if let Some(last) = buffer {
        dry.release(last);
    }
}

/// The allocations and frees of the dry run's second step, as `memory::record` lists them.
#[cfg(test)]
pub(crate) fn second_step_events(
    recipe: &Recipe,
    shard: Option<OptimizerShard>,
) -> Vec<(tl_tensor::memory::EventKind, usize)> {
    let (mut dry, model, mut adamw) = fresh(recipe, shard);
    run_step(&mut dry, &model, &mut adamw, recipe, shard, 1).expect("a valid recipe");
    dry.start_events();
    run_step(&mut dry, &model, &mut adamw, recipe, shard, 2).expect("a valid recipe");
    dry.take_events()
}

/// [`predict_step`] for one rank of tl-parallel's data parallelism (`shard`: its stage and
/// shards), or for a single process without it (`None`). A rank runs the recipe's
/// micro-batches; what data parallelism adds on its meter is replicated stage by stage:
/// DDP's reduction buffer (stages 0 and 1), `ShardedAdamW` (stage 1), `Zero2AdamW` and its
/// hooks (stage 2), `Zero3` with its units, gathers and hooks (stage 3).
///
/// # Errors
/// As [`Recipe::validate`].
pub(crate) fn predict_step_sharded(
    recipe: &Recipe,
    shard: Option<OptimizerShard>,
) -> Result<StepPrediction> {
    recipe.validate()?;
    let (mut dry, model, mut adamw) = fresh(recipe, shard);
    dry.reset_peak();
    run_step(&mut dry, &model, &mut adamw, recipe, shard, 1)?;
    let (first_step_peak_bytes, _, _) = dry.peak();
    let between_steps_bytes = dry.live();
    dry.reset_peak();
    dry.take_calls();
    let (saved, update_extra_bytes) = run_step(&mut dry, &model, &mut adamw, recipe, shard, 2)?;
    let collectives = dry.take_calls();
    let (peak_bytes, peak_at, by_kind) = dry.peak();
    let peak_by_kind = TensorKind::ALL
        .into_iter()
        .zip(by_kind)
        .filter(|&(_, bytes)| bytes > 0)
        .collect();
    let saved = saved
        .into_iter()
        .filter(|(t, _)| t.kind.is_activation())
        .map(|(t, bytes)| SavedBytes {
            layer: t.layer,
            kind: t.kind,
            bytes,
        })
        .collect();
    Ok(StepPrediction {
        checkpointing: recipe.checkpointing,
        update_extra_bytes,
        peak_bytes,
        peak_at: peak_at.expect("a step sets its phase"),
        peak_by_kind,
        first_step_peak_bytes,
        between_steps_bytes,
        saved,
        collectives,
    })
}

/// `train_step_mixed`'s phases, in the order `tl_precision::StepPhase` lists them, on the
/// replica: drop the gradients, accumulate every micro-batch (forward under autocast, then
/// backward of the weighted loss, releasing it and then the loss), update. Returns what was
/// alive when the first micro-batch's backward began, and the most the update allocated
/// above what was live when it began. The replica cannot call the real step
/// (it runs no values), so the order is followed here and checked against the meter's
/// timeline of a real step, event for event.
fn run_step(
    dry: &mut DryRun,
    model: &Rc<ShadowLlama>,
    adamw: &mut ShadowAdamW,
    recipe: &Recipe,
    shard: Option<OptimizerShard>,
    step: u32,
) -> Result<(BTreeMap<Tag, u64>, u64)> {
    let params = model.parameters();
    let stage = shard.map(|s| s.stage);
    dry.phase = Phase {
        step,
        micro_batch: 0,
        accum: recipe.accum,
        stage: Stage::StepStart,
        layer: Layer::Embedding,
    };
    // `model.zero_grad()`, then `opt.zero_grad()` (the pieces' gradients under ZeRO-2/3).
    for (param, _) in &params {
        dry.zero_grad(param);
    }
    dry.sharded_zero_grad();
    dry.autocast = recipe.precision.format().is_some();
    let mut saved = BTreeMap::new();
    for micro_batch in 1..=recipe.accum {
        dry.phase.micro_batch = micro_batch;
        dry.phase.stage = Stage::Forward;
        let loss = model.loss(dry, recipe.checkpointing)?;
        let weighted = dry.layout(&loss, tag(Layer::Head, TensorKind::Loss));
        if micro_batch == 1 {
            saved = dry.live_by_tag();
        }
        // ZeRO-2 arms its hooks for the last micro-batch's backward only.
        let armed = micro_batch == recipe.accum && stage == Some(ZeroStage::Gradients);
        if armed {
            dry.zero2_arm();
        }
        // `backward` seeds the sweep with a one-element gradient.
        dry.backward(&weighted, F32);
        if armed {
            dry.zero2_disarm();
        }
        dry.release(weighted);
        dry.release(loss);
    }
    dry.autocast = false;
    dry.phase.micro_batch = 0;
    dry.phase.stage = Stage::Reduction;
    // The observer's `gradients_ready`.
    match shard {
        None => {}
        Some(shard) => match shard.stage {
            ZeroStage::Ddp | ZeroStage::OptimizerStates => {
                ddp_reduce(dry, &params, shard.bucket_bytes);
            }
            ZeroStage::Gradients => dry.zero2_finish(),
            ZeroStage::Parameters => dry.call(
                "loss, overflow flag, underflows",
                Collective::AllReduce,
                EXTRAS,
                F32,
            ),
        },
    }
    dry.phase.stage = Stage::Optimizer;
    // Under ZeRO-2 and 3 the clip norm's sum of squares is added over the ranks, in f64.
    if recipe.clips() && matches!(stage, Some(ZeroStage::Gradients | ZeroStage::Parameters)) {
        dry.call("gradient norm", Collective::AllReduce, 1, 8);
    }
    let before_update = dry.live();
    dry.start_window();
    adamw.step(dry, &params);
    dry.sharded_step();
    let update_extra = dry.window_peak() - before_update;
    // `Trainer::train_step` then drops what gradients are left (`opt.zero_grad()`): the
    // whole ones under plain AdamW, the shards' under ZeRO-3.
    for (param, _) in &params {
        dry.zero_grad(param);
    }
    dry.sharded_zero_grad();
    Ok((saved, update_extra))
}
