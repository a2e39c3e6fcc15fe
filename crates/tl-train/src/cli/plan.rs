//! `tinyllm plan` (being written).

use clap::Args;

use super::Exit;
use crate::error::{Result, TrainError};

/// Options of `tinyllm plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {}

/// Runs `tinyllm plan`.
pub(super) fn plan(_args: &PlanArgs) -> Result<Exit> {
    Err(TrainError::InvalidConfig(
        "`tinyllm plan` is not available yet".into(),
    ))
}
