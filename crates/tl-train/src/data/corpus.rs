//! [`Corpus`]: the train and validation bytes of a run, from the built-in grammar or a file.

use std::path::Path;

use tl_tensor::Generator;

use super::error::DataError;
use super::grammar::Grammar;

/// The byte streams a run trains and validates on, and where they come from.
///
/// Tokens are bytes (a vocabulary of 256): any text works without a tokenizer. The last tenth
/// of the bytes is held out for validation, split at a byte index.
#[derive(Clone, Debug, PartialEq)]
pub struct Corpus {
    /// What the data is: `"built-in grammar (seed S)"` or the file's path.
    pub source: String,
    /// The first 90% of the bytes.
    pub train: Vec<u8>,
    /// The last 10% of the bytes.
    pub validation: Vec<u8>,
    /// The entropy rate of the source in nats per byte, the floor of the loss, when known
    /// (for the built-in grammar; not for a file).
    pub entropy_nats_per_byte: Option<f64>,
}

/// Bytes of an `n`-byte corpus held out for validation: the last tenth.
fn validation_len(n: usize) -> usize {
    n / 10
}

impl Corpus {
    /// `n_bytes` of text from [`Grammar::default_english`], generated from `seed`: the same
    /// seed gives the same bytes on every machine.
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
        let text = grammar.generate(&Generator::new(seed), n_bytes);
        let (train, validation) = split(text);
        Corpus {
            source: format!("built-in grammar (seed {seed})"),
            train,
            validation,
            entropy_nats_per_byte: Some(grammar.entropy_nats_per_byte()),
        }
    }

    /// Zero bytes standing in for data where only the batches' shapes matter (a plan's meta
    /// run): room for one window of `context` bytes and its targets in each split.
    ///
    /// ```
    /// use tl_train::data::Corpus;
    /// let corpus = Corpus::stand_in(8);
    /// assert_eq!((corpus.train.len(), corpus.validation.len()), (9, 9));
    /// ```
    pub fn stand_in(context: usize) -> Corpus {
        Corpus {
            source: "a stand-in of zero bytes".into(),
            train: vec![0; context + 1],
            validation: vec![0; context + 1],
            entropy_nats_per_byte: None,
        }
    }

    /// The bytes of a UTF-8 text file, for a model with a context of `context` bytes.
    ///
    /// # Errors
    /// A [`DataError`] naming the file when it cannot be read, is empty, is not valid UTF-8,
    /// or is shorter than `10 · (context + 1)` bytes: both the validation tenth and the rest
    /// must hold one window of `context` inputs and their next-byte targets.
    pub fn from_file(path: &Path, context: usize) -> Result<Corpus, DataError> {
        let text = read_limited(path, crate::train::limits::MAX_CORPUS_BYTES)?;
        if text.is_empty() {
            return Err(DataError::Empty {
                path: path.to_path_buf(),
            });
        }
        if let Err(error) = std::str::from_utf8(&text) {
            return Err(DataError::NotUtf8 {
                path: path.to_path_buf(),
                offset: error.valid_up_to(),
            });
        }
        // validation_len(n) >= context + 1 exactly when n >= 10 (context + 1), and the train
        // part is then nine times longer.
        let needed = 10 * (context + 1);
        if text.len() < needed {
            return Err(DataError::TooShort {
                path: path.to_path_buf(),
                found: text.len(),
                needed,
                context,
            });
        }
        let (train, validation) = split(text);
        Ok(Corpus {
            source: path.display().to_string(),
            train,
            validation,
            entropy_nats_per_byte: None,
        })
    }
}

/// The bytes of `path`, refusing a file longer than `limit` without reading past it (a
/// device such as `/dev/zero` never ends).
fn read_limited(path: &Path, limit: usize) -> Result<Vec<u8>, DataError> {
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
            limit,
        });
    }
    Ok(text)
}

fn split(mut text: Vec<u8>) -> (Vec<u8>, Vec<u8>) {
    let validation = text.split_off(text.len() - validation_len(text.len()));
    (text, validation)
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

    #[test]
    fn builtin_is_the_grammar_text_split_ninety_ten() {
        let corpus = Corpus::builtin(5, 1_005);
        // 1005 / 10 = 100 validation bytes (rounded down), 905 train bytes.
        assert_eq!((corpus.train.len(), corpus.validation.len()), (905, 100));
        let text = Grammar::default_english().generate(&Generator::new(5), 1_005);
        assert_eq!(corpus.train, text[..905]);
        assert_eq!(corpus.validation, text[905..]);
        let rate = Grammar::default_english().entropy_nats_per_byte();
        assert_eq!(corpus.entropy_nats_per_byte, Some(rate));
    }

    #[test]
    fn from_file_holds_out_the_last_tenth() {
        let text: Vec<u8> = (0..40).map(|i| b'a' + i % 26).collect();
        let file = file_with(&text);
        // context 3: needs 10 * (3 + 1) = 40 bytes; 4 validation bytes, 36 train bytes.
        let corpus = Corpus::from_file(file.path(), 3).unwrap();
        assert_eq!(corpus.train, text[..36]);
        assert_eq!(corpus.validation, text[36..]);
        assert_eq!(corpus.source, file.path().display().to_string());
        assert_eq!(corpus.entropy_nats_per_byte, None);
    }

    #[test]
    fn from_file_rejects_a_file_one_byte_too_short() {
        let file = file_with(&[b'x'; 39]);
        let error = Corpus::from_file(file.path(), 3).unwrap_err();
        assert!(matches!(
            error,
            DataError::TooShort {
                found: 39,
                needed: 40,
                context: 3,
                ..
            }
        ));
        let message = error.to_string();
        assert!(
            message.contains("39 bytes") && message.contains("at least 40"),
            "{message}"
        );
        assert!(
            message.contains(&file.path().display().to_string()),
            "{message}"
        );
    }

    #[test]
    fn from_file_reports_missing_empty_and_non_utf8_files() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.txt");
        let error = Corpus::from_file(&missing, 3).unwrap_err();
        assert!(
            matches!(&error, DataError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
        );
        assert!(error.to_string().contains("missing.txt"));
        assert!(std::error::Error::source(&error).is_some());

        let empty = file_with(b"");
        assert!(matches!(
            Corpus::from_file(empty.path(), 3),
            Err(DataError::Empty { .. })
        ));

        // "ab" then "é" (0xC3 0xA9), then a lone continuation byte at offset 4.
        let binary = file_with(&[b'a', b'b', 0xC3, 0xA9, 0xA9, b'c']);
        let error = Corpus::from_file(binary.path(), 0).unwrap_err();
        assert!(matches!(error, DataError::NotUtf8 { offset: 4, .. }));
        assert!(error.to_string().contains("offset 4"));
    }
}
