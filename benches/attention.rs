//! Criterion benchmarks of the attention paths (CPU, f32).
//!
//! ```text
//! cargo bench --bench attention
//! ```
//!
//! `scripts/bench_vs_pytorch.py` runs the same shapes beside PyTorch.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use multihead::attention::{scaled_dot_product_attention_via, AttnPath, Causal, Mask};

fn randn(shape: &[usize]) -> candle::Tensor {
    candle::Tensor::randn(0f32, 1., shape, &candle::Device::Cpu).expect("randn on the CPU")
}

fn sdpa(c: &mut Criterion) {
    let mut group = c.benchmark_group("sdpa");
    group.sample_size(10);
    // (label, batch, heads, q_len, kv_len, head_dim, causal)
    let cases = [
        ("B8 N197 H12 hd64", 8, 12, 197, 197, 64, false),
        ("B1 N1024 H8 hd64", 1, 8, 1024, 1024, 64, false),
        ("B1 N1024 H8 hd64 causal", 1, 8, 1024, 1024, 64, true),
        ("decode B1 H8 hd64 S2048", 1, 8, 1, 2048, 64, true),
    ];
    for (label, b, h, l, s, d, causal) in cases {
        let (q, k, v) = (randn(&[b, h, l, d]), randn(&[b, h, s, d]), randn(&[b, h, s, d]));
        let mask = if causal {
            Mask::causal(Causal::BottomRight)
        } else {
            Mask::new()
        };
        for path in [AttnPath::CpuTiled, AttnPath::Reference] {
            group.bench_with_input(
                BenchmarkId::new(format!("{path:?}"), label),
                &path,
                |bench, &path| {
                    bench.iter(|| {
                        scaled_dot_product_attention_via(&q, &k, &v, &mask, None, path).expect("sdpa")
                    })
                },
            );
        }
    }
    group.finish();
}

criterion_group!(benches, sdpa);
criterion_main!(benches);
