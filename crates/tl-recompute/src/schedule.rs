//! Checkpoint schedules: where to cut a stack of layers into segments, and what a cut costs.
//!
//! The memory model counts in units of one layer's stored input. A schedule is the list of
//! segment starts, `[0, start_2, …, start_k]`, cutting `n` layers into segments of sizes
//! `s_1, …, s_k`. The forward pass keeps only the input of each segment but the last; the last
//! segment runs normally and keeps all of its layers' inputs. During backward, segment `j` is
//! rerun while the stored inputs of the `j − 1` segments before it are still held, so
//!
//! ```text
//! peak = max_j (j − 1 + s_j)          recomputed layers = s_1 + … + s_{k−1} = n − s_k
//! ```
//!
//! With `k` segments under a budget `B`, segment `j` can hold at most `B − j + 1` layers, so
//! `B` covers at most `B + (B − 1) + … + 1 = B(B + 1)/2` layers.

use crate::{RecomputeError, Result};

/// What a schedule costs under the memory model of this module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduleCost {
    /// The predicted peak, `max_j (j − 1 + s_j)`, in units of one layer's stored input.
    pub peak_layers: usize,
    /// Layers run twice (forward, then again during backward): all but the last segment's.
    pub recomputed_layers: usize,
}

fn check_layers(n_layers: usize) -> Result<()> {
    if n_layers == 0 {
        return Err(RecomputeError::InvalidArgument {
            name: "n_layers",
            value: "0".into(),
            reason: "a stack to checkpoint has at least one layer".into(),
        });
    }
    Ok(())
}

/// The smallest budget `B` with `B(B + 1)/2 ≥ n_layers`: below it no schedule fits.
fn smallest_budget(n_layers: usize) -> usize {
    (1..=n_layers)
        .find(|&budget| budget * (budget + 1) / 2 >= n_layers)
        .unwrap_or(n_layers)
}

/// The schedule that keeps the peak within `mem_budget_layers` and recomputes the fewest
/// layers: the largest possible last segment (the one that is not recomputed), and among
/// those the fewest segments. The earlier segments are then filled front first, each as
/// long as its share of the budget allows.
///
/// Returns the segment starts; `[0]` (a single segment, no checkpointing) when the budget
/// holds the whole stack.
///
/// # Errors
/// [`RecomputeError::InvalidArgument`] for zero layers or a zero budget;
/// [`RecomputeError::BudgetTooSmall`] when `n_layers > B(B + 1)/2`, naming the smallest
/// budget that fits.
///
/// ```
/// use tl_recompute::{checkpoint_schedule, RecomputeError};
/// // Six layers in four units: segments of 3 and 3, peak max(0 + 3, 1 + 3) = 4.
/// assert_eq!(checkpoint_schedule(6, 4)?, vec![0, 3]);
/// assert_eq!(checkpoint_schedule(6, 6)?, vec![0]);
/// // Two units cover at most 2 + 1 = 3 layers; six need three units (3 + 2 + 1).
/// assert!(matches!(
///     checkpoint_schedule(6, 2),
///     Err(RecomputeError::BudgetTooSmall { min_budget: 3, .. })
/// ));
/// # Ok::<(), RecomputeError>(())
/// ```
pub fn checkpoint_schedule(n_layers: usize, mem_budget_layers: usize) -> Result<Vec<usize>> {
    check_layers(n_layers)?;
    if mem_budget_layers == 0 {
        return Err(RecomputeError::InvalidArgument {
            name: "mem_budget_layers",
            value: "0".into(),
            reason: "every schedule holds at least one layer's input".into(),
        });
    }
    if mem_budget_layers >= n_layers {
        return Ok(vec![0]);
    }
    let min_budget = smallest_budget(n_layers);
    if mem_budget_layers < min_budget {
        return Err(RecomputeError::BudgetTooSmall {
            n_layers,
            mem_budget_layers,
            min_budget,
        });
    }
    let budget = mem_budget_layers;
    // Segment j (1-based) may hold at most budget − j + 1 layers. Try the longest last
    // segment first, then the fewest segments: the first fit is the optimum.
    for last in (1..=budget.min(n_layers)).rev() {
        let rest = n_layers - last;
        for segments in 2..=budget - last + 1 {
            let earlier = segments - 1;
            let capacity: usize = (1..=earlier).map(|j| budget - j + 1).sum();
            if (earlier..=capacity).contains(&rest) {
                return Ok(front_filled_starts(rest, earlier, budget));
            }
        }
    }
    unreachable!("n_layers ≤ B(B + 1)/2 guarantees the k = B, sizes B..1 schedule fits")
}

