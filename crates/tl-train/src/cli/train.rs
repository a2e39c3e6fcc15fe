//! `tinyllm train`: build the config from the flags, run with a progress bar, report.

use std::path::{Path, PathBuf};
use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use indicatif::{ProgressBar, ProgressStyle};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use tl_precision::Precision;
use tl_tensor::memory;

use super::backend::communicator;
use super::{Exit, TrainArgs};
use crate::chart::{LineChart, Series, write_line_chart};
use crate::error::{Result, TrainError};
use crate::model::{Checkpointing, Preset};
use crate::process_memory::{describe_peak, peak_rss_bytes, reset_peak_rss};
use crate::store::write_atomic;
use crate::train::{
    DataSource, Event, LrSchedule, Record, ResumeOptions, Stop, TrainConfig, Trainer,
    default_eval_interval, default_save_interval, default_warmup, limits, read_records,
};

/// Runs `tinyllm train`.
pub(super) fn train(args: &TrainArgs) -> Result<Exit> {
    let mut comm = communicator(args.backend)?;
    if args.backend != super::backend::Backend::Ring {
        super::binding::warn_if_bound(comm.as_mut(), args.threads.chosen())?;
    }
    let mut trainer = match &args.resume {
        Some(dir) => {
            let options = ResumeOptions {
                data_changed_ok: args.data_changed_ok,
                zero: args.zero,
                bucket_bytes: bucket_bytes(args)?,
                overlap: args.overlap,
                tensor: args.tp,
                sequence_parallel: args.sequence_parallel,
                pipeline: args.pp,
                schedule: args.schedule,
                stages_per_rank: args.stages_per_rank,
            };
            let trainer = Trainer::resume_on(dir, options, comm)?;
            check_resume_flags(args, trainer.config(), dir)?;
            trainer
        }
        None => {
            let config = config_from_flags(args)?;
            let out = args.out.clone().unwrap_or_else(|| default_out(&config));
            Trainer::new_on(config, &out, comm)?
        }
    };
    // Rank 0 speaks for the run; the other ranks print only their warnings and errors.
    let leader = trainer.rank() == 0;
    let config = trainer.config().clone();
    let until = args.until_step.unwrap_or(config.steps).min(config.steps);
    if trainer.is_finished() && !trainer.run_dir().join("summary.json").exists() {
        // The process that finished the run was stopped after its last checkpoint and
        // before its summary: write the summary now, from the metrics.
        let note = "rebuilt from metrics.jsonl: the process that finished the run stopped \
                    before writing its summary; the memory figures are those of the process \
                    that rebuilt it, which trained no step";
        return report(&mut trainer, Some(note)).map(|()| Exit::Success);
    }
    // Before any rank finds it has nothing to do: a rank that returned here would leave the
    // others waiting for it in `run`'s own check.
    trainer.agree_on_until(until)?;
    if trainer.step() >= until && !leader {
        return Ok(Exit::Success);
    }
    if trainer.step() >= until {
        let what = if trainer.is_finished() {
            "finished"
        } else {
            "already at that step"
        };
        say!(
            "{}: the run is {what} (step {} of {}); nothing to do",
            trainer.run_dir().display(),
            trainer.step(),
            config.steps
        );
        return Ok(Exit::Success);
    }
    memory::reset_peak();
    reset_peak_rss();
    if leader {
        print_header(&trainer);
    }

    install_stop_handler(leader);

    let bar = progress_bar(args.quiet || !leader, trainer.step(), until);
    let mut last_val = None;
    let outcome = trainer.run(until, &INTERRUPTED, &mut |event| match event {
        Event::Metric(Record::Train {
            step,
            loss,
            tokens_per_s,
            scale,
            ..
        }) => {
            bar.set_position(*step);
            let scale = scale.map(|s| format!(" | scale {s}")).unwrap_or_default();
            let val = last_val
                .map(|v: f64| format!(" | val {v:.4}"))
                .unwrap_or_default();
            bar.set_message(format!(
                "loss {loss:.4}{val} | {tokens_per_s:.0} tok/s{scale}"
            ));
        }
        Event::Metric(Record::Eval {
            step,
            val_loss,
            val_bpb,
            ..
        }) => {
            last_val = Some(*val_loss);
            if leader {
                let bpb = val_bpb
                    .map(|b| format!(" ({b:.4} bits per byte)"))
                    .unwrap_or_default();
                say(
                    &bar,
                    format!("step {step:>6}  validation loss {val_loss:.4}{bpb}"),
                );
            }
        }
        Event::Saved(dir) if leader => say(&bar, format!("checkpoint  {}", dir.display())),
        Event::Saved(_) => {}
    });
    bar.finish_and_clear();
    let stop = outcome?;
    report(&mut trainer, None)?;
    Ok(match stop {
        Stop::Finished => Exit::Success,
        Stop::Interrupted => {
            // Every rank stopped after the same step, but only the ranks that were sent the
            // signal know it: share it, so that every rank names it and exits with it.
            let received = if INTERRUPTED.load(Ordering::SeqCst) {
                STOP_SIGNAL.load(Ordering::SeqCst)
            } else {
                0
            };
            let signal = trainer.max_over_ranks(received.max(0) as u32)? as i32;
            if !leader {
                return Ok(Exit::Interrupted { signal });
            }
            say!(
                "stopped by {} at step {}: continue with  tinyllm train --resume {}",
                signal_name(signal),
                trainer.step(),
                trainer.run_dir().display()
            );
            Exit::Interrupted { signal }
        }
    })
}

