//! What a user of tl-tensor can get wrong, as a typed error.

use thiserror::Error;

/// Errors of tl-tensor. Shape mismatches between tensors in an op are programmer errors and
/// panic instead, naming the op and both shapes.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum TensorError {
    /// Data whose length does not fill the requested shape.
    #[error("{len} values cannot fill a tensor of shape {shape:?}")]
    DataLength {
        /// Number of values given.
        len: usize,
        /// The requested shape.
        shape: Vec<usize>,
    },
    /// A hyperparameter outside its valid range.
    #[error("invalid {name}: {value} ({reason})")]
    InvalidArgument {
        /// Which argument.
        name: &'static str,
        /// The value given, as text.
        value: String,
        /// What was expected.
        reason: String,
    },
    /// A saved optimizer or model state that does not fit the object it is loaded into.
    #[error("{what} does not fit{}: expected {expected}, found {found}", parameter.map_or(String::new(), |i| format!(" parameter {i}")))]
    StateMismatch {
        /// The state being loaded (`"AdamW state"`, `"SGD state"`).
        what: &'static str,
        /// The parameter it concerns, when it concerns one.
        parameter: Option<usize>,
        /// What the object it is loaded into has.
        expected: String,
        /// What the saved state holds.
        found: String,
    },
}

/// `Result` with [`TensorError`].
pub type Result<T> = std::result::Result<T, TensorError>;
