//! The batch share: which rows a rank trains on, and its weight `n_r/B`.

// A share of one micro-batch is written as the list it is.
#![allow(clippy::single_range_in_vec_init)]

use tl_parallel::{BatchShare, batch_share};

fn shares(global_rows: usize, micro_batch_rows: usize, world_size: usize) -> Vec<BatchShare> {
    (0..world_size)
        .map(|rank| batch_share(global_rows, micro_batch_rows, world_size, rank).unwrap())
        .collect()
}

#[test]
fn test_shares_of_uneven_batches() {
    // 5 rows over 2 ranks, micro-batches of at most 2: the first rank takes the extra row.
    let five = shares(5, 2, 2);
    assert_eq!(five[0].rows, 0..3);
    assert_eq!(five[0].micro_batches, [0..2, 2..3]);
    assert_eq!(five[1].rows, 3..5);
    assert_eq!(five[1].micro_batches, [3..5]);
    // n_r/B: 3/5 and 2/5, not 1/2 each.
    assert_eq!((five[0].weight(), five[1].weight()), (0.6, 0.4));

    // 7 rows over 3 ranks: 3, 2 and 2 rows.
    let seven = shares(7, 2, 3);
    let rows: Vec<_> = seven.iter().map(|s| s.rows.clone()).collect();
    assert_eq!(rows, [0..3, 3..5, 5..7]);
    assert_eq!(seven[0].micro_batches, [0..2, 2..3]);
    assert_eq!(seven[2].micro_batches, [5..7]);
    let weights: Vec<f64> = seven.iter().map(BatchShare::weight).collect();
    assert_eq!(weights, [3.0 / 7.0, 2.0 / 7.0, 2.0 / 7.0]);

    // Any batch: every row once, in order, micro-batches of 1..=m rows inside the rank's
    // rows, weights summing to one.
    for global in 1..40 {
        for world in 1..=global.min(6) {
            for m in 1..5 {
                let all = shares(global, m, world);
                let covered: Vec<usize> = all
                    .iter()
                    .flat_map(|s| s.micro_batches.iter().cloned().flatten())
                    .collect();
                assert_eq!(
                    covered,
                    (0..global).collect::<Vec<_>>(),
                    "{global} rows, {world} ranks, m {m}"
                );
                for s in &all {
                    assert!(s.micro_batches.iter().all(|b| (1..=m).contains(&b.len())
                        && s.rows.start <= b.start
                        && b.end <= s.rows.end));
                    let longest = all.iter().map(|s| s.rows.len()).max().unwrap();
                    assert!(
                        longest - s.rows.len() <= 1,
                        "shares differ by at most a row"
                    );
                }
                let total: f64 = all.iter().map(BatchShare::weight).sum();
                assert!((total - 1.0).abs() < 1e-12);
            }
        }
    }
    // Fewer rows than ranks: a rank would have nothing.
    assert!(batch_share(2, 1, 3, 0).is_err());
}
