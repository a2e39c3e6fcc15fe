//! tl-parallel's ZeRO-2 and ZeRO-3 on the [`DryRun`]: their shards, buffers, hooks and
//! collectives, followed allocation for allocation.
//!
//! - **ZeRO-2** (`Zero2AdamW`): the parameters are laid out in DDP's buckets (reverse
//!   parameter order); the rank's chunk of each bucket is cut into 1-D pieces, each a master
//!   copy allocated when the optimizer is made. During the last micro-batch's backward the
//!   gradient-ready hooks mark the parameters done and reduce-scatter each bucket, in order,
//!   as soon as all its parameters are: a buffer of the bucket, the full gradients dropped
//!   once all their segments are copied, a buffer of the chunk, the pieces' gradients set.
//!   The update allocates the pieces' moments (first step), drops their gradients and
//!   all-gathers the weights bucket by bucket (a chunk buffer and a bucket buffer each).
//! - **ZeRO-3** (`Zero3`): units (the embedding, each block, the final norm with the head)
//!   sharded whole; the pieces of the rank's shard of each unit are allocated, then every
//!   unit's values are released. A unit runs between a gather (a shard buffer and a unit
//!   buffer; each parameter's value restored) and a release, except a checkpointed unit's
//!   rerun, which stays gathered for its backward; its output passes an identity op whose
//!   VJP gathers again. Once all of a unit's gradients are in, it is reduce-scattered (a
//!   unit buffer, the gradients dropped, a shard buffer, the pieces' gradients allocated the
//!   first time and added into after) and released. The hooks are armed in every backward.

use super::{DryRun, Handle, Layer, Stage, TensorKind, tag};
use crate::plan::collectives::Collective;
use crate::plan::ops::F32;
use tl_collective::shard_range;

/// What a gradient-ready hook does when its leaf is finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Hook {
    /// ZeRO-2: parameter `i` is done; reduce the buckets that are complete.
    Zero2(usize),
    /// ZeRO-3: one more gradient of unit `u` is in.
    Zero3(usize),
}

/// The ZeRO stage whose state the replica holds, if any.
#[derive(Default)]
pub(crate) enum Sharding {
    /// Stages 0 and 1: the hooks are never armed.
    #[default]
    None,
    /// ZeRO-2.
    Zero2(Zero2),
    /// ZeRO-3.
    Zero3(Zero3),
}

/// A 1-D piece of a rank's shard: a master copy, its gradient and its moments.
struct Piece {
    /// The master copy, held for its bytes (the replica updates nothing): a
    /// [`MasterShard`](TensorKind::MasterShard) beside the full weights under ZeRO-2, and
    /// under ZeRO-3, where nothing else keeps them, the rank's
    /// [`Weights`](TensorKind::Weights).
    _master: Handle,
    bytes: u64,
    layer: Layer,
    grad: Option<Handle>,
    moments: Option<(Handle, Handle)>,
}

impl Piece {
    fn new(dry: &mut DryRun, bytes: u64, layer: Layer, kind: TensorKind) -> Self {
        Self {
            _master: dry.constant(bytes, tag(layer, kind)),
            bytes,
            layer,
            grad: None,
            moments: None,
        }
    }
}

/// The pieces' AdamW: `AdamW::step` gives every piece with a gradient and no moments two
/// zero tensors of its size (in piece order); the update is in place.
fn adamw_step(dry: &mut DryRun, pieces: &mut [Piece]) {
    for piece in pieces {
        if piece.moments.is_none() && piece.grad.is_some() {
            let moment = tag(piece.layer, TensorKind::AdamMoments);
            let first = dry.constant(piece.bytes, moment);
            let second = dry.constant(piece.bytes, moment);
            piece.moments = Some((first, second));
        }
    }
}

/// `Optimizer::zero_grad` over the pieces.
fn zero_pieces(dry: &mut DryRun, pieces: &mut [Piece]) {
    for piece in pieces {
        if let Some(grad) = piece.grad.take() {
            dry.release(grad);
        }
    }
}

