//! The trainer's own step on meta tensors against the same step with values: every recipe
//! `train` accepts gives the same peaks and live bytes, to the byte.

use tl_precision::{Accumulation, Fp8Recipe, Precision};
use tl_tensor::Module;
use tl_train::model::head_loss::ChunkedLoss;
use tl_train::model::{Checkpointing, Preset};
use tl_train::plan::{measure_meta_steps, measure_steps};
use tl_train::train::{DataSource, TrainConfig};

fn tiny(precision: Precision, checkpointing: Checkpointing) -> TrainConfig {
    let mut config = TrainConfig::for_preset(Preset::Tiny);
    config.data = DataSource::Builtin {
        seed: 0,
        bytes: 20_000,
    };
    config.micro_batch = 2;
    config.accum = 2;
    config.precision = precision;
    config.checkpointing = checkpointing;
    config
}

fn assert_meta_is_real(what: &str, config: &TrainConfig) {
    let real = measure_steps(config).unwrap();
    let meta = measure_meta_steps(config).unwrap();
    assert_eq!(meta, real, "{what}: meta run against the real meter");
}

#[test]
fn plain_steps_are_measured_exactly_on_meta_tensors() {
    for precision in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
        assert_meta_is_real(
            &format!("{precision:?}"),
            &tiny(precision, Checkpointing::Off),
        );
    }
    let mut one_batch = tiny(Precision::Fp32, Checkpointing::Off);
    one_batch.accum = 1;
    assert_meta_is_real("no accumulation", &one_batch);
}

#[test]
fn every_checkpoint_policy_is_measured_exactly_on_meta_tensors() {
    for policy in Checkpointing::POLICIES {
        assert_meta_is_real(&format!("{policy:?}"), &tiny(Precision::Bf16, policy));
    }
    // tl-recompute's optimal schedule: 3 stored inputs for 5 blocks.
    let mut budget = tiny(Precision::Fp32, Checkpointing::Budget(3));
    budget.model.n_layers = 5;
    assert_meta_is_real("budget", &budget);
}

#[test]
fn fp8_and_tensor_core_recipes_are_measured_exactly_on_meta_tensors() {
    let mut fp8 = tiny(Precision::Bf16, Checkpointing::PerBlock);
    fp8.fp8 = Some(Fp8Recipe::default());
    assert_meta_is_real("fp8", &fp8);
    let mut h100 = tiny(Precision::Bf16, Checkpointing::Off);
    h100.accumulation = Accumulation::H100;
    assert_meta_is_real("--accumulate h100", &h100);
}

#[test]
fn grouped_queries_and_a_tied_head_are_measured_exactly_on_meta_tensors() {
    for (n_kv_heads, tie_embeddings) in [(1, false), (2, true)] {
        let mut config = tiny(Precision::Bf16, Checkpointing::PerBlock);
        config.model.n_kv_heads = Some(n_kv_heads);
        config.model.tie_embeddings = tie_embeddings;
        assert_meta_is_real(
            &format!("{n_kv_heads} kv heads, tied {tie_embeddings}"),
            &config,
        );
    }
}

#[test]
fn the_chunked_loss_is_measured_exactly_on_meta_tensors() {
    // A vocabulary of 8·d and more: the logits are recomputed in backward, none kept.
    for precision in [Precision::Fp32, Precision::Bf16] {
        let mut config = tiny(precision, Checkpointing::PerBlock);
        config.model.vocab = 1024;
        config.chunked_loss = ChunkedLoss::On;
        assert_meta_is_real(&format!("chunked loss, {precision:?}"), &config);
        config.chunked_loss = ChunkedLoss::Off;
        assert_meta_is_real(&format!("logits kept, {precision:?}"), &config);
    }
}

#[test]
fn dropout_and_clipping_are_measured_exactly_on_meta_tensors() {
    let mut config = tiny(Precision::Fp16, Checkpointing::PerBlock);
    config.model.dropout = 0.1;
    config.clip = Some(1.0);
    assert_meta_is_real("dropout, clip", &config);
}

#[test]
fn a_meta_trainer_holds_shapes_and_no_values() {
    let config = tiny(Precision::Bf16, Checkpointing::PerBlock);
    let _meta = tl_tensor::meta_mode();
    let mut trainer =
        tl_train::train::Trainer::meta_on(config, Box::new(tl_collective::Single::new())).unwrap();
    let parameters = trainer.model().parameters();
    assert!(!parameters.is_empty());
    assert!(
        parameters
            .iter()
            .all(|p| p.is_meta() && p.value().is_empty())
    );
    trainer.train_step().unwrap();
    assert!(parameters.iter().all(|p| p.is_meta()));
    assert_eq!(trainer.step(), 1);
}
