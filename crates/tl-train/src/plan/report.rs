//! [`MemoryPlan`]: the figures `tinyllm plan` prints — model state, the bytes saved for
//! backward by layer and by kind, and the predicted peaks with and without checkpointing.

use serde::Serialize;

use super::kind::{Layer, TensorKind};
use super::ledger::StepPrediction;
use super::ledger::predict_step;
use super::recipe::Recipe;
use crate::error::Result;
use crate::model::Checkpointing;
use crate::model::causal_attention::ATTENTION;

/// Bytes per parameter that training with AdamW cannot go below: the f32 weight, its
/// gradient, and AdamW's two f32 moments (4 + 4 + 8).
pub const FLOOR_BYTES_PER_PARAMETER: u64 = 16;

/// One row of the per-layer table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerBytes {
    /// The layer.
    pub layer: Layer,
    /// Its trainable scalars.
    pub parameters: u64,
    /// 4 bytes per parameter.
    pub weights: u64,
    /// 4 bytes per parameter, once backward has reached every weight.
    pub gradients: u64,
    /// 8 bytes per parameter, from the first update on.
    pub moments: u64,
    /// Bytes it saves for backward in one micro-batch without checkpointing.
    pub saved_plain: u64,
    /// The same with the checkpointing schedule of [`MemoryPlan::checkpointed`].
    pub saved_checkpointed: u64,
}

/// One row of the per-kind table of saved activations (one micro-batch, end of forward).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KindBytes {
    /// What the bytes are.
    pub kind: TensorKind,
    /// Saved by one block without checkpointing (every block saves the same).
    pub per_block: u64,
    /// Saved by all blocks without checkpointing.
    pub all_blocks: u64,
    /// Saved by the embedding, final norm, head and loss without checkpointing.
    pub outside_blocks: u64,
    /// The total without checkpointing.
    pub plain: u64,
    /// The total with the checkpointing schedule of [`MemoryPlan::checkpointed`].
    pub checkpointed: u64,
}

/// What one checkpoint policy keeps and costs (`tinyllm plan`'s policy table).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyPlan {
    /// Its `--checkpoint-policy` name.
    pub policy: &'static str,
    /// Its checkpointing.
    pub checkpointing: Checkpointing,
    /// The named results a checkpointed block keeps besides its input (empty for `none`,
    /// which keeps every activation).
    pub kept: Vec<String>,
    /// The products each checkpointed block's rerun computes again (none for `none`, which
    /// reruns nothing).
    pub recomputed: Vec<&'static str>,
    /// Bytes the first block holds between its forward pass and its backward, by kind (the
    /// first of several blocks is checkpointed under every policy but `none`).
    pub first_block: Vec<(TensorKind, u64)>,
    /// Bytes one micro-batch's forward pass leaves for its backward, all layers.
    pub held_bytes: u64,
    /// The steady-state step's predicted peak.
    pub peak_bytes: u64,
    /// What the update allocates beyond weights, gradients and moments.
    pub update_extra_bytes: u64,
}

/// The products of one block, in the order its forward pass computes them.
const BLOCK_PRODUCTS: [&str; 8] = ["wq", "wk", "wv", ATTENTION, "wo", "w1", "w3", "w2"];

impl PolicyPlan {
    fn new(policy: Checkpointing, prediction: &StepPrediction) -> Self {
        let keep = policy.keep_policy();
        let rerun = policy != Checkpointing::Off;
        Self {
            policy: policy.policy_name().expect("one of the four policies"),
            checkpointing: policy,
            kept: keep.names().to_vec(),
            recomputed: BLOCK_PRODUCTS
                .into_iter()
                .filter(|name| rerun && !keep.keeps(name))
                .collect(),
            first_block: TensorKind::ALL
                .into_iter()
                .map(|kind| {
                    (
                        kind,
                        saved_by(prediction, |l, k| l == Layer::Block(0) && k == kind),
                    )
                })
                .filter(|&(_, bytes)| bytes > 0)
                .collect(),
            held_bytes: prediction.saved_total(),
            peak_bytes: prediction.peak_bytes,
            update_extra_bytes: prediction.update_extra_bytes,
        }
    }

