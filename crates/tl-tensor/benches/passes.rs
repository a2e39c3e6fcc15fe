//! The passes of a capstone step outside its products, in bytes of memory per second: the
//! SwiGLU gate and its VJP (the AVX-512 kernel beside the portable one), and RMSNorm
//! forward and backward, beside the plain `a + b` pass a step's residual adds make, which
//! reads and writes as much as the gate does and computes nothing.
//!
//! Sizes are a capstone step's (8 sequences × 512 tokens = 4096 rows; width 320, SwiGLU
//! hidden 896). The kernels run on one thread over the whole tensor; the ops (`Tensor`
//! level, as the model calls them) on the default rayon pool. Throughput is the bytes the
//! pass reads and writes once each, so a pass at the machine's memory speed reads as it.
//!
//! Run: `cargo bench -p tl-tensor --bench passes -- --measurement-time 3 --warm-up-time 1`

use std::hint::black_box;
use std::mem::MaybeUninit;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ndarray::{Array, ArrayD, IxDyn};
use rayon::ThreadPoolBuilder;
use tl_tensor::kernels::swiglu::{swiglu, swiglu_grads};
use tl_tensor::nn::{Module, RmsNorm};
use tl_tensor::{Element, Tensor};

/// Rows of activations in one capstone step: 8 sequences of 512 tokens.
const ROWS: usize = 4096;
/// The capstone's width.
const WIDTH: usize = 320;
/// The capstone's SwiGLU hidden size.
const HIDDEN: usize = 896;

/// `len` values in [-4, 4) from a fixed hash of the index.
fn filled(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
        })
        .collect()
}

/// The gate `g·σ(g)·u` and its VJP on one thread, the CPU's fast path against the portable
/// loops; the sum `a + b` of as many values, for the memory's speed.
fn swiglu_kernels(c: &mut Criterion) {
    let len = ROWS * HIDDEN;
    let [gate, up, grads] = [1, 2, 3].map(|seed| filled(len, seed));
    let mut out = vec![MaybeUninit::<f32>::uninit(); len];
    let mut group = c.benchmark_group(format!("swiglu {ROWS}x{HIDDEN}"));
    group.sample_size(20);
    let pool = ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    // Forward: reads g and u, writes y.
    group.throughput(Throughput::Bytes((3 * len * 4) as u64));
    group.bench_function("a+b/1t", |b| {
        b.iter(|| {
            let sum: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| g + u).collect();
            black_box(sum)
        });
    });
    group.bench_function("forward/fast/1t", |b| {
        pool.install(|| b.iter(|| black_box(f32::swiglu(&gate, &up, &mut out)[0])));
    });
    group.bench_function("forward/portable/1t", |b| {
        pool.install(|| b.iter(|| black_box(swiglu(&gate, &up, &mut out)[0])));
    });
    // Backward: reads g, u and ȳ, writes ḡ over ȳ and ū.
    group.throughput(Throughput::Bytes((5 * len * 4) as u64));
    let mut dg = grads.clone();
    group.bench_function("backward/fast/1t", |b| {
        b.iter(|| {
            dg.copy_from_slice(&grads);
            black_box(f32::swiglu_grads(&mut dg, &gate, &up, &mut out)[0])
        });
    });
    group.bench_function("backward/portable/1t", |b| {
        b.iter(|| {
            dg.copy_from_slice(&grads);
            black_box(swiglu_grads(&mut dg, &gate, &up, &mut out)[0])
        });
    });
    group.finish();
}

/// RMSNorm over a step's rows as the model runs it (the op, on the default pool): forward,
/// then forward and backward.
fn rmsnorm(c: &mut Criterion) {
    let shape = [8, ROWS / 8, WIDTH];
    let values = ArrayD::from_shape_vec(IxDyn(&shape), filled(ROWS * WIDTH, 4)).unwrap();
    let x = Tensor::param(values);
    let norm = RmsNorm::<f32>::new(WIDTH, 1e-5);
    let upstream: ArrayD<f32> = Array::from_elem(IxDyn(&shape), 0.5);
    let mut group = c.benchmark_group(format!("rmsnorm {ROWS}x{WIDTH}"));
    group.sample_size(20);
    group.throughput(Throughput::Bytes((2 * ROWS * WIDTH * 4) as u64));
    group.bench_function("forward", |b| b.iter(|| black_box(norm.forward(&x))));
    group.bench_function("forward+backward", |b| {
        b.iter(|| {
            norm.forward(&x).backward_with(upstream.clone());
            x.zero_grad();
        });
    });
    group.finish();
}

criterion_group!(benches, swiglu_kernels, rmsnorm);
criterion_main!(benches);
