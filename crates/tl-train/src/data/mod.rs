//! Training data: byte-level text, from the built-in grammar or any UTF-8 file, and the
//! batches a trainer draws from it.
//!
//! Tokens are bytes (a vocabulary of 256), as `usize` ids.
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
mod corpus;
mod english;
mod error;
mod grammar;

pub use batch::{Batch, sample_batch, sequential_batches, skip_batch};
pub use corpus::Corpus;
pub use error::DataError;
pub use grammar::{Expansion, Grammar};
