//! `tinyllm sample`: continue a prompt with a trained model.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use tl_tensor::Generator;

use crate::data::Tokenizer;
use crate::error::{Result, TrainError};
use crate::train::{TOKENIZER_FILE, TrainConfig, load_model_at};

/// Options of `tinyllm sample`.
#[derive(Debug, Args)]
pub struct SampleArgs {
    /// Run directory of a trained model.
    #[arg(long, value_name = "DIR")]
    pub from: PathBuf,
    /// Load the checkpoint of this step instead of the latest.
    #[arg(long, value_name = "STEP")]
    pub checkpoint: Option<u64>,
    /// Text to continue [default: a newline].
    #[arg(long, value_name = "TEXT")]
    pub prompt: Option<String>,
    /// Continue the bytes of this file instead of --prompt.
    #[arg(long, value_name = "FILE", conflicts_with = "prompt")]
    pub prompt_file: Option<PathBuf>,
    /// Tokens to generate (bytes, for a run of byte tokens).
    #[arg(long, value_name = "N", default_value_t = 200)]
    pub tokens: usize,
    /// Encode the prompt and decode the text with this tokenizer.json [default: the run's
    /// own copy of its tokenizer, or bytes].
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Sampling temperature; 0 picks the most likely token.
    #[arg(
        long,
        value_name = "T",
        default_value_t = 0.8,
        allow_negative_numbers = true
    )]
    pub temperature: f64,
    /// Draw each token only among the K most likely (1 picks the most likely) [default: all].
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Seed of the sampling; sample i of --num-samples draws from seed S + i - 1.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Continuations of the prompt to generate, separated by a line `--- sample i ---`.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub num_samples: usize,
    /// Compute threads.
    #[command(flatten)]
    pub threads: super::Threads,
}

/// Runs `tinyllm sample`: prints the prompt and its continuation to stdout, once per sample.
pub(super) fn sample(args: &SampleArgs) -> Result<()> {
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        return Err(TrainError::InvalidArgument {
            name: "temperature",
            value: args.temperature.to_string(),
            reason: "must be finite and >= 0".into(),
        });
    }
    if !(1..=MAX_SAMPLE_TOKENS).contains(&args.tokens) {
        return Err(TrainError::InvalidArgument {
            name: "tokens",
            value: args.tokens.to_string(),
            reason: format!("must be in 1..={MAX_SAMPLE_TOKENS}"),
        });
    }
    if !(1..=MAX_SAMPLES).contains(&args.num_samples) {
        return Err(TrainError::InvalidArgument {
            name: "num-samples",
            value: args.num_samples.to_string(),
            reason: format!("must be in 1..={MAX_SAMPLES}"),
        });
    }
    let prompt = prompt_bytes(args)?;
    let (config, model) = load_model_at(&args.from, args.checkpoint)?;
    let vocab = config.model.vocab;
    if let Some(k) = args.top_k
        && !(1..=vocab).contains(&k)
    {
        return Err(TrainError::InvalidArgument {
            name: "top-k",
            value: k.to_string(),
            reason: format!("must be in 1..={vocab}, the model's vocabulary"),
        });
    }
    let tokenizer = run_tokenizer_of(&args.from, args.tokenizer.as_deref(), &config)?;
    let ids: Vec<usize> = match &tokenizer {
        Tokenizer::Bytes => prompt.iter().map(|&byte| usize::from(byte)).collect(),
        _ => {
            let text =
                String::from_utf8(prompt.clone()).map_err(|error| TrainError::InvalidArgument {
                    name: "prompt",
                    value: format!("{} bytes", prompt.len()),
                    reason: format!(
                        "is not UTF-8 (at byte {}), which a tokenizer reads",
                        error.utf8_error().valid_up_to()
                    ),
                })?;
            let ids = tokenizer.encode(&text)?;
            ids.into_iter().map(|id| id as usize).collect()
        }
    };
    if ids.is_empty() {
        return Err(TrainError::InvalidArgument {
            name: "prompt",
            value: String::from_utf8_lossy(&prompt).into_owned(),
            reason: "encodes to no token".into(),
        });
    }
    if let Some(&id) = ids.iter().find(|&&id| id >= vocab) {
        return Err(TrainError::InvalidArgument {
            name: "prompt",
            value: format!("a token {id}"),
            reason: format!("the model's vocabulary has {vocab} tokens"),
        });
    }
    let mut stdout = std::io::stdout().lock();
    for index in 0..args.num_samples {
        let seed = args.seed.wrapping_add(index as u64);
        let generated = model.generate(
            &ids,
            args.tokens,
            args.temperature,
            args.top_k,
            &Generator::new(seed),
        );
        let mut bytes = Vec::new();
        if index > 0 {
            bytes.extend_from_slice(format!("--- sample {} ---\n", index + 1).as_bytes());
        }
        // The prompt and its continuation decoded together: a character split between them
        // reads whole.
        let all: Vec<u32> = ids.iter().chain(&generated).map(|&id| id as u32).collect();
        bytes.extend_from_slice(tokenizer.decode(&all)?.as_bytes());
        bytes.push(b'\n');
        match stdout.write_all(&bytes).and_then(|()| stdout.flush()) {
            Ok(()) => {}
            // A reader that stopped reading (`| head`) has what it wanted.
            Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
            Err(source) => return Err(TrainError::io("stdout", source)),
        }
    }
    Ok(())
}

/// The tokenizer of the run's ids: `--tokenizer`, else the run's copy of its own, else the
/// file its config names, else bytes. A file's vocabulary must be the model's.
pub(super) fn run_tokenizer_of(
    run_dir: &std::path::Path,
    given: Option<&std::path::Path>,
    config: &TrainConfig,
) -> Result<Tokenizer> {
    let run_copy = run_dir.join(TOKENIZER_FILE);
    let path = match (given, &config.tokenizer) {
        (Some(path), _) => path.to_path_buf(),
        (None, Some(_)) if run_copy.is_file() => run_copy,
        (None, Some(file)) => file.path.clone(),
        (None, None) => return Ok(Tokenizer::Bytes),
    };
    let tokenizer = Tokenizer::load(&path)?;
    if !config.takes_tokenizer_of(tokenizer.vocab_size()) {
        return Err(TrainError::InvalidArgument {
            name: "tokenizer",
            value: path.display().to_string(),
            reason: format!(
                "has a vocabulary of {}, the model {}",
                tokenizer.vocab_size(),
                config.model.vocab
            ),
        });
    }
    Ok(tokenizer)
}

/// The prompt's bytes: of `--prompt-file`, of `--prompt`, or a newline; never empty.
fn prompt_bytes(args: &SampleArgs) -> Result<Vec<u8>> {
    let (bytes, name, value) = match (&args.prompt_file, &args.prompt) {
        (Some(path), _) => {
            let bytes = crate::store::read_bounded(
                path,
                crate::train::limits::MAX_PROMPT_FILE_BYTES,
                "--prompt-file",
            )?;
            (bytes, "prompt-file", path.display().to_string())
        }
        (None, Some(text)) => (text.clone().into_bytes(), "prompt", "\"\"".to_string()),
        (None, None) => (b"\n".to_vec(), "prompt", String::new()),
    };
    if bytes.is_empty() {
        return Err(TrainError::InvalidArgument {
            name,
            value,
            reason: "must hold at least one byte".into(),
        });
    }
    Ok(bytes)
}

/// The most bytes one `tinyllm sample` generates.
const MAX_SAMPLE_TOKENS: usize = 1 << 20;

/// The most continuations one `tinyllm sample` generates.
const MAX_SAMPLES: usize = 1000;
