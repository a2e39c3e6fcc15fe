//! [`Generator`]: a seedable, replayable random stream (xoshiro256++), shared by handle.

use std::cell::RefCell;
use std::rc::Rc;

use rand_core::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::{Deserialize, Serialize};

/// A shared handle on one random stream. Clones draw from the same stream.
///
/// Its [`state`](Self::state) can be read and set back, so a computation that draws from it
/// can be replayed exactly — what activation checkpointing does for dropout, and what a
/// resumed training run does for everything.
///
/// ```
/// use tl_tensor::Generator;
/// let rng = Generator::new(7);
/// let saved = rng.state();
/// let first = rng.next_u64();
/// rng.set_state(&saved);
/// assert_eq!(rng.next_u64(), first);
/// ```
#[derive(Clone, Debug)]
pub struct Generator {
    stream: Rc<RefCell<Xoshiro256PlusPlus>>,
}

/// A snapshot of a [`Generator`]'s position in its stream; serializable for checkpoints.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GeneratorState(Xoshiro256PlusPlus);

impl Generator {
    /// A stream seeded from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            stream: Rc::new(RefCell::new(Xoshiro256PlusPlus::seed_from_u64(seed))),
        }
    }

    /// Where the stream is now.
    pub fn state(&self) -> GeneratorState {
        GeneratorState(self.stream.borrow().clone())
    }

    /// Moves the stream to a saved position.
    pub fn set_state(&self, state: &GeneratorState) {
        *self.stream.borrow_mut() = state.0.clone();
    }

    /// Whether two handles share one stream.
    pub fn same(&self, other: &Generator) -> bool {
        Rc::ptr_eq(&self.stream, &other.stream)
    }

    /// The next 64 random bits.
    pub fn next_u64(&self) -> u64 {
        self.stream.borrow_mut().next_u64()
    }

    /// Advances the stream by `draws` draws of [`next_u64`](Self::next_u64), as if they
    /// were made and discarded: where a caller that needs a later part of the stream (a
    /// pipeline stage's dropout masks, a rank's rows of one) finds it. Xoshiro has no jump
    /// by an arbitrary count, so this costs the draws themselves, without their use.
    ///
    /// ```
    /// use tl_tensor::Generator;
    /// let (drawn, skipped) = (Generator::new(5), Generator::new(5));
    /// for _ in 0..3 {
    ///     drawn.next_u64();
    /// }
    /// skipped.skip(3);
    /// assert_eq!(skipped.state(), drawn.state());
    /// ```
    pub fn skip(&self, draws: u64) {
        let mut stream = self.stream.borrow_mut();
        for _ in 0..draws {
            stream.next_u64();
        }
    }

    /// A uniform draw from `[0, 1)` with 53 random bits.
    pub fn next_f64(&self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A standard normal draw (Box–Muller; one draw per call, so the stream position after
    /// `n` draws does not depend on how they were grouped).
    pub fn next_normal(&self) -> f64 {
        // 1 - u is in (0, 1], so the logarithm is finite.
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// A uniform integer in `0..bound` (Lemire's method, unbiased).
    ///
    /// # Panics
    /// If `bound` is 0.
    pub fn below(&self, bound: u64) -> u64 {
        assert!(bound > 0, "Generator::below: the bound must be positive");
        loop {
            let product = u128::from(self.next_u64()) * u128::from(bound);
            let low = product as u64;
            if low >= bound.wrapping_neg() % bound {
                return (product >> 64) as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_one_stream() {
        let a = Generator::new(1);
        let b = a.clone();
        let fresh = Generator::new(1);
        assert_eq!(a.next_u64(), fresh.next_u64());
        assert_eq!(b.next_u64(), fresh.next_u64());
        assert!(a.same(&b));
    }

    #[test]
    fn state_roundtrips_through_json() {
        let rng = Generator::new(3);
        rng.next_u64();
        let json = serde_json::to_string(&rng.state()).unwrap();
        let state: GeneratorState = serde_json::from_str(&json).unwrap();
        let replay = Generator::new(0);
        replay.set_state(&state);
        assert_eq!(replay.next_u64(), rng.next_u64());
    }

    #[test]
    fn uniform_and_normal_have_the_right_moments() {
        let rng = Generator::new(11);
        let n = 20_000;
        let uniform: Vec<f64> = (0..n).map(|_| rng.next_f64()).collect();
        let mean = uniform.iter().sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "uniform mean {mean}");
        assert!(uniform.iter().all(|&u| (0.0..1.0).contains(&u)));
        let normal: Vec<f64> = (0..n).map(|_| rng.next_normal()).collect();
        let mean = normal.iter().sum::<f64>() / n as f64;
        let var = normal.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.03, "normal mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "normal variance {var}");
        let counts = (0..6000).fold([0usize; 3], |mut c, _| {
            c[rng.below(3) as usize] += 1;
            c
        });
        assert!(
            counts.iter().all(|&c| (1800..2200).contains(&c)),
            "{counts:?}"
        );
    }
}
