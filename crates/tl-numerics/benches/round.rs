//! Throughput of `round_slice` on a large f32 buffer in every format (and of the saturating,
//! counting conversion in the fp8 formats, and fp8's whole scaled cast with its amax), next
//! to a plain copy of the same size (and, for reference, on the same values as f64).
//!
//! Autocast rounds every matmul operand and output, so rounding a slice must run near memory
//! bandwidth; `copy_from_slice` (a memcpy) is the yardstick. Throughput is the buffer size in
//! bytes per iteration, so criterion reports GB/s (GiB/s).
//!
//! Run with: `cargo bench -p tl-numerics --bench round -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::mem::MaybeUninit;

use tl_numerics::{
    Format, round_slice, round_slice_counting_flushes, round_slice_into,
    round_slice_saturating_counting, scale_round_saturating_into,
};

/// 16M values: 64 MiB per buffer, well beyond any cache, so this measures memory streaming.
const LEN: usize = 1 << 24;

/// Values spread over many binades, with both signs, some below fp16's range and some above.
fn inputs() -> Vec<f32> {
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    (0..LEN)
        .map(|_| {
            // xorshift64: cheap, deterministic, and enough to defeat any value pattern.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            unit * 2f32.powi((state % 48) as i32 - 30)
        })
        .collect()
}

fn bench_round(c: &mut Criterion) {
    let source = inputs();
    let mut group = c.benchmark_group("round_16M_f32");
    group.throughput(Throughput::Bytes((LEN * size_of::<f32>()) as u64));
    group.sample_size(20);

    // In place and repeatedly: after the first pass the values are already rounded, which
    // changes nothing for the branch-free kernels (same work per element whatever the value).
    // Every format: each has its own kernel (fp16 and fp8 share one, with other constants).
    for format in Format::ALL {
        let mut xs = source.clone();
        group.bench_function(format!("round_slice_{format}"), |b| {
            b.iter(|| round_slice(black_box(xs.as_mut_slice()), format));
        });
    }
    // The conversion fp8 training stores with: saturating, counting what left the range.
    for format in Format::FP8 {
        let mut xs = source.clone();
        group.bench_function(format!("round_slice_saturating_counting_{format}"), |b| {
            b.iter(|| round_slice_saturating_counting(black_box(xs.as_mut_slice()), format));
        });
    }

    // fp8's cast as delayed scaling does it: scale, saturating round, range counts and the
    // amax, read from one buffer and written to another (so beside memcpy, not in place).
    for format in Format::FP8 {
        let mut out = vec![MaybeUninit::<f32>::uninit(); LEN];
        group.bench_function(format!("scale_round_saturating_into_{format}"), |b| {
            b.iter(|| {
                scale_round_saturating_into(black_box(source.as_slice()), 3.0, &mut out, format)
            });
        });
    }

    let mut destination = vec![0.0_f32; LEN];
    group.bench_function("memcpy", |b| {
        b.iter(|| destination.copy_from_slice(black_box(source.as_slice())));
    });
    group.finish();
}

/// The f64 kernel, for comparison: scalar integer arithmetic on the 53-bit significand.
fn bench_round_f64(c: &mut Criterion) {
    let source: Vec<f64> = inputs().into_iter().map(f64::from).collect();
    let mut group = c.benchmark_group("round_16M_f64");
    group.throughput(Throughput::Bytes((LEN * size_of::<f64>()) as u64));
    group.sample_size(10);
    for format in Format::ALL {
        let mut xs = source.clone();
        group.bench_function(format!("round_slice_{format}"), |b| {
            b.iter(|| round_slice(black_box(xs.as_mut_slice()), format));
        });
    }
    group.finish();
}

/// A capstone activation's size (4096 tokens × 320 columns, 5 MiB): what autocast rounds in
/// a step, in place (a product's output), counting flushes (a gradient) and into a copy (an
/// operand). Unlike the 64 MiB buffers above it stays in a large last-level cache, so the
/// loops' own speed shows, not only the memory's.
fn bench_round_activation(c: &mut Criterion) {
    const ACTIVATION: usize = 4096 * 320;
    let source = &inputs()[..ACTIVATION];
    let mut group = c.benchmark_group("round_activation_f32");
    group.throughput(Throughput::Bytes((ACTIVATION * size_of::<f32>()) as u64));
    group.sample_size(50);
    let mut xs = source.to_vec();
    group.bench_function("round_slice_bf16", |b| {
        b.iter(|| round_slice(black_box(xs.as_mut_slice()), Format::Bf16));
    });
    group.bench_function("round_slice_counting_flushes_bf16", |b| {
        b.iter(|| round_slice_counting_flushes(black_box(xs.as_mut_slice()), Format::Bf16));
    });
    let mut out = vec![MaybeUninit::<f32>::uninit(); ACTIVATION];
    group.bench_function("round_slice_into_bf16", |b| {
        b.iter(|| round_slice_into(black_box(source), &mut out, Format::Bf16));
    });
    group.finish();
}

criterion_group!(
    benches,
    bench_round,
    bench_round_f64,
    bench_round_activation
);
criterion_main!(benches);
