//! The plan against closed forms worked by hand, and the meta run it makes against the real
//! step's meter, event for event.

use tl_precision::Precision;
use tl_tensor::memory::{self, Event};

use super::*;
use crate::model::{Checkpointing, ModelConfig, Preset};
use crate::train::{DataSource, TrainConfig, Trainer};

/// B = 2 sequences of T = 16 tokens, d = 16, H = 2 heads, hidden h = 24, L = 4 blocks,
/// V = 256: N = B·T = 32 tokens, so N·d = 512, N·h = 768 and N·V = 8192 floats.
fn micro_config(precision: Precision, checkpointing: Checkpointing, dropout: f64) -> TrainConfig {
    let mut config = TrainConfig::for_preset(Preset::Tiny);
    config.model = ModelConfig {
        vocab: 256,
        d_model: 16,
        n_layers: 4,
        n_heads: 2,
        hidden: 24,
        context: 16,
        norm_eps: 1e-5,
        rope_base: 10_000.0,
        dropout,
        n_kv_heads: None,
        tie_embeddings: false,
    };
    config.data = DataSource::Builtin {
        seed: 0,
        bytes: 4_000,
    };
    config.micro_batch = 2;
    config.accum = 2;
    config.precision = precision;
    config.checkpointing = checkpointing;
    // V = 16·d would chunk the loss: these closed forms keep the logits.
    config.chunked_loss = crate::model::head_loss::ChunkedLoss::Off;
    config
}

fn predict(config: &TrainConfig) -> StepPrediction {
    predict_step(&Recipe::from(config)).unwrap()
}

fn saved_in(prediction: &StepPrediction, keep: impl Fn(Layer) -> bool) -> u64 {
    prediction
        .saved
        .iter()
        .filter(|s| keep(s.layer))
        .map(|s| s.bytes)
        .sum()
}

#[test]
fn an_fp32_block_saves_eight_nd_and_three_nh() {
    let prediction = predict(&micro_config(Precision::Fp32, Checkpointing::Off, 0.0));
    // 8·512 + 3·768 = 6400 floats = 25,600 bytes, the same in every block.
    for i in 0..4 {
        assert_eq!(saved_in(&prediction, |l| l == Layer::Block(i)), 25_600);
    }
    // Final norm input and head input (2·512) + logits copy (8192) = 9216 floats, and the
    // loss with its weighted copy (2 floats): 36,872 bytes.
    assert_eq!(saved_in(&prediction, |l| l == Layer::Head), 36_872);
    assert_eq!(prediction.saved_total(), 4 * 25_600 + 36_872);
}

#[test]
fn autocast_adds_rounded_copies_of_the_projection_inputs_and_weights() {
    let prediction = predict(&micro_config(Precision::Bf16, Checkpointing::Off, 0.0));
    // As in fp32, the norms' inputs (1024) and what the fused attention and gate keep in
    // f32 (q, k, v: 1536; gate and up: 1536), and what the projections read, rounded where
    // it was made rather than copied: the first norm's output, shared by q, k and v, the
    // attention's output, the second norm's output, shared by gate and up, and the gate's
    // output (3·512 + 768 = 2304). Only the weights are copied, rounded
    // (4d² + 3dh = 2176): 8,576 floats.
    assert_eq!(saved_in(&prediction, |l| l == Layer::Block(0)), 34_304);
    // As in fp32: 512 + the head input (the final norm's output, rounded as it is written)
    // 512 + the logits 8192, and the two loss floats. The fused head and loss rounds its
    // weight into working memory in each pass, as the attention kernel keeps its blocks:
    // no rounded copy of the weight is kept.
    assert_eq!(saved_in(&prediction, |l| l == Layer::Head), 36_872);
}

#[test]
fn the_chunked_loss_keeps_no_logits() {
    let mut config = micro_config(Precision::Fp32, Checkpointing::Off, 0.0);
    config.chunked_loss = crate::model::head_loss::ChunkedLoss::On;
    let chunked = predict(&config);
    // The final norm's input and output (2·512 floats) and the two loss floats: the 8192
    // logits are recomputed in backward, 64 rows at a time.
    assert_eq!(saved_in(&chunked, |l| l == Layer::Head), 4_104);
    let kept = predict(&micro_config(Precision::Fp32, Checkpointing::Off, 0.0));
    assert!(chunked.peak_bytes < kept.peak_bytes);
    // Auto chunks at V ≥ 8·d: V = 256 is 16·d here.
    config.chunked_loss = crate::model::head_loss::ChunkedLoss::Auto;
    assert_eq!(predict(&config), chunked);
}

