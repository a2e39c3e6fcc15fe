//! [`Tokenizer`]: text to token ids and back, one byte a token or any Hugging Face
//! `tokenizer.json`, and the byte-level BPE that `tinyllm tokenizer train` makes.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, TokenizerImpl};

use super::error::DataError;

/// The end-of-text token a trained BPE gets, GPT-2's name for it.
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// Special tokens taken for the end of a document, in this order of preference: GPT-2's,
/// Llama 3's, Llama 2's and SentencePiece's, Gemma's.
const END_OF_TEXT_NAMES: [&str; 4] = [END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>"];

/// The largest `tokenizer.json` read (Llama 3's is 9 MB; a bigger file is a mistake).
const MAX_TOKENIZER_FILE_BYTES: usize = 256 << 20;

/// Text to token ids and back.
///
/// [`Bytes`](Tokenizer::Bytes) needs no file: every byte of the UTF-8 text is its own token,
/// a vocabulary of 256, and a document ends with a newline byte. A
/// [`File`](Tokenizer::File) is any Hugging Face `tokenizer.json`, run by the `tokenizers`
/// crate (the reference implementation); the model's vocabulary is its largest id plus one.
///
/// ```
/// use tl_train::data::Tokenizer;
/// let bytes = Tokenizer::Bytes;
/// assert_eq!(bytes.encode("hé")?, [104, 195, 169]);
/// assert_eq!(bytes.decode(&[104, 195, 169])?, "hé");
/// assert_eq!((bytes.vocab_size(), bytes.end_of_text()), (256, vec![10]));
/// # Ok::<(), tl_train::data::DataError>(())
/// ```
#[derive(Clone, Debug)]
pub enum Tokenizer {
    /// One token a byte.
    Bytes,
    /// A `tokenizer.json`.
    File(Box<FileTokenizer>),
}

/// A `tokenizer.json` as loaded, with what a run records of it.
#[derive(Clone, Debug)]
pub struct FileTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    sha256: String,
    vocab: usize,
    end_of_text: Option<u32>,
}

