//! [`ZeroStage`]: how much of the model state each rank keeps, ZeRO's stages with plain DDP
//! as stage 0 — the one name of a stage that tl-parallel's users pass around.

use std::fmt;

use crate::error::{ParallelError, Result};

/// How much of the model state each rank keeps (Rajbhandari et al.'s stages; stage 0 is
/// plain DDP). Each stage shards what the one before it shards, and one thing more.
///
/// ```
/// use tl_parallel::ZeroStage;
///
/// assert_eq!(ZeroStage::from_index(2)?, ZeroStage::Gradients);
/// assert_eq!(ZeroStage::try_from(3u8)?.to_string(), "3");
/// assert!(ZeroStage::Optimizer < ZeroStage::Parameters);
/// assert!(ZeroStage::from_index(4).is_err());
/// # Ok::<(), tl_parallel::ParallelError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ZeroStage {
    /// Stage 0: plain DDP ([`DataParallel`](crate::DataParallel) with a whole optimizer),
    /// every rank keeps everything.
    Ddp,
    /// Stage 1: AdamW's moments and update sharded ([`ShardedAdamW`](crate::ShardedAdamW)).
    Optimizer,
    /// Stage 2: the gradients sharded too ([`Zero2AdamW`](crate::Zero2AdamW)).
    Gradients,
    /// Stage 3: the parameters sharded too ([`Zero3`](crate::Zero3)).
    Parameters,
}

impl ZeroStage {
    /// The four stages, in order.
    pub const ALL: [ZeroStage; 4] = [
        ZeroStage::Ddp,
        ZeroStage::Optimizer,
        ZeroStage::Gradients,
        ZeroStage::Parameters,
    ];

    /// The stage's number, 0 to 3.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The stage numbered `index`.
    ///
    /// # Errors
    /// [`ParallelError::UnknownStage`] for a number above 3.
    pub fn from_index(index: usize) -> Result<Self> {
        Self::ALL
            .get(index)
            .copied()
            .ok_or(ParallelError::UnknownStage { index })
    }
}

impl TryFrom<u8> for ZeroStage {
    type Error = ParallelError;

    /// The stage numbered `index` (a config's `zero` field).
    fn try_from(index: u8) -> Result<Self> {
        Self::from_index(usize::from(index))
    }
}

/// The stage's number.
impl fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.index())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_are_numbered_in_order_and_nothing_past_three_is_one() {
        for (index, stage) in ZeroStage::ALL.into_iter().enumerate() {
            assert_eq!(stage.index(), index);
            assert_eq!(ZeroStage::from_index(index).unwrap(), stage);
        }
        let error = ZeroStage::try_from(4u8).unwrap_err();
        assert!(
            matches!(error, ParallelError::UnknownStage { index: 4 }),
            "{error}"
        );
        assert_eq!(
            error.to_string(),
            "unknown ZeRO stage 4: a stage is 0 (plain DDP), 1, 2 or 3"
        );
    }
}
