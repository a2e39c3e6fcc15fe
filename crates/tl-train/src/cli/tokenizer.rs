//! `tinyllm tokenizer train`: a byte-level BPE trained on the user's text.

use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, Subcommand};

use crate::data::{DEFAULT_CHUNK_BYTES, DataError, Inputs, Tokenizer, split_text, train_bpe};
use crate::error::{Result, TrainError};
use crate::store::write_atomic;

/// Options of `tinyllm tokenizer`.
#[derive(Debug, Args)]
pub struct TokenizerArgs {
    #[command(subcommand)]
    command: TokenizerCommand,
}

#[derive(Debug, Subcommand)]
enum TokenizerCommand {
    /// Train a byte-level BPE (GPT-2's kind) on text, and write its tokenizer.json.
    Train(TrainTokenizerArgs),
}

/// Options of `tinyllm tokenizer train`.
#[derive(Debug, Args)]
pub struct TrainTokenizerArgs {
    /// The text: a UTF-8 file, a directory of .txt files (at any depth), or a .jsonl file of
    /// {"text": ...} lines, as `tinyllm train --data` takes it.
    #[arg(long, value_name = "PATH")]
    pub data: PathBuf,
    /// Tokens in the vocabulary: the 256 bytes, <|endoftext|> and the merges (fewer when
    /// the text runs out of pairs to merge).
    #[arg(long, value_name = "N")]
    pub vocab_size: usize,
    /// Where to write the tokenizer.json.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

/// Runs `tinyllm tokenizer`.
pub(super) fn tokenizer(args: &TokenizerArgs) -> Result<()> {
    match &args.command {
        TokenizerCommand::Train(args) => train(args),
    }
}

/// The largest vocabulary `tokenizer train` makes: the largest a model config may ask for.
const MAX_VOCAB: usize = 1 << 20;

fn train(args: &TrainTokenizerArgs) -> Result<()> {
    if args.vocab_size > MAX_VOCAB {
        return Err(TrainError::InvalidArgument {
            name: "vocab-size",
            value: args.vocab_size.to_string(),
            reason: format!("must be at most {MAX_VOCAB}"),
        });
    }
    let inputs = Inputs::find(&args.data)?;
    let bytes = inputs.total_bytes()?;
    let started = Instant::now();
    let progress = indicatif::ProgressBar::new(bytes);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "reading {wide_bar} {binary_bytes}/{binary_total_bytes} ({eta})",
    ) {
        progress.set_style(style);
    }
    // The reader streams stretches of text to the trainer through a short queue, so that
    // no more than a few are in memory besides the trainer's word counts.
    let (sender, receiver) = std::sync::mpsc::sync_channel::<String>(4);
    let (read, json) = std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let sender = sender;
            inputs.read(DEFAULT_CHUNK_BYTES, &progress, &mut |piece| {
                // In stretches of 64 KiB: the trainer's pre-tokenizer keeps tens of bytes a
                // byte of the text it cuts into words.
                for text in split_text(piece.text, 64 << 10) {
                    // A closed queue means the trainer failed: its error is the one to report.
                    let _ = sender.send(text.to_string());
                }
                Ok::<(), DataError>(())
            })
        });
        let json = train_bpe(receiver.into_iter(), args.vocab_size);
        (reader.join().expect("the reader does not panic"), json)
    });
    progress.finish_and_clear();
    read?;
    let json = json?;
    write_atomic(&args.out, json.as_bytes())?;
    let tokenizer = Tokenizer::load(&args.out)?;
    say!(
        "wrote {}: a byte-level BPE of {} tokens (asked for {}), SHA-256 {}, trained on {} \
         bytes in {:.1} s",
        args.out.display(),
        tokenizer.vocab_size(),
        args.vocab_size,
        tokenizer.sha256().unwrap_or_default(),
        bytes,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