    /// All the first block holds between forward and backward.
    pub fn first_block_bytes(&self) -> u64 {
        self.first_block.iter().map(|&(_, bytes)| bytes).sum()
    }
}

/// Everything `tinyllm plan` reports for one recipe.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryPlan {
    /// The recipe asked for.
    pub recipe: Recipe,
    /// Trainable scalars of the model.
    pub parameters: u64,
    /// `16 · parameters`: weights, gradients and moments.
    pub floor_bytes: u64,
    /// Model state and saved activations per layer.
    pub layers: Vec<LayerBytes>,
    /// Saved activations per kind (kinds saved by neither schedule left out).
    pub kinds: Vec<KindBytes>,
    /// The step without checkpointing.
    pub plain: StepPrediction,
    /// The step with the recipe's checkpointing schedule, or per-block checkpointing when
    /// the recipe has none.
    pub checkpointed: StepPrediction,
    /// The four checkpoint policies on the recipe, in [`Checkpointing::POLICIES`]' order.
    pub policies: Vec<PolicyPlan>,
    /// The recipe's step with the chunked loss on and off (`--chunked-loss`).
    pub chunked_loss: ChunkedLossPlan,
}

/// What the chunked loss changes in the recipe's step (with its checkpointing as asked).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChunkedLossPlan {
    /// Whether the recipe computes its loss in chunks (`--chunked-loss` resolved).
    pub on: bool,
    /// The steady-state peak with the chunked loss on.
    pub peak_on_bytes: u64,
    /// The steady-state peak with it off (the logits kept for backward).
    pub peak_off_bytes: u64,
}

impl MemoryPlan {
    /// Predicts `recipe` with and without checkpointing.
    ///
    /// ```
    /// use tl_train::model::{Checkpointing, Preset};
    /// use tl_train::plan::{MemoryPlan, Recipe};
    /// use tl_train::train::TrainConfig;
    ///
    /// let mut config = TrainConfig::for_preset(Preset::Tiny);
    /// config.micro_batch = 2;
    /// let plan = MemoryPlan::new(&Recipe::from(&config))?;
    /// assert_eq!(plan.parameters, 133_440);
    /// assert_eq!(plan.floor_bytes, 16 * 133_440);
    /// assert_eq!(plan.checkpointed.checkpointing, Checkpointing::PerBlock);
    /// assert!(plan.checkpointed.peak_bytes < plan.plain.peak_bytes);
    /// assert!(plan.plain.peak_bytes > plan.floor_bytes);
    /// # Ok::<(), tl_train::TrainError>(())
    /// ```
    ///
    /// # Errors
    /// As [`Recipe::validate`].
    pub fn new(recipe: &Recipe) -> Result<Self> {
        let plain = predict_step(&recipe.with_checkpointing(Checkpointing::Off))?;
        let schedule = match recipe.checkpointing {
            Checkpointing::Off => Checkpointing::PerBlock,
            chosen => chosen,
        };
        let checkpointed = predict_step(&recipe.with_checkpointing(schedule))?;
        let policies = Checkpointing::POLICIES
            .into_iter()
            .map(|policy| {
                let prediction = match policy {
                    Checkpointing::Off => plain.clone(),
                    _ if policy == schedule => checkpointed.clone(),
                    _ => predict_step(&recipe.with_checkpointing(policy))?,
                };
                Ok(PolicyPlan::new(policy, &prediction))
            })
            .collect::<Result<Vec<_>>>()?;
        let chunked_loss = ChunkedLossPlan::new(recipe, as_asked(recipe, &plain, &checkpointed))?;
        let parameters = recipe.model.num_parameters() as u64;
        Ok(Self {
            recipe: recipe.clone(),
            parameters,
            floor_bytes: FLOOR_BYTES_PER_PARAMETER * parameters,
            layers: layer_rows(recipe, &plain, &checkpointed),
            kinds: kind_rows(&plain, &checkpointed),
            plain,
            checkpointed,
            policies,
            chunked_loss,
        })
    }