/// One of ZeRO-2's buckets.
struct Bucket {
    /// `(parameter, elements)` of each segment, in bucket order.
    segments: Vec<(usize, u64)>,
    /// Elements on the wire (the last bucket carries the three extras).
    wire_len: u64,
    /// This rank's chunk of it.
    chunk_len: u64,
    /// Its pieces, in chunk order.
    pieces: std::ops::Range<usize>,
}

/// The replica of `Zero2AdamW` and of its hooks' state.
pub(crate) struct Zero2 {
    params: Vec<(Handle, Layer)>,
    buckets: Vec<Bucket>,
    pieces: Vec<Piece>,
    segments_of: Vec<usize>,
    remaining: Vec<usize>,
    ready: Vec<bool>,
    next: usize,
}

/// tl-parallel's own bucket plan (`tl_parallel::bucket_plan`: buckets of at most
/// `capacity` elements filled from the last parameter to the first, a parameter split where
/// a bucket is full), in the dry run's sizes: `(parameter, start, len)` per segment.
pub(crate) fn bucket_plan(numels: &[u64], capacity: u64) -> Vec<Vec<(usize, u64, u64)>> {
    let numels: Vec<usize> = numels.iter().map(|&n| n as usize).collect();
    tl_parallel::bucket_plan(&numels, capacity as usize)
        .into_iter()
        .map(|bucket| {
            bucket
                .into_iter()
                .map(|s| (s.param, s.start as u64, s.len as u64))
                .collect()
        })
        .collect()
}

/// The scalars DDP appends to the last bucket: loss, non-finite flag, underflows.
pub(crate) const EXTRAS: u64 = 3;

impl Zero2 {
    /// `Zero2AdamW::new`: the buckets of `params` (`bucket_bytes` each) and this rank's
    /// pieces of their chunks, each a master copy allocated now.
    pub(crate) fn new(
        dry: &mut DryRun,
        params: &[(&Handle, Layer)],
        world_size: usize,
        rank: usize,
        bucket_bytes: usize,
    ) -> Self {
        let numels: Vec<u64> = params.iter().map(|(h, _)| h.bytes / F32).collect();
        let capacity = (bucket_bytes as u64 / F32).max(1);
        let planned = bucket_plan(&numels, capacity);
        let last = planned.len() - 1;
        let mut segments_of = vec![0; params.len()];
        let mut pieces = Vec::new();
        let mut buckets = Vec::new();
        for (index, segments) in planned.into_iter().enumerate() {
            let len: u64 = segments.iter().map(|s| s.2).sum();
            let wire_len = len + if index == last { EXTRAS } else { 0 };
            let chunk = shard_range(wire_len as usize, world_size, rank);
            let (chunk_start, chunk_end) = (chunk.start as u64, chunk.end as u64);
            let first_piece = pieces.len();
            let mut offset = 0;
            for &(param, _, seg_len) in &segments {
                segments_of[param] += 1;
                let own = offset.max(chunk_start)..(offset + seg_len).min(chunk_end);
                if !own.is_empty() {
                    pieces.push(Piece::new(
                        dry,
                        (own.end - own.start) * F32,
                        params[param].1,
                        TensorKind::MasterShard,
                    ));
                }
                offset += seg_len;
            }
            buckets.push(Bucket {
                segments: segments.iter().map(|&(p, _, len)| (p, len)).collect(),
                wire_len,
                chunk_len: chunk_end - chunk_start,
                pieces: first_piece..pieces.len(),
            });
        }
        Self {
            params: params
                .iter()
                .map(|(h, layer)| (DryRun::alias(h), *layer))
                .collect(),
            buckets,
            pieces,
            remaining: segments_of.clone(),
            ready: vec![false; params.len()],
            segments_of,
            next: 0,
        }
    }

    fn reset(&mut self) {
        self.remaining.clone_from(&self.segments_of);
        self.ready.iter_mut().for_each(|r| *r = false);
        self.next = 0;
    }

    /// `Core::advance`: reduces every complete bucket from `next` on (all when `flush`).
    fn advance(&mut self, dry: &mut DryRun, flush: bool) {
        while self.next < self.buckets.len() {
            let ready = self.buckets[self.next]
                .segments
                .iter()
                .all(|&(p, _)| self.ready[p]);
            if !(ready || flush) {
                break;
            }
            self.reduce(dry, self.next);
            self.next += 1;
        }
    }

