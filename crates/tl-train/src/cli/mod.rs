//! The `tinyllm` command line: argument parsing (clap) and the subcommands.

mod backend;
mod bench;
mod binding;
mod comm_bench;
mod compare;
mod export;
mod gradients;
mod launch;
mod plan;
mod profile;
mod sample;
mod schedule;
mod tokenizer;
mod train;

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::model::Checkpointing;
pub use sample::SampleArgs;

/// What `tinyllm --help` says first.
const ABOUT: &str = "Train small Llama models on the CPU with the exact numerics of bf16 and fp16 \
hardware, emulated: mixed precision, loss scaling, gradient accumulation, activation \
checkpointing and data parallelism, each measured.";

/// What `tinyllm --help` says last.
const AFTER_HELP: &str = "Start here:
  tinyllm train --preset small --bf16                  train on the built-in corpus (a few minutes)
  tinyllm sample --from runs/small-bf16-seed0          generate text from the trained model
Each command's flags: tinyllm help COMMAND. Guides: docs/ in the source tree.";

/// The `tinyllm` command line.
#[derive(Debug, Parser)]
#[command(
    name = "tinyllm",
    version = crate::build_info::VERSION_LINE,
    about = ABOUT,
    after_help = AFTER_HELP
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train a model, or continue a stopped run with --resume.
    Train(Box<TrainArgs>),
    /// Generate text from a trained model.
    Sample(SampleArgs),
    /// Write a run's model in Hugging Face's Llama format, for transformers to load.
    Export(export::ExportArgs),
    /// Print a trained model's logits for a prompt, as JSON (to check an export).
    Logits(export::LogitsArgs),
    /// Train a mixed-precision recipe and fp32 side by side; compare loss and memory.
    ///
    /// Passes when the recipe's validation loss is within 2% of fp32's on less memory (the
    /// course's milestone MS-L11).
    Compare(Box<compare::CompareArgs>),
    /// Where the gradients lie against fp16's range, and what each loss scale does to them.
    Gradients(gradients::GradientsArgs),
    /// Predict a training step's memory before it runs, in one process or per rank.
    Plan(plan::PlanArgs),
    /// Record live tensor memory over a training step and draw the timeline.
    Profile(profile::ProfileArgs),
    /// Time training steps of a recipe, or of two recipes taking turns (--paired).
    Bench(Box<bench::BenchArgs>),
    /// Run a tinyllm command as N processes (ranks) on this machine: -n N -- COMMAND.
    Launch(launch::LaunchArgs),
    /// Measure the all-reduce bandwidth between ranks (under launch, or mpirun).
    CommBench(comm_bench::CommBenchArgs),
    /// Draw a pipeline schedule's timeline and bubble, from the simulator.
    Schedule(schedule::ScheduleArgs),
    /// Train a byte-level BPE tokenizer on your text: tokenizer train --data PATH ...
    Tokenizer(tokenizer::TokenizerArgs),
}