#[test]
fn per_block_checkpointing_keeps_block_inputs_and_the_last_block_whole() {
    let prediction = predict(&micro_config(Precision::Fp32, Checkpointing::PerBlock, 0.0));
    // Blocks 0..3 keep their inputs and their attention outputs, which the rerun reuses
    // (512 floats each); the last segment is not checkpointed, so block 3 keeps all 6400
    // floats.
    for i in 0..3 {
        assert_eq!(saved_in(&prediction, |l| l == Layer::Block(i)), 2 * 2_048);
    }
    assert_eq!(saved_in(&prediction, |l| l == Layer::Block(3)), 25_600);
    assert!(
        prediction.peak_bytes
            < predict(&micro_config(Precision::Fp32, Checkpointing::Off, 0.0)).peak_bytes
    );
}

#[test]
fn each_keep_policy_adds_its_kept_products_to_a_checkpointed_blocks_bytes() {
    // Per block: the input and the attention's output (2·512 floats). Keeping x·Wq adds 512;
    // keeping every product adds q, k, v, o (4·512) and gate, up (2·768) and w2's output
    // (512): 5·512 + 2·768. The last block is not checkpointed and keeps all 6400 floats.
    for (checkpointing, floats) in [
        (Checkpointing::PerBlock, 2 * 512),
        (Checkpointing::FirstMatmul, 3 * 512),
        (Checkpointing::Matmuls, 7 * 512 + 2 * 768),
    ] {
        let prediction = predict(&micro_config(Precision::Fp32, checkpointing, 0.0));
        for i in 0..3 {
            assert_eq!(
                saved_in(&prediction, |l| l == Layer::Block(i)),
                4 * floats,
                "{checkpointing}, block {i}"
            );
        }
        assert_eq!(saved_in(&prediction, |l| l == Layer::Block(3)), 25_600);
    }
}

#[test]
fn the_meta_run_holds_for_every_keep_policy_under_autocast_and_dropout() {
    // The kept products are taken back under autocast (their rounded copies and cast nodes
    // recorded again, nothing multiplied) and with dropout's masks drawn again.
    for checkpointing in [Checkpointing::Matmuls, Checkpointing::FirstMatmul] {
        assert_same_timeline(&micro_config(Precision::Bf16, checkpointing, 0.1));
        assert_same_timeline(&micro_config(Precision::Fp32, checkpointing, 0.0));
    }
}

#[test]
fn plain_adamw_updates_in_place_and_zero_one_copies_and_gathers() {
    let config = micro_config(Precision::Fp32, Checkpointing::Off, 0.0);
    assert_eq!(predict(&config).update_extra_bytes, 0);
    let mut zero1 = config.clone();
    zero1.parallel.zero = 1;
    let (zero1, _) = super::ledger::predict_rank(&zero1, 0, 1).unwrap();
    // ZeRO-1 copies the gradients into its pieces and gathers the updated weights.
    assert!(zero1.update_extra_bytes > 0);
}

#[test]
fn between_steps_the_model_holds_twelve_bytes_per_parameter() {
    let config = micro_config(Precision::Fp32, Checkpointing::Off, 0.0);
    let parameters = config.model.num_parameters() as u64;
    let prediction = predict(&config);
    // Weights and moments: the trainer drops the gradients after each update.
    assert_eq!(prediction.between_steps_bytes, 12 * parameters);
    // With two micro-batches the peak of step 1 falls in the second one, like step 2's,
    // only without the moments.
    assert_eq!(
        prediction.peak_bytes - prediction.first_step_peak_bytes,
        8 * parameters
    );
}

#[test]
fn a_budget_with_no_schedule_is_refused() {
    // Four blocks need a budget of 3: 2·3/2 = 3 < 4 ≤ 3·4/2.
    let config = micro_config(Precision::Fp32, Checkpointing::Budget(2), 0.0);
    assert!(matches!(
        predict_step(&Recipe::from(&config)),
        Err(crate::TrainError::Recompute(_))
    ));
}

/// The meter's events (tags included) of a trainer's second step: a real trainer, or with
/// `meta`, the trainer on meta tensors that the plan runs.
fn second_step_events(config: &TrainConfig, meta: bool) -> Vec<Event> {
    let dir = tempfile::tempdir().unwrap();
    let _meta = meta.then(tl_tensor::meta_mode);
    let mut trainer = if meta {
        Trainer::meta_on(config.clone(), Box::new(tl_collective::Single::new())).unwrap()
    } else {
        Trainer::new(config.clone(), &dir.path().join("run")).unwrap()
    };
    trainer.train_step().unwrap();
    let (record, events) = memory::record(|| trainer.train_step().unwrap());
    assert!(matches!(
        record,
        crate::train::Record::Train { skipped: false, .. }
    ));
    events
        .into_iter()
        .map(|e| Event { live_after: 0, ..e })
        .collect()
}

