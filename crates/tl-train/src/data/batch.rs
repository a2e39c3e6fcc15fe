//! [`Batch`]es of next-byte prediction windows: random ones for training, sequential ones
//! for a deterministic validation loss.

use tl_tensor::Generator;

use super::tokens::TokenSource;

/// `rows` windows of `context` bytes and, for each byte, the byte that follows it.
///
/// Both vectors are row-major `[rows, context]`: row `r` of `inputs` is
/// `data[start_r .. start_r + context]` and row `r` of `targets` is the same window moved one
/// byte to the right, `data[start_r + 1 .. start_r + context + 1]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Input tokens, `rows · context` of them.
    pub inputs: Vec<usize>,
    /// The token after each input token.
    pub targets: Vec<usize>,
    /// Number of windows.
    pub rows: usize,
    /// Tokens per window.
    pub context: usize,
}

impl Batch {
    fn with_capacity(rows: usize, context: usize) -> Self {
        Self {
            inputs: Vec::with_capacity(rows * context),
            targets: Vec::with_capacity(rows * context),
            rows: 0,
            context,
        }
    }

    fn push_window<T: TokenSource + ?Sized>(&mut self, data: &T, start: usize) {
        let window = start..start + self.context + 1;
        self.inputs
            .extend(window.clone().take(self.context).map(|i| data.token(i)));
        self.targets.extend(window.skip(1).map(|i| data.token(i)));
        self.rows += 1;
    }
}

fn check_shape(function: &str, rows: usize, context: usize) {
    assert!(rows > 0, "{function}: rows must be positive");
    assert!(context > 0, "{function}: context must be positive");
}

/// `rows` windows at uniformly random starts in `data`, as nanoGPT samples its batches.
///
/// Each row's start is `rng.below(len - context)` for `len` tokens, so every window of `context + 1`
/// bytes (inputs and the last target) is equally likely. The windows are drawn from `rng`
/// alone, one draw per row, so saving and restoring the generator's state replays them.
///
/// # Panics
/// If `rows` or `context` is 0, or `data` is shorter than `context + 1` bytes.
///
/// ```
/// use tl_train::data::sample_batch;
/// use tl_tensor::Generator;
/// let batch = sample_batch(b"hello world", 2, 4, &Generator::new(0));
/// assert_eq!((batch.inputs.len(), batch.targets.len()), (8, 8));
/// assert_eq!(batch.inputs[1..4], batch.targets[..3]);
/// ```
pub fn sample_batch<T: TokenSource + ?Sized>(
    data: &T,
    rows: usize,
    context: usize,
    rng: &Generator,
) -> Batch {
    check_shape("sample_batch", rows, context);
    assert!(
        data.token_count() > context,
        "sample_batch: {} bytes of data cannot hold a window of context {context} + 1 bytes",
        data.token_count()
    );
    let starts = (data.token_count() - context) as u64;
    let mut batch = Batch::with_capacity(rows, context);
    for _ in 0..rows {
        batch.push_window(data, rng.below(starts) as usize);
    }
    batch
}

/// Draws from `rng` exactly what [`sample_batch`] would, without building the batch: how a
/// rank steps over the rows of a global batch that other ranks train on.
///
/// ```
/// use tl_train::data::{sample_batch, skip_batch};
/// use tl_tensor::Generator;
/// let (a, b) = (Generator::new(1), Generator::new(1));
/// sample_batch(b"hello world", 3, 4, &a);
/// skip_batch(b"hello world", 3, 4, &b);
/// assert_eq!(sample_batch(b"hello world", 1, 4, &a), sample_batch(b"hello world", 1, 4, &b));
/// ```
///
/// # Panics
/// As [`sample_batch`].
pub fn skip_batch<T: TokenSource + ?Sized>(data: &T, rows: usize, context: usize, rng: &Generator) {
    check_shape("skip_batch", rows, context);
    assert!(
        data.token_count() > context,
        "skip_batch: {} bytes of data cannot hold a window of context {context} + 1 bytes",
        data.token_count()
    );
    let starts = (data.token_count() - context) as u64;
    for _ in 0..rows {
        rng.below(starts);
    }
}