/// The model and the recipe of a training step, as `tinyllm train`, `plan` and `profile`
/// take them. Every option is optional so that `--resume` can tell the ones given (which
/// must match the checkpoint) from the defaults.
#[derive(Clone, Debug, Args, Default)]
pub struct RecipeArgs {
    /// Model size: tiny, small or capstone [default: small]; for any other size, --config.
    #[arg(long, value_name = "PRESET")]
    pub preset: Option<String>,
    /// Tokens from this tokenizer.json (any Hugging Face tokenizer, or one from `tinyllm
    /// tokenizer train`); the model's vocabulary is its own [default: bytes, vocabulary 256].
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Start from a Hugging Face Llama directory (`config.json`, safetensors in f32, bf16 or
    /// f16, one file or shards, and its `tokenizer.json`): its sizes and weights, to continue
    /// training or fine-tune. Instead of --preset and a config file's [model].
    #[arg(long, value_name = "HF_DIR", conflicts_with = "preset")]
    pub init_from: Option<PathBuf>,
    /// Matmuls under emulated bf16 autocast (bf16 inputs, f32 accumulation).
    #[arg(long, conflicts_with = "fp16")]
    pub bf16: bool,
    /// Matmuls under emulated fp16 autocast, with dynamic loss scaling.
    #[arg(long)]
    pub fp16: bool,
    /// How the 16-bit products add up: f32 (a CPU GEMM), amx (as Intel's AMX tiles do,
    /// bf16 only; on them where the CPU has them), as the tensor cores of v100, a100 or h100
    /// do (block FMA, truncated), or tensor-core:BLOCK:EXTRA_BITS [default: f32].
    #[arg(long, value_name = "MODEL")]
    pub accumulate: Option<tl_precision::Accumulation>,
    /// Sequences per micro-batch [default: 8].
    #[arg(long, value_name = "N")]
    pub micro_batch: Option<usize>,
    /// Micro-batches accumulated per optimizer step (gradient accumulation) [default: 4].
    #[arg(long, value_name = "K")]
    pub accum: Option<usize>,
    /// Recompute each block's activations during backward instead of keeping them
    /// (--checkpoint-policy block).
    #[arg(long)]
    pub checkpoint_activations: bool,
    /// Checkpoint on the optimal schedule for this many stored block inputs.
    #[arg(long, value_name = "K", conflicts_with = "checkpoint_activations")]
    pub checkpoint_budget: Option<usize>,
    /// What each block keeps for backward, the rest recomputed during backward
    /// [default: none].
    #[arg(
        long,
        value_name = "POLICY",
        conflicts_with_all = ["checkpoint_activations", "checkpoint_budget"]
    )]
    pub checkpoint_policy: Option<CheckpointPolicy>,
    /// Recompute the head's logits in backward, 64 rows at a time, instead of keeping them
    /// all (the same bits): on, off, or auto, on when the vocabulary is at least 8 times the
    /// width [default: auto].
    #[arg(long, value_name = "WHEN")]
    pub chunked_loss: Option<crate::model::head_loss::ChunkedLoss>,
    /// Dropout on each residual branch [default: 0].
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    pub dropout: Option<f64>,
}

/// `--checkpoint-policy`: what a checkpointed block keeps, as [`Checkpointing`] names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CheckpointPolicy {
    /// No checkpointing: every block keeps all it needs.
    None,
    /// Per block: the input and the attention's result.
    Block,
    /// Per block, also every projection's output.
    Matmuls,
    /// Per block, also the first projection's output.
    FirstMatmul,
}

impl CheckpointPolicy {
    /// The checkpointing this policy names.
    pub fn checkpointing(self) -> Checkpointing {
        match self {
            CheckpointPolicy::None => Checkpointing::Off,
            CheckpointPolicy::Block => Checkpointing::PerBlock,
            CheckpointPolicy::Matmuls => Checkpointing::Matmuls,
            CheckpointPolicy::FirstMatmul => Checkpointing::FirstMatmul,
        }
    }
}

/// `--fp8-amax`: how the amax history gives the scale's amax.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Fp8Amax {
    /// The history's largest amax.
    Max,
    /// Its newest entry.
    MostRecent,
}

/// `--threads N`: the compute threads of a command that computes.
#[derive(Clone, Copy, Debug, Args, Default)]
pub struct Threads {
    /// Compute threads [default: $RAYON_NUM_THREADS, else one per core].
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
}

/// The most compute threads `--threads` asks for.
const MAX_THREADS: usize = 4096;

/// The stack of each compute thread: a main thread's 8 MiB (rayon's default is 2 MiB), since
/// a command runs on one of them.
const POOL_STACK_BYTES: usize = 8 << 20;

impl Threads {
    /// Whether the user chose the threads: `--threads`, or `RAYON_NUM_THREADS`.
    fn chosen(self) -> bool {
        self.threads.is_some() || std::env::var_os("RAYON_NUM_THREADS").is_some()
    }

