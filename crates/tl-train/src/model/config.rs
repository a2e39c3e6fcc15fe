//! The shape of a model: [`ModelConfig`] and the named [`Preset`]s.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// The largest vocabulary, width, hidden size, head count or context a config may ask for:
/// far beyond what trains here, and small enough that every count of parameters and bytes
/// fits in 64 bits.
const MAX_SIZE: usize = 1 << 20;
/// The most blocks a config may ask for.
const MAX_LAYERS: usize = 1 << 12;

/// Everything that fixes a model's parameter shapes and its forward computation.
///
/// Two checkpoints can share weights only if their configs are equal; the trainer checks this
/// before loading anything.

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Vocabulary size: 256 for byte-level tokens.
    pub vocab: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Attention (query) heads per block; `d_model / n_heads` must be an even head size
    /// (rotary embedding rotates pairs).
    pub n_heads: usize,
    /// Key/value heads per block, for grouped-query attention: a divisor of `n_heads`, each
    /// shared by `n_heads / n_kv_heads` query heads (1 is multi-query attention). Absent
    /// (`None`), as many as the query heads: multi-head attention, as Hugging Face reads a
    /// config without `num_key_value_heads`. See [`kv_heads`](Self::kv_heads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_kv_heads: Option<usize>,
    /// Hidden width of the SwiGLU MLP.
    pub hidden: usize,
    /// Longest sequence the model is trained on (the rotary tables' length).
    pub context: usize,
    /// Added to the mean square in every RMSNorm.
    pub norm_eps: f64,
    /// Base of the rotary embedding's frequencies (`rope_theta` in Hugging Face's configs,
    /// which this field also reads).
    #[serde(alias = "rope_theta")]
    pub rope_base: f64,
    /// Dropout probability on each residual branch (0 disables dropout).
    pub dropout: f64,
    /// Whether the head is the embedding's table (`logits = x·Eᵀ`, one `V × d` parameter
    /// for both, as GPT-2 and the small Llamas have it) rather than a weight of its own.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tie_embeddings: bool,
}

/// The named model sizes of `tinyllm --preset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    /// For tests: 2 layers of width 64, context 64 (as `llama_ref.py`'s `tiny`).
    Tiny,
    /// A meaningful run in a few minutes on two cores: 4 layers of width 128, context 128.
    Small,
    /// The capstone of the chapter: 8 layers of width 320, context 512, 10,327,360
    /// parameters.
    Capstone,
}

impl Preset {
    /// Every preset, smallest first.
    pub const ALL: [Preset; 3] = [Preset::Tiny, Preset::Small, Preset::Capstone];

