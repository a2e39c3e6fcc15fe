//! The ops of the model as the [`DryRun`] sees them: what each allocates and what its VJP
//! closure keeps, read off the op's code in tl-tensor, tl-precision and the model.

use super::dry_run::{DryRun, Handle, Tag, Vjp, tag};
use super::kind::TensorKind;
use crate::model::causal_attention::ATTENTION;

/// Bytes of one f32, the element type the trainer runs in.
pub(crate) const F32: u64 = 4;

impl DryRun {
    /// An op whose VJP needs nothing from the forward pass (reshape, permute, transpose —
    /// which copy in tl-tensor — the rotary embedding, `cast`, `add`, `mul_scalar`).
    pub(crate) fn saves_nothing(&mut self, parents: &[&Handle], bytes: u64, tag: Tag) -> Handle {
        self.record(bytes, tag, parents, Vjp::Saved(Vec::new()))
    }

    /// An op of the same size as `x` that saves nothing.
    pub(crate) fn layout(&mut self, x: &Handle, tag: Tag) -> Handle {
        self.saves_nothing(&[x], x.bytes, tag)
    }

    /// An op whose VJP keeps handles on `saved` (each shared, not copied).
    pub(crate) fn saving(
        &mut self,
        parents: &[&Handle],
        saved: &[&Handle],
        bytes: u64,
        tag: Tag,
    ) -> Handle {
        let saved = saved.iter().map(|h| self.share(h)).collect();
        self.record(bytes, tag, parents, Vjp::Saved(saved))
    }

    /// `RmsNorm::forward`: saves its input and the gain (the per-row `1/rms` is a plain
    /// array, outside the meter).
    pub(crate) fn rms_norm(&mut self, x: &Handle, gain: &Handle, tag: Tag) -> Handle {
        self.saving(&[x, gain], &[x, gain], x.bytes, tag)
    }

    /// `matmul_plain`: saves both operands.
    pub(crate) fn matmul_plain(
        &mut self,
        lhs: &Handle,
        rhs: &Handle,
        bytes: u64,
        tag: Tag,
    ) -> Handle {
        self.saving(&[lhs, rhs], &[lhs, rhs], bytes, tag)
    }

    /// `matmul_plain` on a result given to it (tl-tensor's `with_given_product`): the node
    /// saves both operands and its output shares `given`, allocating nothing.
    fn matmul_given(&mut self, lhs: &Handle, rhs: &Handle, given: Handle) -> Handle {
        let saved = [lhs, rhs].map(|h| self.share(h)).into();
        self.record_on(given, &[lhs, rhs], Vjp::Saved(saved))
    }

    /// `Tensor::matmul`: the plain product, or under autocast `cast(cast(lhs)·cast(rhs))`,
    /// whose product saves the two rounded copies (an activation's shared with the products
    /// that read it before, see [`DryRun::rounded_operand`]) and whose result is rounded in
    /// place: the cast's output takes over the product's storage.
    pub(crate) fn matmul(
        &mut self,
        lhs: &Handle,
        rhs: &Handle,
        bytes: u64,
        out_tag: Tag,
    ) -> Handle {
        self.matmul_or_given(lhs, rhs, bytes, out_tag, None)
    }

    /// [`DryRun::matmul`], its product taking `given` as its result when there is one.
    fn matmul_or_given(
        &mut self,
        lhs: &Handle,
        rhs: &Handle,
        bytes: u64,
        out_tag: Tag,
        given: Option<Handle>,
    ) -> Handle {
        let product =
            |dry: &mut Self, lhs: &Handle, rhs: &Handle, given: Option<Handle>| match given {
                Some(given) => dry.matmul_given(lhs, rhs, given),
                None => dry.matmul_plain(lhs, rhs, bytes, out_tag),
            };
        if !self.autocast {
            return product(self, lhs, rhs, given);
        }
        let copy_kind = |is_weight| {
            if is_weight {
                TensorKind::WeightCopies
            } else {
                TensorKind::RoundedCopies
            }
        };
        let lhs_kind = copy_kind(self.is_param(lhs));
        let rhs_kind = copy_kind(self.is_param(rhs));
        let lhs_copy = self.rounded_operand(lhs, tag(out_tag.layer, lhs_kind));
        let rhs_copy = self.rounded_operand(rhs, tag(out_tag.layer, rhs_kind));
        let product = product(self, &lhs_copy, &rhs_copy, given);
        let storage = self.share(&product);
        let rounded = self.record_on(storage, &[&product], Vjp::Saved(Vec::new()));
        self.release(product);
        self.release(rhs_copy);
        self.release(lhs_copy);
        rounded
    }