    /// The compute pool of a command (the threads its matmuls, attention and elementwise
    /// kernels share): `--threads` threads, else rayon's default (`RAYON_NUM_THREADS`, else
    /// one per core the process may run on), each with a main thread's stack.
    ///
    /// The command then runs on one of the pool's threads ([`rayon::ThreadPool::install`]),
    /// not on the main thread. A parallel kernel called from outside its pool hands the work
    /// over and puts the caller to sleep until it is done, and a step calls thousands of
    /// them: two context switches each, and a third thread on the cores. From inside, the
    /// kernels split their work where they are. Measured on the capstone (2-core AMD EPYC,
    /// `bench --steps 4 --warmup 1`, the whole process): one thread, fp32, 4210 voluntary
    /// context switches to 27 and 10.0 to 9.3 s of CPU time; two threads, bf16, 19765
    /// voluntary and 21436 involuntary switches to 4838 and 259, and 15.3 to 14.4 s.
    ///
    /// A pool of the command's own, not rayon's global one: a thread of a pool that waits
    /// for a parallel kernel runs other work of its pool meanwhile, and two commands run in
    /// one process (as tests do) must never run inside each other. Threads a command starts
    /// (the plan's meta run, communication) compute, if at all, on the global pool, so that
    /// waiting for them never waits for the command's own thread.
    fn pool(self) -> crate::Result<rayon::ThreadPool> {
        let mut pool = rayon::ThreadPoolBuilder::new()
            .stack_size(POOL_STACK_BYTES)
            .thread_name(|i| format!("tl-compute-{i}"));
        if let Some(n) = self.threads {
            if !(1..=MAX_THREADS).contains(&n) {
                return Err(crate::TrainError::InvalidArgument {
                    name: "threads",
                    value: n.to_string(),
                    reason: format!("must be in 1..={MAX_THREADS}"),
                });
            }
            pool = pool.num_threads(n);
        }
        pool.build()
            .map_err(|error| crate::TrainError::InvalidArgument {
                name: "threads",
                value: self
                    .threads
                    .map_or_else(|| "default".into(), |n| n.to_string()),
                reason: format!("the compute pool did not start: {error}"),
            })
    }
}