    /// `Core::reduce`: the bucket's buffer, the gradients dropped once fully copied, the
    /// chunk's buffer and the reduce-scatter, then the pieces' gradients.
    fn reduce(&mut self, dry: &mut DryRun, index: usize) {
        let bucket = &self.buckets[index];
        let layer = self.params[bucket.segments[0].0].1;
        let buf = dry.buffer(bucket.wire_len * F32, layer);
        for &(param, _) in &bucket.segments {
            self.remaining[param] -= 1;
            if self.remaining[param] == 0 {
                dry.zero_grad(&self.params[param].0);
            }
        }
        let shard = dry.buffer(bucket.chunk_len * F32, layer);
        let purpose = if index + 1 == self.buckets.len() {
            "last gradient bucket"
        } else {
            "gradient buckets"
        };
        dry.call(purpose, Collective::ReduceScatter, bucket.wire_len, F32);
        dry.release(buf);
        for piece in &mut self.pieces[bucket.pieces.clone()] {
            let grad = dry.constant(piece.bytes, tag(piece.layer, TensorKind::Gradients));
            if let Some(old) = piece.grad.replace(grad) {
                dry.release(old);
            }
        }
        dry.release(shard);
    }

    /// `opt.zero_grad()` at the start of a step: the pieces' gradients.
    fn zero_grad(&mut self, dry: &mut DryRun) {
        zero_pieces(dry, &mut self.pieces);
    }

    /// `Zero2AdamW::step`: the pieces' moments (first step), their gradients dropped, then
    /// the weights all-gathered bucket by bucket.
    fn step(&mut self, dry: &mut DryRun) {
        adamw_step(dry, &mut self.pieces);
        zero_pieces(dry, &mut self.pieces);
        dry.phase.stage = Stage::Gather;
        for bucket in &self.buckets {
            let layer = self.params[bucket.segments[0].0].1;
            let local = dry.buffer(bucket.chunk_len * F32, layer);
            let gathered = dry.buffer(bucket.wire_len * F32, layer);
            dry.call(
                "updated weights",
                Collective::AllGather,
                bucket.wire_len,
                F32,
            );
            dry.release(gathered);
            dry.release(local);
        }
    }
}

/// One of ZeRO-3's units.
struct Unit {
    /// Indices of its parameters in [`Zero3::params`].
    params: Vec<usize>,
    /// Elements of all its parameters.
    len: u64,
    /// Elements of this rank's shard of it.
    shard_len: u64,
    /// Its pieces, in shard order.
    pieces: std::ops::Range<usize>,
    ready: usize,
    layer: Layer,
    /// What its gathers are called in the traffic's table.
    purpose: [&'static str; 3],
}

/// The replica of `Zero3` and of its hooks' state.
pub(crate) struct Zero3 {
    params: Vec<Handle>,
    units: Vec<Unit>,
    pieces: Vec<Piece>,
}

impl Zero3 {
    /// `Zero3::on`: `units` (each its parameters and its layer, in order) sharded over the
    /// ranks, this rank's pieces allocated, then every unit's values released.
    pub(crate) fn new(
        dry: &mut DryRun,
        units: &[(Vec<&Handle>, Layer)],
        world_size: usize,
        rank: usize,
    ) -> Self {
        let mut params = Vec::new();
        let mut planned = Vec::new();
        let mut pieces = Vec::new();
        let count = units.len();
        for (index, (unit_params, layer)) in units.iter().enumerate() {
            let len: u64 = unit_params.iter().map(|h| h.bytes / F32).sum();
            let shard = shard_range(len as usize, world_size, rank);
            let (shard_start, shard_end) = (shard.start as u64, shard.end as u64);
            let first_piece = pieces.len();
            let first_param = params.len();
            let mut offset = 0;
            for handle in unit_params {
                let numel = handle.bytes / F32;
                let own = offset.max(shard_start)..(offset + numel).min(shard_end);
                if !own.is_empty() {
                    pieces.push(Piece::new(
                        dry,
                        (own.end - own.start) * F32,
                        *layer,
                        TensorKind::Weights,
                    ));
                }
                offset += numel;
                params.push(DryRun::alias(handle));
            }
            let purpose = if index == 0 {
                [
                    "embedding weights, forward",
                    "embedding weights, backward",
                    "embedding gradients",
                ]
            } else if index + 1 == count {
                [
                    "norm + head weights, forward",
                    "norm + head weights, backward",
                    "norm + head gradients",
                ]
            } else {
                [
                    "block weights, forward",
                    "block weights, backward",
                    "block gradients",
                ]
            };
            planned.push(Unit {
                params: (first_param..params.len()).collect(),
                len,
                shard_len: shard_end - shard_start,
                pieces: first_piece..pieces.len(),
                ready: 0,
                layer: *layer,
                purpose,
            });
        }
        let zero3 = Self {
            params,
            units: planned,
            pieces,
        };
        for unit in 0..zero3.units.len() {
            zero3.release(dry, unit);
        }
        for (index, unit) in zero3.units.iter().enumerate() {
            for &p in &unit.params {
                let node = zero3.params[p].node.expect("a parameter has a leaf node");
                dry.hooks.insert(node, Hook::Zero3(index));
            }
        }
        zero3
    }

