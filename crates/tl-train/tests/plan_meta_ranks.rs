//! The trainer's data-parallel step on meta tensors, rank by rank, against ranks that train
//! for real: rank `r` of `N` run alone on a `Phantom` (`measure_meta_rank`) sees the meter
//! events — every allocation, free and retag, with its bytes and tag, in order — and the
//! communication counters (collectives, bytes sent) that rank `r` of `N` real ranks sees
//! over the socket ring (`measure_rank`), at every ZeRO stage.
//!
//! The real ranks are threads of this test (the meter is per thread), joined by the ring.

use std::thread;
use std::time::Duration;

use tl_collective::{RingComm, RingConfig};
use tl_precision::Precision;
use tl_tensor::Module;
use tl_tensor::memory::{self, Event};
use tl_train::model::{Checkpointing, Preset};
use tl_train::plan::{
    DataParallelism, RankMeasurement, Recipe, measure_meta_rank, measure_meta_steps_on,
    measure_rank, plan_ranks,
};
use tl_train::train::{TrainConfig, Trainer};

/// The tiny preset, 2 micro-batches of 2 sequences per rank, at ZeRO stage `zero`.
fn tiny(precision: Precision, checkpointing: Checkpointing, zero: u8) -> TrainConfig {
    let mut config = TrainConfig::for_preset(Preset::Tiny);
    config.micro_batch = 2;
    config.accum = 2;
    config.precision = precision;
    config.checkpointing = checkpointing;
    config.parallel.zero = zero;
    config
}

/// What one rank saw: its measurement and every meter event of it.
type Seen = (RankMeasurement, Vec<Event>);

