//! The recipes a capstone step is timed in, by name: what `cargo bench -p tl-train --bench
//! step` measures and `tinyllm bench --paired A,B` compares.

use tl_precision::{Accumulation, Fp8Recipe, Precision};

use super::TrainConfig;
use crate::model::{Checkpointing, Preset};

/// One way to take a training step: the arithmetic of the matmuls and whether the blocks
/// are checkpointed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepRecipe {
    /// The name the benchmark reports and `tinyllm bench --paired` accepts, e.g. `bf16+ckpt`.
    pub name: &'static str,
    /// fp32, or emulated bf16/fp16 autocast.
    pub precision: Precision,
    /// Per-block activation checkpointing, or none.
    pub checkpointing: Checkpointing,
    /// The blocks' linear layers in fp8 with delayed scaling (the default recipe, as
    /// `tinyllm train --fp8`), on top of `precision` for the other products.
    pub fp8: bool,
    /// How the 16-bit products add up (`--accumulate`): f32 but for `bf16+amx`.
    pub accumulation: Accumulation,
}

/// Every timed recipe: plain fp32, the two emulated 16-bit formats, per-block checkpointing
/// with fp32 and with bf16, fp32 under the two other checkpoint policies, fp8 (the blocks'
/// linear layers in fp8, the other products in fp32, as `tinyllm train --fp8`), and bf16 in
/// the AMX tiles' order (`--bf16 --accumulate amx`).
pub const STEP_RECIPES: [StepRecipe; 9] = [
    StepRecipe::new("fp32", Precision::Fp32, Checkpointing::Off),
    StepRecipe::new("bf16", Precision::Bf16, Checkpointing::Off),
    StepRecipe::new("fp16", Precision::Fp16, Checkpointing::Off),
    StepRecipe::new("fp32+ckpt", Precision::Fp32, Checkpointing::PerBlock),
    StepRecipe::new("bf16+ckpt", Precision::Bf16, Checkpointing::PerBlock),
    StepRecipe::new("fp32+ckpt-matmuls", Precision::Fp32, Checkpointing::Matmuls),
    StepRecipe::new(
        "fp32+ckpt-first-matmul",
        Precision::Fp32,
        Checkpointing::FirstMatmul,
    ),
    StepRecipe::new("fp8", Precision::Fp32, Checkpointing::Off).with_fp8(),
    StepRecipe::new("bf16+amx", Precision::Bf16, Checkpointing::Off).on(Accumulation::Amx),
];

impl StepRecipe {
    const fn new(name: &'static str, precision: Precision, checkpointing: Checkpointing) -> Self {
        Self {
            name,
            precision,
            checkpointing,
            fp8: false,
            accumulation: Accumulation::F32,
        }
    }

    const fn with_fp8(self) -> Self {
        Self { fp8: true, ..self }
    }

    const fn on(self, accumulation: Accumulation) -> Self {
        Self {
            accumulation,
            ..self
        }
    }

    /// The recipe called `name` in [`STEP_RECIPES`], if there is one.
    ///
    /// ```
    /// use tl_train::train::StepRecipe;
    /// assert_eq!(StepRecipe::named("bf16+ckpt").unwrap().name, "bf16+ckpt");
    /// assert!(StepRecipe::named("bf32").is_none());
    /// ```
    pub fn named(name: &str) -> Option<Self> {
        STEP_RECIPES.into_iter().find(|recipe| recipe.name == name)
    }

    /// The config `tinyllm train --preset capstone --micro-batch 8 --accum 1` builds with
    /// this recipe's flags (`--bf16`/`--fp16`, `--checkpoint-activations`, `--fp8`,
    /// `--accumulate`): one optimizer step of 8 × 512 = 4096 tokens.
    pub fn capstone_config(&self) -> TrainConfig {
        let mut config = TrainConfig::for_preset(Preset::Capstone);
        config.precision = self.precision;
        config.micro_batch = 8;
        config.accum = 1;
        config.checkpointing = self.checkpointing;
        config.fp8 = self.fp8.then(Fp8Recipe::default);
        config.accumulation = self.accumulation;
        config
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_recipe_is_valid_and_found_by_its_name() {
        for recipe in STEP_RECIPES {
            assert_eq!(StepRecipe::named(recipe.name), Some(recipe));
            let config = recipe.capstone_config();
            config.validate().expect("a valid recipe");
            assert_eq!((config.micro_batch, config.accum), (8, 1));
            assert_eq!(config.precision, recipe.precision);
            assert_eq!(config.checkpointing, recipe.checkpointing);
            assert_eq!(config.fp8.is_some(), recipe.fp8);
        }
    }
}