/// The meta run allocates and frees what the real step does, event for event, with the
/// same tags.
fn assert_same_timeline(config: &TrainConfig) {
    let predicted = second_step_events(config, true);
    let measured = second_step_events(config, false);
    let first_difference = predicted.iter().zip(&measured).position(|(p, m)| p != m);
    assert_eq!(
        (first_difference, predicted.len()),
        (None, measured.len()),
        "first differing event, then the event counts"
    );
}

#[test]
fn the_meta_run_replays_the_meters_timeline_event_for_event() {
    assert_same_timeline(&micro_config(Precision::Fp32, Checkpointing::Off, 0.0));
}

#[test]
fn the_meta_run_holds_under_autocast_dropout_and_a_checkpoint_budget() {
    // Budget 3 on 4 blocks: segments [1, 3], the first one checkpointed.
    assert_same_timeline(&micro_config(
        Precision::Bf16,
        Checkpointing::Budget(3),
        0.1,
    ));
    assert_same_timeline(&micro_config(Precision::Fp16, Checkpointing::PerBlock, 0.0));
}

#[test]
fn the_parallel_plan_of_stages_0_and_1_is_the_single_step_split_by_term() {
    let config = micro_config(Precision::Fp32, Checkpointing::Off, 0.0);
    let recipe = Recipe::from(&config);
    let p = config.model.num_parameters() as u64;
    let single = predict_step(&recipe).unwrap();
    let ddp = plan_ranks(&recipe, &DataParallelism::new(3, 0).unwrap()).unwrap();
    for rank in &ddp.ranks {
        // A DDP rank's meter sees the single process's step.
        assert_eq!(rank.peak_bytes, single.peak_bytes);
        assert_eq!(
            rank.first_step_peak_bytes,
            Some(single.first_step_peak_bytes)
        );
    }
    let zero1 = plan_ranks(&recipe, &DataParallelism::new(3, 1).unwrap()).unwrap();
    for rank in &zero1.ranks {
        // The moments 8P are replaced by 12 bytes per element of the rank's shard.
        let shard = tl_collective::shard_range(p as usize, 3, rank.rank).len() as u64;
        assert_eq!(rank.peak_bytes, single.peak_bytes - 8 * p + 12 * shard);
        assert_eq!(rank.optimizer_bytes, 12 * shard);
    }
    // On one rank, nothing is sent.
    let alone = plan_ranks(&recipe, &DataParallelism::new(1, 1).unwrap()).unwrap();
    assert_eq!(alone.rank0().sent_bytes, 0);
}

#[test]
fn a_7b_shape_plans_fast_with_its_real_vocabulary() {
    let mut config = TrainConfig::for_preset(crate::model::Preset::Tiny);
    config.model = PlanShape::Llama7b.config();
    (config.micro_batch, config.accum) = (1, 1);
    (config.precision, config.checkpointing) = (Precision::Fp32, Checkpointing::Off);
    let recipe = Recipe::from(&config);
    let started = std::time::Instant::now();
    let plan = plan_ranks(&recipe, &DataParallelism::new(1024, 3).unwrap()).unwrap();
    assert!(started.elapsed().as_secs_f64() < 1.0);
    // The head's logits alone are 4096 tokens × 32,000 × 4 bytes.
    assert!(plan.rank0().activations_bytes > 4096 * 32_000 * 4);
    assert_eq!(plan.sizes.parameters, 6_738_415_616);
    assert_eq!(plan.ranks.len(), 1);
}

#[test]
fn every_call_a_rank_makes_sends_what_the_ring_sends() {
    // The plan's bytes are what the phantom counted, call by call: the ring's arithmetic.
    for checkpointing in [Checkpointing::Off, Checkpointing::PerBlock] {
        let recipe = Recipe::from(&micro_config(Precision::Fp32, checkpointing, 0.0));
        for stage in ZeroStage::ALL {
            for bucket_bytes in [BUCKET_BYTES, 16 << 10] {
                let parallelism = DataParallelism {
                    bucket_bytes,
                    ..DataParallelism::new(3, stage.index()).unwrap()
                };
                let plan = plan_ranks(&recipe, &parallelism).unwrap();
                for rank in &plan.ranks {
                    for sent in &rank.sent {
                        let c = sent.calls;
                        let one = ring_bytes_sent(
                            c.collective,
                            c.elements,
                            c.element_bytes,
                            3,
                            rank.rank,
                        );
                        assert_eq!(sent.bytes, c.calls * one, "stage {stage}: {}", c.purpose);
                    }
                    let total: u64 = rank.sent.iter().map(|s| s.bytes).sum();
                    assert_eq!(total, rank.sent_bytes);
                    assert!(stage == ZeroStage::Ddp || total > 0 || plan.ranks.len() == 1);
                }
            }
        }
    }
}
