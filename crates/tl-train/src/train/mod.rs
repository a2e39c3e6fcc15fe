//! Training: the run's config, the learning-rate schedule, the loop, metrics and
//! checkpoints.

mod config;
mod data;
mod fp8_ranks;
pub mod lock;
mod memory_check;
mod metrics;
mod optimizer;
mod pipeline;
mod ranks;
mod recipes;
mod resume;
mod run_config;
mod schedule;
pub mod snapshot;
mod summary;
mod trainer;

pub use config::{
    AdamWConfig, DataSource, Divergence, FileFingerprint, MAX_ZERO_STAGE, Parallel, TokenizerFile,
    TrainConfig, limits,
};
pub(crate) use config::{default_eval_interval, default_save_interval, default_warmup};
pub(crate) use data::load_corpus;
pub use data::{READ_CHUNK_ENV, TOKEN_CACHE_ENV, run_tokenizer, token_cache_root, tokenizer_file};
pub(crate) use fp8_ranks::FP8_AMAXES_LABEL;
pub use memory_check::{MARGIN_PERCENT, ProcessMemory, RUNTIME_BYTES, check_memory};
pub use metrics::{Fp8Counts, MetricsLog, Record, read_records, rfc3339_utc};
pub use optimizer::RunOptimizer;
pub use pipeline::{PIPELINE_TIMELINE_FILE, PipelineTimeline, TimedAction};
pub use ranks::{RankReport, StepBatch, StepTraffic, dropout_state};
pub use recipes::{STEP_RECIPES, StepRecipe};
pub use resume::{load_model, load_model_at, read_config};
pub use run_config::{BUILD_KEY, config_json, read_config_json};
pub use schedule::LrSchedule;
pub use summary::RunSummary;
pub use trainer::{Event, ResumeOptions, Stop, TOKENIZER_FILE, Trainer, batch_loss};
pub(crate) use trainer::{mixed_step, new_optimizer, new_scaler};
