//! One training step run from its parts, each phase recorded by the memory meter.
//!
//! `train_step_mixed` runs a step as one call, which leaves no seam to tell forward from
//! backward in the meter's events. This runs the same parts in the same order — zero the
//! gradients; per micro-batch, the loss weighted by its share of the rows (times the loss
//! scale) and its backward, under the step's autocast; then the checks, clipping and the
//! AdamW update — with one recording per phase. The events' live counts are absolute, so
//! the recordings join into one timeline. A test checks that the weights come out bit for
//! bit as `train_step_mixed` leaves them.

use tl_precision::{PrecisionError, grad_is_finite};
use tl_tensor::memory;
use tl_tensor::nn::Module;
use tl_tensor::optim::{Optimizer, clip_grad_norm};
use tl_tensor::{Element, Tensor};

use super::session::Session;
use super::timeline::{Phase, Timeline};
use crate::data::Batch;
use crate::error::Result;

impl Session {
    /// Runs one optimizer step on `micro_batches`, appending its phases to `timeline` as
    /// step `step`, and its loss to the timeline's losses.
    ///
    /// # Errors
    /// As `train_step_mixed`: without a loss scaler, a non-finite loss or gradient is
    /// refused before the update; with one, its errors. The phases recorded so far stay in
    /// the timeline.
    pub(super) fn recorded_step(
        &mut self,
        step: usize,
        micro_batches: &[Batch],
        timeline: &mut Timeline,
    ) -> Result<()> {
        let base = self.base_live;
        let ((), events) = memory::record(|| {
            self.model.zero_grad();
            self.optimizer.zero_grad();
        });
        timeline.push_phase(step, Phase::ZeroGrad, None, &events, base);

        let total_rows: usize = micro_batches.iter().map(|batch| batch.rows).sum();
        let loss_scale = self
            .scaler
            .as_ref()
            .map_or(1.0, |scaler| scaler.loss_scale());
        let precision = self.config.precision;
        let mut step_loss = 0.0;
        for (index, batch) in micro_batches.iter().enumerate() {
            let weight = batch.rows as f64 / total_rows as f64;
            let (weighted, events) = memory::record(|| -> Result<Tensor<f32>> {
                let _autocast = precision.autocast();
                let loss =
                    self.model
                        .loss(&batch.inputs, &batch.targets, batch.rows, batch.context)?;
                step_loss += weight * f64::from(loss.item());
                Ok(loss.mul_scalar(f32::from_f64(weight * loss_scale)))
            });
            timeline.push_phase(step, Phase::Forward, Some(index), &events, base);
            let weighted = weighted?;
            // The loss is moved in and dropped inside, so the release of the graph's last
            // handle is part of the backward phase.
            let ((), events) = memory::record(move || {
                let _autocast = precision.autocast();
                weighted.backward();
            });
            timeline.push_phase(step, Phase::Backward, Some(index), &events, base);
        }

        let (updated, events) = memory::record(|| self.update(step_loss));
        timeline.push_phase(step, Phase::Optimizer, None, &events, base);
        updated?;
        timeline.losses.push(step_loss);
        Ok(())
    }