/// `world` real ranks, threads over a fresh socket directory, each measuring its steps.
fn real_ranks(config: &TrainConfig, world: usize) -> Vec<Seen> {
    let dir = tempfile::tempdir().unwrap();
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let ring = RingConfig::new(rank, world, dir.path(), [3; 32])
                .unwrap()
                .timeout(Duration::from_secs(60));
            let config = config.clone();
            thread::spawn(move || {
                let comm = RingComm::connect(ring).unwrap();
                let (measured, events) = memory::record(|| measure_rank(&config, Box::new(comm)));
                (measured.unwrap(), events)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Rank `rank` of `world` on meta tensors, on a thread of its own as a real rank is.
fn meta_rank(config: &TrainConfig, rank: usize, world: usize) -> Seen {
    let config = config.clone();
    thread::spawn(move || {
        let (measured, events) = memory::record(|| measure_meta_rank(&config, rank, world));
        (measured.unwrap(), events)
    })
    .join()
    .unwrap()
}

/// Every rank of `world` on meta tensors against the real ranks: the same events, the same
/// measurement, the same counters.
fn assert_meta_ranks_are_real(what: &str, config: &TrainConfig, world: usize) -> Vec<Seen> {
    let real = real_ranks(config, world);
    for (rank, (real, real_events)) in real.iter().enumerate() {
        let (meta, meta_events) = meta_rank(config, rank, world);
        let what = format!("{what}, rank {rank} of {world}");
        let first_difference = meta_events
            .iter()
            .zip(real_events)
            .position(|(meta, real)| meta != real);
        if let Some(i) = first_difference {
            let shown = i.saturating_sub(2)..(i + 3).min(meta_events.len());
            panic!(
                "{what}: event {i} differs\n meta {:#?}\n real {:#?}",
                &meta_events[shown.clone()],
                &real_events[shown.start..shown.end.min(real_events.len())]
            );
        }
        assert_eq!(meta_events.len(), real_events.len(), "{what}: event counts");
        assert_eq!(meta.memory, real.memory, "{what}: meter");
        assert_eq!(meta.comm, real.comm, "{what}: communication");
        assert!(real.comm.collectives > 0, "{what}: the steps communicate");
    }
    real
}

/// Every ZeRO stage of `world` ranks in fp32 and in bf16 with every block checkpointed
/// (ZeRO-3 then gathers each block in its forward pass and again in its rerun).
fn check_world(world: usize) {
    let recipes = [
        ("fp32", Precision::Fp32, Checkpointing::Off),
        ("bf16, per block", Precision::Bf16, Checkpointing::PerBlock),
    ];
    for zero in 0..4 {
        for (name, precision, checkpointing) in recipes {
            let config = tiny(precision, checkpointing, zero);
            assert_meta_ranks_are_real(&format!("ZeRO-{zero} {name}"), &config, world);
        }
    }
}

/// Tensor parallelism: the split step (its all-reduces in the blocks, the embedding's sum,
/// the vocabulary-parallel loss) on meta ranks as on real ones, at tp 2 and at dp 2 × tp 2,
/// at every ZeRO stage, in fp32 and in bf16 with every block checkpointed (the rerun
/// all-reduces again; at ZeRO-3 it gathers the block's slices over the data-parallel group
/// again too).
#[test]
fn tensor_parallel_meta_ranks_step_as_real_ranks() {
    for (world, tensor) in [(2, 2), (4, 2)] {
        for zero in 0..4 {
            for (name, precision, checkpointing) in [
                ("fp32", Precision::Fp32, Checkpointing::Off),
                ("bf16, per block", Precision::Bf16, Checkpointing::PerBlock),
            ] {
                let mut config = tiny(precision, checkpointing, zero);
                config.parallel.tensor = tensor;
                let what = format!("tp {tensor} ZeRO-{zero} {name}");
                assert_meta_ranks_are_real(&what, &config, world);
            }
        }
    }
}

/// Sequence parallelism: the same split step with the residual stream as each rank's rows
/// of the tokens (the gathers and scatters in the blocks, the gains' gradients summed over
/// the group) on meta ranks as on real ones, at tp 2 and at dp 2 × tp 2, every ZeRO stage,
/// in fp32, in bf16 with every block checkpointed, and with dropout's masks on the rows.
///
/// It takes memory from each rank: the real ranks' metered peak of a steady step is
/// below the plain split's.
#[test]
fn sequence_parallel_meta_ranks_step_as_real_ranks_on_less_memory() {
    for (world, tensor) in [(2, 2), (4, 2)] {
        for zero in 0..4 {
            for (name, precision, checkpointing, dropout) in [
                ("fp32", Precision::Fp32, Checkpointing::Off, 0.0),
                (
                    "bf16, per block",
                    Precision::Bf16,
                    Checkpointing::PerBlock,
                    0.0,
                ),
                ("fp32, dropout", Precision::Fp32, Checkpointing::Off, 0.1),
            ] {
                let mut config = tiny(precision, checkpointing, zero);
                config.model.dropout = dropout;
                config.parallel.tensor = tensor;
                config.parallel.sequence_parallel = true;
                let what = format!("tp {tensor} of {world} ZeRO-{zero} {name}, sequence parallel");
                let sequence = assert_meta_ranks_are_real(&what, &config, world);
                if world != 2 || zero != 0 {
                    continue;
                }
                config.parallel.sequence_parallel = false;
                let plain = real_ranks(&config, world);
                for (rank, (sequence, plain)) in sequence.iter().zip(&plain).enumerate() {
                    let (with, without) = (sequence.0.memory, plain.0.memory);
                    eprintln!(
                        "tiny, {name}, tp 2, rank {rank}: peak {} B with sequence \
                         parallelism, {} B without (first step {} B, {} B)",
                        with.peak_bytes,
                        without.peak_bytes,
                        with.first_step_peak_bytes,
                        without.first_step_peak_bytes
                    );
                    assert!(with.peak_bytes < without.peak_bytes, "{what}, rank {rank}");
                }
            }
        }
    }
}

/// fp8 on ranks: after each step the amaxes and range counts are all-reduced over every
/// rank of the run, on meta ranks as on real ones, at dp 2 and dp 2 × tp 2, and the plan
/// names that call: one a step, `3L + 6L·N` doubles for `L` fp8 layers on `N` ranks.
#[test]
fn fp8_meta_ranks_make_their_amaxes_global_as_real_ranks_and_the_plan_says_so() {
    for (world, tensor) in [(2, 1), (4, 2)] {
        let mut config = tiny(Precision::Fp32, Checkpointing::Off, 0);
        config.fp8 = Some(tl_precision::Fp8Recipe::default());
        config.parallel.tensor = tensor;
        let what = format!("fp8, {world} ranks, tp {tensor}");
        assert_meta_ranks_are_real(&what, &config, world);
        let parallelism = DataParallelism::new(world, 0)
            .unwrap()
            .with_tensor(tensor)
            .unwrap();
        let plan = plan_ranks(&Recipe::from(&config), &parallelism).unwrap();
        let layers = 7 * config.model.n_layers as u64;
        for rank in &plan.ranks {
            let fp8: Vec<_> = rank
                .sent
                .iter()
                .filter(|sent| sent.calls.purpose == "fp8 amaxes and counts")
                .collect();
            assert_eq!(fp8.len(), 1, "{what}: {:?}", rank.sent);
            let calls = fp8[0].calls;
            assert_eq!(
                (calls.calls, calls.elements, calls.element_bytes),
                (1, 3 * layers + 6 * layers * world as u64, 8),
                "{what}"
            );
            assert!(fp8[0].bytes > 0, "{what}");
        }
    }
}

#[test]
fn two_meta_ranks_step_as_two_real_ranks_at_every_stage() {
    check_world(2);
}

#[test]
fn three_meta_ranks_step_as_three_real_ranks_at_every_stage() {
    // Three ranks: shards of unequal lengths, and a bucket's chunks not all the same.
    check_world(3);
}

#[test]
fn buckets_of_16_kib_split_on_meta_ranks_as_on_real_ones() {
    for zero in 0..4 {
        let mut config = tiny(Precision::Fp32, Checkpointing::Off, zero);
        let whole = assert_meta_ranks_are_real(&format!("ZeRO-{zero}"), &config, 3);
        config.parallel.bucket_bytes = 16 << 10;
        let split = assert_meta_ranks_are_real(&format!("ZeRO-{zero}, 16 KiB"), &config, 3);
        // The tiny model (133,440 floats) is one bucket of 25 MiB and 33 of 16 KiB: more
        // collectives, except at ZeRO-3, whose units are not bucketed.
        let calls = |seen: &[Seen]| seen[0].0.comm.collectives;
        if zero < 3 {
            assert!(calls(&split) > calls(&whole), "ZeRO-{zero}: buckets split");
        } else {
            assert_eq!(calls(&split), calls(&whole), "ZeRO-3 has no buckets");
        }
    }
}

#[test]
fn a_meta_rank_of_a_large_world_is_measured_as_its_phantom_counts() {
    // Rank 1000 of 1024 under ZeRO-3 holds a 1024th of each unit's weights between uses.
    let config = tiny(Precision::Bf16, Checkpointing::PerBlock, 3);
    let large = measure_meta_steps_on(&config, 1000, 1024).unwrap();
    let small = measure_meta_steps_on(&config, 1, 2).unwrap();
    assert!(large.between_steps_bytes < small.between_steps_bytes);
    assert!(measure_meta_steps_on(&config, 2, 2).is_err());
}

#[test]
fn a_meta_rank_holds_shapes_and_no_values_at_every_stage() {
    for zero in 0..4 {
        let config = tiny(Precision::Bf16, Checkpointing::PerBlock, zero);
        let _meta = tl_tensor::meta_mode();
        let phantom = tl_collective::Phantom::new(1, 3).unwrap();
        let mut trainer = Trainer::meta_on(config, Box::new(phantom)).unwrap();
        for _ in 0..2 {
            trainer.train_step().unwrap();
        }
        let parameters = trainer.model().parameters();
        assert!(
            parameters
                .iter()
                .all(|p| p.is_meta() && p.value().is_empty()),
            "ZeRO-{zero}"
        );
        // ZeRO-3 keeps a unit's weights only while it computes.
        assert_eq!(parameters.iter().all(|p| p.is_released()), zero == 3);
        assert_eq!((trainer.step(), trainer.world_size()), (2, 3));
    }
}

#[test]
fn the_plan_counts_the_extras_tl_parallel_appends() {
    assert_eq!(tl_train::plan::STEP_EXTRAS, tl_parallel::STEP_EXTRAS as u64);
}
