//! [`Corpus`]: the train and validation tokens of a run, from the built-in grammar or from
//! files through the token cache.

use std::path::{Path, PathBuf};

use tl_tensor::Generator;

use super::cache;
use super::error::DataError;
use super::grammar::Grammar;
use super::inputs::Inputs;
use super::tokenizer::Tokenizer;
use super::tokens::Tokens;
use crate::train::FileFingerprint;

/// The token streams a run trains and validates on, and where they come from.
#[derive(Clone, Debug, PartialEq)]
pub struct Corpus {
    /// What the data is: `"built-in grammar (seed S)"` or the path `--data` named.
    pub source: String,
    /// The training split.
    pub train: Tokens,
    /// The validation split.
    pub validation: Tokens,
    /// The entropy rate of the source in nats per byte, the floor of the loss, when known
    /// (for the built-in grammar; not for files).
    pub entropy_nats_per_byte: Option<f64>,
    /// The data's size and SHA-256 (see [`Inputs::fingerprint`]); `None` for the built-in
    /// grammar.
    pub fingerprint: Option<FileFingerprint>,
    /// The token cache the splits are mapped from, for files.
    pub cache: Option<PathBuf>,
}

/// Where and how [`Corpus::from_path`] reads and caches.
#[derive(Clone, Copy, Debug)]
pub struct CacheOptions<'a> {
    /// The directory of token caches (one subdirectory a key).
    pub root: &'a Path,
    /// The most bytes of text read and tokenized at once (see [`Inputs::read`]).
    pub chunk_bytes: usize,
    /// A resumed run's fingerprint of its data: its cache is used when the files are as they
    /// were, without reading them.
    pub expected: Option<&'a FileFingerprint>,
}

/// The most bytes of text read and tokenized at once, unless a test caps it lower.
pub const DEFAULT_CHUNK_BYTES: usize = 16 << 20;

impl Corpus {
    /// `n_bytes` of text from [`Grammar::default_english`], generated from `seed`, as byte
    /// tokens, the last tenth held out: the same seed gives the same bytes on every machine.
    ///
    /// ```
    /// use tl_train::data::Corpus;
    /// let corpus = Corpus::builtin(1, 10_000);
    /// assert_eq!((corpus.train.len(), corpus.validation.len()), (9_000, 1_000));
    /// assert_eq!(corpus.source, "built-in grammar (seed 1)");
    /// assert!(corpus.entropy_nats_per_byte.is_some());
    /// ```
    pub fn builtin(seed: u64, n_bytes: usize) -> Corpus {
        let grammar = Grammar::default_english();
        let mut text = grammar.generate(&Generator::new(seed), n_bytes);
        let validation = text.split_off(text.len() - text.len() / 10);
        Corpus {
            source: format!("built-in grammar (seed {seed})"),
            train: Tokens::from_bytes(text),
            validation: Tokens::from_bytes(validation),
            entropy_nats_per_byte: Some(grammar.entropy_nats_per_byte()),
            fingerprint: None,
            cache: None,
        }
    }

    /// [`builtin`](Self::builtin)'s text in `tokenizer`'s tokens: each split encoded on its
    /// own. The entropy floor, per byte, is then not the loss's unit and is left out.
    ///
    /// # Errors
    /// [`DataError::Encode`] when the tokenizer fails.
    pub fn builtin_tokenized(
        seed: u64,
        n_bytes: usize,
        tokenizer: &Tokenizer,
    ) -> Result<Corpus, DataError> {
        let corpus = Corpus::builtin(seed, n_bytes);
        if let Tokenizer::Bytes = tokenizer {
            return Ok(corpus);
        }
        let encode = |tokens: &Tokens| -> Result<Tokens, DataError> {
            let text = String::from_utf8(tokens.to_bytes()).expect("the grammar writes ASCII");
            Ok(Tokens::from_ids(tokenizer.encode(&text)?))
        };
        Ok(Corpus {
            source: format!("{} in {}", corpus.source, tokenizer.describe()),
            train: encode(&corpus.train)?,
            validation: encode(&corpus.validation)?,
            entropy_nats_per_byte: None,
            ..corpus
        })
    }

    /// Zero tokens standing in for data where only the batches' shapes matter (a plan's meta
    /// run): room for one window of `context` tokens and its targets in each split.
    ///
    /// ```
    /// use tl_train::data::Corpus;
    /// let corpus = Corpus::stand_in(8);
    /// assert_eq!((corpus.train.len(), corpus.validation.len()), (9, 9));
    /// ```
    pub fn stand_in(context: usize) -> Corpus {
        Corpus {
            source: "a stand-in of zero bytes".into(),
            train: Tokens::from_bytes(vec![0; context + 1]),
            validation: Tokens::from_bytes(vec![0; context + 1]),
            entropy_nats_per_byte: None,
            fingerprint: None,
            cache: None,
        }
    }

