//! [`TrainConfig`]: everything that determines a training run.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tl_precision::Precision;
use tl_recompute::checkpoint_schedule;

use super::schedule::LrSchedule;
use crate::error::{Result, TrainError};
use crate::model::{Checkpointing, ModelConfig, Preset};

/// Where the training text comes from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataSource {
    /// The built-in grammar corpus: `bytes` bytes generated from `seed`.
    Builtin {
        /// Seed of the generator.
        seed: u64,
        /// Length of the generated text.
        bytes: usize,
    },
    /// A UTF-8 text file, read as bytes.
    File {
        /// The file.
        path: PathBuf,
    },
}

/// Everything that determines a run: with the same config, two runs produce the same bits.
///
/// The checkpoint saves it; resuming refuses a checkpoint whose config differs from the one
/// asked for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// The preset the model came from, if any (informational: `model` is what counts).
    pub preset: Option<Preset>,
    /// The model's sizes.
    pub model: ModelConfig,
    /// The training text.
    pub data: DataSource,
    /// fp32, or bf16/fp16 autocast (fp16 with a dynamic loss scaler).
    pub precision: Precision,
    /// Rows (sequences of `model.context` tokens) per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches accumulated per optimizer step.
    pub accum: usize,
    /// How blocks keep activations for backward.
    pub checkpointing: Checkpointing,
    /// Optimizer steps of the whole run.
    pub steps: u64,
    /// Peak learning rate, warmup and floor.
    pub lr: LrSchedule,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// Clip the gradient's total norm to this, if set.
    pub clip: Option<f64>,
    /// Seed of the weights, the batches and dropout.
    pub seed: u64,
    /// Steps between validation losses (and the last step always).
    pub eval_interval: u64,
    /// Validation batches per evaluation (of `micro_batch` rows each).
    pub eval_batches: usize,
    /// Steps between checkpoints (and the last step always).
    pub save_interval: u64,
}

impl TrainConfig {
    /// The defaults of `tinyllm train` for `preset`: the mixed recipe's batch of
    /// 8 × 4 sequences, fp32, no checkpointing, the built-in corpus.
    pub fn for_preset(preset: Preset) -> Self {
        let (steps, peak) = match preset {
            Preset::Tiny => (40, 3e-3),
            Preset::Small => (200, 2e-3),
            Preset::Capstone => (2000, 1e-3),
        };
        let warmup = (steps / 10).max(1);
        TrainConfig {
            preset: Some(preset),
            model: preset.config(),
            data: DataSource::Builtin {
                seed: 0,
                bytes: 2_000_000,
            },
            precision: Precision::Fp32,
            micro_batch: 8,
            accum: 4,
            checkpointing: Checkpointing::Off,
            steps,
            lr: LrSchedule {
                peak,
                min: peak / 10.0,
                warmup,
                total: steps,
            },
            weight_decay: 0.01,
            clip: Some(1.0),
            seed: 0,
            eval_interval: (steps / 10).max(1),
            eval_batches: 4,
            save_interval: (steps / 4).max(1),
        }
    }

    /// Tokens per optimizer step.
    pub fn tokens_per_step(&self) -> usize {
        self.micro_batch * self.accum * self.model.context
    }

    /// Checks every option, naming the first that is out of range.
    ///
    /// # Errors
    /// [`TrainError::InvalidArgument`] or [`TrainError::InvalidConfig`].
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        let invalid = |name: &'static str, value: String, reason: &str| {
            Err(TrainError::InvalidArgument {
                name,
                value,
                reason: reason.to_string(),
            })
        };
        if self.micro_batch == 0 {
            return invalid("micro-batch", "0".into(), "must be at least 1");
        }
        if self.accum == 0 {
            return invalid("accum", "0".into(), "must be at least 1");
        }
        if self.steps == 0 {
            return invalid("steps", "0".into(), "must be at least 1");
        }
        let LrSchedule { peak, min, .. } = self.lr;
        if !(peak.is_finite() && peak > 0.0) {
            return invalid("lr", peak.to_string(), "must be finite and positive");
        }
        if !(min.is_finite() && (0.0..=peak).contains(&min)) {
            return invalid("min-lr", min.to_string(), "must be in [0, lr]");
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return invalid(
                "weight-decay",
                self.weight_decay.to_string(),
                "must be finite and >= 0",
            );
        }
        if let Some(clip) = self.clip
            && !(clip.is_finite() && clip > 0.0)
        {
            return invalid("clip", clip.to_string(), "must be finite and positive");
        }
        if self.eval_interval == 0 || self.save_interval == 0 || self.eval_batches == 0 {
            return invalid("eval/save interval", "0".into(), "must be at least 1");
        }
        if let DataSource::Builtin { bytes, .. } = self.data
            && bytes < 20 * (self.model.context + 1)
        {
            return invalid(
                "corpus-bytes",
                bytes.to_string(),
                "the built-in corpus needs at least 20 windows of context + 1 bytes",
            );
        }
        if let Checkpointing::Budget(budget) = self.checkpointing {
            checkpoint_schedule(self.model.n_layers, budget)?;
        }
        Ok(())
    }
}

#[cfg(test)]
impl TrainConfig {
    /// The tiny preset on 20 kB of built-in text, 2 × 2 sequences per step: the smallest run
    /// the unit tests of several modules train.
    pub(crate) fn tiny_for_tests() -> Self {
        TrainConfig {
            data: DataSource::Builtin {
                seed: 0,
                bytes: 20_000,
            },
            micro_batch: 2,
            accum: 2,
            ..TrainConfig::for_preset(Preset::Tiny)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_default_is_valid() {
        for preset in Preset::ALL {
            let config = TrainConfig::for_preset(preset);
            config.validate().unwrap();
            assert_eq!(config.lr.total, config.steps);
        }
        // 8 rows × 4 micro-batches × 512 tokens
        assert_eq!(
            TrainConfig::for_preset(Preset::Capstone).tokens_per_step(),
            16_384
        );
    }

    #[test]
    fn out_of_range_options_are_named() {
        let base = TrainConfig::for_preset(Preset::Tiny);
        type Breaker = fn(&mut TrainConfig);
        let cases: [(&str, Breaker); 6] = [
            ("micro-batch", |c| c.micro_batch = 0),
            ("accum", |c| c.accum = 0),
            ("steps", |c| c.steps = 0),
            ("lr", |c| c.lr.peak = f64::NAN),
            ("clip", |c| c.clip = Some(-1.0)),
            ("min-lr", |c| c.lr.min = 1.0),
        ];
        for (name, break_it) in cases {
            let mut config = base.clone();
            break_it(&mut config);
            let error = config.validate().unwrap_err();
            assert!(error.to_string().contains(name), "{name}: {error}");
        }
        let mut config = base.clone();
        config.checkpointing = Checkpointing::Budget(0);
        assert!(matches!(config.validate(), Err(TrainError::Recompute(_))));
    }
}
