//! [`DataError`]: what can be wrong with a text file given as training data.

use std::path::PathBuf;

use thiserror::Error;

/// Why a text file cannot be used as a corpus. Every message names the file.
#[derive(Debug, Error)]
pub enum DataError {
    /// The file is missing or cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// The file holds no bytes at all.
    #[error("{} is empty", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// The file is not UTF-8 text (a binary file given by mistake, or another encoding).
    #[error("{} is not valid UTF-8: the first bad byte is at offset {offset}", path.display())]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// Byte offset of the first byte that does not belong to valid UTF-8.
        offset: usize,
    },
    /// The file is too short to hold one training window in the train split and one in the
    /// validation split.
    #[error(
        "{} is too short: {found} bytes, but a context of {context} needs at least {needed} \
         (one window of context + 1 bytes in the validation tenth, and in the rest)",
        path.display()
    )]
    TooShort {
        /// The file.
        path: PathBuf,
        /// Bytes in the file.
        found: usize,
        /// The smallest size that works for this context.
        needed: usize,
        /// The model's context length, in bytes.
        context: usize,
    },
    /// A data file longer than the trainer reads (it holds the whole text in memory).
    #[error("{}: longer than {limit} bytes, the most a run reads", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The limit, bytes.
        limit: usize,
    },
}