/// Starts of `earlier` segments covering `rest` layers, segment `j` capped at
/// `budget − j + 1`, filled front first; the last segment starts right after them.
///
/// `earlier` is the fewest segments whose caps cover `rest`, so the caps of the first
/// `earlier − 1` fall short of it: they are filled to their caps and the last earlier
/// segment keeps at least one layer.
fn front_filled_starts(mut rest: usize, earlier: usize, budget: usize) -> Vec<usize> {
    let mut starts = Vec::with_capacity(earlier + 1);
    let mut next_start = 0;
    for j in 1..=earlier {
        let size = (budget - j + 1).min(rest);
        starts.push(next_start);
        next_start += size;
        rest -= size;
    }
    starts.push(next_start);
    starts
}

/// Segments of `⌈√n⌉` layers (the last one possibly shorter): Chen et al.'s sublinear
/// schedule, whose peak grows like `2√n` whatever the budget.
///
/// # Errors
/// [`RecomputeError::InvalidArgument`] for zero layers.
///
/// ```
/// use tl_recompute::{schedule_cost, uniform_schedule};
/// assert_eq!(uniform_schedule(16)?, vec![0, 4, 8, 12]);
/// // peak = 3 stored inputs + the last 4 layers; 12 layers are rerun.
/// let cost = schedule_cost(16, &uniform_schedule(16)?)?;
/// assert_eq!((cost.peak_layers, cost.recomputed_layers), (7, 12));
/// # Ok::<(), tl_recompute::RecomputeError>(())
/// ```
pub fn uniform_schedule(n_layers: usize) -> Result<Vec<usize>> {
    check_layers(n_layers)?;
    let mut size = n_layers.isqrt();
    if size * size < n_layers {
        size += 1;
    }
    Ok((0..n_layers).step_by(size).collect())
}

/// The sizes of the segments a valid schedule cuts `n_layers` into.
///
/// # Errors
/// [`RecomputeError::InvalidArgument`] for zero layers; [`RecomputeError::InvalidSchedule`]
/// unless the schedule starts at 0, increases strictly and stays below `n_layers`.
pub fn segment_sizes(n_layers: usize, schedule: &[usize]) -> Result<Vec<usize>> {
    check_layers(n_layers)?;
    let invalid = |reason| RecomputeError::InvalidSchedule {
        schedule: schedule.to_vec(),
        n_layers,
        reason,
    };
    if schedule.first() != Some(&0) {
        return Err(invalid("the first segment starts at layer 0"));
    }
    if schedule.windows(2).any(|pair| pair[0] >= pair[1]) {
        return Err(invalid("segment starts increase strictly"));
    }
    if schedule.last().is_some_and(|&start| start >= n_layers) {
        return Err(invalid("every segment starts before the last layer's end"));
    }
    let ends = schedule.iter().skip(1).copied().chain([n_layers]);
    Ok(schedule
        .iter()
        .zip(ends)
        .map(|(start, end)| end - start)
        .collect())
}

/// The predicted peak and the number of recomputed layers of `schedule`, under the model of
/// this module (see [`ScheduleCost`]).
///
/// # Errors
/// As [`segment_sizes`].
///
/// ```
/// use tl_recompute::schedule_cost;
/// // Sizes 3, 3: peak max(0 + 3, 1 + 3) = 4, the first 3 layers run twice.
/// let cost = schedule_cost(6, &[0, 3])?;
/// assert_eq!((cost.peak_layers, cost.recomputed_layers), (4, 3));
/// assert!(schedule_cost(6, &[1, 3]).is_err());
/// # Ok::<(), tl_recompute::RecomputeError>(())
/// ```
pub fn schedule_cost(n_layers: usize, schedule: &[usize]) -> Result<ScheduleCost> {
    let sizes = segment_sizes(n_layers, schedule)?;
    let peak_layers = sizes
        .iter()
        .enumerate()
        .map(|(index, size)| index + size)
        .max()
        .expect("a valid schedule has a segment");
    let last = *sizes.last().expect("a valid schedule has a segment");
    Ok(ScheduleCost {
        peak_layers,
        recomputed_layers: n_layers - last,
    })
}

#[cfg(test)]
mod tests;
