//! [`DataError`]: what can be wrong with the training data or a tokenizer.

use std::path::PathBuf;

use thiserror::Error;

/// Why data or a tokenizer cannot be used. Every message names the file (and the line, for
/// an error inside one).
#[derive(Debug, Error)]
pub enum DataError {
    /// A file is missing or cannot be read (or, for the token cache, written).
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// The data holds no bytes at all.
    #[error("{} is empty", path.display())]
    Empty {
        /// The file or directory.
        path: PathBuf,
    },
    /// A file is not UTF-8 text (a binary file given by mistake, or another encoding).
    #[error(
        "{} is not valid UTF-8: line {line}, the first bad byte at offset {offset}",
        path.display()
    )]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// The line of the bad byte, from 1.
        line: usize,
        /// Byte offset of the first byte that does not belong to valid UTF-8.
        offset: usize,
    },
    /// A line of a JSON Lines file is not JSON.
    #[error("{}, line {line}: not JSON ({reason})", path.display())]
    NotJson {
        /// The file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// What the parser said.
        reason: String,
    },
    /// A line of a JSON Lines file has no `text` string.
    #[error("{}, line {line}: no \"text\" string field (found {found})", path.display())]
    NoText {
        /// The file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// What the line holds instead.
        found: String,
    },
    /// A line of a JSON Lines file longer than the reader holds at once.
    #[error("{}, line {line}: longer than {limit} bytes, the most read at once", path.display())]
    LineTooLong {
        /// The file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// The reader's limit, bytes.
        limit: usize,
    },
    /// A directory given as data holds no `.txt` file.
    #[error("{} holds no .txt file (at any depth)", path.display())]
    NoTextFiles {
        /// The directory.
        path: PathBuf,
    },
    /// The data is a device or a pipe, which has no length and may never end.
    #[error(
        "{} is not a regular file or directory (a device or pipe may never end)",
        path.display()
    )]
    NotRegular {
        /// The path.
        path: PathBuf,
    },
    /// A split of the data is too short to hold one training window.
    #[error(
        "{} is too short: its {split} split holds {found} tokens, but a context of {context} \
         needs at least {needed} (one window of context + 1 tokens)",
        path.display()
    )]
    TooShort {
        /// The data.
        path: PathBuf,
        /// `training` or `validation`.
        split: &'static str,
        /// Tokens in the split.
        found: usize,
        /// The fewest that work for this context: `context + 1`.
        needed: usize,
        /// The model's context length, in tokens.
        context: usize,
    },
    /// Data longer than a run reads.
    #[error("{}: longer than {limit} bytes, the most a run reads", path.display())]
    TooLarge {
        /// The file or directory.
        path: PathBuf,
        /// The limit, bytes.
        limit: u64,
    },
    /// A file of the data is not the one a run's token cache was made from.
    #[error("{} changed since the run began (was {expected}, now {found})", path.display())]
    Changed {
        /// The file (or the data, when which file is not known).
        path: PathBuf,
        /// What it was.
        expected: String,
        /// What it is.
        found: String,
    },
    /// A file that is not a tokenizer the `tokenizers` crate loads.
    #[error("{} is not a tokenizer.json: {reason}", path.display())]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// What the loader said.
        reason: String,
    },
    /// A run's tokenizer file is not the one it started with.
    #[error(
        "the tokenizer {} changed since the run began (SHA-256 was {expected}, now {found}): \
         its ids would no longer be the model's",
        path.display()
    )]
    TokenizerChanged {
        /// The file.
        path: PathBuf,
        /// Its SHA-256 when the run began.
        expected: String,
        /// Its SHA-256 now.
        found: String,
    },
    /// A tokenizer failed on a text, or on ids.
    #[error("the tokenizer {} failed: {reason}", path.display())]
    Encode {
        /// The tokenizer's file.
        path: PathBuf,
        /// What it said.
        reason: String,
    },
    /// A BPE vocabulary too small to hold the bytes and the end-of-text token.
    #[error(
        "a byte-level BPE needs a vocabulary of at least {needed} (256 bytes and <|endoftext|>), not {found}"
    )]
    VocabSize {
        /// The size asked for.
        found: usize,
        /// The smallest.
        needed: usize,
    },
    /// Training a tokenizer failed.
    #[error("training the tokenizer failed: {reason}")]
    Train {
        /// What the trainer said.
        reason: String,
    },
}