/// Non-overlapping windows covering `data` in order, `rows` per batch: every byte after the
/// first is predicted exactly once, so a loss averaged over them is a deterministic measure
/// of the whole split.
///
/// Window `k` starts at byte `k · context`; its targets reach one byte into window `k + 1`.
/// There are `(len − 1) / context` windows (rounded down: a final window that does not
/// fit is dropped), grouped in order into batches of `rows`, the last batch possibly shorter.
/// Data shorter than `context + 1` bytes gives no batch.
///
/// # Panics
/// If `rows` or `context` is 0.
///
/// ```
/// use tl_train::data::sequential_batches;
/// // 10 bytes, context 3: windows at 0, 3, 6 (9 bytes of targets), in batches of 2 and 1.
/// let batches = sequential_batches(b"0123456789", 2, 3);
/// assert_eq!(batches.iter().map(|b| b.rows).collect::<Vec<_>>(), [2, 1]);
/// assert_eq!(batches[1].inputs, [b'6', b'7', b'8'].map(usize::from));
/// assert_eq!(batches[1].targets, [b'7', b'8', b'9'].map(usize::from));
/// ```
pub fn sequential_batches<T: TokenSource + ?Sized>(
    data: &T,
    rows: usize,
    context: usize,
) -> Vec<Batch> {
    check_shape("sequential_batches", rows, context);
    let windows = data.token_count().saturating_sub(1) / context;
    (0..windows)
        .step_by(rows)
        .map(|first| {
            let end = (first + rows).min(windows);
            let mut batch = Batch::with_capacity(end - first, context);
            for k in first..end {
                batch.push_window(data, k * context);
            }
            batch
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Bytes whose value is their index, so a token says where it was read.
    fn ramp(n: usize) -> Vec<u8> {
        (0..n).map(|i| i as u8).collect()
    }

    #[test]
    fn sampled_rows_are_windows_with_targets_shifted_by_one() {
        let data = ramp(50);
        let batch = sample_batch(&data, 4, 6, &Generator::new(3));
        assert_eq!((batch.rows, batch.context), (4, 6));
        for r in 0..4 {
            let inputs = &batch.inputs[r * 6..(r + 1) * 6];
            let start = inputs[0];
            assert!(start + 6 < 50, "window at {start} runs past the data");
            assert_eq!(inputs, (start..start + 6).collect::<Vec<_>>());
            assert_eq!(
                batch.targets[r * 6..(r + 1) * 6],
                (start + 1..start + 7).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn sampling_replays_from_a_saved_generator_state() {
        let data = ramp(200);
        let rng = Generator::new(9);
        let saved = rng.state();
        let first = sample_batch(&data, 3, 8, &rng);
        let second = sample_batch(&data, 3, 8, &rng);
        assert_ne!(first, second);
        rng.set_state(&saved);
        assert_eq!(sample_batch(&data, 3, 8, &rng), first);
        assert_eq!(sample_batch(&data, 3, 8, &Generator::new(9)), first);
    }

    #[test]
    fn sampling_reaches_the_first_and_the_last_window() {
        // 6 bytes, context 4: starts 0 and 1 only (below(2)).
        let data = ramp(6);
        let batch = sample_batch(&data, 64, 4, &Generator::new(0));
        let starts: Vec<usize> = batch.inputs.chunks(4).map(|row| row[0]).collect();
        assert!(starts.contains(&0) && starts.contains(&1), "{starts:?}");
        assert!(starts.iter().all(|&s| s <= 1));
    }

    #[test]
    #[should_panic(expected = "cannot hold a window")]
    fn sampling_panics_when_no_window_fits() {
        sample_batch(&ramp(4), 1, 4, &Generator::new(0));
    }

    #[test]
    fn sequential_batches_cover_the_data_once_in_order() {
        // 101 bytes, context 10: (101 - 1) / 10 = 10 windows, every target byte 1..=100 once;
        // 4 rows per batch gives batches of 4, 4, 2.
        let batches = sequential_batches(&ramp(101), 4, 10);
        assert_eq!(
            batches.iter().map(|b| b.rows).collect::<Vec<_>>(),
            [4, 4, 2]
        );
        let targets: Vec<usize> = batches.iter().flat_map(|b| b.targets.clone()).collect();
        assert_eq!(targets, (1..=100).collect::<Vec<_>>());
        let inputs: Vec<usize> = batches.iter().flat_map(|b| b.inputs.clone()).collect();
        assert_eq!(inputs, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn sequential_batches_drop_a_window_that_does_not_fit() {
        // 100 bytes, context 10: (100 - 1) / 10 = 9 windows; the tenth would need byte 100.
        let batches = sequential_batches(&ramp(100), 5, 10);
        assert_eq!(batches.iter().map(|b| b.rows).collect::<Vec<_>>(), [5, 4]);
        assert_eq!(batches[1].targets.last(), Some(&90));
        assert!(sequential_batches(&ramp(10), 5, 10).is_empty());
        assert!(sequential_batches(&[], 5, 10).is_empty());
    }

    proptest! {
        #[test]
        fn every_sampled_window_lies_inside_the_data(
            len in 2usize..300,
            context_fraction in 0.0f64..1.0,
            rows in 1usize..6,
            seed in any::<u64>(),
        ) {
            let context = 1 + ((len - 2) as f64 * context_fraction) as usize;
            let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let batch = sample_batch(&data, rows, context, &Generator::new(seed));
            prop_assert_eq!(batch.inputs.len(), rows * context);
            for row in 0..rows {
                // The data repeats with period 251 only, so any window matching the row is
                // followed by the same byte as the row's own window.
                let inputs = &batch.inputs[row * context..(row + 1) * context];
                let start = (0..len - context)
                    .find(|&s| data[s..s + context].iter().map(|&b| usize::from(b)).eq(inputs.iter().copied()));
                prop_assert!(start.is_some(), "row {} is not a window of the data", row);
                let start = start.unwrap();
                for i in 0..context {
                    prop_assert_eq!(batch.targets[row * context + i], usize::from(data[start + i + 1]));
                }
            }
        }

        #[test]
        fn sequential_batches_hold_every_window_that_fits(
            len in 0usize..300,
            context in 1usize..40,
            rows in 1usize..8,
        ) {
            let data: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let batches = sequential_batches(&data, rows, context);
            let windows = len.saturating_sub(1) / context;
            prop_assert_eq!(batches.iter().map(|b| b.rows).sum::<usize>(), windows);
            prop_assert!(batches.iter().all(|b| b.rows >= 1 && b.rows <= rows));
            prop_assert!(batches.iter().rev().skip(1).all(|b| b.rows == rows));
            let targets: Vec<usize> = batches.iter().flat_map(|b| b.targets.clone()).collect();
            let expected: Vec<usize> =
                data.iter().skip(1).take(windows * context).map(|&b| usize::from(b)).collect();
            prop_assert_eq!(targets, expected);
        }
    }
}