    /// tl-precision's `round_for_products`: under autocast the op that made `x` rounded it
    /// as it wrote it (no node, no bytes), and `x` is marked as its own rounded operand for
    /// the products that read it next.
    pub(crate) fn round_for_products(&mut self, x: Handle) -> Handle {
        if self.autocast {
            self.mark_rounded(&x);
        }
        x
    }

    /// The model's fused `causal_attention`: saves its three inputs (never a `T×T` tensor;
    /// its row statistics are a plain array, outside the meter) and rounds inside under
    /// autocast, so it keeps no rounded copies; its result, rounded already, is marked as its
    /// own rounded copy for the output projection. The result goes through
    /// `keep_named("attention")`: a checkpoint node whose policy names it keeps it in its
    /// forward pass, and the rerun takes it back without allocating.
    pub(crate) fn causal_attention(
        &mut self,
        q: &Handle,
        k: &Handle,
        v: &Handle,
        tag: Tag,
    ) -> Handle {
        let keeps = self.frame_keeps(ATTENTION);
        let output = match keeps.then(|| self.take_kept()).flatten() {
            Some(kept) => {
                let saved = [q, k, v].map(|h| self.share(h)).into();
                self.record_on(kept, &[q, k, v], Vjp::Saved(saved))
            }
            None => {
                let output = self.saving(&[q, k, v], &[q, k, v], q.bytes, tag);
                if keeps {
                    self.keep_for_rerun(&output);
                }
                output
            }
        };
        if self.autocast {
            self.mark_rounded(&output);
        }
        output
    }

    /// `swiglu`, the fused gate `silu(g) ⊙ u`: saves both inputs.
    pub(crate) fn swiglu(&mut self, gate: &Handle, up: &Handle, tag: Tag) -> Handle {
        self.saving(&[gate, up], &[gate, up], gate.bytes, tag)
    }

    /// `Dropout::forward` while training: the mask becomes a tensor first (counted), then
    /// the output; the VJP owns the mask.
    pub(crate) fn dropout(&mut self, x: &Handle, out_tag: Tag) -> Handle {
        let mask = self.constant(x.bytes, tag(out_tag.layer, TensorKind::DropoutMasks));
        self.record(x.bytes, out_tag, &[x], Vjp::Saved(vec![mask]))
    }

    /// `cross_entropy`: a one-element loss that saves the logits it read.
    pub(crate) fn cross_entropy(&mut self, logits: &Handle, tag: Tag) -> Handle {
        self.saving(&[logits], &[logits], F32, tag)
    }

    /// `Linear::forward` on a `[B, T, in]` input: one product whose leading axes fold into
    /// its rows as a view, so it saves the input itself, not a copy.
    pub(crate) fn linear(
        &mut self,
        x: &Handle,
        weight: &Handle,
        out_bytes: u64,
        out_tag: Tag,
    ) -> Handle {
        self.matmul(x, weight, out_bytes, out_tag)
    }

