//! Buckets: the gradients flattened from the last parameter to the first, in buckets of a
//! fixed capacity, parameters split across them.

use tl_parallel::{BucketSegment, bucket_plan};

fn seg(param: usize, start: usize, len: usize) -> BucketSegment {
    BucketSegment { param, start, len }
}

#[test]
fn test_buckets_fill_backwards_and_split() {
    // Parameters of 3, 10 and 2 elements in buckets of 4: the last parameter first, the
    // 10-element one, larger than a bucket, over three buckets, the first parameter last.
    assert_eq!(
        bucket_plan(&[3, 10, 2], 4),
        [
            vec![seg(2, 0, 2), seg(1, 0, 2)],
            vec![seg(1, 2, 4)],
            vec![seg(1, 6, 4)],
            vec![seg(0, 0, 3)],
        ]
    );
    // A model smaller than a bucket is one bucket, still in reverse order; an empty
    // parameter takes no segment.
    assert_eq!(
        bucket_plan(&[2, 0, 3], 100),
        [vec![seg(2, 0, 3), seg(0, 0, 2)]]
    );
    // Any model: every bucket but the last holds exactly the capacity, the segments cover
    // every element of every parameter once, last parameter first.
    for capacity in 1..9 {
        let numels = [5, 1, 0, 7, 3, 12];
        let buckets = bucket_plan(&numels, capacity);
        let (last, full) = buckets.split_last().unwrap();
        assert!(
            full.iter()
                .all(|b| b.iter().map(|s| s.len).sum::<usize>() == capacity)
        );
        assert!((1..=capacity).contains(&last.iter().map(|s| s.len).sum::<usize>()));
        let order: Vec<(usize, usize)> = buckets
            .iter()
            .flatten()
            .flat_map(|s| (s.start..s.start + s.len).map(move |e| (s.param, e)))
            .collect();
        let expected: Vec<(usize, usize)> = (0..numels.len())
            .rev()
            .flat_map(|p| (0..numels[p]).map(move |e| (p, e)))
            .collect();
        assert_eq!(order, expected, "capacity {capacity}");
    }
}
