//! How the model is cut into pipeline stages: consecutive blocks per stage, the embedding
//! with the first, the final norm and the head with the last; given by the user
//! (`--pp-split`) or balanced by parameter count.
//!
//! Stage `s` of `p · v` is held by rank `s mod p` of the pipeline group (Megatron's
//! interleaved layout; `v = 1` but for the interleaved schedule).

use std::ops::Range;

use super::config::ModelConfig;
use super::llama::Stage;
use crate::error::{Result, TrainError};

/// The parameters of each of the model's `n_layers` blocks, with the embedding's added to
/// the first and the final norm's and the head's to the last: what a stage of those blocks
/// holds.
fn block_costs(config: &ModelConfig) -> Vec<usize> {
    let (v, d, h) = (config.vocab, config.d_model, config.hidden);
    let per_block = 4 * d * d + 3 * d * h + 2 * d;
    let mut costs = vec![per_block; config.n_layers];
    if let Some(first) = costs.first_mut() {
        *first += v * d;
    }
    if let Some(last) = costs.last_mut() {
        *last += d + d * v;
    }
    costs
}

/// The blocks of each of `stages` stages: at `boundaries` (the first block of stages 1 to
/// `stages − 1`, as `--pp-split 3,6` gives them), or else balanced so that the largest
/// stage holds as few parameters as any cut can give it (each stage at least one block).
///
/// # Errors
/// [`TrainError::InvalidArgument`] naming `pp-split` for boundaries that are not
/// `stages − 1` increasing blocks strictly inside the model;
/// [`TrainError::InvalidConfig`] naming `n_layers` when there are fewer blocks than stages.
///
/// ```
/// use tl_train::model::{Preset, pipeline::stage_blocks};
/// let capstone = Preset::Capstone.config(); // 8 blocks, the embedding and head 81,920 each
/// assert_eq!(stage_blocks(&capstone, 2, None)?, [0..4, 4..8]);
/// assert_eq!(stage_blocks(&capstone, 3, Some(&[2, 5]))?, [0..2, 2..5, 5..8]);
/// # Ok::<(), tl_train::TrainError>(())
/// ```
pub fn stage_blocks(
    config: &ModelConfig,
    stages: usize,
    boundaries: Option<&[usize]>,
) -> Result<Vec<Range<usize>>> {
    let layers = config.n_layers;
    if stages == 0 || stages > layers {
        return Err(TrainError::InvalidConfig {
            field: "n_layers",
            value: layers.to_string(),
            reason: format!(
                "a pipeline of {stages} stages needs at least one block a stage, so at least \
                 {stages} blocks"
            ),
        });
    }
    let cuts: Vec<usize> = match boundaries {
        Some(given) => {
            let valid = given.len() + 1 == stages
                && given.windows(2).all(|w| w[0] < w[1])
                && given.iter().all(|&b| 0 < b && b < layers);
            if !valid {
                return Err(TrainError::InvalidArgument {
                    name: "pp-split",
                    value: format!("{given:?}"),
                    reason: format!(
                        "{stages} stages need {} increasing first blocks of stages 1 to {}, \
                         each between 1 and {} (the model has {layers} blocks)",
                        stages - 1,
                        stages - 1,
                        layers - 1
                    ),
                });
            }
            given.to_vec()
        }
        None => balanced(&block_costs(config), stages),
    };
    let starts = std::iter::once(0).chain(cuts.iter().copied());
    let ends = cuts.iter().copied().chain(std::iter::once(layers));
    Ok(starts.zip(ends).map(|(a, b)| a..b).collect())
}

