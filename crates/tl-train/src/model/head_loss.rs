//! The head and the loss as one op: `mean_r(log Σ_c exp(z_rc) − z_r,t_r)` with `z = x·W`,
//! on tl-tensor's [`LinearCrossEntropy`] kernel, block by block of 64 rows.
//!
//! With a vocabulary of tens of thousands, a small model's largest tensors are its logits
//! (`N × V`) and their gradient; keeping them for backward is what [`ChunkedLoss::Off`]
//! does, and [`ChunkedLoss::On`] instead recomputes each block's logits in backward, so that
//! one block of them exists at a time and none is kept between the passes. The kernel's
//! arithmetic is the same block by block either way, so the two give the same bits: the
//! loss, the gradient of the final norm's output, and the head's (or the tied embedding's)
//! gradient. Under autocast it rounds, and counts the gradient values it flushes, where the
//! separate ops' casts would (`z = rd(rd(x)·rd(W))`, `dz`, `dx`, `dW` rounded), and
//! multiplies by autocast's accumulation model.

use std::rc::Rc;

use serde::{Deserialize, Serialize};
use tl_precision::{autocast_format, autocast_product_kernel, record_underflows};
use tl_tensor::kernels::linear_cross_entropy::LinearCrossEntropy;
use tl_tensor::ndarray::{ArrayD, ArrayView2, Ix2, IxDyn};
use tl_tensor::{Element, Tensor, memory};

use super::causal_attention::with_rounding;
use super::config::ModelConfig;
use super::roles;

/// Whether the head's logits are kept between the forward and the backward pass, or
/// recomputed block by block (`--chunked-loss`). In JSON `"auto"`, `"on"`, `"off"`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChunkedLoss {
    /// On when the vocabulary is at least 8 times the model's width (see
    /// [`ChunkedLoss::resolve`]).
    #[default]
    Auto,
    /// Recompute the logits in backward, one block of rows at a time.
    On,
    /// Keep all the logits for backward.
    Off,
}

impl ChunkedLoss {
    /// Whether a model of `config` computes its loss in chunks: `Auto` is on when
    /// `V ≥ 8·d`, where a token's `V` logits (and their `V` gradients) outweigh what a block
    /// keeps of it for backward (about `14·d` values for Llama's MLP width): the byte
    /// vocabulary of the presets stays off, an 8k BPE on `small` is on.
    pub fn resolve(self, config: &ModelConfig) -> bool {
        match self {
            ChunkedLoss::Auto => config.vocab >= 8 * config.d_model,
            ChunkedLoss::On => true,
            ChunkedLoss::Off => false,
        }
    }
}

impl std::str::FromStr for ChunkedLoss {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ChunkedLoss::Auto),
            "on" => Ok(ChunkedLoss::On),
            "off" => Ok(ChunkedLoss::Off),
            _ => Err(format!("`{s}`: expected auto, on or off")),
        }
    }
}

impl std::fmt::Display for ChunkedLoss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ChunkedLoss::Auto => "auto",
            ChunkedLoss::On => "on",
            ChunkedLoss::Off => "off",
        })
    }
}

