//! [`RunOptimizer`]: the run's AdamW, whole on every rank (DDP, ZeRO stage 0), with its
//! moments and update sharded over the ranks (ZeRO-1), its gradients too (ZeRO-2), or the
//! parameters themselves (ZeRO-3). Whatever the stage a checkpoint holds the whole state,
//! so a run resumes at any world size and stage.

use std::rc::Rc;

use tl_parallel::{DataParallel, ShardedAdamW, Zero2AdamW, Zero3, ZeroStage};
use tl_precision::{DynamicLossScaler, MicroBatch, Precision, StepReport, train_step_mixed};
use tl_tensor::Tensor;
use tl_tensor::optim::{AdamW, AdamWState, Optimizer};

use crate::error::{Result, TrainError};
use crate::model::Llama;

/// AdamW as the run's ZeRO stage keeps it.
pub enum RunOptimizer {
    /// Every rank holds the whole state.
    Whole(AdamW<f32>),
    /// Each rank holds its shard of the moments and updates its shard of the weights.
    Sharded(ShardedAdamW<f32>),
    /// Each rank also keeps only its shard of the gradients, reduce-scattered during the
    /// last micro-batch's backward by the run's `DataParallel`.
    Zero2(Zero2AdamW<f32>),
    /// Each rank keeps only its shard of every parameter too: the model's units are
    /// gathered around their forward and backward, and their gradients reduce-scattered
    /// in every micro-batch's backward, by the model's unit hook.
    Zero3(Zero3<f32>),
}

impl RunOptimizer {
    /// `adamw` (fresh, or holding a checkpoint's whole state) on `model`'s parameters at
    /// ZeRO stage `stage` over `ddp`'s ranks. At stage 3 the model's whole values are
    /// released and its unit hook set: from then on they exist only while a unit runs, or
    /// while [`named_weights`](Self::named_weights) copies them out.
    ///
    /// `stage` is a [`ZeroStage`], or a stage's number as a config holds it (`u8`),
    /// converted here.
    ///
    /// # Errors
    /// [`TrainError::Parallel`](crate::TrainError::Parallel) if the state does not fit, or
    /// for a stage number past 3 ([`UnknownStage`](tl_parallel::ParallelError::UnknownStage)).
    pub fn at_stage<S>(
        adamw: AdamW<f32>,
        stage: S,
        ddp: &mut DataParallel,
        model: &Llama<f32>,
    ) -> Result<Self>
    where
        S: TryInto<ZeroStage>,
        TrainError: From<S::Error>,
    {
        Ok(match stage.try_into()? {
            ZeroStage::Ddp => Self::Whole(adamw),
            ZeroStage::Optimizer => {
                let (state, fresh) = state_and_fresh(&adamw)?;
                let mut sharded = ShardedAdamW::new(ddp, fresh)?;
                sharded.load_full_state(&state)?;
                Self::Sharded(sharded)
            }
            ZeroStage::Gradients => {
                let (state, fresh) = state_and_fresh(&adamw)?;
                let mut sharded = Zero2AdamW::new(ddp, fresh)?;
                sharded.load_full_state(&state)?;
                Self::Zero2(sharded)
            }
            ZeroStage::Parameters => {
                let (state, fresh) = state_and_fresh(&adamw)?;
                let mut zero3 = Zero3::on(ddp, model.units(), &fresh)?;
                zero3.load_full_state(&state)?;
                let runner = zero3.runner();
                // The hook is called with the whole model's unit index; a pipeline part's
                // units are numbered from 0 in `Zero3`.
                let indices = model.unit_indices();
                model.set_unit_hook(Some(Rc::new(move |unit, forward| {
                    let held = (indices.iter().position(|&i| i == unit))
                        .expect("a part runs only the units it holds");
                    runner.run_unit(held, forward)
                })));
                Self::Zero3(zero3)
            }
        })
    }