    /// The preset's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Small => "small",
            Preset::Capstone => "capstone",
        }
    }

    /// The model this preset names.
    pub fn config(self) -> ModelConfig {
        let (d_model, n_layers, n_heads, hidden, context) = match self {
            Preset::Tiny => (64, 2, 4, 176, 64),
            Preset::Small => (128, 4, 4, 352, 128),
            Preset::Capstone => (320, 8, 10, 896, 512),
        };
        ModelConfig {
            vocab: 256,
            d_model,
            n_layers,
            n_heads,
            hidden,
            context,
            norm_eps: 1e-5,
            rope_base: 10_000.0,
            dropout: 0.0,
            n_kv_heads: None,
            tie_embeddings: false,
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = TrainError;

    fn from_str(s: &str) -> Result<Self> {
        Preset::ALL
            .into_iter()
            .find(|preset| preset.name() == s)
            .ok_or_else(|| TrainError::UnknownPreset {
                input: s.to_string(),
            })
    }
}

impl ModelConfig {
    /// The size of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads
    }

    /// Key/value heads per block: `n_kv_heads`, or `n_heads` when it is absent.
    pub fn kv_heads(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// The width of the keys and of the values, `kv_heads · head_dim` (`d_model` without
    /// grouped-query attention).
    pub fn kv_width(&self) -> usize {
        self.kv_heads() * self.head_dim()
    }

    /// Checks that the sizes fit together, and that none is so large that counting the
    /// model's parameters or bytes could overflow.
    ///
    /// # Errors
    /// [`TrainError::InvalidConfig`] naming the first size that does not fit.
    pub fn validate(&self) -> Result<()> {
        let invalid = |field: &'static str, value: String, reason: String| {
            Err(TrainError::InvalidConfig {
                field,
                value,
                reason,
            })
        };
        let sizes = [
            ("vocab", self.vocab, MAX_SIZE),
            ("d_model", self.d_model, MAX_SIZE),
            ("n_layers", self.n_layers, MAX_LAYERS),
            ("n_heads", self.n_heads, MAX_SIZE),
            ("hidden", self.hidden, MAX_SIZE),
            ("context", self.context, MAX_SIZE),
        ];
        for (field, value, max) in sizes {
            if !(1..=max).contains(&value) {
                return invalid(field, value.to_string(), format!("must be in 1..={max}"));
            }
        }
        if !self.d_model.is_multiple_of(self.n_heads) || !self.head_dim().is_multiple_of(2) {
            return invalid(
                "n_heads",
                self.n_heads.to_string(),
                format!(
                    "d_model {} must split into heads of an even size",
                    self.d_model
                ),
            );
        }
        let kv_heads = self.kv_heads();
        if kv_heads == 0 || !self.n_heads.is_multiple_of(kv_heads) {
            return invalid(
                "n_kv_heads",
                kv_heads.to_string(),
                format!(
                    "must divide the {} query heads (each key/value head serves a group of \
                     query heads)",
                    self.n_heads
                ),
            );
        }
        if !(self.norm_eps.is_finite() && self.norm_eps >= 0.0) {
            return invalid(
                "norm_eps",
                self.norm_eps.to_string(),
                "must be finite and >= 0".into(),
            );
        }
        if !(self.rope_base.is_finite() && self.rope_base > 1.0) {
            return invalid(
                "rope_base",
                self.rope_base.to_string(),
                "must be finite and > 1".into(),
            );
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return invalid(
                "dropout",
                self.dropout.to_string(),
                "must be in [0, 1)".into(),
            );
        }
        Ok(())
    }

    /// The number of trainable scalars, from the sizes alone:
    ///
    /// `V·d` (embedding) `+ L·(2d² + 2d·d_kv + 3d·h + 2d)` (attention's q and o, its k and v
    /// of width `d_kv = kv_heads·head_dim`, SwiGLU, two gains per block) `+ d` (final norm)
    /// `+ d·V` (the head, unless it is tied to the embedding).
    pub fn num_parameters(&self) -> usize {
        let (v, d, h, d_kv) = (self.vocab, self.d_model, self.hidden, self.kv_width());
        let per_block = 2 * d * d + 2 * d * d_kv + 3 * d * h + 2 * d;
        let head = if self.tie_embeddings { 0 } else { d * v };
        v * d + self.n_layers * per_block + d + head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_capstone_has_the_chapters_parameter_count() {
        // 256·320 + 8·(4·320² + 3·320·896 + 2·320) + 320 + 320·256
        //   = 81,920 + 8·1,270,400 + 320 + 81,920 = 10,327,360
        assert_eq!(Preset::Capstone.config().num_parameters(), 10_327_360);
    }

    #[test]
    fn grouped_queries_and_a_tied_head_count_fewer_parameters() {
        // Tiny: d 64, 4 heads of 16, hidden 176, 2 layers, V 256. Two key/value heads halve
        // k and v (64·32 each instead of 64·64); the tied head drops 64·256.
        let mut config = Preset::Tiny.config();
        let plain = config.num_parameters();
        config.n_kv_heads = Some(2);
        assert_eq!(plain - config.num_parameters(), 2 * 2 * (64 * 64 - 64 * 32));
        config.tie_embeddings = true;
        assert_eq!(
            plain - config.num_parameters(),
            2 * 2 * (64 * 64 - 64 * 32) + 64 * 256
        );
        config.n_kv_heads = Some(4);
        assert_eq!(config.kv_width(), 64);
        config.validate().unwrap();
        config.n_kv_heads = Some(3);
        let error = config.validate().unwrap_err().to_string();
        assert!(
            error.contains("n_kv_heads") && error.contains("4 query heads"),
            "{error}"
        );
        config.n_kv_heads = Some(0);
        assert!(config.validate().is_err());
    }

    #[test]
    fn hugging_faces_rope_theta_reads_and_old_configs_have_no_new_fields() {
        let mut json = serde_json::to_value(Preset::Tiny.config()).unwrap();
        assert!(json.get("n_kv_heads").is_none() && json.get("tie_embeddings").is_none());
        let base = json.as_object_mut().unwrap().remove("rope_base").unwrap();
        json["rope_theta"] = base;
        let config: ModelConfig = serde_json::from_value(json).unwrap();
        assert_eq!(config, Preset::Tiny.config());
    }

    #[test]
    fn names_round_trip_and_unknown_names_are_errors() {
        for preset in Preset::ALL {
            assert_eq!(preset.name().parse::<Preset>().unwrap(), preset);
            preset.config().validate().unwrap();
        }
        let error = "huge".parse::<Preset>().unwrap_err();
        assert!(error.to_string().contains("huge"));
        assert!(error.to_string().contains("tiny, small, capstone"));
    }

    #[test]
    fn sizes_that_do_not_fit_are_rejected() {
        let mut config = Preset::Tiny.config();
        config.n_heads = 3; // 64 = 3·21 + 1
        assert!(matches!(
            config.validate(),
            Err(TrainError::InvalidConfig { .. })
        ));
        config.n_heads = 64; // head size 1: no pairs to rotate
        assert!(config.validate().is_err());
        let mut config = Preset::Tiny.config();
        config.dropout = 1.0;
        assert!(config.validate().is_err());
        let mut config = Preset::Tiny.config();
        config.n_layers = 0;
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("n_layers")
        );
    }
}
