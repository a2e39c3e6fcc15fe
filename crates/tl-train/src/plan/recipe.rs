//! [`Recipe`]: what the plan plans — a training config, whole.

use std::ops::Deref;

use serde::ser::{Serialize, SerializeStruct, Serializer};
use tl_precision::Accumulation;

use crate::error::Result;
use crate::model::Checkpointing;
use crate::train::TrainConfig;

/// What fixes the memory of a training step: the model, the micro-batch, the number of
/// micro-batches per step, the precision, the tensor cores' accumulation, fp8, the
/// checkpointing schedule, clipping, the data-parallel setup — that is, the run's
/// [`TrainConfig`], whole. The plan runs the trainer's own step on it (on meta tensors),
/// so nothing a run would do is left out; the recipe reads as the config it holds.
///
/// In JSON it is the fields that decide the memory: `model`, `micro_batch`, `accum`,
/// `precision`, `checkpointing`, `clip` (whether gradients are clipped), and, when they
/// are not the defaults, `accumulation` and `fp8`.
///
/// ```
/// use tl_train::plan::Recipe;
/// use tl_train::train::TrainConfig;
/// let mut config = TrainConfig::for_preset(tl_train::model::Preset::Tiny);
/// config.fp8 = Some(tl_precision::Fp8Recipe::default());
/// let recipe = Recipe::from(&config);
/// assert_eq!(recipe.config(), &config); // nothing dropped
/// assert!(serde_json::to_string(&recipe)?.contains(r#""fp8":"#));
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Recipe(TrainConfig);

impl From<&TrainConfig> for Recipe {
    fn from(config: &TrainConfig) -> Self {
        Self(config.clone())
    }
}

impl Deref for Recipe {
    type Target = TrainConfig;

    fn deref(&self) -> &TrainConfig {
        &self.0
    }
}

impl Recipe {
    /// The config the recipe is.
    pub fn config(&self) -> &TrainConfig {
        &self.0
    }

    /// The same recipe with another checkpointing schedule.
    pub fn with_checkpointing(&self, checkpointing: Checkpointing) -> Self {
        Self(TrainConfig {
            checkpointing,
            ..self.0.clone()
        })
    }

    /// The same recipe with the loss's logits kept (`false`) or recomputed (`true`).
    pub fn with_chunked_loss(&self, chunked: bool) -> Self {
        let chunked_loss = match chunked {
            true => crate::model::head_loss::ChunkedLoss::On,
            false => crate::model::head_loss::ChunkedLoss::Off,
        };
        Self(TrainConfig {
            chunked_loss,
            ..self.0.clone()
        })
    }

    /// The step's arithmetic as the tables print it: the precision, then the tensor cores'
    /// accumulation and fp8 when the recipe has them (`bf16`, `bf16, h100 accumulation`,
    /// `bf16, fp8 linears`).
    pub fn arithmetic(&self) -> String {
        let mut label = self.0.precision.to_string();
        if self.0.accumulation != Accumulation::F32 {
            label.push_str(&format!(", {} accumulation", self.0.accumulation));
        }
        if self.0.fp8.is_some() {
            label.push_str(", fp8 linears");
        }
        label
    }

    /// Whether the gradients' norm is clipped.
    pub fn clips(&self) -> bool {
        self.0.clip.is_some()
    }

    /// Checks that the config can be trained, as `train` checks it.
    ///
    /// # Errors
    /// Those of [`TrainConfig::validate`].
    pub fn validate(&self) -> Result<()> {
        self.0.validate()
    }
}

impl Serialize for Recipe {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let c = &self.0;
        let defaults =
            usize::from(c.accumulation != Accumulation::F32) + usize::from(c.fp8.is_some());
        let mut out = serializer.serialize_struct("Recipe", 6 + defaults)?;
        out.serialize_field("model", &c.model)?;
        out.serialize_field("micro_batch", &c.micro_batch)?;
        out.serialize_field("accum", &c.accum)?;
        out.serialize_field("precision", &c.precision)?;
        out.serialize_field("checkpointing", &c.checkpointing)?;
        out.serialize_field("clip", &c.clip.is_some())?;
        if c.accumulation != Accumulation::F32 {
            out.serialize_field("accumulation", &c.accumulation)?;
        }
        if let Some(fp8) = &c.fp8 {
            out.serialize_field("fp8", fp8)?;
        }
        out.end()
    }
}