    /// The end of the step, as `train_step_mixed` ends it.
    fn update(&mut self, loss: f64) -> Result<()> {
        let params = self.optimizer.parameters().to_vec();
        if let Some(scaler) = self.scaler.as_mut() {
            scaler.step(&mut self.optimizer, &params, self.config.clip)?;
            return Ok(());
        }
        if !loss.is_finite() {
            return Err(PrecisionError::NonFiniteLoss { loss }.into());
        }
        if let Some(index) = params.iter().position(|param| !grad_is_finite(param)) {
            return Err(PrecisionError::NonFiniteGradient { index }.into());
        }
        if let Some(max_norm) = self.config.clip {
            clip_grad_norm(&params, max_norm)?;
        }
        self.optimizer.step();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use tl_precision::{Precision, train_step_mixed};

    use super::*;
    use crate::TrainError;
    use crate::model::{Checkpointing, Llama};
    use crate::train::TrainConfig;

    fn tiny_config(precision: Precision, checkpointing: Checkpointing) -> TrainConfig {
        TrainConfig {
            precision,
            checkpointing,
            ..TrainConfig::tiny_for_tests()
        }
    }

    fn weight_bits(session: &Session) -> Vec<Vec<u32>> {
        session
            .model
            .named_parameters()
            .iter()
            .map(|(_, tensor)| tensor.to_vec().iter().map(|v| v.to_bits()).collect())
            .collect()
    }

    /// Warms up two sessions of `config`, then takes one step in each: recorded in one, with
    /// `train_step_mixed` in the other.
    fn recorded_and_reference(config: &TrainConfig) -> (Session, Session, Timeline) {
        let mut recorded = Session::new(config).unwrap();
        let mut reference = Session::new(config).unwrap();
        recorded.warm_up().unwrap();
        reference.warm_up().unwrap();
        let batches = recorded.next_micro_batches();
        assert_eq!(batches, reference.next_micro_batches());
        let mut timeline = Timeline::new("t".into(), config.checkpointing, recorded.live());
        recorded.recorded_step(0, &batches, &mut timeline).unwrap();
        let report = train_step_mixed(
            &reference.model,
            &batches,
            |model: &Llama<f32>, b: &Batch| {
                model
                    .loss(&b.inputs, &b.targets, b.rows, b.context)
                    .unwrap()
            },
            &mut reference.optimizer,
            config.precision,
            reference.scaler.as_mut(),
            config.clip,
        )
        .unwrap();
        assert_eq!(timeline.losses, [report.loss]);
        (recorded, reference, timeline)
    }

    #[test]
    fn a_recorded_step_updates_the_weights_exactly_as_train_step_mixed() {
        for (precision, checkpointing) in [
            (Precision::Fp32, Checkpointing::Off),
            (Precision::Bf16, Checkpointing::PerBlock),
            (Precision::Fp16, Checkpointing::Off),
        ] {
            let config = tiny_config(precision, checkpointing);
            let (recorded, reference, _) = recorded_and_reference(&config);
            assert!(
                weight_bits(&recorded) == weight_bits(&reference),
                "{precision} {checkpointing:?}: the weights differ"
            );
            let scale = |s: &Session| s.scaler.as_ref().map(|s| s.loss_scale());
            assert_eq!(scale(&recorded), scale(&reference));
        }
    }

    #[test]
    fn a_recorded_step_has_its_phases_in_order_and_ends_where_it_started() {
        let config = tiny_config(Precision::Fp32, Checkpointing::Off);
        // The reference session stays alive: its bytes are part of the recorded live counts.
        let (recorded, _reference, timeline) = recorded_and_reference(&config);
        let phases: Vec<(Phase, Option<usize>)> = timeline
            .spans
            .iter()
            .map(|span| (span.phase, span.micro_batch))
            .collect();
        assert_eq!(
            phases,
            [
                (Phase::ZeroGrad, None),
                (Phase::Forward, Some(0)),
                (Phase::Backward, Some(0)),
                (Phase::Forward, Some(1)),
                (Phase::Backward, Some(1)),
                (Phase::Optimizer, None),
            ]
        );
        // Zeroing frees the 133,440 gradients of the warm-up step, 4 bytes each; the step
        // makes them again, so it ends at the level it started from.
        let zero_grad = &timeline.spans[0];
        let after_zero_grad = timeline.live_before(zero_grad.events.end);
        assert_eq!(timeline.start_live - after_zero_grad, 133_440 * 4);
        assert_eq!(timeline.events.last().unwrap().live, timeline.start_live);
        assert_eq!(recorded.live(), timeline.start_live);
        // AdamW updates in place: the optimizer phase allocates nothing.
        assert!(timeline.spans[5].events.is_empty());
    }

    #[test]
    fn a_non_finite_loss_is_refused_before_the_update() {
        let config = tiny_config(Precision::Fp32, Checkpointing::Off);
        let mut session = Session::new(&config).unwrap();
        session.warm_up().unwrap();
        let before = weight_bits(&session);
        session.model.named_parameters()[0]
            .1
            .update_value(|w| w.fill(f32::NAN));
        let broken = weight_bits(&session);
        let batches = session.next_micro_batches();
        let mut timeline = Timeline::new("t".into(), config.checkpointing, session.live());
        let error = session
            .recorded_step(0, &batches, &mut timeline)
            .unwrap_err();
        assert!(
            matches!(
                error,
                TrainError::Precision(PrecisionError::NonFiniteLoss { .. })
            ),
            "{error}"
        );
        assert_ne!(before, broken);
        assert_eq!(weight_bits(&session), broken);
        assert!(timeline.losses.is_empty());
    }
}