/// Raised by a stopping signal; the training loop checks it after every step.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// The signal that raised [`INTERRUPTED`].
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(SIGINT);

/// The conventional name of the stopping signals.
fn signal_name(signal: i32) -> &'static str {
    match signal {
        SIGINT => "SIGINT (Ctrl-C)",
        SIGTERM => "SIGTERM",
        SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

/// Installs the process's handler of the stopping signals once. SIGINT (Ctrl-C), SIGTERM (a
/// scheduler's stop, `timeout`, `kill`) and SIGHUP (a closed terminal) all ask the loop to
/// finish its step, checkpoint and exit with `128 + signal`; a second signal while that
/// checkpoint is written quits at once (the previous checkpoint is still whole).
fn install_stop_handler(leader: bool) {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let signals = match Signals::new([SIGINT, SIGTERM, SIGHUP]) {
            Ok(signals) => signals,
            Err(error) => {
                crate::output::warn(&format!(
                    "stopping signals will not checkpoint before exiting ({error})"
                ));
                return;
            }
        };
        std::thread::spawn(move || {
            let mut signals = signals;
            for signal in signals.forever() {
                if INTERRUPTED.load(Ordering::SeqCst) {
                    std::process::exit(128 + signal);
                }
                STOP_SIGNAL.store(signal, Ordering::SeqCst);
                INTERRUPTED.store(true, Ordering::SeqCst);
                if !leader {
                    continue;
                }
                say!(
                    "{}: checkpointing after the current step (send it again to quit at once)",
                    signal_name(signal)
                );
            }
        });
    });
}

/// The config the flags describe, on top of `--config`'s file when one is given (or the
/// preset's defaults): what every command that takes a recipe trains, plans or times.
///
/// `--preset` with a file that names the model too (a `preset` key, or sizes in `[model]`) is
/// refused unless both name the same sizes: neither may silently drop the other. With a
/// file that leaves the model out, `--preset` chooses it.
pub(super) fn config_from_flags(args: &TrainArgs) -> Result<TrainConfig> {
    let Some(path) = args.config.as_deref() else {
        return config_from_args(args, None);
    };
    let (file, names_model) = TrainConfig::from_file_naming_model(path)?;
    if let Some(dir) = &args.recipe.init_from
        && names_model
    {
        return Err(TrainError::InvalidArgument {
            name: "init-from",
            value: dir.display().to_string(),
            reason: format!(
                "--config {} names the model too: the directory's config.json gives it (drop \
                 the file's preset and [model] sizes)",
                path.display()
            ),
        });
    }
    if let Some(flag) = &args.recipe.preset
        && names_model
    {
        let preset: Preset = flag.parse()?;
        let same_sizes = crate::model::ModelConfig {
            dropout: file.model.dropout,
            ..preset.config()
        } == file.model;
        if !same_sizes {
            let named = file.preset.map_or_else(
                || {
                    let m = &file.model;
                    format!(
                        "a custom model (vocab {}, d_model {}, n_layers {}, n_heads {}, \
                         hidden {}, context {})",
                        m.vocab, m.d_model, m.n_layers, m.n_heads, m.hidden, m.context
                    )
                },
                |preset| format!("the {} preset", preset.name()),
            );
            return Err(TrainError::InvalidArgument {
                name: "preset",
                value: flag.clone(),
                reason: format!(
                    "--config {} names {named}: give the model in one place (drop --preset, \
                     or the file's preset and [model] sizes)",
                    path.display()
                ),
            });
        }
    }
    config_from_args(args, Some(&file))
}

