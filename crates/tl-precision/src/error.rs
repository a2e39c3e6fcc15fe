//! What a user of tl-precision can get wrong, as a typed error.

use thiserror::Error;
use tl_numerics::{Format, NumericsError};
use tl_tensor::TensorError;

/// Errors of tl-precision.
///
/// Shape mismatches inside the model are programmer errors and panic in tl-tensor; this enum
/// covers the inputs a caller chooses (names, hyperparameters, saved states, batches) and the
/// numerical failures a training step must refuse to act on.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum PrecisionError {
    /// A format name that tl-numerics does not know (it knows `"bf16"`, `"fp16"`, `"e4m3"`
    /// and `"e5m2"`).
    #[error(transparent)]
    Format(#[from] NumericsError),
    /// A format that no [`Precision`](crate::Precision) trains in: the fp8 formats, whose
    /// training needs per-tensor scaling that tl-precision does not have.
    #[error(
        "no training precision rounds to {format}: a precision is fp32, bf16 or fp16 \
         (fp8 training needs per-tensor scaling)"
    )]
    NoPrecisionForFormat {
        /// The format asked for.
        format: Format,
    },
    /// A precision name other than `"fp32"`, `"bf16"` or `"fp16"`.
    #[error("unknown precision `{input}`: expected one of \"fp32\", \"bf16\", \"fp16\"")]
    UnknownPrecision {
        /// The text that was given, verbatim.
        input: String,
    },
    /// An accumulation model name other than `"f32"`, `"amx"`, `"v100"`, `"a100"`, `"h100"` or a
    /// valid `"tensor-core:BLOCK:EXTRA_BITS"`.
    #[error(
        "unknown accumulation `{input}`: expected one of \"f32\", \"amx\", \"v100\", \"a100\", \"h100\" \
         or \"tensor-core:BLOCK:EXTRA_BITS\" (a block of 1 to 65536 products, 0 to 40 extra bits)"
    )]
    UnknownAccumulation {
        /// The text that was given, verbatim.
        input: String,
    },
    /// An fp8 delayed-scaling setting outside its valid range.
    #[error("invalid fp8 {name}: {value} ({reason})")]
    InvalidFp8Recipe {
        /// Which setting.
        name: &'static str,
        /// The value given, as text.
        value: String,
        /// What was expected.
        reason: String,
    },
    /// A loss-scaler hyperparameter outside its valid range.
    #[error("invalid loss-scaler {name}: {value} ({reason})")]
    InvalidScalerArgument {
        /// Which argument.
        name: &'static str,
        /// The value given, as text.
        value: String,
        /// What was expected.
        reason: String,
    },
    /// A saved loss-scaler state that cannot be loaded; the scaler was left unchanged.
    #[error("malformed loss-scaler state: {field}: {reason}")]
    InvalidState {
        /// The field of [`ScalerState`](crate::ScalerState) that cannot be.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// The scale sat at its floor while every step overflowed, for the configured number of
    /// consecutive steps: the run would otherwise skip forever.
    #[error(
        "loss scale stuck at its floor {scale} for {skips} consecutive overflowing steps; \
         the gradients overflow even at the smallest allowed scale"
    )]
    ScaleStuckAtFloor {
        /// The scale (equal to the floor).
        scale: f64,
        /// Consecutive skipped steps at the floor.
        skips: u32,
    },
    /// Gradient accumulation was given no micro-batches.
    #[error("gradient accumulation needs at least one micro-batch")]
    NoMicroBatches,
    /// A micro-batch without rows: its mean loss is undefined.
    #[error("micro-batch {index} has no rows")]
    EmptyMicroBatch {
        /// Position of the micro-batch in the input.
        index: usize,
    },
    /// The loss of a step was NaN or infinite; no parameter was updated.
    #[error("the loss is not finite ({loss}); the step was refused before any update")]
    NonFiniteLoss {
        /// The weighted loss that was computed.
        loss: f64,
    },
    /// A gradient held NaN or infinity (without a loss scaler to skip the step); no
    /// parameter was updated. Under data parallelism every process refuses the step
    /// together, including those whose own gradients were finite.
    #[error(
        "{} has a non-finite gradient; the step was refused before any update",
        match index { Some(i) => format!("parameter {i}"), None => "another process".into() }
    )]
    NonFiniteGradient {
        /// Position of the parameter in the optimizer's list, or `None` when this
        /// process's gradients were finite and the step's observer reported a non-finite
        /// gradient elsewhere (another rank's shard).
        index: Option<usize>,
    },
    /// An error from tl-tensor (an invalid clipping bound, for example).
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

/// `Result` with [`PrecisionError`].
pub type Result<T> = std::result::Result<T, PrecisionError>;