    /// One training step of `model` on this rank's `micro_batches` (of a global batch of
    /// `global_rows` sequences over `ddp`'s ranks), by the path the stage needs: ZeRO-3's own
    /// step, tl-precision's plain step for a single process at stages 0 and 1 (nothing to
    /// communicate), or `DataParallel`'s, whose observer ZeRO-2 needs even alone (it fills
    /// the shards' gradients).
    ///
    /// # Errors
    /// Those of the step taken, as [`TrainError::Precision`](crate::TrainError::Precision)
    /// or [`TrainError::Parallel`](crate::TrainError::Parallel); the weights are then
    /// unchanged.
    #[allow(clippy::too_many_arguments)]
    pub fn train_step<B: MicroBatch>(
        &mut self,
        ddp: &mut DataParallel,
        model: &Llama<f32>,
        micro_batches: &[B],
        global_rows: usize,
        loss: impl FnMut(&Llama<f32>, &B) -> Tensor<f32>,
        precision: Precision,
        scaler: Option<&mut DynamicLossScaler>,
        clip: Option<f64>,
    ) -> Result<StepReport> {
        Ok(match self {
            Self::Zero3(zero3) => zero3.train_step(
                model,
                micro_batches,
                global_rows,
                loss,
                precision,
                scaler,
                clip,
            )?,
            Self::Whole(_) | Self::Sharded(_) if ddp.world_size() == 1 && !ddp.spans_tensor() => {
                train_step_mixed(model, micro_batches, loss, self, precision, scaler, clip)?
            }
            _ => ddp.train_step(
                model,
                micro_batches,
                global_rows,
                loss,
                self,
                precision,
                scaler,
                clip,
            )?,
        })
    }

    /// `model`'s weights by name, in order, when `keep` (the rank that writes them), and
    /// nothing otherwise. At ZeRO-3 every rank must call it: each unit is all-gathered in
    /// turn, copied out by the rank that keeps them, and released, so no rank holds more than
    /// one unit's whole values on top of its shards.
    ///
    /// # Errors
    /// [`TrainError::Parallel`](crate::TrainError::Parallel) if a gather fails.
    pub fn named_weights(
        &self,
        model: &Llama<f32>,
        keep: bool,
    ) -> Result<Vec<(String, Tensor<f32>)>> {
        let Self::Zero3(zero3) = self else {
            // The parameters themselves (handles, not copies).
            return Ok(if keep {
                model.named_parameters()
            } else {
                Vec::new()
            });
        };
        let copy =
            |(name, tensor): (String, Tensor<f32>)| (name, Tensor::from_array(tensor.to_array()));
        // The units are the named parameters, in order: take each unit's run of them.
        let mut named = model.named_parameters().into_iter();
        let sizes: Vec<usize> = model.units().iter().map(Vec::len).collect();
        let mut weights = Vec::new();
        zero3.for_each_unit_gathered(|unit| {
            let run = named.by_ref().take(sizes[unit]);
            if keep {
                weights.extend(run.map(copy));
            } else {
                run.for_each(drop);
            }
        })?;
        Ok(weights)
    }

    /// The whole state gathered from the ranks' shards, as an unsharded AdamW would hold
    /// it (`f64` moments: 16 bytes a parameter), or `None` when this rank holds the whole
    /// state already ([`RunOptimizer::Whole`]: save it from [`AdamW::moments`], with no
    /// copy). A collective at ZeRO-1 to 3, which every rank must call.
    ///
    /// # Errors
    /// [`TrainError::Parallel`](crate::TrainError::Parallel) if the gather fails.
    pub fn gathered_state(&mut self) -> Result<Option<AdamWState>> {
        Ok(match self {
            Self::Whole(_) => None,
            Self::Sharded(sharded) => Some(sharded.full_state()?),
            Self::Zero2(sharded) => Some(sharded.full_state()?),
            Self::Zero3(zero3) => Some(zero3.full_state()?),
        })
    }
}