/// The cut of `costs` into `parts` consecutive non-empty runs whose largest sum is least,
/// and of those cuts the most even one (the least sum of the runs' squares): the first
/// index of runs 1 on.
fn balanced(costs: &[usize], parts: usize) -> Vec<usize> {
    let n = costs.len();
    let prefix: Vec<u128> = std::iter::once(0)
        .chain(costs.iter().scan(0u128, |sum, &c| {
            *sum += c as u128;
            Some(*sum)
        }))
        .collect();
    let run = |j: usize, i: usize| prefix[i] - prefix[j];
    // First the least largest run; then, with every run at most that, the least sum of
    // squares. Both are dynamic programmes over (runs, prefix length); `from` says where
    // the last run of the best cut of a prefix starts.
    let cut = |score: &dyn Fn(u128, u128) -> Option<u128>| {
        let mut best = vec![vec![None::<u128>; n + 1]; parts + 1];
        let mut from = vec![vec![0; n + 1]; parts + 1];
        best[0][0] = Some(0);
        for k in 1..=parts {
            for i in k..=n {
                for j in (k - 1)..i {
                    let Some(before) = best[k - 1][j] else {
                        continue;
                    };
                    let Some(total) = score(before, run(j, i)) else {
                        continue;
                    };
                    if best[k][i].is_none_or(|b| total < b) {
                        best[k][i] = Some(total);
                        from[k][i] = j;
                    }
                }
            }
        }
        (best[parts][n].expect("n ≥ parts: some cut exists"), from)
    };
    let (largest, _) = cut(&|before, run| Some(before.max(run)));
    let (_, from) = cut(&|before, run| (run <= largest).then(|| before + run * run));
    let mut cuts = Vec::with_capacity(parts - 1);
    let mut i = n;
    for k in (2..=parts).rev() {
        i = from[k][i];
        cuts.push(i);
    }
    cuts.reverse();
    cuts
}

/// The stages rank `rank` of a pipeline of `ranks` holds, `stages_per_rank` of them, with
/// their blocks from `blocks` (one range a stage, as [`stage_blocks`] gives them).
pub fn rank_stages(rank: usize, ranks: usize, blocks: &[Range<usize>]) -> Vec<Stage> {
    let last = blocks.len() - 1;
    (rank..blocks.len())
        .step_by(ranks)
        .map(|index| Stage {
            index,
            blocks: blocks[index].clone(),
            last: index == last,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;

    #[test]
    fn a_balanced_cut_is_the_best_one() {
        // Brute force over every cut of a few shapes.
        fn brute(costs: &[usize], parts: usize) -> usize {
            fn go(costs: &[usize], parts: usize) -> usize {
                if parts == 1 {
                    return costs.iter().sum();
                }
                (1..=costs.len() - (parts - 1))
                    .map(|i| {
                        costs[..i]
                            .iter()
                            .sum::<usize>()
                            .max(go(&costs[i..], parts - 1))
                    })
                    .min()
                    .unwrap()
            }
            go(costs, parts)
        }
        for costs in [
            vec![5, 1, 1, 1, 1, 1, 1, 5],
            vec![1, 2, 3, 4, 5, 6, 7],
            vec![9, 9, 1, 1, 1, 1],
            vec![3; 6],
        ] {
            for parts in 1..=costs.len() {
                let cuts = balanced(&costs, parts);
                assert_eq!(cuts.len(), parts - 1);
                let starts = std::iter::once(0).chain(cuts.iter().copied());
                let ends = cuts.iter().copied().chain(std::iter::once(costs.len()));
                let worst = starts
                    .zip(ends)
                    .map(|(a, b)| {
                        assert!(a < b, "{costs:?} in {parts}: an empty run");
                        costs[a..b].iter().sum::<usize>()
                    })
                    .max()
                    .unwrap();
                assert_eq!(worst, brute(&costs, parts), "{costs:?} in {parts}");
            }
        }
    }

    #[test]
    fn a_large_vocabulary_moves_blocks_off_the_end_stages() {
        let mut config = Preset::Capstone.config();
        config.vocab = 32_000; // 10.2M parameters each in the embedding and the head
        assert_eq!(
            stage_blocks(&config, 4, None).unwrap(),
            [0..1, 1..4, 4..7, 7..8]
        );
    }

    #[test]
    fn splits_that_cannot_be_are_refused_naming_the_size() {
        let capstone = Preset::Capstone.config();
        let err = stage_blocks(&capstone, 9, None).unwrap_err().to_string();
        assert!(
            err.contains("n_layers") && err.contains("9 stages"),
            "{err}"
        );
        for bad in [&[4][..], &[0, 4, 6], &[4, 4, 6], &[2, 5, 8]] {
            let err = stage_blocks(&capstone, 4, Some(bad))
                .unwrap_err()
                .to_string();
            assert!(err.contains("pp-split"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn interleaved_ranks_hold_every_pth_stage() {
        let blocks = stage_blocks(&Preset::Capstone.config(), 4, None).unwrap();
        let stages = rank_stages(1, 2, &blocks);
        assert_eq!(stages.iter().map(|s| s.index).collect::<Vec<_>>(), [1, 3]);
        assert!(stages[1].last && !stages[0].last);
    }
}