    /// `Core::gather`: unless the unit's values are all there, a shard buffer and a unit
    /// buffer, the all-gather, each released value restored, the buffers dropped.
    fn gather(&self, dry: &mut DryRun, index: usize, backward: bool) {
        let unit = &self.units[index];
        if unit
            .params
            .iter()
            .all(|&p| !dry.is_released(&self.params[p]))
        {
            return;
        }
        let local = dry.buffer(unit.shard_len * F32, unit.layer);
        let gathered = dry.buffer(unit.len * F32, unit.layer);
        let purpose = unit.purpose[usize::from(backward)];
        dry.call(purpose, Collective::AllGather, unit.len, F32);
        for &p in &unit.params {
            if dry.is_released(&self.params[p]) {
                dry.restore_value(&self.params[p]);
            }
        }
        dry.release(gathered);
        dry.release(local);
    }

    /// `Core::release`: the unit's values off the meter.
    fn release(&self, dry: &mut DryRun, index: usize) {
        for &p in &self.units[index].params {
            if !dry.is_released(&self.params[p]) {
                dry.release_value(&self.params[p]);
            }
        }
    }

    /// `Core::gradient_ready`: on the unit's last gradient, reduce and release it.
    fn gradient_ready(&mut self, dry: &mut DryRun, index: usize) {
        let unit = &mut self.units[index];
        unit.ready += 1;
        if unit.ready == unit.params.len() {
            unit.ready = 0;
            self.reduce(dry, index);
            self.release(dry, index);
        }
    }

    /// `Core::reduce`: a unit buffer, the gradients dropped, a shard buffer and the
    /// reduce-scatter, the pieces' gradients allocated if they have none.
    fn reduce(&mut self, dry: &mut DryRun, index: usize) {
        let unit = &self.units[index];
        let buf = dry.buffer(unit.len * F32, unit.layer);
        for &p in &unit.params {
            dry.zero_grad(&self.params[p]);
        }
        let shard = dry.buffer(unit.shard_len * F32, unit.layer);
        dry.call(unit.purpose[2], Collective::ReduceScatter, unit.len, F32);
        dry.release(buf);
        for piece in &mut self.pieces[unit.pieces.clone()] {
            if piece.grad.is_none() {
                let grad = dry.constant(piece.bytes, tag(piece.layer, TensorKind::Gradients));
                piece.grad = Some(grad);
            }
        }
        dry.release(shard);
    }

    /// `opt.zero_grad()` at the start of a step: the pieces' gradients.
    fn zero_grad(&mut self, dry: &mut DryRun) {
        zero_pieces(dry, &mut self.pieces);
    }

    /// `Zero3`'s update: AdamW on the pieces (their moments at the first step).
    fn step(&mut self, dry: &mut DryRun) {
        adamw_step(dry, &mut self.pieces);
    }
}

impl DryRun {
    /// `opt.zero_grad()` of ZeRO-2's or ZeRO-3's optimizer: the pieces' gradients.
    pub(crate) fn sharded_zero_grad(&mut self) {
        let mut sharding = std::mem::take(&mut self.sharding);
        match &mut sharding {
            Sharding::None => {}
            Sharding::Zero2(zero2) => zero2.zero_grad(self),
            Sharding::Zero3(zero3) => zero3.zero_grad(self),
        }
        self.sharding = sharding;
    }