/// The model of the Hugging Face Llama in `dir` for `config`: its sizes (no preset), the
/// directory itself to load the weights from when the run starts, and, with
/// `its_tokenizer`, its `tokenizer.json` as the run's tokenizer.
///
/// # Errors
/// What [`hf_model_config`](crate::import::hf_model_config) reports of the config;
/// [`TrainError::InvalidArgument`] naming `init-from` when the directory has no tokenizer
/// and none is given, or the tokenizer has more tokens than the model's table.
fn init_from(config: &mut TrainConfig, dir: &std::path::Path, its_tokenizer: bool) -> Result<()> {
    let dir = std::path::absolute(dir).map_err(|source| TrainError::io(dir, source))?;
    let dropout = config.model.dropout;
    config.model = crate::import::hf_model_config(&dir)?;
    config.model.dropout = dropout;
    config.preset = None;
    let refuse = |reason: String| TrainError::InvalidArgument {
        name: "init-from",
        value: dir.display().to_string(),
        reason,
    };
    if its_tokenizer {
        let path = dir.join(crate::train::TOKENIZER_FILE);
        if !path.exists() {
            return Err(refuse(
                "it has no tokenizer.json, and the model's ids mean nothing without its \
                 tokenizer: give it with --tokenizer"
                    .into(),
            ));
        }
        config.tokenizer = Some(crate::train::tokenizer_file(&path)?.1);
    }
    if let Some(file) = &config.tokenizer {
        let tokens = crate::data::Tokenizer::load(&file.path)?.vocab_size();
        if tokens > config.model.vocab {
            return Err(refuse(format!(
                "the tokenizer {} has {tokens} tokens, more than the model's {} embeddings",
                file.path.display(),
                config.model.vocab
            )));
        }
    }
    config.init_from = Some(dir);
    Ok(())
}

/// Caps a built-in corpus at `bytes` (never below the 20 windows a model's context needs),
/// for the commands whose figures do not depend on what the batches hold.
pub(super) fn shrink_builtin_corpus(config: &mut TrainConfig, bytes: usize) {
    let floor = 20 * (config.model.context + 1);
    if let DataSource::Builtin { bytes: have, .. } = &mut config.data {
        *have = (*have).min(bytes.max(floor));
    }
}