impl Tokenizer {
    /// The `tokenizer.json` at `path`.
    ///
    /// # Errors
    /// [`DataError::Io`] when it cannot be read, [`DataError::Tokenizer`] naming it when it is
    /// not a tokenizer the `tokenizers` crate loads, or has no token.
    pub fn load(path: &Path) -> Result<Tokenizer, DataError> {
        let bytes = super::corpus::read_limited(path, MAX_TOKENIZER_FILE_BYTES)?;
        let bad = |reason: String| DataError::Tokenizer {
            path: path.to_path_buf(),
            reason,
        };
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| bad(e.to_string()))?;
        let vocab = inner.get_vocab(true);
        let Some(&largest) = vocab.values().max() else {
            return Err(bad("it has no token".into()));
        };
        let end_of_text = END_OF_TEXT_NAMES
            .iter()
            .find_map(|name| inner.token_to_id(name));
        Ok(Tokenizer::File(Box::new(FileTokenizer {
            inner,
            path: path.to_path_buf(),
            sha256: crate::store::fingerprint(&bytes),
            vocab: largest as usize + 1,
            end_of_text,
        })))
    }

    /// Token ids of `text`, without any special token added around it (a document's end is
    /// marked by [`end_of_text`](Self::end_of_text), by whoever joins documents).
    ///
    /// # Errors
    /// [`DataError::Encode`] when the tokenizer fails on the text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::File(file) => file
                .inner
                .encode_fast(text, false)
                .map(|encoding| encoding.get_ids().to_vec())
                .map_err(|error| DataError::Encode {
                    path: file.path.clone(),
                    reason: error.to_string(),
                }),
        }
    }

    /// The text of `ids`. Bytes that do not form UTF-8 (a character cut by a window's edge)
    /// read as U+FFFD, and special tokens as their names.
    ///
    /// # Errors
    /// [`DataError::Encode`] when the tokenizer cannot decode an id (one outside its
    /// vocabulary).
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        match self {
            Tokenizer::Bytes => {
                let bytes: Vec<u8> = ids.iter().map(|&id| id as u8).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Tokenizer::File(file) => {
                file.inner
                    .decode(ids, false)
                    .map_err(|error| DataError::Encode {
                        path: file.path.clone(),
                        reason: error.to_string(),
                    })
            }
        }
    }

    /// How many bytes of UTF-8 text `ids` stand for: one a byte for bytes; the decoded text's
    /// length, special tokens (the end-of-text between documents) left out, for a file. A
    /// character cut at either end counts as the 3 bytes of U+FFFD.
    ///
    /// # Errors
    /// As [`decode`](Self::decode).
    pub fn text_bytes(&self, ids: &[u32]) -> Result<usize, DataError> {
        match self {
            Tokenizer::Bytes => Ok(ids.len()),
            Tokenizer::File(file) => (file.inner.decode(ids, true))
                .map(|text| text.len())
                .map_err(|error| DataError::Encode {
                    path: file.path.clone(),
                    reason: error.to_string(),
                }),
        }
    }

    /// Token ids run from 0 to `vocab_size() - 1`: the model's vocabulary.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::File(file) => file.vocab,
        }
    }

    /// The ids put between two documents: the tokenizer's end-of-text token (the first of
    /// `<|endoftext|>`, `<|end_of_text|>`, `</s>` and `<eos>` it has), or, for bytes and a
    /// tokenizer without one, a newline encoded.
    pub fn end_of_text(&self) -> Vec<u32> {
        match self {
            Tokenizer::File(file) => match file.end_of_text {
                Some(id) => vec![id],
                None => file
                    .inner
                    .encode_fast("\n", false)
                    .map(|encoding| encoding.get_ids().to_vec())
                    .unwrap_or_default(),
            },
            Tokenizer::Bytes => vec![u32::from(b'\n')],
        }
    }

    /// The special token that ends a document, and its id: the first of `<|endoftext|>`,
    /// `<|end_of_text|>`, `</s>` and `<eos>` the tokenizer has; `None` for bytes (whose
    /// documents end with a newline, an ordinary byte) and a tokenizer with none.
    pub fn end_of_text_token(&self) -> Option<(u32, String)> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::File(file) => {
                let id = file.end_of_text?;
                Some((id, file.inner.id_to_token(id)?))
            }
        }
    }

    /// The SHA-256 of the `tokenizer.json` file, `None` for bytes.
    pub fn sha256(&self) -> Option<&str> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::File(file) => Some(&file.sha256),
        }
    }

    /// The file it was loaded from, `None` for bytes.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::File(file) => Some(&file.path),
        }
    }

    /// `"bytes"`, or the file and its vocabulary, for messages.
    pub fn describe(&self) -> String {
        match self {
            Tokenizer::Bytes => "bytes (vocabulary 256)".into(),
            Tokenizer::File(file) => {
                format!("{} (vocabulary {})", file.path.display(), file.vocab)
            }
        }
    }
}

/// The `tokenizer.json` of [`Tokenizer::Bytes`], for other tools: a byte-level BPE without
/// merges whose token `b` is byte `b` (spelt as GPT-2 spells bytes, `Ġ` for a space), so
/// Hugging Face's `tokenizers` and `transformers` encode any text into its UTF-8 bytes and
/// decode ids back, as tinyllm does. No special token, no text cut into words.
///
/// ```
/// let json = tl_train::data::bytes_tokenizer_json();
/// let file = tempfile::NamedTempFile::new().unwrap();
/// std::fs::write(file.path(), &json).unwrap();
/// let bytes = tl_train::data::Tokenizer::load(file.path())?;
/// assert_eq!(bytes.encode("hé ")?, [104, 195, 169, 32]);
/// assert_eq!(bytes.vocab_size(), 256);
/// # Ok::<(), tl_train::data::DataError>(())
/// ```
pub fn bytes_tokenizer_json() -> String {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8)
        .map(|b| (byte_char(b).to_string(), serde_json::Value::from(b)))
        .collect();
    let byte_level = serde_json::json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false
    });
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []
        }
    });
    let mut text = serde_json::to_string_pretty(&json).expect("JSON serializes");
    text.push('\n');
    text
}

