//! The error type of tl-numerics: everything a caller can get wrong when naming a format.

use thiserror::Error;

/// An error from tl-numerics.
///
/// The fallible operations are parsing a format name and making a block FMA; rounding and
/// accumulation themselves are total (every input, NaN and infinities included, has a
/// defined result).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum NumericsError {
    /// A format name other than `"bf16"`, `"fp16"`, `"e4m3"` and `"e5m2"`.
    #[error("unknown format `{input}`: expected one of \"bf16\", \"fp16\", \"e4m3\", \"e5m2\"")]
    UnknownFormat {
        /// The text that was given, verbatim.
        input: String,
    },
    /// A block FMA with a block of 0 or beyond `MAX_BLOCK` products, or more than
    /// `MAX_EXTRA_BITS` extra alignment bits.
    #[error(
        "invalid tensor-core accumulation: a block of {block} products with {extra_bits} extra \
         bits (a block must be 1 to 65536, extra bits 0 to 40)"
    )]
    InvalidBlockFma {
        /// The block size given.
        block: usize,
        /// The extra alignment bits given.
        extra_bits: u32,
    },
}

/// The result type of tl-numerics.
pub type Result<T> = std::result::Result<T, NumericsError>;