/// The config the flags describe, on top of `base` (or the preset's defaults).
pub(super) fn config_from_args(
    args: &TrainArgs,
    base: Option<&TrainConfig>,
) -> Result<TrainConfig> {
    let recipe = &args.recipe;
    let preset: Preset = recipe.preset.as_deref().unwrap_or("small").parse()?;
    let mut config = match base {
        Some(base) => base.clone(),
        None => TrainConfig::for_preset(preset),
    };
    if base.is_some() && recipe.preset.is_some() {
        config.preset = Some(preset);
        config.model = preset.config();
        config.model.dropout = base.map_or(0.0, |b| b.model.dropout);
    }
    if let Some(path) = &recipe.tokenizer {
        let (tokenizer, record) = crate::train::tokenizer_file(path)?;
        config.model.vocab = tokenizer.vocab_size();
        config.tokenizer = Some(record);
    }
    if let Some(dir) = &recipe.init_from {
        init_from(&mut config, dir, recipe.tokenizer.is_none())?;
    }
    if let Some(path) = &args.data {
        // Absolute, so that a resume started from another directory finds it.
        let path = std::path::absolute(path).map_err(|source| TrainError::io(path, source))?;
        config.data = DataSource::File { path };
    }
    if let DataSource::Builtin { seed, bytes } = &mut config.data {
        *seed = args.corpus_seed.unwrap_or(*seed);
        *bytes = args.corpus_bytes.unwrap_or(*bytes);
    }
    if recipe.bf16 {
        config.precision = Precision::Bf16;
    } else if recipe.fp16 {
        config.precision = Precision::Fp16;
    }
    config.accumulation = recipe.accumulate.unwrap_or(config.accumulation);
    config.micro_batch = recipe.micro_batch.unwrap_or(config.micro_batch);
    config.accum = recipe.accum.unwrap_or(config.accum);
    if recipe.checkpoint_activations {
        config.checkpointing = Checkpointing::PerBlock;
    } else if let Some(budget) = recipe.checkpoint_budget {
        config.checkpointing = Checkpointing::Budget(budget);
    } else if let Some(policy) = recipe.checkpoint_policy {
        config.checkpointing = policy.checkpointing();
    }
    config.chunked_loss = recipe.chunked_loss.unwrap_or(config.chunked_loss);
    if let Some(steps) = args.steps {
        // Intervals and warmup follow the run's length unless given.
        config.steps = steps;
        config.lr.total = steps;
        config.lr.warmup = default_warmup(steps);
        config.eval_interval = default_eval_interval(steps);
        config.save_interval = default_save_interval(steps);
    }
    if let Some(lr) = args.lr {
        config.lr.peak = lr;
        config.lr.min = lr / 10.0;
    }
    let LrSchedule { min, warmup, .. } = config.lr;
    config.lr.min = args.min_lr.unwrap_or(min);
    config.lr.warmup = args.warmup.unwrap_or(warmup);
    config.weight_decay = args.weight_decay.unwrap_or(config.weight_decay);
    let adamw = &mut config.adamw;
    adamw.beta1 = args.adam_beta1.unwrap_or(adamw.beta1);
    adamw.beta2 = args.adam_beta2.unwrap_or(adamw.beta2);
    adamw.eps = args.adam_epsilon.unwrap_or(adamw.eps);
    if args.no_clip {
        config.clip = None;
    } else if args.clip.is_some() {
        config.clip = args.clip;
    }
    config.model.dropout = recipe.dropout.unwrap_or(config.model.dropout);
    config.seed = args.seed.unwrap_or(config.seed);
    config.eval_interval = args.eval_interval.unwrap_or(config.eval_interval);
    config.eval_batches = args.eval_batches.unwrap_or(config.eval_batches);
    config.save_interval = args.save_interval.unwrap_or(config.save_interval);
    config.keep_checkpoints = args.keep_checkpoints.unwrap_or(config.keep_checkpoints);
    if args.max_loss.is_some() {
        config.divergence.max_loss = args.max_loss;
    }
    config.divergence.max_skipped = args.max_skipped.unwrap_or(config.divergence.max_skipped);
    apply_fp8_flags(args, &mut config)?;
    config.parallel.zero = args.zero.unwrap_or(config.parallel.zero);
    config.parallel.bucket_bytes = bucket_bytes(args)?.unwrap_or(config.parallel.bucket_bytes);
    config.parallel.overlap = args.overlap.unwrap_or(config.parallel.overlap);
    config.parallel.tensor = args.tp.unwrap_or(config.parallel.tensor);
    config.parallel.sequence_parallel = args
        .sequence_parallel
        .unwrap_or(config.parallel.sequence_parallel);
    let parallel = &mut config.parallel;
    parallel.pipeline = args.pp.unwrap_or(parallel.pipeline);
    parallel.schedule = args.schedule.unwrap_or(parallel.schedule);
    let interleaved = parallel.schedule == tl_parallel::pipeline::ScheduleKind::Interleaved;
    parallel.stages_per_rank = match args.stages_per_rank {
        Some(v) => v,
        None if interleaved && parallel.pipeline > 1 && parallel.stages_per_rank == 1 => 2,
        None => parallel.stages_per_rank,
    };
    if args.pp_split.is_some() {
        parallel.pipeline_split = args.pp_split.clone();
    }
    // The ranks are the world's, set when the run starts on them; until then, the fewest
    // that the split needs.
    parallel.ranks = parallel.ranks.max(parallel.tensor * parallel.pipeline);
    config.validate()?;
    Ok(config)
}

/// `--fp8` and its settings on `config`'s fp8 recipe. A setting without fp8 (neither the flag
/// nor the base config) is refused, as it would change nothing.
fn apply_fp8_flags(args: &TrainArgs, config: &mut TrainConfig) -> Result<()> {
    if args.fp8 && config.fp8.is_none() {
        config.fp8 = Some(tl_precision::Fp8Recipe::default());
    }
    let settings = [
        ("fp8-margin", args.fp8_margin.map(|m| m.to_string())),
        ("fp8-history", args.fp8_history.map(|n| n.to_string())),
        ("fp8-amax", args.fp8_amax.map(|a| format!("{a:?}"))),
    ];
    let Some(recipe) = &mut config.fp8 else {
        if let Some((name, Some(value))) = settings.into_iter().find(|(_, v)| v.is_some()) {
            return Err(TrainError::InvalidArgument {
                name,
                value,
                reason: "sets fp8's delayed scaling: add --fp8".into(),
            });
        }
        return Ok(());
    };
    recipe.margin = args.fp8_margin.unwrap_or(recipe.margin);
    recipe.history_len = args.fp8_history.unwrap_or(recipe.history_len);
    if let Some(amax) = args.fp8_amax {
        recipe.amax = match amax {
            super::Fp8Amax::Max => tl_precision::AmaxAlgorithm::Max,
            super::Fp8Amax::MostRecent => tl_precision::AmaxAlgorithm::MostRecent,
        };
    }
    Ok(())
}

