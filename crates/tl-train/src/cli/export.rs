//! `tinyllm export` (a run's model in Hugging Face's Llama format) and `tinyllm logits`
//! (the model's logits for a prompt, as JSON, to compare an export with transformers).

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use tl_tensor::nn::Module;
use tl_tensor::no_grad;

use crate::error::{Result, TrainError};
use crate::export::export_run;
use crate::train::load_model;

/// Options of `tinyllm export`.
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// Run directory whose latest checkpoint to export.
    #[arg(long, value_name = "RUN_DIR")]
    pub from: PathBuf,
    /// Directory to write (config.json and model.safetensors); must not exist or be empty.
    #[arg(long, value_name = "DIR")]
    pub to: PathBuf,
    /// Replace --to even if it is not empty.
    #[arg(long)]
    pub force: bool,
}

/// Options of `tinyllm logits`.
#[derive(Debug, Args)]
pub struct LogitsArgs {
    /// Run directory of a trained model.
    #[arg(long, value_name = "RUN_DIR")]
    pub from: PathBuf,
    /// Text to encode with the run's tokenizer (at most the model's context in tokens).
    #[arg(long, value_name = "TEXT")]
    pub prompt: String,
    /// Print the logits of every position, not only the last.
    #[arg(long)]
    pub all_positions: bool,
    /// Compute threads.
    #[command(flatten)]
    pub threads: super::Threads,
}

/// Runs `tinyllm export`.
pub(super) fn export(args: &ExportArgs) -> Result<()> {
    let exported = export_run(&args.from, &args.to, args.force)?;
    let step = exported
        .checkpoint_step
        .map_or_else(|| "?".to_string(), |step| step.to_string());
    say!(
        "exported step {step} of {} to {} (Hugging Face Llama: config.json, model.safetensors)",
        args.from.display(),
        exported.dir.display()
    );
    Ok(())
}

/// Runs `tinyllm logits`: prints one JSON object to stdout,
/// `{"ids": [..], "positions": [..], "logits": [[..vocab..], ..]}`, a row of logits for
/// each position listed.
pub(super) fn logits(args: &LogitsArgs) -> Result<()> {
    let (config, model) = load_model(&args.from)?;
    // The run's own tokenizer (bytes, or its copy of the tokenizer.json it trained with).
    let tokenizer = super::sample::run_tokenizer_of(&args.from, None, &config)?;
    let ids: Vec<usize> = (tokenizer.encode(&args.prompt)?)
        .into_iter()
        .map(|id| id as usize)
        .collect();
    let context = model.config().context;
    if ids.is_empty() || ids.len() > context {
        return Err(TrainError::InvalidArgument {
            name: "prompt",
            value: format!("{} tokens", ids.len()),
            reason: format!("must hold 1..={context} tokens (the model's context)"),
        });
    }
    let _inference = no_grad();
    model.set_training(false);
    let logits = model.forward_ids(&ids, 1, ids.len())?.to_vec();
    let vocab = model.config().vocab;
    let positions: Vec<usize> = if args.all_positions {
        (0..ids.len()).collect()
    } else {
        vec![ids.len() - 1]
    };
    let rows: Vec<&[f32]> = positions
        .iter()
        .map(|&t| &logits[t * vocab..(t + 1) * vocab])
        .collect();
    let json = serde_json::json!({ "ids": ids, "positions": positions, "logits": rows });
    let mut stdout = std::io::stdout().lock();
    match writeln!(stdout, "{json}").and_then(|()| stdout.flush()) {
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        result => result.map_err(|source| TrainError::io("stdout", source)),
    }
}
