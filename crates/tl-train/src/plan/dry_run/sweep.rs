//! The backward sweep of the [`DryRun`]: tl-tensor's order (the same function), in-flight
//! gradients, and the checkpoint node that reruns its segment.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use super::{DryRun, Handle, KeepFrame, NodeKind, Rerun, Segment, Vjp, tag};
use crate::plan::kind::{Layer, Stage, TensorKind};

impl DryRun {
    /// tl-recompute's `checkpoint`: runs `segment` without a graph, keeps a copy of its
    /// output and a handle on its input, and reruns it when backward reaches the node.
    pub(crate) fn checkpoint(
        &mut self,
        input: &Handle,
        params: &[&Handle],
        layer: Layer,
        segment: Segment,
    ) -> Handle {
        if !self.grad_enabled {
            self.keep_frames.push(KeepFrame::Plain);
            let output = segment(self, input);
            self.keep_frames.pop();
            return output;
        }
        let autocast = self.autocast;
        self.grad_enabled = false;
        self.keep_frames.push(KeepFrame::Recording(Vec::new()));
        let output = segment(self, input);
        let Some(KeepFrame::Recording(kept)) = self.keep_frames.pop() else {
            unreachable!("keep frames are pushed and popped in pairs")
        };
        self.grad_enabled = true;
        // The node owns a copy of the output (made outside the meter); the segment's own
        // output is dropped before the copy becomes a tensor.
        let bytes = output.bytes;
        self.release(output);
        let inputs = vec![self.share(input)];
        let mut parents = vec![input];
        parents.extend_from_slice(params);
        let vjp = Vjp::Rerun(Rerun {
            inputs,
            kept,
            segment,
            autocast,
            keep: self.keep.clone(),
            layer,
        });
        self.record(bytes, tag(layer, TensorKind::ResidualStream), &parents, vjp)
    }

    /// The nodes reachable from `root`, each before its parents: tl-tensor's own order
    /// ([`tl_tensor::topological_order`]), run on the replica's nodes.
    fn topological_order(&self, root: usize) -> Vec<usize> {
        tl_tensor::topological_order(
            root,
            |&node| node,
            |&node| match &self.nodes[node].kind {
                NodeKind::Leaf { .. } => Vec::new(),
                NodeKind::Op { parents, vjp } => {
                    assert!(vjp.is_some(), "backward through a swept graph");
                    parents.clone()
                }
            },
        )
    }

    /// `backward_with`: sweeps the graph behind `root`, starting from a gradient of
    /// `grad_bytes`.
    ///
    /// When leaves of the graph have gradient-ready hooks, each of them is finished (its
    /// gradient handed over, its hook run) as soon as the last op consuming it has run, as
    /// tl-tensor's `backward` does, not at its own place in the order.
    pub(crate) fn backward(&mut self, root: &Handle, grad_bytes: u64) {
        let root = root
            .node
            .expect("backward: the tensor does not require grad");
        self.sweeps += 1;
        let order = self.topological_order(root);
        let mut waiting = self.hooked_consumers(&order);
        let mut pending: HashMap<usize, u64> = HashMap::new();
        let in_flight = |layer| tag(layer, TensorKind::GradientsInFlight);
        self.charge(in_flight(self.nodes[root].layer), grad_bytes);
        pending.insert(root, grad_bytes);
        for id in order {
            let Some(bytes) = pending.remove(&id) else {
                continue;
            };
            let layer = self.nodes[id].layer;
            self.phase.stage = Stage::Backward;
            self.phase.layer = layer;
            let (parents, vjp) = match &mut self.nodes[id].kind {
                NodeKind::Leaf { .. } => {
                    self.finish_leaf(id, bytes);
                    continue;
                }
                NodeKind::Op { parents, vjp } => (parents.clone(), vjp.take().expect("swept once")),
            };
            // The engine takes the gradient off the meter and puts it straight back on: it
            // stays counted while the VJP runs.
            self.refund(in_flight(layer), bytes);
            self.charge(in_flight(layer), bytes);
            let receivers = match vjp {
                Vjp::Saved(saved) => {
                    saved.into_iter().for_each(|h| self.release(h));
                    parents.len()
                }
                Vjp::Gather(unit) => {
                    self.zero3_gather(unit);
                    parents.len()
                }
                Vjp::Rerun(node) => self.rerun(node, bytes),
            };
            for (index, &parent) in parents.iter().enumerate() {
                if index < receivers
                    && let Entry::Vacant(slot) = pending.entry(parent)
                {
                    let (parent_bytes, parent_layer) =
                        (self.nodes[parent].bytes, self.nodes[parent].layer);
                    slot.insert(parent_bytes);
                    self.charge(in_flight(parent_layer), parent_bytes);
                }
                if let Some(count) = waiting.get_mut(&parent) {
                    *count -= 1;
                    if *count == 0 {
                        waiting.remove(&parent);
                        if let Some(parent_bytes) = pending.remove(&parent) {
                            self.finish_leaf(parent, parent_bytes);
                        }
                    }
                }
            }
            self.refund(in_flight(layer), bytes);
        }
        self.sweeps -= 1;
    }

