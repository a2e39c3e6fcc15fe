//! `tinyllm profile` (being written).

use clap::Args;

use super::Exit;
use crate::error::{Result, TrainError};

/// Options of `tinyllm profile`.
#[derive(Debug, Args)]
pub struct ProfileArgs {}

/// Runs `tinyllm profile`.
pub(super) fn profile(_args: &ProfileArgs) -> Result<Exit> {
    Err(TrainError::InvalidConfig(
        "`tinyllm profile` is not available yet".into(),
    ))
}