/// Options of `tinyllm train`: the recipe, the data, the optimizer and the run. Every option
/// is optional so that `--resume` can tell the ones given from the defaults.
#[derive(Debug, Args, Default)]
pub struct TrainArgs {
    /// The model and the recipe.
    #[command(flatten)]
    pub recipe: RecipeArgs,
    /// Train on this text instead of the built-in grammar corpus: a UTF-8 file, a directory
    /// of .txt files (at any depth), or a .jsonl file of {"text": ...} lines; tokenized once
    /// into a token cache beside the run, the last documents held out for validation.
    #[arg(long, value_name = "PATH")]
    pub data: Option<PathBuf>,
    /// Bytes of built-in corpus to generate [default: 2000000].
    #[arg(long, value_name = "N", conflicts_with = "data")]
    pub corpus_bytes: Option<usize>,
    /// Seed of the built-in corpus [default: 0].
    #[arg(long, value_name = "S", conflicts_with = "data")]
    pub corpus_seed: Option<u64>,
    /// Optimizer steps of the whole run [default: by preset].
    #[arg(long, value_name = "N")]
    pub steps: Option<u64>,
    /// Peak learning rate [default: by preset].
    #[arg(long, value_name = "LR", allow_negative_numbers = true)]
    pub lr: Option<f64>,
    /// Final learning rate of the cosine [default: lr/10].
    #[arg(long, value_name = "LR", allow_negative_numbers = true)]
    pub min_lr: Option<f64>,
    /// Warmup steps [default: steps/10].
    #[arg(long, value_name = "N")]
    pub warmup: Option<u64>,
    /// AdamW's decoupled weight decay [default: 0.01].
    #[arg(long, value_name = "WD", allow_negative_numbers = true)]
    pub weight_decay: Option<f64>,
    /// AdamW's first-moment decay rate, beta1 [default: 0.9].
    #[arg(long, value_name = "B", allow_negative_numbers = true)]
    pub adam_beta1: Option<f64>,
    /// AdamW's second-moment decay rate, beta2 [default: 0.999].
    #[arg(long, value_name = "B", allow_negative_numbers = true)]
    pub adam_beta2: Option<f64>,
    /// AdamW's epsilon, added to the update's denominator [default: 1e-8].
    #[arg(long, value_name = "EPS", allow_negative_numbers = true)]
    pub adam_epsilon: Option<f64>,
    /// Clip the gradient norm to this [default: 1.0].
    #[arg(
        long,
        value_name = "NORM",
        conflicts_with = "no_clip",
        allow_negative_numbers = true
    )]
    pub clip: Option<f64>,
    /// Do not clip gradients.
    #[arg(long)]
    pub no_clip: bool,
    /// The blocks' linear layers in fp8 with delayed scaling (Transformer Engine's HYBRID
    /// recipe: E4M3 forward, E5M2 gradients; per-tensor scales from an amax history).
    #[arg(long)]
    pub fp8: bool,
    /// fp8: the scale leaves 2^M of headroom below the largest finite value [default: 0].
    #[arg(long, value_name = "M")]
    pub fp8_margin: Option<u32>,
    /// fp8: steps of amax history per tensor [default: 1024].
    #[arg(long, value_name = "N")]
    pub fp8_history: Option<usize>,
    /// fp8: the history's amax is its max, or its most recent entry [default: max].
    #[arg(long, value_name = "ALGO", value_enum)]
    pub fp8_amax: Option<Fp8Amax>,
    /// Seed of the weights, batches and dropout [default: 0].
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,
    /// Steps between validation losses [default: steps/10].
    #[arg(long, value_name = "N")]
    pub eval_interval: Option<u64>,
    /// Validation micro-batches per evaluation [default: 4].
    #[arg(long, value_name = "N")]
    pub eval_batches: Option<usize>,
    /// Steps between checkpoints [default: steps/4].
    #[arg(long, value_name = "N")]
    pub save_interval: Option<u64>,
    /// Run directory [default: runs/PRESET-PRECISION-seedSEED].
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    pub out: Option<PathBuf>,
    /// Continue the run in DIR from its latest checkpoint.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Start from this config file (JSON, or TOML by its `.toml` extension), in the schema
    /// of the `config.json` a run writes; any model size. Flags given too override it.
    #[arg(long, value_name = "FILE", conflicts_with = "resume")]
    pub config: Option<PathBuf>,
    /// Stop (with a checkpoint) once this many steps are done; resume later to finish.
    #[arg(long, value_name = "STEP")]
    pub until_step: Option<u64>,
    /// No progress bar (one line per evaluation instead).
    #[arg(long)]
    pub quiet: bool,
    /// Checkpoints to keep, newest first [default: 2].
    #[arg(long, value_name = "N")]
    pub keep_checkpoints: Option<usize>,
    /// Stop as diverged when a step's loss exceeds this, nats per token
    /// [default: 2 ln(vocab)].
    #[arg(long, value_name = "LOSS", allow_negative_numbers = true)]
    pub max_loss: Option<f64>,
    /// Stop as diverged after this many consecutive fp16 steps skipped at the loss
    /// scale's floor of 1 [default: 10].
    #[arg(long, value_name = "K")]
    pub max_skipped: Option<u32>,
    /// With --resume: continue even if the --data file changed since the run began.
    #[arg(long, requires = "resume")]
    pub data_changed_ok: bool,
    /// ZeRO stage over the ranks: 0 (DDP, every rank keeps everything), 1 (AdamW's moments
    /// partitioned), 2 (the gradients too) or 3 (the parameters too, gathered around each
    /// block's use) [default: 0, or the run's with --resume].
    #[arg(long, value_name = "S")]
    pub zero: Option<u8>,
    /// MiB of gradients per collective of the reduction, as PyTorch DDP's bucket_cap_mb
    /// [default: 25, or the run's with --resume].
    #[arg(long, value_name = "MIB")]
    pub bucket_mib: Option<f64>,
    /// Reduce each bucket of gradients on a communication thread as soon as the last
    /// micro-batch's backward has produced it, while backward goes on (as PyTorch DDP
    /// does); --overlap=false reduces them all after backward. The same bits either way
    /// [default: on, or the run's with --resume].
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub overlap: Option<bool>,
    /// Tensor parallelism: split each layer over this many consecutive ranks (attention
    /// heads, MLP units and the vocabulary divided among them, as Megatron-LM does); the
    /// world's ranks form data-parallel replicas of T ranks each [default: 1, or the run's
    /// with --resume].
    #[arg(long, value_name = "T")]
    pub tp: Option<usize>,
    /// Sequence parallelism, with --tp > 1 (Korthikanti et al., as Megatron-LM's
    /// --sequence-parallel): the activations between the split layers are split over the T
    /// ranks too, each holding its rows of the tokens, so the norms, dropout and residual
    /// adds keep 1/T of them; the context must be divisible by T. With --resume,
    /// --sequence-parallel=false turns it off [default: off, or the run's with --resume].
    #[arg(
        long,
        value_name = "ON",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub sequence_parallel: Option<bool>,
    /// Pipeline parallelism: cut the model's blocks into consecutive stages over this many
    /// ranks (the embedding with the first, the head with the last), the step's --accum
    /// micro-batches streamed through them [default: 1, or the run's with --resume].
    #[arg(long, value_name = "P")]
    pub pp: Option<usize>,
    /// The pipeline's schedule: gpipe, 1f1b, interleaved or zb-h1 (each backward split into
    /// the input's gradient and the weights', the latter held back to fill the bubble)
    /// [default: 1f1b, or the run's with --resume].
    #[arg(long, value_name = "S", requires = "pp")]
    pub schedule: Option<tl_parallel::pipeline::ScheduleKind>,
    /// Stages on each pipeline rank, with --schedule interleaved [default: 2 with it, else
    /// 1].
    #[arg(long, value_name = "V", requires = "pp")]
    pub stages_per_rank: Option<usize>,
    /// The first block of each stage past the first, e.g. 3,6 for three stages of an
    /// 8-block model [default: balanced by parameter count].
    #[arg(long, value_name = "B,B,..", value_delimiter = ',', requires = "pp")]
    pub pp_split: Option<Vec<usize>>,
    /// How the ranks communicate: ring (under `tinyllm launch`), or mpi / mpi-ring (under
    /// mpirun, in a build with the `mpi` feature).
    #[arg(long, value_enum, default_value_t)]
    pub backend: backend::Backend,
    /// Compute threads.
    #[command(flatten)]
    pub threads: Threads,
}