/// GPT-2's spelling of byte `b` in a byte-level vocabulary: the printable bytes (`!`–`~`,
/// `¡`–`¬`, `®`–`ÿ`) as themselves, the other 68 as the characters from U+0100 on, in order.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        char::from(b)
    } else {
        let before = (0..b).filter(|&c| !printable(c)).count() as u32;
        char::from_u32(256 + before).expect("a character")
    }
}

/// The smallest vocabulary a byte-level BPE can have: the 256 bytes and the end-of-text
/// token.
pub const MIN_BPE_VOCAB: usize = 257;

/// Trains a byte-level BPE (GPT-2's) of `vocab_size` tokens on `documents`, and returns its
/// `tokenizer.json`.
///
/// The vocabulary starts with the end-of-text token [`END_OF_TEXT`] (id 0) and the 256
/// bytes, so that any text encodes; the rest are merges, the most frequent pair of tokens
/// first (ties to the smaller pair of ids). Text is cut into words by GPT-2's pattern with no
/// space added in front, so decoding the ids of any text gives the text back. The same
/// documents and size give the same file, byte for byte (a test trains twice). A text with
/// fewer distinct pairs than the size asks for gives a smaller vocabulary.
///
/// # Errors
/// [`DataError::VocabSize`] when `vocab_size` is below [`MIN_BPE_VOCAB`];
/// [`DataError::Train`] when training fails.
///
/// ```
/// use tl_train::data::{Tokenizer, train_bpe};
/// let text = "the cat sat on the mat. the cat ate. ".repeat(20);
/// let json = train_bpe([text].into_iter(), 265)?;
/// let file = tempfile::NamedTempFile::new().unwrap();
/// std::fs::write(file.path(), &json).unwrap();
/// let bpe = Tokenizer::load(file.path())?;
/// assert_eq!(bpe.vocab_size(), 265);
/// let ids = bpe.encode("the cat sat")?;
/// assert!(ids.len() < "the cat sat".len());
/// assert_eq!(bpe.decode(&ids)?, "the cat sat");
/// # Ok::<(), tl_train::data::DataError>(())
/// ```
pub fn train_bpe<I, S>(documents: I, vocab_size: usize) -> Result<String, DataError>
where
    I: Iterator<Item = S> + Send,
    S: AsRef<str> + Send,
{
    if vocab_size < MIN_BPE_VOCAB {
        return Err(DataError::VocabSize {
            found: vocab_size,
            needed: MIN_BPE_VOCAB,
        });
    }
    let failed = |error: tokenizers::Error| DataError::Train {
        reason: error.to_string(),
    };
    let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(0)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
        .initial_alphabet(alphabet)
        .build();
    let byte_level = ByteLevel::new(false, false, true);
    let mut tokenizer: TokenizerImpl<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel> =
        TokenizerImpl::new(BPE::default());
    tokenizer
        .with_pre_tokenizer(Some(byte_level))
        .with_post_processor(Some(byte_level))
        .with_decoder(Some(byte_level));
    tokenizer.train(&mut trainer, documents).map_err(failed)?;
    let mut json = tokenizer.to_string(true).map_err(failed)?;
    json.push('\n');
    Ok(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Some 60 kB of English prose, code and tables: this workspace's guides.
    fn english(part: usize) -> String {
        let guides = [
            include_str!("../../../../docs/training.md"),
            include_str!("../../../../docs/mixed-precision.md"),
            include_str!("../../../../docs/architecture.md"),
        ];
        guides[part].to_string()
    }

    fn load(json: &str) -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json).unwrap();
        let tokenizer = Tokenizer::load(&path).unwrap();
        (dir, tokenizer)
    }

    #[test]
    fn a_trained_bpe_round_trips_every_test_string() {
        let json = train_bpe([english(0)].into_iter(), 1000).unwrap();
        let (_dir, bpe) = load(&json);
        assert_eq!(bpe.vocab_size(), 1000);
        assert_eq!(bpe.end_of_text(), [0], "the end-of-text token comes first");
        let strings = [
            "The lazy fox chases two birds near the river.\n",
            "",
            " leading and trailing spaces  ",
            "\n\n\ttabs\r\nand CRLF\r\n",
            "naïve café, Ünïcödé — “quotes” 漢字 🦀 emoji",
            "numbers 0123456789 and symbols !@#$%^&*()_+{}|:<>?",
            "a word the grammar never saw: floccinaucinihilipilification",
            "<|endoftext|> spelled out inside a text",
            "\u{0}\u{7f}\u{80}\u{ffff}\u{10ffff}",
        ];
        for text in strings {
            let ids = bpe.encode(text).unwrap();
            assert!(ids.iter().all(|&id| (id as usize) < 1000), "{text:?}");
            assert_eq!(bpe.decode(&ids).unwrap(), text, "{ids:?}");
        }
        let sentence = bpe.encode("The model trains on the data.").unwrap();
        assert!(sentence.len() < 12, "merges shorten English: {sentence:?}");
    }

    #[test]
    fn the_same_text_and_size_give_the_same_file_twice() {
        let documents = || [english(1), english(2)].into_iter();
        let first = train_bpe(documents(), 2000).unwrap();
        let second = train_bpe(documents(), 2000).unwrap();
        // Not assert_eq: a failure would print two files of 100 kB.
        assert!(first == second, "two trainings differ");
        assert!(train_bpe(documents(), 2001).unwrap() != first);
    }

    #[test]
    fn a_vocabulary_without_room_for_the_bytes_is_refused() {
        let error = train_bpe(["text"].into_iter(), 256).unwrap_err();
        assert!(matches!(
            error,
            DataError::VocabSize {
                found: 256,
                needed: 257
            }
        ));
        assert!(error.to_string().contains("257"), "{error}");
    }

    #[test]
    fn a_file_that_is_not_a_tokenizer_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("broken.json");
        std::fs::write(&path, "{\"model\": 3}").unwrap();
        let error = Tokenizer::load(&path).unwrap_err();
        assert!(matches!(error, DataError::Tokenizer { .. }), "{error}");
        assert!(error.to_string().contains("broken.json"), "{error}");
        let missing = dir.path().join("missing.json");
        let error = Tokenizer::load(&missing).unwrap_err();
        assert!(matches!(error, DataError::Io { .. }), "{error}");
        assert!(error.to_string().contains("missing.json"), "{error}");
    }

    #[test]
    fn the_bytes_tokenizer_json_is_the_crates_byte_level_alphabet_in_byte_order() {
        let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
        let ours: HashSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(ours, alphabet);
        assert_eq!(
            (byte_char(b' '), byte_char(b'\n'), byte_char(b'A')),
            ('Ġ', 'Ċ', 'A')
        );
        let (_dir, file) = load(&bytes_tokenizer_json());
        let text = "any text: é, 漢字, 🦀, \u{0}\t\r\n <|endoftext|>";
        let ids = file.encode(text).unwrap();
        assert_eq!(ids, Tokenizer::Bytes.encode(text).unwrap());
        assert_eq!(file.decode(&ids).unwrap(), text);
        assert_eq!(file.end_of_text_token(), None);
        let all: Vec<u32> = (0..256).collect();
        assert_eq!(
            file.decode(&all).unwrap(),
            Tokenizer::Bytes.decode(&all).unwrap()
        );
    }

    #[test]
    fn bytes_encode_each_byte_and_end_a_document_with_a_newline() {
        let bytes = Tokenizer::Bytes;
        assert_eq!(bytes.encode("ab\n").unwrap(), [97, 98, 10]);
        assert_eq!(bytes.decode(&[0xE2, 0x82]).unwrap(), "\u{fffd}");
        assert_eq!(bytes.sha256(), None);
    }
}
