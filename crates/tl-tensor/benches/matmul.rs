//! Matrix-product throughput on the capstone model's shapes, in GFLOP/s.
//!
//! A training step of the capstone (batch 8 × context 512 = 4096 rows, d_model 320, SwiGLU
//! hidden 896, 10 heads of 32 over 8 sequences = 80 attention matrices) spends almost all its
//! time in these products: the linear layers forward (`X·W`) and backward (`G·Wᵀ`, `Xᵀ·G`,
//! with the transposes passed as strided views, as the VJP does), and attention's two batched
//! products. Each runs in a rayon pool of 1 and of 2 threads; ndarray's `dot`
//! (matrixmultiply, single-threaded as this workspace builds it) is measured beside gemm on
//! the linear shapes. Throughput is counted as 2·m·n·k flops per product, so criterion's
//! "elem/s" reads as flop/s.
//!
//! `gemm/Nt` returns a fresh output, as `Tensor::matmul` does, so it includes what the
//! allocator charges for it; `gemm-into-reused/2t` writes into one output kept across
//! iterations, the kernel alone. The gap is large for outputs of 32 MiB and more (80×512×512
//! f32 is 84 MB), which glibc maps fresh from the kernel on every allocation: the page faults
//! cost about as much as the product.
//!
//! Run: `cargo bench -p tl-tensor --bench matmul -- --measurement-time 3 --warm-up-time 1`

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ndarray::{Array, Array2, ArrayView2, ArrayViewMut2, Dimension, IntoDimension};
use rayon::{ThreadPool, ThreadPoolBuilder};
use tl_tensor::kernels::attention::CausalAttention;
use tl_tensor::kernels::batched::{batched_matmul, batched_matmul_into};
use tl_tensor::kernels::bf16_dot::{
    Bf16Rhs, amx_available, amx_gemm, amx_gemm_into, amx_gemm_portable_into, bf16_gemm,
    bf16_gemm_into, bf16_gemm_portable, units_available,
};
use tl_tensor::kernels::gemm::{gemm_into, matmul};

/// Rows of activations in one capstone step: 8 sequences of 512 tokens.
const ROWS: usize = 4096;
/// (in, out) features of the capstone's linear layers: SwiGLU up, SwiGLU down, attention.
const LINEAR: [(usize, usize); 3] = [(320, 896), (896, 320), (320, 320)];
/// Thread counts every product is measured at.
const THREADS: [usize; 2] = [1, 2];

/// An array of the given shape with values in [-0.5, 0.5) from a fixed hash of the index.
fn filled<D: Dimension>(shape: impl IntoDimension<Dim = D>, seed: u64) -> Array<f32, D> {
    let mut state = seed;
    Array::from_shape_simple_fn(shape, move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    })
}

fn pools() -> Vec<(usize, ThreadPool)> {
    THREADS
        .iter()
        .map(|&threads| {
            let pool = ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a rayon pool");
            (threads, pool)
        })
        .collect()
}

/// One 2-D product `lhs · rhs`, with gemm at every thread count and, if `compare`, with
/// ndarray's `dot` too.
fn bench_product(
    c: &mut Criterion,
    name: &str,
    lhs: ArrayView2<'_, f32>,
    rhs: ArrayView2<'_, f32>,
    compare: bool,
) {
    let (m, k, n) = (lhs.nrows(), lhs.ncols(), rhs.ncols());
    let mut group = c.benchmark_group(format!("{name} {m}x{k}x{n}"));
    group.throughput(Throughput::Elements((2 * m * n * k) as u64));
    for (threads, pool) in pools() {
        group.bench_function(format!("gemm/{threads}t"), |b| {
            pool.install(|| b.iter(|| matmul(black_box(lhs), black_box(rhs))));
        });
    }
    if compare {
        // The same product into one output reused across iterations: what a fresh,
        // zero-filled output costs shows as the gap to gemm/2t.
        let mut out = ndarray::Array2::zeros((m, n));
        let (_, pool) = &pools()[1];
        group.bench_function("gemm-into-reused/2t", |b| {
            pool.install(|| b.iter(|| gemm_into(&mut out.view_mut(), black_box(lhs), rhs, false)));
        });
        group.bench_function("matrixmultiply/1t", |b| {
            b.iter(|| black_box(lhs).dot(&black_box(rhs)));
        });
    }
    group.finish();
}