/// `--bucket-mib` in bytes.
fn bucket_bytes(args: &TrainArgs) -> Result<Option<usize>> {
    args.bucket_mib
        .map(|mib| {
            let bytes = mib * f64::from(1u32 << 20);
            if bytes.is_finite() && bytes >= 4.0 && bytes <= limits::MAX_BUCKET_BYTES as f64 {
                Ok(bytes as usize)
            } else {
                Err(TrainError::InvalidArgument {
                    name: "bucket-mib",
                    value: mib.to_string(),
                    reason: format!(
                        "must hold one gradient (4 bytes) and at most {} MiB",
                        limits::MAX_BUCKET_BYTES >> 20
                    ),
                })
            }
        })
        .transpose()
}

/// With `--resume`, flags that shape the run must agree with the checkpoint's config.
fn check_resume_flags(args: &TrainArgs, saved: &TrainConfig, dir: &Path) -> Result<()> {
    let asked = config_from_args(args, Some(saved))?;
    if &asked == saved {
        return Ok(());
    }
    let (asked, saved) = (
        serde_json::to_value(&asked).expect("serializes"),
        serde_json::to_value(saved).expect("serializes"),
    );
    let differing: Vec<String> = saved
        .as_object()
        .expect("a struct")
        .iter()
        .filter(|(key, value)| asked.get(key.as_str()) != Some(value))
        .map(|(key, value)| {
            format!(
                "{key}: checkpoint has {value}, flags ask for {}",
                asked[key.as_str()]
            )
        })
        .collect();
    Err(TrainError::InvalidArgument {
        name: "resume",
        value: dir.display().to_string(),
        reason: format!(
            "the run was trained with a different config ({}); drop the flags that differ",
            differing.join("; ")
        ),
    })
}

fn default_out(config: &TrainConfig) -> PathBuf {
    let preset = config.preset.map_or("custom", Preset::name);
    PathBuf::from("runs").join(format!(
        "{preset}-{}-seed{}",
        config.precision.name(),
        config.seed
    ))
}

/// Prints a line above the progress bar, or plainly when the bar is hidden (`--quiet`, or
/// stderr is not a terminal).
fn say(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        say!("{line}");
    } else {
        bar.println(line);
    }
}

pub(super) fn progress_bar(quiet: bool, position: u64, length: u64) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(length).with_position(position);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:28} {pos:>5}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
        )
        .expect("a valid template"),
    );
    bar
}

fn print_header(trainer: &Trainer) {
    let config = trainer.config();
    let corpus = trainer.corpus();
    say!(
        "tinyllm train: {} ({} parameters), {}, micro-batch {} x accum {} x context {} = {} tokens/step, checkpointing {}",
        config.preset.map_or("custom", Preset::name),
        config.model.num_parameters(),
        config.precision.name(),
        config.micro_batch,
        config.accum,
        config.model.context,
        config.tokens_per_step(),
        config.checkpointing,
    );
    let unit = match &config.tokenizer {
        Some(_) => "tokens",
        None => "bytes",
    };
    say!(
        "data: {} ({} train / {} validation {unit}){}",
        corpus.source,
        corpus.train.len(),
        corpus.validation.len(),
        corpus
            .entropy_nats_per_byte
            .map(|h| format!(", entropy floor {h:.4} nats/byte"))
            .unwrap_or_default()
    );
    if let Some(tokenizer) = &config.tokenizer {
        say!(
            "tokenizer: {} (vocabulary {})",
            tokenizer.path.display(),
            config.model.vocab
        );
    }
    if let Some(cache) = &corpus.cache {
        say!("token cache: {}", cache.display());
    }
    say!(
        "run directory: {}  (from step {} of {})",
        trainer.run_dir().display(),
        trainer.step(),
        config.steps
    );
}