    /// A block's projection named `name` (the model's `Fp8Slot::project`, through
    /// tl-recompute's `keep_product`): a plain [`DryRun::linear`] unless the checkpoint it
    /// runs in keeps `name`; then its forward pass keeps the result, and the rerun's product
    /// takes it back (rounded copies and nodes as ever, no product allocated).
    pub(crate) fn projection(
        &mut self,
        name: &str,
        x: &Handle,
        weight: &Handle,
        out_bytes: u64,
        out_tag: Tag,
    ) -> Handle {
        if !self.frame_keeps(name) {
            return self.linear(x, weight, out_bytes, out_tag);
        }
        match self.take_kept() {
            Some(kept) => self.matmul_or_given(x, weight, out_bytes, out_tag, Some(kept)),
            None => {
                let output = self.linear(x, weight, out_bytes, out_tag);
                self.keep_for_rerun(&output);
                output
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::kind::Layer;

    fn activation(kind: TensorKind) -> Tag {
        tag(Layer::Block(0), kind)
    }

    #[test]
    fn a_saved_input_outlives_its_handle_until_backward_runs_the_op() {
        let mut dry = DryRun::new();
        let w = dry.param(4 * F32, Layer::Block(0));
        let x = dry.constant(6 * F32, activation(TensorKind::ResidualStream));
        let rows = dry.layout(&x, activation(TensorKind::NormOutputs)); // 24 bytes, has no node
        let y = dry.matmul_plain(&rows, &w, 12 * F32, activation(TensorKind::LinearOutputs));
        dry.release(rows);
        dry.release(x);
        // weights 16 + rows 24 (saved by the product) + y 48
        assert_eq!(dry.live(), 16 + 24 + 48);
        dry.backward(&y, 12 * F32);
        // The product's VJP freed the rows; w's gradient (16) stayed as its `.grad`.
        assert_eq!(dry.live(), 16 + 48 + 16);
        assert!(dry.has_grad(&w));
    }

    #[test]
    fn autocast_keeps_rounded_copies_instead_of_the_operands() {
        let mut dry = DryRun::new();
        dry.autocast = true;
        let w = dry.param(4 * F32, Layer::Block(0));
        let input = dry.constant(6 * F32, activation(TensorKind::ResidualStream));
        // An activation in the graph (some op of `w`), so that the casts record nodes.
        let x = dry.saving(&[&input, &w], &[], 6 * F32, activation(TensorKind::Heads));
        dry.release(input);
        let _y = dry.matmul(&x, &w, 12 * F32, activation(TensorKind::LinearOutputs));
        dry.release(x);
        // weights 16, rounded x 24, rounded w 16, y 48; x itself and the unrounded product
        // are gone.
        assert_eq!(dry.live(), 16 + 24 + 16 + 48);
        let kinds = dry.live_by_tag();
        assert_eq!(kinds[&activation(TensorKind::RoundedCopies)], 24);
        assert_eq!(kinds[&activation(TensorKind::WeightCopies)], 16);
        // The product was rounded in place: the peak held x and its copy, never two y.
        assert_eq!(dry.peak().0, 16 + 24 + 24 + 16 + 48);
    }

    #[test]
    fn products_of_one_activation_share_its_rounded_copy() {
        let mut dry = DryRun::new();
        dry.autocast = true;
        let w = dry.param(4 * F32, Layer::Block(0));
        let input = dry.constant(6 * F32, activation(TensorKind::ResidualStream));
        let x = dry.saving(&[&input, &w], &[], 6 * F32, activation(TensorKind::Heads));
        let _products =
            [0, 1, 2].map(|_| dry.matmul(&x, &w, 12 * F32, activation(TensorKind::LinearOutputs)));
        // input 24, x 24, one rounded x 24, three rounded w 48, three y 144
        assert_eq!(dry.live(), 16 + 24 + 24 + 24 + 3 * 16 + 3 * 48);
        assert_eq!(
            dry.live_by_tag()[&activation(TensorKind::RoundedCopies)],
            24
        );
        // A constant is not remembered: each product rounds its own copy.
        let _more =
            [0, 1].map(|_| dry.matmul(&input, &w, 12 * F32, activation(TensorKind::LinearOutputs)));
        assert_eq!(
            dry.live_by_tag()[&activation(TensorKind::RoundedCopies)],
            24 + 2 * 24
        );
    }
}
