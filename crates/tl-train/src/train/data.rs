//! A run's data: its tokenizer (checked against the one it began with), where its token
//! cache lives, and its corpus loaded and checked against the model's vocabulary.

use std::path::{Path, PathBuf};

use super::config::{DataSource, FileFingerprint, TokenizerFile, TrainConfig};
use crate::data::{
    CacheOptions, Corpus, DEFAULT_CHUNK_BYTES, DataError, MIN_CHUNK_BYTES, Tokenizer,
};
use crate::error::{Result, TrainError};

/// Overrides where token caches are written (a directory of one subdirectory a cache).
pub const TOKEN_CACHE_ENV: &str = "TINYLLM_TOKEN_CACHE";

/// Caps the bytes of text read and tokenized at once (tests cap it to show that a corpus
/// larger than the cap trains); at least [`MIN_CHUNK_BYTES`].
pub const READ_CHUNK_ENV: &str = "TINYLLM_READ_CHUNK_BYTES";

/// The directory of token caches for a run in `run_dir`: `$TINYLLM_TOKEN_CACHE`, else
/// `token-cache` beside the run (so that the runs of one directory share their caches), else,
/// for a command without a run, `tinyllm-token-cache` in the system's temporary directory.
pub fn token_cache_root(run_dir: Option<&Path>) -> PathBuf {
    if let Some(root) = std::env::var_os(TOKEN_CACHE_ENV) {
        return PathBuf::from(root);
    }
    match run_dir {
        Some(run_dir) => {
            let absolute = std::path::absolute(run_dir).unwrap_or_else(|_| run_dir.to_path_buf());
            absolute
                .parent()
                .map_or_else(|| PathBuf::from("token-cache"), |p| p.join("token-cache"))
        }
        None => std::env::temp_dir().join("tinyllm-token-cache"),
    }
}

/// Bytes of text read at once: `$TINYLLM_READ_CHUNK_BYTES`, else [`DEFAULT_CHUNK_BYTES`].
fn chunk_bytes() -> Result<usize> {
    let Some(value) = std::env::var_os(READ_CHUNK_ENV) else {
        return Ok(DEFAULT_CHUNK_BYTES);
    };
    let value = value.to_string_lossy().into_owned();
    match value.parse::<usize>() {
        Ok(bytes) if bytes >= MIN_CHUNK_BYTES => Ok(bytes),
        _ => Err(TrainError::InvalidArgument {
            name: READ_CHUNK_ENV,
            value,
            reason: format!("must be a number of bytes, at least {MIN_CHUNK_BYTES}"),
        }),
    }
}

/// The tokenizer `path` names, as a run records it.
///
/// # Errors
/// [`TrainError::Data`] when it cannot be loaded, and [`TrainError::Io`] when its path
/// cannot be made absolute.
pub fn tokenizer_file(path: &Path) -> Result<(Tokenizer, TokenizerFile)> {
    let absolute = std::path::absolute(path).map_err(|source| TrainError::io(path, source))?;
    let tokenizer = Tokenizer::load(&absolute)?;
    let record = TokenizerFile {
        path: absolute,
        sha256: tokenizer.sha256().expect("a file").to_string(),
    };
    Ok((tokenizer, record))
}

/// The run's tokenizer: bytes, or its `tokenizer.json`, which must be the file the run began
/// with and give the model's vocabulary.
///
/// # Errors
/// [`TrainError::Data`] when the file cannot be loaded or changed
/// ([`DataError::TokenizerChanged`]); [`TrainError::InvalidConfig`] naming `vocab` when the
/// model's vocabulary is not the tokenizer's.
pub fn run_tokenizer(config: &TrainConfig) -> Result<Tokenizer> {
    let Some(file) = &config.tokenizer else {
        return Ok(Tokenizer::Bytes);
    };
    let tokenizer = Tokenizer::load(&file.path)?;
    let found = tokenizer.sha256().expect("a file");
    if found != file.sha256 {
        return Err(DataError::TokenizerChanged {
            path: file.path.clone(),
            expected: file.sha256.clone(),
            found: found.to_string(),
        }
        .into());
    }
    if !config.takes_tokenizer_of(tokenizer.vocab_size()) {
        return Err(TrainError::InvalidConfig {
            field: "vocab",
            value: config.model.vocab.to_string(),
            reason: format!(
                "the tokenizer {} has a vocabulary of {}",
                file.path.display(),
                tokenizer.vocab_size()
            ),
        });
    }
    Ok(tokenizer)
}

/// Loads the corpus a config names, through the token cache under `cache_root`, and checks
/// that the model's vocabulary holds every token of it. With `expected` (a resumed run's
/// fingerprint of its data), the cache is used without reading the files when they are as
/// they were.
///
/// # Errors
/// [`TrainError::Data`] for data that cannot be a corpus (and [`DataError::Changed`] when
/// it is not `expected`); [`TrainError::InvalidConfig`] naming `vocab` when the data holds a
/// token the vocabulary does not.
pub(crate) fn load_corpus(
    config: &TrainConfig,
    cache_root: &Path,
    expected: Option<&FileFingerprint>,
) -> Result<Corpus> {
    let tokenizer = run_tokenizer(config)?;
    let corpus = match &config.data {
        DataSource::Builtin { seed, bytes } => {
            Corpus::builtin_tokenized(*seed, *bytes, &tokenizer)?
        }
        DataSource::File { path } => {
            let options = CacheOptions {
                root: cache_root,
                chunk_bytes: chunk_bytes()?,
                expected,
            };
            Corpus::from_path(path, &tokenizer, config.model.context, options)?
        }
    };
    let vocab = config.model.vocab;
    if vocab >= tokenizer.vocab_size() {
        return Ok(corpus);
    }
    let outside = corpus
        .train
        .iter()
        .chain(corpus.validation.iter())
        .enumerate()
        .find(|&(_, id)| id >= vocab);
    if let Some((offset, id)) = outside {
        return Err(TrainError::InvalidConfig {
            field: "vocab",
            value: vocab.to_string(),
            reason: format!(
                "the data ({}) holds byte {id} at offset {offset}, a token outside the \
                 vocabulary; a byte vocabulary needs at least {} (256 holds every byte)",
                corpus.source,
                id + 1
            ),
        });
    }
    Ok(corpus)
}
