//! The block-FMA GEMM on each kernel, on the pieces the capstone's products are cut into:
//! tl-tensor splits a product's rows over threads (four pieces a thread, two threads), so a
//! kernel sees 512 rows of the forward `(4096×320)·(320×896)` and of `d lhs`
//! `(4096×896)·(896×320)`, and 40 rows of `d rhs` `(320×4096)·(4096×896)`.
//!
//! One thread, each kernel the CPU has; the models are the autocast bench's: bf16 on an
//! H100, fp16 on a V100. Throughput is in products (multiply-adds).
//!
//! Run with: `cargo bench -p tl-numerics --bench block_fma -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tl_numerics::{BlockFma, Format, GemmKernel, round_slice};

/// Normal-ish values of `format`: a sum of uniforms, both signs, rounded.
fn operands(len: usize, format: Format, seed: u64) -> Vec<f32> {
    let mut state = seed | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let mut xs: Vec<f32> = (0..len).map(|_| next() + next() + next()).collect();
    round_slice(&mut xs, format);
    xs
}

fn bench_block_fma(c: &mut Criterion) {
    let models = [
        ("bf16_h100", Format::Bf16, BlockFma::H100),
        ("fp16_v100", Format::Fp16, BlockFma::V100),
    ];
    let shapes = [
        ("forward", (512, 320, 896)),
        ("d_lhs", (512, 896, 320)),
        ("d_rhs", (40, 4096, 896)),
    ];
    let kernels: Vec<GemmKernel> = [GemmKernel::Avx2, GemmKernel::Avx512]
        .into_iter()
        .filter(|k| {
            let available = k.is_available();
            if !available {
                eprintln!("{k:?}: not on this CPU, not measured");
            }
            available
        })
        .chain([GemmKernel::Portable])
        .collect();
    for (name, (m, k, n)) in shapes {
        let mut group = c.benchmark_group(format!("block_fma_{name}_{m}x{k}x{n}"));
        group.throughput(Throughput::Elements((m * k * n) as u64));
        group.sample_size(10);
        for (model, format, fma) in models {
            let a = operands(m * k, format, 1);
            let b = operands(k * n, format, 2);
            let mut out = vec![0.0f32; m * n];
            for kernel in &kernels {
                group.bench_function(format!("{model}/{kernel:?}"), |bench| {
                    bench.iter(|| {
                        assert!(fma.gemm_on(*kernel, format, (m, k, n), &a, &b, &mut out, false));
                        black_box(&out);
                    })
                });
            }
        }
        group.finish();
    }
}

criterion_group!(benches, bench_block_fma);
criterion_main!(benches);