/// The end-of-run summary: printed, written as `summary.json` (with `note`, if any), and
/// the loss chart. A collective: every rank calls it.
fn report(trainer: &mut Trainer, note: Option<&str>) -> Result<()> {
    let (live, rss) = (memory::peak_bytes() as u64, peak_rss_bytes());
    let ranks = trainer.rank_reports(live, rss)?;
    let timeline = trainer.pipeline_timelines()?;
    if trainer.rank() != 0 {
        return Ok(());
    }
    if let Some(timeline) = timeline {
        // The last step as it ran, for `tinyllm schedule --from RUN`.
        let json = serde_json::to_vec_pretty(&timeline).expect("the timeline serializes");
        write_atomic(
            &trainer.run_dir().join(crate::train::PIPELINE_TIMELINE_FILE),
            &json,
        )?;
    }
    let mut summary = trainer.summary(live, rss)?;
    if ranks.len() > 1 {
        summary.ranks = ranks;
    }
    if let Some(note) = note {
        crate::output::warn(&format!("summary.json was missing; {note}"));
        summary.note = Some(note.to_string());
    }
    let json = serde_json::to_vec_pretty(&summary).expect("the summary serializes");
    write_atomic(&trainer.run_dir().join("summary.json"), &json)?;
    let chart_path = trainer.run_dir().join("loss.svg");
    // A log axis: the loss falls fast from ln 256 and then creeps towards the entropy floor,
    // and the creeping is what a reader looks for.
    write_loss_chart(
        &chart_path,
        "tinyllm training loss",
        &[("", trainer.run_dir())],
        summary.entropy_floor,
        true,
    )?;
    say!(
        "step {}: train loss {:.4} (mean of the last steps)",
        summary.steps,
        summary.train_loss
    );
    if let Some(val) = summary.val_loss {
        let gap = summary
            .entropy_floor
            .map(|h| format!(", entropy floor {h:.4} (gap {:.4})", val - h))
            .unwrap_or_default();
        let bpb = (summary.val_bpb)
            .map(|b| format!(" ({b:.4} bits per byte)"))
            .unwrap_or_default();
        say!("validation loss {val:.4}{bpb}{gap}");
    }
    say!(
        "median {:.0} tokens/s ({:.2} s/step); peak live tensors {:.1} MiB{}",
        summary.tokens_per_s,
        summary.step_s,
        mib(summary.peak_live_bytes),
        describe_peak(summary.peak_rss_bytes)
    );
    for rank in &summary.ranks {
        say!(
            "rank {}: peak live tensors {:.1} MiB{}; sent {:.2} MiB per step, {:.3} s per step communicating ({:.1}% of its step time){}",
            rank.rank,
            mib(rank.peak_live_bytes),
            describe_peak(rank.peak_rss_bytes),
            rank.bytes_sent_per_step / f64::from(1u32 << 20),
            rank.comm_s_per_step,
            100.0 * rank.comm_share,
            if rank.overlapped_comm_s_per_step > 0.0 {
                format!(
                    ", {:.3} s on its communication thread",
                    rank.overlapped_comm_s_per_step
                )
            } else {
                String::new()
            },
        );
    }
    say!("loss chart: {}", chart_path.display());
    Ok(())
}

/// Bytes as MiB.
pub(super) fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Draws the train and validation losses of each `(label, run directory)` on one chart, with
/// the entropy floor when known; on a log y axis (so labelled) with `log_y`.
pub(super) fn write_loss_chart(
    path: &Path,
    title: &str,
    runs: &[(&str, &Path)],
    floor: Option<f64>,
    log_y: bool,
) -> Result<()> {
    let mut series = Vec::new();
    for (label, dir) in runs {
        let (mut train, mut val) = (Vec::new(), Vec::new());
        for record in read_records(&dir.join("metrics.jsonl"))? {
            match record {
                Record::Train { step, loss, .. } => train.push((step as f64, loss)),
                Record::Eval { step, val_loss, .. } => val.push((step as f64, val_loss)),
            }
        }
        let name = |what: &str| {
            if label.is_empty() {
                what.to_string()
            } else {
                format!("{label} {what}")
            }
        };
        series.push(Series {
            label: name("train loss"),
            points: train,
        });
        series.push(Series {
            label: name("validation loss"),
            points: val,
        });
    }
    let hlines: Vec<(String, f64)> = floor
        .map(|h| ("entropy floor".to_string(), h))
        .into_iter()
        .collect();
    write_line_chart(
        path,
        &LineChart {
            title,
            x_label: "optimizer step",
            y_label: if log_y {
                "loss (nats/byte, log scale)"
            } else {
                "loss (nats/byte)"
            },
            series: &series,
            hlines: &hlines,
            log_y,
        },
    )?;
    Ok(())
}
