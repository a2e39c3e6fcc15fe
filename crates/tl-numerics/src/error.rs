//! The error type of tl-numerics: everything a caller can get wrong when naming a format.

use thiserror::Error;

/// An error from tl-numerics.
///
/// The only fallible operation is parsing a format name; rounding itself is total
/// (every input, NaN and infinities included, has a defined result).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum NumericsError {
    /// A format name other than `"bf16"`, `"fp16"`, `"e4m3"` and `"e5m2"`.
    #[error("unknown format `{input}`: expected one of \"bf16\", \"fp16\", \"e4m3\", \"e5m2\"")]
    UnknownFormat {
        /// The text that was given, verbatim.
        input: String,
    },
}

/// The result type of tl-numerics.
pub type Result<T> = std::result::Result<T, NumericsError>;