fn linear_layers(c: &mut Criterion) {
    for (inputs, outputs) in LINEAR {
        let x = filled((ROWS, inputs), 1);
        let w = filled((inputs, outputs), 2);
        let grad = filled((ROWS, outputs), 3);
        bench_product(c, "X·W", x.view(), w.view(), true);
        bench_product(c, "G·Wᵀ", grad.view(), w.t(), true);
        bench_product(c, "Xᵀ·G", x.t(), grad.view(), true);
    }
}

fn attention(c: &mut Criterion) {
    let (heads, context, head_dim) = (80, 512, 32);
    let query = filled((heads, context, head_dim), 4);
    let key_t = filled((heads, head_dim, context), 5);
    let key = filled((heads, context, head_dim), 6);
    let probs = filled((heads, context, context), 7);
    let cases = [
        ("Q·Kᵀ", query.view().into_dyn(), key_t.view().into_dyn()),
        // Kᵀ as attention's backward and a view-based forward see it: K with swapped axes.
        (
            "Q·Kᵀ(view)",
            query.view().into_dyn(),
            key.view().permuted_axes([0, 2, 1]).into_dyn(),
        ),
        ("P·V", probs.view().into_dyn(), key.view().into_dyn()),
    ];
    for (name, lhs, rhs) in cases {
        let (m, k, n) = (lhs.shape()[1], lhs.shape()[2], rhs.shape()[2]);
        let mut group = c.benchmark_group(format!("{name} {heads}x{m}x{k}x{n}"));
        group.throughput(Throughput::Elements((2 * heads * m * n * k) as u64));
        for (threads, pool) in pools() {
            group.bench_function(format!("gemm/{threads}t"), |b| {
                pool.install(|| b.iter(|| batched_matmul(black_box(lhs.view()), rhs.view())));
            });
        }
        let mut out = ndarray::ArrayD::zeros(ndarray::IxDyn(&[heads, m, n]));
        let (_, pool) = &pools()[1];
        group.bench_function("gemm-into-reused/2t", |b| {
            pool.install(|| {
                b.iter(|| {
                    batched_matmul_into(
                        &mut out.view_mut(),
                        black_box(lhs.view()),
                        rhs.view(),
                        false,
                    )
                })
            });
        });
        group.finish();
    }
}

/// `a` with every value cut to a bf16 value (its low 16 bits cleared): operands as autocast
/// hands them to the bf16 kernel.
fn bf16(a: Array2<f32>) -> Array2<f32> {
    a.mapv(|x| f32::from_bits(x.to_bits() & 0xffff_0000))
}

/// The linear layers' forward products in bf16 (operands rounded to bf16 first): the f32 GEMM
/// on the rounded values (what autocast computed before the bf16 kernel), the bf16 kernel as
/// autocast runs it (`units`: on the CPU's bf16 units, or by fused multiply-adds on their
/// packing where those outpace them, `units_preferred`), its portable path, and the
/// AMX order (on the tiles when the CPU has them). The bf16 kernels write into one output
/// reused across iterations, as `gemm-into-reused` does.
fn bf16_products(c: &mut Criterion) {
    if !units_available() {
        eprintln!(
            "this CPU has no AVX512-BF16 units: `units` runs fused multiply-adds on their \
             packing where it has AVX-512, the portable path otherwise"
        );
    }
    if !amx_available() {
        eprintln!("this CPU has no AMX tiles: `amx-tiles` runs the AMX order's portable path");
    }
    for (inputs, outputs) in LINEAR {
        let x = bf16(filled((ROWS, inputs), 1));
        let w = bf16(filled((inputs, outputs), 2));
        let (m, k, n) = (ROWS, inputs, outputs);
        let mut group = c.benchmark_group(format!("bf16 X·W {m}x{k}x{n}"));
        group.throughput(Throughput::Elements((2 * m * n * k) as u64));
        let mut out = Array2::zeros((m, n));
        let (lhs, rhs) = (x.as_slice().unwrap(), w.as_slice().unwrap());
        for (threads, pool) in pools() {
            group.bench_function(format!("f32-gemm-into-reused/{threads}t"), |b| {
                pool.install(|| {
                    b.iter(|| gemm_into(&mut out.view_mut(), black_box(x.view()), w.view(), false))
                });
            });
            let out = out.as_slice_mut().unwrap();
            group.bench_function(format!("units/{threads}t"), |b| {
                pool.install(|| b.iter(|| bf16_gemm(m, k, n, black_box(lhs), rhs, out, false)));
            });
            group.bench_function(format!("portable/{threads}t"), |b| {
                pool.install(|| {
                    b.iter(|| bf16_gemm_portable(m, k, n, black_box(lhs), rhs, out, false))
                });
            });
            group.bench_function(format!("amx-tiles/{threads}t"), |b| {
                pool.install(|| b.iter(|| amx_gemm(m, k, n, black_box(lhs), rhs, out, false)));
            });
            let (l, r) = (x.view(), w.view());
            let mut view = ArrayViewMut2::from_shape((m, n), &mut *out).unwrap();
            group.bench_function(format!("amx-portable/{threads}t"), |b| {
                pool.install(|| {
                    b.iter(|| amx_gemm_portable_into(&mut view, black_box(l), r, false))
                });
            });
        }
        group.finish();
    }
}