    /// tl-tensor's `hooked_consumers`: for each hooked leaf of `order`, how many parent
    /// slots of its ops point at it. Empty when no leaf of the graph is hooked.
    fn hooked_consumers(&self, order: &[usize]) -> HashMap<usize, u32> {
        let mut waiting = HashMap::new();
        if self.hooks.is_empty() || !order.iter().any(|node| self.hooks.contains_key(node)) {
            return waiting;
        }
        for &node in order {
            if let NodeKind::Op { parents, .. } = &self.nodes[node].kind {
                for parent in parents {
                    if self.hooks.contains_key(parent) {
                        *waiting.entry(*parent).or_insert(0) += 1;
                    }
                }
            }
        }
        waiting
    }

    /// tl-tensor's `finish_leaf`: a leaf's first gradient becomes its `.grad`, a later one
    /// is added in and dropped; then the leaf's hook, if any, runs.
    fn finish_leaf(&mut self, id: usize, bytes: u64) {
        let layer = self.nodes[id].layer;
        let in_flight = tag(layer, TensorKind::GradientsInFlight);
        let NodeKind::Leaf { grad, param } = &mut self.nodes[id].kind else {
            unreachable!("only leaves accumulate")
        };
        let (first, param) = (grad.is_none(), *param);
        if first {
            *grad = Some(bytes);
        }
        if first && param {
            // The buffer itself becomes the parameter's `.grad`.
            self.uncount(in_flight, bytes);
            self.count(tag(layer, TensorKind::Gradients), bytes);
        }
        if let Some(&hook) = self.hooks.get(&id) {
            self.run_hook(hook);
        }
        if !first {
            // Added into the existing gradient; the in-flight one is dropped when
            // `finish_leaf` returns, after the hook.
            self.refund(in_flight, bytes);
        }
    }

    /// The VJP of a checkpoint node: rerun the segment from leaf copies of its inputs with
    /// the forward pass's modes, backpropagate `grad_bytes` through the rerun, and hand the
    /// inputs' gradients on. Returns how many parents (the first ones, the inputs) receive
    /// a gradient.
    fn rerun(
        &mut self,
        Rerun {
            inputs,
            kept,
            segment,
            autocast,
            keep,
            layer,
        }: Rerun,
        grad_bytes: u64,
    ) -> usize {
        let leaves: Vec<Handle> = inputs
            .iter()
            .map(|input| {
                let mut leaf = self.share(input);
                leaf.node = Some(self.leaf(input.bytes, layer, false));
                leaf
            })
            .collect();
        let outer = (self.grad_enabled, self.autocast, self.phase);
        let outer_keep = std::mem::replace(&mut self.keep, keep);
        (self.grad_enabled, self.autocast) = (true, autocast);
        self.phase.stage = Stage::Recompute;
        self.keep_frames.push(KeepFrame::Replaying(kept.into()));
        let output = segment(self, &leaves[0]);
        if let Some(KeepFrame::Replaying(unused)) = self.keep_frames.pop() {
            unused.into_iter().for_each(|h| self.release(h));
        }
        (self.grad_enabled, self.autocast) = (outer.0, outer.1);
        self.keep = outer_keep;
        self.backward(&output, grad_bytes);
        self.release(output);
        // The inputs' gradients were copied out of the leaves (outside the meter); the
        // leaves' own `.grad` buffers die with them.
        for leaf in leaves {
            if let Some(node) = leaf.node
                && let NodeKind::Leaf { grad, .. } = &mut self.nodes[node].kind
                && let Some(bytes) = grad.take()
            {
                self.refund(tag(layer, TensorKind::GradientsInFlight), bytes);
            }
            self.release(leaf);
        }
        let n_inputs = inputs.len();
        inputs.into_iter().for_each(|input| self.release(input));
        self.phase = outer.2;
        n_inputs
    }
}