    /// The prediction for the recipe as asked (plain or checkpointed).
    pub fn chosen(&self) -> &StepPrediction {
        as_asked(&self.recipe, &self.plain, &self.checkpointed)
    }
}

/// Of the plain and the checkpointed prediction, the one for `recipe` as asked.
fn as_asked<'a>(
    recipe: &Recipe,
    plain: &'a StepPrediction,
    checkpointed: &'a StepPrediction,
) -> &'a StepPrediction {
    match recipe.checkpointing {
        Checkpointing::Off => plain,
        _ => checkpointed,
    }
}

impl ChunkedLossPlan {
    /// `recipe`'s peak as asked (`chosen`), and the same step with the chunked loss the
    /// other way.
    fn new(recipe: &Recipe, chosen: &StepPrediction) -> Result<Self> {
        let on = recipe.chunked_loss.resolve(&recipe.model);
        let other = predict_step(&recipe.with_chunked_loss(!on))?.peak_bytes;
        let (peak_on_bytes, peak_off_bytes) = match on {
            true => (chosen.peak_bytes, other),
            false => (other, chosen.peak_bytes),
        };
        Ok(Self {
            on,
            peak_on_bytes,
            peak_off_bytes,
        })
    }
}

/// Trainable scalars of each layer: `V·d` for the embedding, `4d² + 3dh + 2d` per block,
/// `d + dV` for the final norm and the head.
fn layer_parameters(recipe: &Recipe) -> Vec<(Layer, u64)> {
    let c = &recipe.model;
    let (v, d, h) = (c.vocab as u64, c.d_model as u64, c.hidden as u64);
    let mut layers = vec![(Layer::Embedding, v * d)];
    layers.extend((0..c.n_layers).map(|i| (Layer::Block(i), 4 * d * d + 3 * d * h + 2 * d)));
    layers.push((Layer::Head, d + d * v));
    layers
}

fn saved_by(prediction: &StepPrediction, keep: impl Fn(Layer, TensorKind) -> bool) -> u64 {
    prediction
        .saved
        .iter()
        .filter(|s| keep(s.layer, s.kind))
        .map(|s| s.bytes)
        .sum()
}

fn layer_rows(
    recipe: &Recipe,
    plain: &StepPrediction,
    checkpointed: &StepPrediction,
) -> Vec<LayerBytes> {
    layer_parameters(recipe)
        .into_iter()
        .map(|(layer, parameters)| LayerBytes {
            layer,
            parameters,
            weights: 4 * parameters,
            gradients: 4 * parameters,
            moments: 8 * parameters,
            saved_plain: saved_by(plain, |l, _| l == layer),
            saved_checkpointed: saved_by(checkpointed, |l, _| l == layer),
        })
        .collect()
}

fn kind_rows(plain: &StepPrediction, checkpointed: &StepPrediction) -> Vec<KindBytes> {
    let in_block = |layer| matches!(layer, Layer::Block(_));
    TensorKind::ALL
        .into_iter()
        .filter(|kind| kind.is_activation())
        .map(|kind| KindBytes {
            kind,
            per_block: saved_by(plain, |l, k| k == kind && l == Layer::Block(0)),
            all_blocks: saved_by(plain, |l, k| k == kind && in_block(l)),
            outside_blocks: saved_by(plain, |l, k| k == kind && !in_block(l)),
            plain: saved_by(plain, |_, k| k == kind),
            checkpointed: saved_by(checkpointed, |_, k| k == kind),
        })
        .filter(|row| row.plain > 0 || row.checkpointed > 0)
        .collect()
}