impl RunOptimizer {
    /// The state of an unsharded optimizer ([`RunOptimizer::Whole`]) as a copy, for what
    /// must change it before it is saved (gathering a tensor-parallel rank's slices).
    ///
    /// # Panics
    /// If the optimizer is sharded: use [`gathered_state`](Self::gathered_state).
    pub fn whole_state(&self) -> AdamWState {
        match self {
            Self::Whole(adamw) => adamw.state_dict(),
            _ => panic!("RunOptimizer::whole_state: a sharded optimizer's state is gathered"),
        }
    }
}

/// `adamw`'s whole state, and a fresh AdamW with its parameters and hyperparameters for a
/// sharded optimizer to start from (the state is loaded into the shards after).
fn state_and_fresh(adamw: &AdamW<f32>) -> Result<(AdamWState, AdamW<f32>)> {
    let fresh = AdamW::new(adamw.parameters().to_vec(), adamw.learning_rate())?
        .with_betas(adamw.betas().0, adamw.betas().1)?
        .with_eps(adamw.eps())?
        .with_weight_decay(adamw.weight_decay())?;
    Ok((adamw.state_dict(), fresh))
}

impl Optimizer<f32> for RunOptimizer {
    fn step(&mut self) {
        match self {
            Self::Whole(adamw) => adamw.step(),
            Self::Sharded(sharded) => sharded.step(),
            Self::Zero2(sharded) => sharded.step(),
            Self::Zero3(zero3) => zero3.step(),
        }
    }

    fn zero_grad(&self) {
        match self {
            Self::Whole(adamw) => adamw.zero_grad(),
            Self::Sharded(sharded) => sharded.zero_grad(),
            Self::Zero2(sharded) => sharded.zero_grad(),
            Self::Zero3(zero3) => zero3.zero_grad(),
        }
    }

    fn parameters(&self) -> &[Tensor<f32>] {
        match self {
            Self::Whole(adamw) => adamw.parameters(),
            Self::Sharded(sharded) => sharded.parameters(),
            Self::Zero2(sharded) => sharded.parameters(),
            Self::Zero3(zero3) => zero3.parameters(),
        }
    }

    fn learning_rate(&self) -> f64 {
        match self {
            Self::Whole(adamw) => adamw.learning_rate(),
            Self::Sharded(sharded) => sharded.learning_rate(),
            Self::Zero2(sharded) => sharded.learning_rate(),
            Self::Zero3(zero3) => zero3.learning_rate(),
        }
    }

    fn set_learning_rate(&mut self, lr: f64) {
        match self {
            Self::Whole(adamw) => adamw.set_learning_rate(lr),
            Self::Sharded(sharded) => sharded.set_learning_rate(lr),
            Self::Zero2(sharded) => sharded.set_learning_rate(lr),
            Self::Zero3(zero3) => zero3.set_learning_rate(lr),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;
    use crate::train::TrainConfig;
    use tl_collective::Single;
    use tl_tensor::nn::Module;

    #[test]
    fn a_stage_is_typed_or_a_config_number_checked_at_the_boundary() {
        let config = TrainConfig::for_preset(Preset::Tiny);
        let model = Llama::<f32>::new(&config.model, 0).unwrap();
        let mut ddp = DataParallel::new(Box::new(Single::new()));
        let adamw = || AdamW::new(model.parameters(), 1e-3).unwrap();
        let zero2 = RunOptimizer::at_stage(adamw(), ZeroStage::Gradients, &mut ddp, &model);
        assert!(matches!(zero2, Ok(RunOptimizer::Zero2(_))));
        let zero1 = RunOptimizer::at_stage(adamw(), 1u8, &mut ddp, &model);
        assert!(matches!(zero1, Ok(RunOptimizer::Sharded(_))));
        let error = RunOptimizer::at_stage(adamw(), 4u8, &mut ddp, &model).err();
        assert!(
            matches!(
                error,
                Some(TrainError::Parallel(
                    tl_parallel::ParallelError::UnknownStage { index: 4 }
                ))
            ),
            "{error:?}"
        );
    }
}
