//! One full optimizer step of the capstone (10,327,360 parameters, micro-batch 8 × context
//! 512 = 4096 tokens, accumulation 1) in each precision mode, in tokens/s.
//!
//! Each benchmark times `Trainer::train_step`, the very call `tinyllm train` makes once per
//! step, on the config `tinyllm train --preset capstone [--bf16|--fp16]
//! [--checkpoint-activations] --micro-batch 8 --accum 1` builds: drawing the micro-batch,
//! forward, backward, gradient clipping, the loss scaler's check (fp16) and the AdamW update,
//! plus the one flushed line of `metrics.jsonl`. Evaluation and checkpoints happen only in
//! `Trainer::run`, so none happens inside the timed loop. The modes:
//!
//! - `fp32`: plain f32.
//! - `bf16`: matmuls under emulated bf16 autocast.
//! - `fp16`: matmuls under emulated fp16 autocast, with dynamic loss scaling (a step whose
//!   gradients overflow skips the AdamW update; the bench reports how many did).
//! - `fp32+ckpt`, `bf16+ckpt`: as `fp32`/`bf16`, with per-block activation checkpointing.
//! - `fp8`: the blocks' linear layers in fp8 with delayed scaling (`--fp8`), the other
//!   products in fp32.
//!
//! The caching global allocator of the `tinyllm` binary is installed, so the figures match
//! the binary's. A step takes several seconds: each mode warms up with one step (which also
//! fills the allocator's cache) and then times 10 samples of one step each (flat sampling),
//! about 11 steps per mode and under 6 minutes for all five on two cores. Criterion warns
//! that it cannot complete 10 samples in the target time; that is expected with one step
//! per sample. Throughput is counted as 4096 tokens per step, so criterion's "elem/s" reads
//! as tokens/s.
//!
//! Run: `cargo bench -p tl-train --bench step` (all modes), or with a filter on the mode,
//! e.g. `cargo bench -p tl-train --bench step -- bf16` (matches `bf16` and `bf16+ckpt`).

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use tl_train::train::{Record, STEP_RECIPES, StepRecipe, Trainer};

/// As in `src/main.rs`: large freed buffers are kept for the next step instead of being
/// page-faulted in afresh.
#[global_allocator]
static ALLOCATOR: tl_tensor::alloc::CachingAllocator = tl_tensor::alloc::CachingAllocator;

/// A fresh run of the mode in a temporary directory (kept alive as long as the trainer).
struct Run {
    trainer: Trainer,
    skipped: usize,
    steps: usize,
    _dir: tempfile::TempDir,
}

impl Run {
    fn new(recipe: StepRecipe) -> Self {
        let dir = tempfile::tempdir().expect("a temporary run directory");
        let config = recipe.capstone_config();
        let trainer = Trainer::new(config, &dir.path().join("run")).expect("a new capstone run");
        Self {
            trainer,
            skipped: 0,
            steps: 0,
            _dir: dir,
        }
    }

    /// One optimizer step, exactly as `Trainer::run` takes it.
    fn step(&mut self) {
        let record = self.trainer.train_step().expect("the step succeeds");
        if let Record::Train { skipped, .. } = &record {
            self.skipped += usize::from(*skipped);
        }
        self.steps += 1;
        black_box(record);
    }
}

fn training_step(c: &mut Criterion) {
    let tokens = STEP_RECIPES[0].capstone_config().tokens_per_step() as u64;
    let mut group = c.benchmark_group("capstone_step_8x512");
    group
        .throughput(Throughput::Elements(tokens))
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        // Shorter than one step: the warm-up is a single step.
        .warm_up_time(Duration::from_secs(1))
        // 2 s per sample: one step per sample for any step longer than 2 s.
        .measurement_time(Duration::from_secs(20));
    for recipe in STEP_RECIPES {
        let name = recipe.name;
        // Built on the first call (criterion calls the routine once per sample, and not at
        // all for a mode the filter excludes), outside the timed region.
        let mut run: Option<Run> = None;
        group.bench_function(name, |b| {
            let run = run.get_or_insert_with(|| Run::new(recipe));
            b.iter(|| run.step());
        });
        if let Some(run) = run
            && run.skipped > 0
        {
            eprintln!(
                "{name}: {} of {} steps skipped the update (loss-scale overflow)",
                run.skipped, run.steps
            );
        }
    }
    group.finish();
}

criterion_group!(benches, training_step);
criterion_main!(benches);
