//! The pre-flight memory check: what the process will hold while it trains, against what
//! it can be given, before anything is allocated.
//!
//! The tensors come from the memory plan, exact against tl-tensor's meter. The rest is what
//! the meter does not see, each term from reading the code and measured against the
//! process's peak resident memory (`tests/process_memory.rs`): the training text, the
//! whole optimizer state that ZeRO gathers to write a checkpoint, and the program itself
//! (code, threads, the kernels' packing buffers, small allocations). A checkpoint of a
//! whole optimizer, and a resume, stream tensor by tensor: they add no term (a resume
//! holds the weights, the moments and two of the largest tensor at most, under a step's
//! weights, gradients and moments for any model whose largest tensor is at most half
//! of it).

use super::config::{DataSource, TrainConfig};
use crate::error::{Result, TrainError};
use tl_parallel::ZeroStage;

/// What a process outside its tensors holds at least: the program's code and data, its
/// threads' stacks, the GEMM's packing buffers, the allocator's small blocks. Measured at
/// 40 to 60 MiB for a training process on 2 threads.
pub const RUNTIME_BYTES: u64 = 96 << 20;

/// The margin of the check over the sum of its terms, in percent: the allocator's cache of
/// freed blocks and fragmentation live in it.
pub const MARGIN_PERCENT: u64 = 10;

/// The memory a training process of a config will hold at its peak, by kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessMemory {
    /// Live tensors at the rank's step peak, as the plan predicts them: the trainer's own
    /// step on meta tensors (so every recipe `train` accepts is counted as it runs, and a
    /// ZeRO rank's shards as that rank holds them).
    pub tensors: u64,
    /// The training and validation text, held as bytes.
    pub corpus: u64,
    /// The whole optimizer state a ZeRO run gathers to write a checkpoint (or, at the
    /// start, shards): `24 P (1 + 1/N) + 8 P` bytes for `P` parameters on `N` ranks, 4
    /// bytes a parameter more at stage 3 (the weights gathered for the file); 0 without
    /// ZeRO.
    pub checkpoint: u64,
    /// [`RUNTIME_BYTES`].
    pub runtime: u64,
}

impl ProcessMemory {
    /// The prediction for rank 0 of `config`'s ranks (its `parallel.zero` stage included).
    ///
    /// # Errors
    /// Those of the memory plan for a recipe it cannot plan.
    pub fn of(config: &TrainConfig) -> Result<Self> {
        Self::of_rank(config, 0)
    }

    /// The prediction for rank `rank` of `config`'s `parallel.ranks`: the trainer's own
    /// step on meta tensors, as that rank of a phantom world, at the config's ZeRO stage.
    ///
    /// # Errors
    /// Those of the memory plan for a recipe it cannot plan.
    pub fn of_rank(config: &TrainConfig, rank: usize) -> Result<Self> {
        let parameters = config.model.num_parameters() as u64;
        let ranks = config.parallel.ranks.max(1);
        let tensors = crate::plan::predict_rank(config, rank.min(ranks - 1), ranks)?
            .0
            .peak_bytes;
        let corpus = match &config.data {
            DataSource::Builtin { bytes, .. } => *bytes as u64,
            // Files are tokenized into a memory-mapped cache, which the kernel pages in and
            // out: what the process holds is the reader's chunk of text and its ids (at most
            // four bytes an id, one id a byte).
            DataSource::File { .. } => 5 * crate::data::DEFAULT_CHUNK_BYTES as u64,
        };
        // ZeRO's `full_state` holds the rank's shard as `f64` and `f32` (24 bytes a
        // parameter of the shard), the gathered moments as `f32` and as `f64` (24 bytes a
        // parameter); a resume holds the whole moments once more before it shards them
        // (8 bytes); at stage 3 the weights are gathered for the file too (4 bytes).
        let ranks = ranks as u64;
        let gathered = parameters.saturating_mul(24);
        let resumed = parameters.saturating_mul(8);
        let checkpoint = match ZeroStage::try_from(config.parallel.zero)? {
            ZeroStage::Ddp => 0,
            ZeroStage::Optimizer | ZeroStage::Gradients => gathered
                .saturating_add(gathered / ranks)
                .saturating_add(resumed),
            ZeroStage::Parameters => gathered
                .saturating_add(gathered / ranks)
                .saturating_add(resumed)
                .saturating_add(parameters.saturating_mul(4)),
        };
        Ok(Self {
            tensors,
            corpus,
            checkpoint,
            runtime: RUNTIME_BYTES,
        })
    }

    /// The bytes the check asks for: the terms' sum and [`MARGIN_PERCENT`] more.
    pub fn total(&self) -> u64 {
        let sum = self
            .tensors
            .saturating_add(self.corpus)
            .saturating_add(self.checkpoint)
            .saturating_add(self.runtime);
        sum.saturating_add(sum / 100 * MARGIN_PERCENT)
    }
}

/// Refuses a config whose process would need more memory than it can have (the least of
/// the machine's free memory, a cgroup's limit and `ulimit -v`), before anything is
/// allocated.
///
/// # Errors
/// [`TrainError::InvalidArgument`] on `micro-batch`, with the prediction by term and the
/// bound that is short.
pub fn check_memory(config: &TrainConfig, rank: usize) -> Result<()> {
    let Some(bound) = crate::process_memory::memory_bound() else {
        return Ok(());
    };
    let needed = ProcessMemory::of_rank(config, rank)?;
    if needed.total() <= bound.bytes {
        return Ok(());
    }
    let mib = |bytes: u64| bytes as f64 / f64::from(1u32 << 20);
    let terms: Vec<String> = [
        (needed.tensors, "of tensors (tinyllm plan)"),
        (needed.corpus, "of text"),
        (needed.checkpoint, "to gather ZeRO's state for a checkpoint"),
        (needed.runtime, "for the program"),
    ]
    .iter()
    .filter(|(bytes, _)| *bytes > 0)
    .map(|(bytes, what)| format!("{:.0} MiB {what}", mib(*bytes)))
    .collect();
    Err(TrainError::InvalidArgument {
        name: "micro-batch",
        value: config.micro_batch.to_string(),
        reason: format!(
            "this run needs {:.0} MiB: {}, and {MARGIN_PERCENT}% more; that is more than the \
             {:.0} MiB of {}",
            mib(needed.total()),
            terms.join(", "),
            mib(bound.bytes),
            bound.source
        ),
    })
}
