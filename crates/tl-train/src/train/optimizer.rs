//! [`RunOptimizer`]: the run's AdamW, whole on every rank (DDP, ZeRO stage 0), with its
//! moments and update sharded over the ranks (ZeRO-1), or its gradients too (ZeRO-2).
//! Whatever the stage a checkpoint holds the whole state, so a run resumes at any world
//! size and stage.

use tl_parallel::{DataParallel, ShardedAdamW, Zero2AdamW};
use tl_tensor::Tensor;
use tl_tensor::optim::{AdamW, AdamWState, Optimizer};

use crate::error::Result;

/// AdamW as the run's ZeRO stage keeps it.
pub enum RunOptimizer {
    /// Every rank holds the whole state.
    Whole(AdamW<f32>),
    /// Each rank holds its shard of the moments and updates its shard of the weights.
    Sharded(ShardedAdamW<f32>),
    /// Each rank also keeps only its shard of the gradients, reduce-scattered during the
    /// last micro-batch's backward by the run's `DataParallel`.
    Zero2(Zero2AdamW<f32>),
}

impl RunOptimizer {
    /// `adamw` (fresh, or holding a checkpoint's whole state) at ZeRO stage `zero` over
    /// `ddp`'s ranks.
    ///
    /// # Errors
    /// [`TrainError::Parallel`](crate::TrainError::Parallel) if the state does not fit.
    pub fn at_stage(adamw: AdamW<f32>, zero: u8, ddp: &mut DataParallel) -> Result<Self> {
        if zero == 0 {
            return Ok(Self::Whole(adamw));
        }
        let state = adamw.state_dict();
        let fresh = AdamW::new(adamw.parameters().to_vec(), adamw.learning_rate())?
            .with_betas(adamw.betas().0, adamw.betas().1)?
            .with_eps(adamw.eps())?
            .with_weight_decay(adamw.weight_decay())?;
        if zero == 1 {
            let mut sharded = ShardedAdamW::new(ddp, fresh)?;
            sharded.load_full_state(&state)?;
            return Ok(Self::Sharded(sharded));
        }
        let mut sharded = Zero2AdamW::new(ddp, fresh)?;
        sharded.load_full_state(&state)?;
        Ok(Self::Zero2(sharded))
    }

    /// The whole state, as an unsharded AdamW holds it: a collective at ZeRO-1, which every
    /// rank must call.
    ///
    /// # Errors
    /// [`TrainError::Parallel`](crate::TrainError::Parallel) if the gather fails.
    pub fn full_state(&mut self) -> Result<AdamWState> {
        Ok(match self {
            Self::Whole(adamw) => adamw.state_dict(),
            Self::Sharded(sharded) => sharded.full_state()?,
            Self::Zero2(sharded) => sharded.full_state()?,
        })
    }
}

impl Optimizer<f32> for RunOptimizer {
    fn step(&mut self) {
        match self {
            Self::Whole(adamw) => adamw.step(),
            Self::Sharded(sharded) => sharded.step(),
            Self::Zero2(sharded) => sharded.step(),
        }
    }

    fn zero_grad(&self) {
        match self {
            Self::Whole(adamw) => adamw.zero_grad(),
            Self::Sharded(sharded) => sharded.zero_grad(),
            Self::Zero2(sharded) => sharded.zero_grad(),
        }
    }

    fn parameters(&self) -> &[Tensor<f32>] {
        match self {
            Self::Whole(adamw) => adamw.parameters(),
            Self::Sharded(sharded) => sharded.parameters(),
            Self::Zero2(sharded) => sharded.parameters(),
        }
    }

    fn learning_rate(&self) -> f64 {
        match self {
            Self::Whole(adamw) => adamw.learning_rate(),
            Self::Sharded(sharded) => sharded.learning_rate(),
            Self::Zero2(sharded) => sharded.learning_rate(),
        }
    }

    fn set_learning_rate(&mut self, lr: f64) {
        match self {
            Self::Whole(adamw) => adamw.set_learning_rate(lr),
            Self::Sharded(sharded) => sharded.set_learning_rate(lr),
            Self::Zero2(sharded) => sharded.set_learning_rate(lr),
        }
    }
}