/// The mean cross-entropy of `x · head` (`x` is `[.., d]`, its leading axes the rows) against
/// `targets`, one per row. `head` is `[d, V]`, or with `tied` the embedding's `[V, d]` table
/// multiplied transposed. With `chunked`, no logits are kept for backward (see the module
/// documentation); otherwise they are kept as one tensor, labelled as logits on the memory
/// meter.
///
/// # Panics
/// If the shapes do not chain, `targets` has not one entry per row, or a target is not
/// below `V`.
pub fn head_loss<E: Element>(
    x: &Tensor<E>,
    head: &Tensor<E>,
    tied: bool,
    targets: &[usize],
    chunked: bool,
) -> Tensor<E> {
    let (x_shape, head_shape) = (x.shape(), head.shape());
    let d = *x_shape.last().expect("head_loss: x has a feature axis");
    // The head's `[d, V]`, or the tied table's `[V, d]`.
    let classes = match (tied, head_shape.as_slice()) {
        (false, &[head_d, classes]) | (true, &[classes, head_d]) if head_d == d => Some(classes),
        _ => None,
    };
    let Some(classes) = classes else {
        panic!("head_loss: cannot multiply {x_shape:?} by a head of {head_shape:?} (tied: {tied})")
    };
    let rows = x.numel() / d.max(1);
    let kernel = LinearCrossEntropy { rows, d, classes };
    let format = autocast_format();
    let products = autocast_product_kernel();
    let computes = tl_tensor::meta::computes(&[x, head]);
    let kept = (!chunked).then(|| {
        let _label = memory::label_scope(roles::LOGITS);
        match computes {
            true => Tensor::from_array(ArrayD::zeros(IxDyn(&[rows, classes]))),
            false => Tensor::meta(&[rows, classes]),
        }
    });
    let _label = memory::label_scope(roles::LOSS);
    let forward = computes.then(|| {
        with_operands((x, head), (rows, d), tied, |x_rows, w| {
            let run = |kept: Option<tl_tensor::ndarray::ArrayViewMut2<'_, E>>| {
                with_rounding(format, products.as_ref(), |rounding| {
                    kernel.forward(x_rows, w, targets, kept, rounding)
                })
            };
            match &kept {
                Some(kept) => kept.update_value(|logits| {
                    run(Some(
                        logits.view_mut().into_dimensionality::<Ix2>().expect("2-D"),
                    ))
                }),
                None => run(None),
            }
        })
    });
    let (value, stats) = forward.map_or((None, None), |(total, stats)| {
        let mean = E::from_f64(total / rows.max(1) as f64);
        (
            Some(ArrayD::from_elem(IxDyn(&[]), mean)),
            Some(Rc::new(stats)),
        )
    });
    let value = || value.expect("computed for real inputs");
    let saved = (x.clone(), head.clone(), kept, targets.to_vec());
    Tensor::from_op_shaped(&[], value, &[x, head], move |grad| {
        let (x, head, kept, targets) = &saved;
        let stats = stats
            .as_ref()
            .expect("a values VJP runs on real gradients only");
        let scale = grad.iter().next().copied().expect("one element") / E::from_f64(rows as f64);
        let kept_value = kept.as_ref().map(|kept| kept.value());
        let kept_view =
            (kept_value.as_ref()).map(|k| k.view().into_dimensionality::<Ix2>().expect("2-D"));
        let (dx, dw, flushed) = with_operands((x, head), (rows, d), tied, |x_rows, w| {
            with_rounding(format, products.as_ref(), |rounding| {
                kernel.backward((x_rows, w), targets, stats, kept_view, scale, rounding)
            })
        });
        record_underflows(flushed);
        let dx = dx
            .into_dyn()
            .into_shape_with_order(IxDyn(&x.shape()))
            .expect("same count");
        let dw = match tied {
            false => dw.into_dyn(),
            true => dw
                .reversed_axes()
                .as_standard_layout()
                .into_owned()
                .into_dyn(),
        };
        vec![
            x.requires_grad().then_some(dx),
            head.requires_grad().then_some(dw),
        ]
    })
}

/// `f` of the op's operands as the kernel reads them: `x` as its `[rows, d]` matrix, and the
/// head's weight as the `[d, V]` matrix, itself or the tied embedding's `[V, d]` table
/// transposed (views, no copy, for standard-layout values).
fn with_operands<E: Element, R>(
    (x, head): (&Tensor<E>, &Tensor<E>),
    (rows, d): (usize, usize),
    tied: bool,
    f: impl FnOnce(ArrayView2<'_, E>, ArrayView2<'_, E>) -> R,
) -> R {
    let x_value = x.value();
    let x_standard = x_value.as_standard_layout();
    let x_rows = (x_standard.view())
        .into_shape_with_order((rows, d))
        .expect("rows of d features");
    let head_value = head.value();
    let w = head_value
        .view()
        .into_dimensionality::<Ix2>()
        .expect("a 2-D head");
    f(x_rows, if tied { w.reversed_axes() } else { w })
}
