//! Measuring a communicator's all-reduce bandwidth, as nccl-tests reports it, against
//! memcpy on the same machine. Shared by `tinyllm comm-bench` and the criterion bench.
//!
//! For an all-reduce of `bytes` taking `time`: the algorithm bandwidth is `bytes / time`,
//! and the bus bandwidth `algbw · 2(N−1)/N` — the rate at which each rank's link carries the
//! bytes a bandwidth-optimal algorithm must move, comparable across world sizes and with the
//! hardware's link speed (here: memcpy, the speed of moving bytes within one machine).

use std::hint::black_box;
use std::time::{Duration, Instant};

use crate::communicator::Communicator;
use crate::error::Result;

/// One size of a sweep.
#[derive(Clone, Copy, Debug)]
pub struct Row {
    /// Bytes all-reduced (f32 elements × 4).
    pub bytes: usize,
    /// Time of one all-reduce (the slowest rank's mean).
    pub time: Duration,
    /// Algorithm bandwidth, bytes / time, in GB/s (10^9 bytes per second).
    pub algbw: f64,
    /// Bus bandwidth, algbw · 2(N−1)/N, in GB/s.
    pub busbw: f64,
    /// memcpy of the same number of bytes on rank 0, in GB/s (bytes copied per second).
    pub memcpy: f64,
}

/// Sizes from `min` to `max` bytes, each `factor` times the last.
pub fn sizes(min: usize, max: usize, factor: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut size = min.max(4);
    while size <= max {
        out.push(size);
        // Past usize's range the sweep is over (it used to wrap to 0 and never end).
        let Some(next) = size.checked_mul(factor.max(2)) else {
            break;
        };
        size = next;
    }
    out
}

/// memcpy's bandwidth for `bytes`, in GB/s, measured for about `budget`.
pub fn memcpy_bandwidth(bytes: usize, budget: Duration) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let start = Instant::now();
    let mut copies = 0u64;
    while start.elapsed() < budget || copies < 3 {
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
        copies += 1;
    }
    (bytes as f64 * copies as f64) / start.elapsed().as_secs_f64() / 1e9
}

/// All-reduces `bytes` of f32 for about `budget` on every rank (which must all call this),
/// after two warm-up calls; the ranks agree on the count of calls.
///
/// # Errors
/// The communicator's.
pub fn measure_all_reduce(
    comm: &mut dyn Communicator,
    bytes: usize,
    budget: Duration,
) -> Result<Row> {
    let n = comm.world_size();
    let memcpy = if comm.rank() == 0 {
        memcpy_bandwidth(bytes, budget / 4)
    } else {
        0.0
    };
    let memcpy = comm.all_reduce_max_f32(memcpy as f32)? as f64;
    // Zeros stay zeros, so repeated sums never reach infinities or subnormals.
    let mut buf = vec![0.0f32; bytes / 4];
    // The first call pays for page faults; the second one sets the pace.
    comm.all_reduce_sum((&mut buf).into())?;
    let warm = Instant::now();
    comm.all_reduce_sum((&mut buf).into())?;
    let once = warm.elapsed().as_secs_f64().max(1e-6);
    let calls = (budget.as_secs_f64() / once).clamp(3.0, 10_000.0) as f32;
    let calls = comm.all_reduce_max_f32(calls)? as u32;
    comm.barrier()?;
    let start = Instant::now();
    for _ in 0..calls {
        comm.all_reduce_sum((&mut buf).into())?;
    }
    let mean = start.elapsed().as_secs_f64() / f64::from(calls);
    let slowest = comm.all_reduce_max_f32(mean as f32)?;
    let time = Duration::from_secs_f64(f64::from(slowest));
    let algbw = bytes as f64 / time.as_secs_f64() / 1e9;
    let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
    Ok(Row {
        bytes,
        time,
        algbw,
        busbw,
        memcpy,
    })
}

/// A size as "4 KiB", "16 MiB".
pub fn format_size(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// The rows as a Markdown table.
pub fn format_table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| size | time (us) | algbw (GB/s) | busbw (GB/s) | memcpy (GB/s) |\n\
         |---:|---:|---:|---:|---:|\n",
    );
    for row in rows {
        out.push_str(&format!(
            "| {} | {:.1} | {:.2} | {:.2} | {:.2} |\n",
            format_size(row.bytes),
            row.time.as_secs_f64() * 1e6,
            row.algbw,
            row.busbw,
            row.memcpy
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Single;

    #[test]
    fn sizes_go_up_by_the_factor() {
        assert_eq!(sizes(4096, 65536, 4), [4096, 16384, 65536]);
        assert_eq!(sizes(1 << 62, usize::MAX, 4), [1 << 62]);
        assert_eq!(format_size(4096), "4 KiB");
        assert_eq!(format_size(64 << 20), "64 MiB");
    }

    #[test]
    fn a_world_of_one_has_no_bus_traffic() {
        let row = measure_all_reduce(&mut Single::new(), 4096, Duration::from_millis(5)).unwrap();
        assert_eq!(row.busbw, 0.0);
        assert!(row.memcpy > 0.0);
        assert!(format_table(&[row]).contains("| 4 KiB |"));
    }
}