/// What `tinyllm` exits with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// Done.
    Success,
    /// Training was stopped by a signal and checkpointed.
    Interrupted {
        /// The signal (SIGINT, SIGTERM or SIGHUP): the process exits with `128 + signal`.
        signal: i32,
    },
    /// `tinyllm compare` ran, and the recipe missed MS-L11.
    MilestoneMissed,
}

/// Parses `args` (program name first) and runs the command.
///
/// # Errors
/// [`CliError::Usage`] for bad syntax (print it with `clap::Error::exit`), or
/// [`CliError::Run`] with the command's error.
pub fn run<I, T>(args: I) -> std::result::Result<Exit, CliError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = Cli::try_parse_from(args).map_err(CliError::Usage)?;
    let threads = match &cli.command {
        Command::Train(args) => Some(args.threads),
        Command::Sample(args) => Some(args.threads),
        Command::Logits(args) => Some(args.threads),
        Command::Compare(args) => Some(args.threads),
        Command::Plan(args) => Some(args.threads),
        Command::Gradients(args) => Some(args.threads),
        Command::Profile(args) => Some(args.threads),
        Command::Bench(args) => Some(args.threads),
        Command::Export(_)
        | Command::Launch(_)
        | Command::CommBench(_)
        | Command::Schedule(_)
        | Command::Tokenizer(_) => None,
    };
    let pool = threads
        .map(Threads::pool)
        .transpose()
        .map_err(CliError::Run)?;
    let execute = |command: Command| match command {
        Command::Train(args) => train::train(&args),
        Command::Sample(args) => sample::sample(&args).map(|()| Exit::Success),
        Command::Logits(args) => export::logits(&args).map(|()| Exit::Success),
        Command::Compare(args) => compare::compare_command(&args),
        Command::Plan(args) => plan::plan(&args),
        Command::Gradients(args) => gradients::gradients(&args),
        Command::Profile(args) => profile::profile(&args),
        Command::Bench(args) => bench::bench(&args),
        Command::Export(args) => export::export(&args).map(|()| Exit::Success),
        Command::Launch(args) => launch::launch(&args),
        Command::CommBench(args) => comm_bench::comm_bench(&args),
        Command::Schedule(args) => schedule::schedule(&args),
        Command::Tokenizer(args) => tokenizer::tokenizer(&args).map(|()| Exit::Success),
    };
    let outcome = match pool {
        Some(pool) => pool.install(|| execute(cli.command)),
        None => execute(cli.command),
    };
    outcome.map_err(CliError::Run)
}

