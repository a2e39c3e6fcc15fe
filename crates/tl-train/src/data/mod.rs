//! Training data: text from the built-in grammar, or from files (a text file, a directory of
//! `.txt` files, JSON Lines) tokenized once into a memory-mapped token cache; the tokenizers
//! (bytes, or any Hugging Face `tokenizer.json`); and the batches a trainer draws.
//!
//! Token ids are `usize` in batches; the built-in grammar's are bytes (a vocabulary of 256).
//!
//! ```
//! use tl_train::data::{Corpus, sample_batch};
//! use tl_tensor::Generator;
//! let corpus = Corpus::builtin(0, 5_000);
//! let batch = sample_batch(&corpus.train, 4, 32, &Generator::new(0));
//! assert_eq!(batch.inputs.len(), 4 * 32);
//! println!("loss floor: {:.4} nats/byte", corpus.entropy_nats_per_byte.unwrap());
//! ```

mod batch;
mod cache;
mod corpus;
mod english;
mod error;
mod grammar;
mod inputs;
mod tokenizer;
mod tokens;

pub use batch::{Batch, sample_batch, sequential_batches, skip_batch};
pub use cache::{Manifest, cache_key, validation_start};
pub use corpus::{CacheOptions, Corpus, DEFAULT_CHUNK_BYTES};
pub use error::DataError;
pub use grammar::{Expansion, Grammar};
pub use inputs::{InputFile, InputFormat, Inputs, MIN_CHUNK_BYTES, Piece, split_text};
pub use tokenizer::{
    END_OF_TEXT, FileTokenizer, MIN_BPE_VOCAB, Tokenizer, bytes_tokenizer_json, train_bpe,
};
pub use tokens::{IdWidth, TokenSource, Tokens};
