//! The learning-rate schedule: linear warmup, then cosine decay to a floor.

use serde::{Deserialize, Serialize};

/// Linear warmup from `peak/warmup` to `peak` over the first `warmup` steps, then a cosine
/// from `peak` down to `min` at step `total`, as in nanoGPT:
///
/// ```text
/// lr(s) = peak · (s + 1)/warmup                                   s < warmup
/// lr(s) = min + (peak − min) · (1 + cos(π · (s − warmup)/(total − warmup)))/2   after
/// ```
///
/// Steps count from 0; the schedule depends on the step alone, so a resumed run gets the
/// same rates as an uninterrupted one.
///
/// ```
/// use tl_train::train::LrSchedule;
/// let schedule = LrSchedule { peak: 1e-3, min: 1e-4, warmup: 10, total: 110 };
/// assert_eq!(schedule.at(0), 1e-4);           // 1e-3 · 1/10
/// assert_eq!(schedule.at(10), 1e-3);          // the peak, start of the cosine
/// assert!((schedule.at(60) - 5.5e-4).abs() < 1e-15); // halfway: (peak + min)/2
/// assert_eq!(schedule.at(110), 1e-4);         // the floor, and after
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LrSchedule {
    /// The rate after warmup.
    pub peak: f64,
    /// The rate at and after the last step.
    pub min: f64,
    /// Steps of linear warmup.
    pub warmup: u64,
    /// The step the cosine reaches `min`.
    pub total: u64,
}

impl LrSchedule {
    /// The learning rate of step `step`.
    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        if step >= self.total {
            return self.min;
        }
        let progress = (step - self.warmup) as f64 / (self.total - self.warmup) as f64;
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.min + (self.peak - self.min) * cosine
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_rises_linearly_and_the_cosine_falls_monotonically() {
        let schedule = LrSchedule {
            peak: 2.0,
            min: 0.5,
            warmup: 4,
            total: 20,
        };
        // 2·1/4, 2·2/4, 2·3/4, 2·4/4
        let warmup: Vec<f64> = (0..4).map(|s| schedule.at(s)).collect();
        assert_eq!(warmup, [0.5, 1.0, 1.5, 2.0]);
        assert_eq!(schedule.at(4), 2.0);
        let decay: Vec<f64> = (4..=20).map(|s| schedule.at(s)).collect();
        assert!(decay.windows(2).all(|pair| pair[1] < pair[0]));
        // A quarter of the way: min + (peak − min)·(1 + cos(π/4))/2
        let quarter = 0.5 + 1.5 * (1.0 + std::f64::consts::FRAC_1_SQRT_2) / 2.0;
        assert!((schedule.at(8) - quarter).abs() < 1e-15);
        assert_eq!(schedule.at(25), 0.5);
    }

    #[test]
    fn no_warmup_starts_at_the_peak() {
        let schedule = LrSchedule {
            peak: 1.0,
            min: 0.0,
            warmup: 0,
            total: 2,
        };
        assert_eq!(schedule.at(0), 1.0);
        assert_eq!(schedule.at(1), 0.5); // (1 + cos(π/2))/2
        assert_eq!(schedule.at(2), 0.0);
    }
}