/// The fused causal attention in f32 as one rank of the capstone runs it (micro-batch 4, one
/// thread): forward, and backward from the forward's row statistics.
fn fused_attention(c: &mut Criterion) {
    let (batch, time, n_heads, head_dim) = (4, 512, 10, 32);
    let kernel = CausalAttention {
        batch,
        time,
        n_heads,
        n_kv_heads: n_heads,
        head_dim,
        scale: 1.0 / (head_dim as f32).sqrt(),
    };
    let shape = (batch, time, n_heads * head_dim);
    let [q, k, v, d_out] = [8, 9, 10, 11].map(|seed| filled(shape, seed).into_dyn());
    let mut group = c.benchmark_group(format!(
        "fused attention f32 {batch}x{time}x{n_heads}x{head_dim}"
    ));
    group.sample_size(20);
    let pool = ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    group.bench_function("forward/1t", |b| {
        pool.install(|| b.iter(|| kernel.forward(black_box(&q), &k, &v, None)));
    });
    let (_, stats) = kernel.forward(&q, &k, &v, None);
    group.bench_function("backward/1t", |b| {
        pool.install(|| b.iter(|| kernel.backward([black_box(&q), &k, &v], &stats, &d_out, None)));
    });
    group.finish();
}

/// The linear layers' weight gradients in bf16, `Xᵀ·dY` with both operands read where they
/// lie (X transposed, dY's rows of 4096 tokens packed as the right operand): the products
/// whose packing is the largest, on the units as autocast runs them.
fn bf16_weight_gradients(c: &mut Criterion) {
    for (inputs, outputs) in LINEAR {
        let x = bf16(filled((ROWS, inputs), 5));
        let dy = bf16(filled((ROWS, outputs), 6));
        let (m, k, n) = (inputs, ROWS, outputs);
        let mut group = c.benchmark_group(format!("bf16 Xᵀ·dY {m}x{k}x{n}"));
        group.throughput(Throughput::Elements((2 * m * n * k) as u64));
        let mut out = Array2::zeros((m, n));
        for (threads, pool) in pools() {
            group.bench_function(format!("units/{threads}t"), |b| {
                pool.install(|| {
                    b.iter(|| {
                        bf16_gemm_into(&mut out.view_mut(), black_box(x.t()), dy.view(), false)
                    })
                });
            });
            group.bench_function(format!("amx-tiles/{threads}t"), |b| {
                pool.install(|| {
                    b.iter(|| {
                        amx_gemm_into(&mut out.view_mut(), black_box(x.t()), dy.view(), false)
                    })
                });
            });
        }
        group.finish();
    }
}

/// One block of the fused attention's scores in bf16, `q[64 rows]·k[..512]ᵀ` for a head of
/// 32 columns, with the keys packed once ([`Bf16Rhs`]) as the attention packs them per head:
/// 16 pairs of the inner dimension per output, so the kernel's work between tiles counts as
/// much as the tiles themselves. One thread, as the attention's tasks run.
fn bf16_scores(c: &mut Criterion) {
    let (m, k, n) = (64, 32, 512);
    let (q, keys) = (bf16(filled((m, k), 3)), bf16(filled((n, k), 4)));
    let mut group = c.benchmark_group(format!("bf16 scores {m}x{k}x{n}"));
    group.throughput(Throughput::Elements((2 * m * n * k) as u64));
    let mut out = Array2::zeros((m, n));
    let pool = ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    for (name, prepared) in [
        ("units-prepared/1t", Bf16Rhs::new(keys.t())),
        ("amx-tiles-prepared/1t", Bf16Rhs::amx(keys.t())),
    ] {
        group.bench_function(name, |b| {
            pool.install(|| {
                b.iter(|| prepared.product_into(&mut out.view_mut(), black_box(q.view()), false))
            });
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    linear_layers,
    attention,
    fused_attention,
    bf16_products,
    bf16_weight_gradients,
    bf16_scores
);
criterion_main!(benches);
