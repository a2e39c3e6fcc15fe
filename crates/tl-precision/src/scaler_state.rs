//! Saving and restoring a [`DynamicLossScaler`], so a resumed run continues the same
//! scale schedule — including how far it is into the current growth interval.

use serde::{Deserialize, Serialize};

use crate::error::{PrecisionError, Result};
use crate::scaler::DynamicLossScaler;

/// Every field of a [`DynamicLossScaler`], for serde (the names follow PyTorch's
/// `GradScaler.state_dict`, plus the floor and ceiling of this crate).
///
/// ```
/// use tl_precision::{DynamicLossScaler, ScalerState};
///
/// let scaler = DynamicLossScaler::new(1024.0, 2.0, 0.5, 100)?;
/// let json = serde_json::to_string(&scaler.state_dict()).unwrap();
/// let state: ScalerState = serde_json::from_str(&json).unwrap();
/// let mut resumed = DynamicLossScaler::default();
/// resumed.load_state_dict(&state)?;
/// assert_eq!(resumed, scaler);
/// # Ok::<(), tl_precision::PrecisionError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScalerState {
    /// The loss scale `S`.
    pub scale: f64,
    /// The factor applied after `growth_interval` good steps.
    pub growth_factor: f64,
    /// The factor applied after an overflow.
    pub backoff_factor: f64,
    /// Consecutive good steps between growths.
    pub growth_interval: u32,
    /// Consecutive good steps since the last overflow or growth.
    pub good_steps: u32,
    /// The lowest scale allowed, if any.
    pub floor: Option<f64>,
    /// The highest scale allowed, if any.
    pub ceiling: Option<f64>,
    /// Consecutive overflows at the floor that make a step fail (meaningful with a floor).
    pub floor_patience: u32,
    /// Consecutive overflows taken at the floor so far.
    pub skips_at_floor: u32,
}

fn malformed(field: &'static str, reason: String) -> PrecisionError {
    PrecisionError::InvalidState { field, reason }
}

/// A hyperparameter the scaler's constructors refused, as the saved state's field.
fn invalid_field(error: PrecisionError) -> PrecisionError {
    match error {
        PrecisionError::InvalidScalerArgument {
            name,
            value,
            reason,
        } => {
            let field = match name {
                "init" => "scale",
                "growth" => "growth_factor",
                "backoff" => "backoff_factor",
                "interval" => "growth_interval",
                "patience" => "floor_patience",
                other => other,
            };
            malformed(field, format!("{value} ({reason})"))
        }
        other => other,
    }
}

impl DynamicLossScaler {
    /// A snapshot of every field, to save beside the model and optimizer states.
    pub fn state_dict(&self) -> ScalerState {
        ScalerState {
            scale: self.scale,
            growth_factor: self.growth,
            backoff_factor: self.backoff,
            growth_interval: self.interval,
            good_steps: self.good_steps,
            floor: self.floor,
            ceiling: self.ceiling,
            floor_patience: self.floor_patience,
            skips_at_floor: self.skips_at_floor,
        }
    }

    /// Replaces every field with a saved state (see [`state_dict`](Self::state_dict)).
    ///
    /// # Errors
    /// [`PrecisionError::InvalidState`] if the state could not come from a scaler: a
    /// hyperparameter out of range, a scale outside its floor and ceiling, or a count at or
    /// beyond its limit. The scaler is left unchanged.
    pub fn load_state_dict(&mut self, state: &ScalerState) -> Result<()> {
        *self = Self::from_state(state)?;
        Ok(())
    }

    fn from_state(state: &ScalerState) -> Result<Self> {
        let invalid = invalid_field;
        let mut scaler = Self::new(
            state.scale,
            state.growth_factor,
            state.backoff_factor,
            state.growth_interval,
        )
        .map_err(invalid)?;
        if let Some(ceiling) = state.ceiling {
            scaler = scaler.with_ceiling(ceiling).map_err(invalid)?;
        }
        match state.floor {
            Some(floor) => {
                scaler = scaler
                    .with_floor(floor, state.floor_patience)
                    .map_err(invalid)?
            }
            None if state.skips_at_floor != 0 => {
                return Err(malformed(
                    "skips_at_floor",
                    format!("{}, but there is no floor", state.skips_at_floor),
                ));
            }
            None => {}
        }
        if state.good_steps >= state.growth_interval {
            return Err(malformed(
                "good_steps",
                format!(
                    "{} must be below growth_interval {}",
                    state.good_steps, state.growth_interval
                ),
            ));
        }
        if state.floor.is_some() && state.skips_at_floor >= state.floor_patience {
            return Err(malformed(
                "skips_at_floor",
                format!(
                    "{} must be below floor_patience {}",
                    state.skips_at_floor, state.floor_patience
                ),
            ));
        }
        scaler.good_steps = state.good_steps;
        scaler.skips_at_floor = state.skips_at_floor;
        scaler.floor_patience = state.floor_patience;
        Ok(scaler)
    }
}