    /// The documents of `path` (a text file, a directory of `.txt` files, or a `.jsonl`
    /// file: see [`Inputs`]) tokenized by `tokenizer` and separated by its
    /// [end-of-text](Tokenizer::end_of_text) ids, through the token cache, for a model with a
    /// context of `context` tokens.
    ///
    /// The validation split is the shortest run of whole last documents that holds a tenth
    /// of the tokens (the last tenth of a single document).
    ///
    /// ```
    /// use tl_train::data::{CacheOptions, Corpus, Tokenizer};
    /// let dir = tempfile::tempdir().unwrap();
    /// let data = dir.path().join("text.txt");
    /// std::fs::write(&data, "one line of text\n".repeat(10)).unwrap();
    /// let cache = dir.path().join("cache");
    /// let options = CacheOptions { root: &cache, chunk_bytes: 1 << 20, expected: None };
    /// let corpus = Corpus::from_path(&data, &Tokenizer::Bytes, 8, options)?;
    /// assert_eq!((corpus.train.len(), corpus.validation.len()), (153, 17));
    /// assert_eq!(corpus.fingerprint.unwrap().bytes, 170);
    /// # Ok::<(), tl_train::data::DataError>(())
    /// ```
    ///
    /// # Errors
    /// What [`Inputs::find`] and the cache report: a file that cannot be read, is empty, is
    /// not UTF-8 (naming the line) or not JSON Lines, and [`DataError::Changed`] when
    /// `options.expected` is not the data's fingerprint; [`DataError::TooShort`] when a
    /// split cannot hold one window of `context + 1` tokens.
    pub fn from_path(
        path: &Path,
        tokenizer: &Tokenizer,
        context: usize,
        options: CacheOptions<'_>,
    ) -> Result<Corpus, DataError> {
        let inputs = Inputs::find(path)?;
        let cached = cache::load(
            &inputs,
            tokenizer,
            options.root,
            options.chunk_bytes,
            options.expected,
        )?;
        let split = cached.manifest.validation_start as usize;
        let train = cached.tokens.slice(0..split);
        let validation = cached.tokens.slice(split..cached.tokens.len());
        for (name, tokens) in [("training", &train), ("validation", &validation)] {
            if tokens.len() <= context {
                return Err(DataError::TooShort {
                    path: path.to_path_buf(),
                    split: name,
                    found: tokens.len(),
                    needed: context + 1,
                    context,
                });
            }
        }
        Ok(Corpus {
            source: path.display().to_string(),
            train,
            validation,
            entropy_nats_per_byte: None,
            fingerprint: Some(cached.manifest.data.clone()),
            cache: Some(cached.dir),
        })
    }
}

/// The bytes of `path`, refusing a file longer than `limit` without reading past it (a
/// device such as `/dev/zero` never ends).
pub(super) fn read_limited(path: &Path, limit: usize) -> Result<Vec<u8>, DataError> {
    use std::io::Read;
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut text = Vec::new();
    file.take(limit as u64 + 1)
        .read_to_end(&mut text)
        .map_err(io)?;
    if text.len() > limit {
        return Err(DataError::TooLarge {
            path: path.to_path_buf(),
            limit: limit as u64,
        });
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn file_with(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(bytes).unwrap();
        file
    }

    fn from_path(path: &Path, context: usize) -> Result<Corpus, DataError> {
        let cache = tempfile::tempdir().unwrap();
        let options = CacheOptions {
            root: cache.path(),
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            expected: None,
        };
        Corpus::from_path(path, &Tokenizer::Bytes, context, options)
    }

    #[test]
    fn builtin_is_the_grammar_text_split_ninety_ten() {
        let corpus = Corpus::builtin(5, 1_005);
        // 1005 / 10 = 100 validation bytes (rounded down), 905 train bytes.
        assert_eq!((corpus.train.len(), corpus.validation.len()), (905, 100));
        let text = Grammar::default_english().generate(&Generator::new(5), 1_005);
        assert_eq!(corpus.train.to_bytes(), text[..905]);
        assert_eq!(corpus.validation.to_bytes(), text[905..]);
        let rate = Grammar::default_english().entropy_nats_per_byte();
        assert_eq!(corpus.entropy_nats_per_byte, Some(rate));
    }

    #[test]
    fn a_text_file_holds_out_its_last_tenth() {
        let text: Vec<u8> = (0..40).map(|i| b'a' + i % 26).collect();
        let file = file_with(&text);
        // context 3: 4 validation bytes, 36 train bytes, one window of 4 in each.
        let corpus = from_path(file.path(), 3).unwrap();
        assert_eq!(corpus.train.to_bytes(), text[..36]);
        assert_eq!(corpus.validation.to_bytes(), text[36..]);
        assert_eq!(corpus.source, file.path().display().to_string());
        assert_eq!(corpus.entropy_nats_per_byte, None);
        assert_eq!(corpus.fingerprint, Some(FileFingerprint::of(&text)));
    }

    #[test]
    fn a_file_one_byte_too_short_is_refused() {
        // 39 bytes: 3 validation bytes, one short of a window of context 3 and its target.
        let file = file_with(&[b'x'; 39]);
        let error = from_path(file.path(), 3).unwrap_err();
        assert!(matches!(
            error,
            DataError::TooShort {
                split: "validation",
                found: 3,
                needed: 4,
                context: 3,
                ..
            }
        ));
        let message = error.to_string();
        assert!(
            message.contains("3 tokens") && message.contains("at least 4"),
            "{message}"
        );
        assert!(
            message.contains(&file.path().display().to_string()),
            "{message}"
        );
    }

    #[test]
    fn missing_empty_and_non_utf8_files_are_errors_naming_them() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.txt");
        let error = from_path(&missing, 3).unwrap_err();
        assert!(
            matches!(&error, DataError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
        );
        assert!(error.to_string().contains("missing.txt"));
        assert!(std::error::Error::source(&error).is_some());

        let empty = file_with(b"");
        assert!(matches!(
            from_path(empty.path(), 3),
            Err(DataError::Empty { .. })
        ));

        // "ab" then "é" (0xC3 0xA9), then a lone continuation byte at offset 4.
        let binary = file_with(&[b'a', b'b', 0xC3, 0xA9, 0xA9, b'c']);
        let error = from_path(binary.path(), 0).unwrap_err();
        assert!(matches!(
            error,
            DataError::NotUtf8 {
                offset: 4,
                line: 1,
                ..
            }
        ));
        assert!(error.to_string().contains("offset 4"));
    }
}