    /// `opt.step()` of ZeRO-2's or ZeRO-3's optimizer.
    pub(crate) fn sharded_step(&mut self) {
        let mut sharding = std::mem::take(&mut self.sharding);
        match &mut sharding {
            Sharding::None => {}
            Sharding::Zero2(zero2) => zero2.step(self),
            Sharding::Zero3(zero3) => zero3.step(self),
        }
        self.sharding = sharding;
    }

    /// Runs a gradient-ready hook, with the stage's state taken out of the replica.
    pub(super) fn run_hook(&mut self, hook: Hook) {
        let mut sharding = std::mem::take(&mut self.sharding);
        match (&mut sharding, hook) {
            (Sharding::Zero2(zero2), Hook::Zero2(param)) => {
                assert!(!zero2.ready[param], "ZeRO-2: a second gradient");
                zero2.ready[param] = true;
                zero2.advance(self, false);
            }
            (Sharding::Zero3(zero3), Hook::Zero3(unit)) => zero3.gradient_ready(self, unit),
            _ => unreachable!("a hook of the stage the replica runs"),
        }
        self.sharding = sharding;
    }

    /// The VJP of ZeRO-3's identity op: gather unit `unit` unless it is there.
    pub(super) fn zero3_gather(&mut self, unit: usize) {
        let sharding = std::mem::take(&mut self.sharding);
        if let Sharding::Zero3(zero3) = &sharding {
            zero3.gather(self, unit, true);
        }
        self.sharding = sharding;
    }

    /// `UnitRunner::run_unit` under ZeRO-3 (the model's unit hook), or `forward` alone:
    /// gather, run, release unless this is a rerun inside backward, and under grad mode
    /// an identity op on the output whose VJP gathers again.
    pub(crate) fn run_unit(
        &mut self,
        unit: usize,
        forward: impl FnOnce(&mut DryRun) -> Handle,
    ) -> Handle {
        let sharding = std::mem::take(&mut self.sharding);
        let Sharding::Zero3(zero3) = &sharding else {
            self.sharding = sharding;
            return forward(self);
        };
        let rerun_gather = self.in_backward();
        zero3.gather(self, unit, rerun_gather);
        self.sharding = sharding;
        let output = forward(self);
        let rerun = self.grad_enabled && self.in_backward();
        if !rerun {
            let sharding = std::mem::take(&mut self.sharding);
            if let Sharding::Zero3(zero3) = &sharding {
                zero3.release(self, unit);
            }
            self.sharding = sharding;
        }
        if !self.grad_enabled {
            return output;
        }
        let shared = self.share(&output);
        let identity = self.record_on(shared, &[&output], super::Vjp::Gather(unit));
        self.release(output);
        identity
    }

    /// `zero2::arm`: the hooks of ZeRO-2's parameters, for the last micro-batch's backward.
    pub(crate) fn zero2_arm(&mut self) {
        if let Sharding::Zero2(zero2) = &mut self.sharding {
            zero2.reset();
            for (index, (param, _)) in zero2.params.iter().enumerate() {
                let node = param.node.expect("a parameter has a leaf node");
                self.hooks.insert(node, Hook::Zero2(index));
            }
        }
    }

    /// `zero2::disarm`.
    pub(crate) fn zero2_disarm(&mut self) {
        if matches!(self.sharding, Sharding::Zero2(_)) {
            self.hooks.clear();
        }
    }

    /// `zero2::finish`: the buckets left reduced, then the extras all-reduced.
    pub(crate) fn zero2_finish(&mut self) {
        let mut sharding = std::mem::take(&mut self.sharding);
        if let Sharding::Zero2(zero2) = &mut sharding {
            zero2.advance(self, true);
            zero2.reset();
        }
        self.sharding = sharding;
        self.call(
            "loss, overflow flag, underflows",
            Collective::AllReduce,
            EXTRAS,
            F32,
        );
    }
}