/// Why `tinyllm` failed.
#[derive(Debug)]
pub enum CliError {
    /// Bad command-line syntax (also `--help` and `--version`, which clap reports this way).
    Usage(clap::Error),
    /// The command ran and failed.
    Run(crate::TrainError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    #[test]
    fn the_policy_flag_names_each_policy_as_checkpointing_does() {
        // The names live twice (clap's, from the variants, and `policy_name`): they agree,
        // and every policy of `Checkpointing::POLICIES` has its flag value.
        let flags: Vec<Checkpointing> = CheckpointPolicy::value_variants()
            .iter()
            .map(|policy| {
                let name = policy.to_possible_value().unwrap().get_name().to_string();
                assert_eq!(Some(name.as_str()), policy.checkpointing().policy_name());
                policy.checkpointing()
            })
            .collect();
        assert!(Checkpointing::POLICIES.iter().all(|p| flags.contains(p)));
    }

    /// Each command gets a pool of the threads it asks for, whatever an earlier command of
    /// the process asked (one global pool refused a second size), and runs on one of them.
    #[test]
    fn each_command_computes_on_a_pool_of_its_own_size() {
        for n in [1, 3] {
            let pool = Threads { threads: Some(n) }.pool().unwrap();
            let (threads, name) = pool.install(|| {
                let name = std::thread::current().name().map(str::to_string);
                (rayon::current_num_threads(), name)
            });
            assert_eq!(threads, n);
            assert!(name.is_some_and(|name| name.starts_with("tl-compute-")));
        }
        let refused = Threads { threads: Some(0) }.pool().unwrap_err();
        assert!(refused.to_string().contains("must be in 1..="), "{refused}");

        let dir = tempfile::tempdir().unwrap();
        for (run, threads) in [("a", "1"), ("b", "2"), ("c", "1")] {
            let out = dir.path().join(run);
            let args = ["tinyllm", "train", "--preset", "tiny", "--steps", "1"];
            let exit = super::run(args.into_iter().map(String::from).chain([
                "--threads".into(),
                threads.into(),
                "--out".into(),
                out.display().to_string(),
            ]));
            assert!(
                matches!(exit, Ok(Exit::Success)),
                "train --threads {threads} after other sizes: {:?}",
                exit.err()
            );
        }
    }
}
