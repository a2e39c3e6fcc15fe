//! One training step recorded phase by phase by the memory meter: tl-precision's
//! `train_step_mixed_observed` with an observer that records each phase (zero the
//! gradients; per micro-batch, the weighted loss and its backward; the update). The events'
//! live counts are absolute, so the recordings join into one timeline. A test checks that
//! the weights come out bit for bit as `train_step_mixed` leaves them.

use tl_precision::{StepObserver, StepPhase, train_step_mixed_observed};
use tl_tensor::memory;

use super::session::Session;
use super::timeline::{Phase, Timeline};
use crate::data::Batch;
use crate::error::Result;
use crate::train::batch_loss;

/// Records each phase of a step into a timeline, as step `step`.
struct PhaseRecorder<'a> {
    timeline: &'a mut Timeline,
    step: usize,
    /// The session's zero of live bytes.
    base: usize,
}

impl StepObserver<f32> for PhaseRecorder<'_> {
    fn phase<R>(&mut self, phase: StepPhase, run: impl FnOnce(&mut Self) -> R) -> R {
        let (out, events) = memory::record(|| run(self));
        let (phase, micro_batch) = match phase {
            StepPhase::ZeroGrad => (Phase::ZeroGrad, None),
            StepPhase::Forward { micro_batch } => (Phase::Forward, Some(micro_batch)),
            StepPhase::Backward { micro_batch } => (Phase::Backward, Some(micro_batch)),
            StepPhase::Update => (Phase::Optimizer, None),
        };
        self.timeline
            .push_phase(self.step, phase, micro_batch, &events, self.base);
        out
    }
}

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
        let mut recorder = PhaseRecorder {
            step,
            base: self.base_live,
            timeline,
        };
        let started = std::time::Instant::now();
        let report = train_step_mixed_observed(
            &self.model,
            micro_batches,
            batch_loss,
            &mut self.optimizer,
            self.config.precision,
            self.scaler.as_mut(),
            self.config.clip,
            &mut recorder,
        )?;
        timeline.step_seconds.push(started.elapsed().as_secs_f64());
        timeline.losses.push(report.loss);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use tl_precision::{Precision, PrecisionError, train_step_mixed};

    use super::*;
    use crate::TrainError;
    use crate::model::Checkpointing;
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
    /// `train_step_mixed` under the meter's recorder in the other.
    fn recorded_and_reference(config: &TrainConfig) -> (Session, Session, Timeline) {
        let mut recorded = Session::new(config).unwrap();
        let mut reference = Session::new(config).unwrap();
        recorded.warm_up().unwrap();
        reference.warm_up().unwrap();
        let batches = recorded.next_micro_batches();
        assert_eq!(batches, reference.next_micro_batches());
        let mut timeline = Timeline::new("t".into(), config.checkpointing, recorded.live());
        recorded.recorded_step(0, &batches, &mut timeline).unwrap();
        let (report, events) = memory::record(|| {
            train_step_mixed(
                &reference.model,
                &batches,
                batch_loss,
                &mut reference.optimizer,
                config.precision,
                reference.scaler.as_mut(),
                config.clip,
            )
            .unwrap()
        });
        // The recording is the step itself: the same allocations and frees, in order (a
        // retag moves no bytes, and the timeline leaves it out).
        let sizes: Vec<(bool, u64)> = events
            .iter()
            .filter(|e| e.kind != memory::EventKind::Retag)
            .map(|e| (e.kind == memory::EventKind::Alloc, e.bytes as u64))
            .collect();
        let recorded_sizes: Vec<(bool, u64)> = timeline
            .events
            .iter()
            .map(|e| (e.kind == super::super::EventKind::Alloc, e.bytes))
            .collect();
        assert!(sizes == recorded_sizes, "the recorded step's events differ");
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
