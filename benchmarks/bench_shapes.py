"""Model shapes, model FLOPs and synthetic batches, shared by the benchmarks.

Shape letters (a dict from `shape`): L layers, D embedding width, N query heads, K key/value
heads, H head width, F MLP width, V vocabulary, T sequence length, B global batch.
"""

from __future__ import annotations

import numpy as np


def shape(size: str) -> dict:
    """Model and batch shape of a size preset: L, D, N, K, H, F, V, T, B."""
    from configs import lm

    c = lm.get_config(f"size={size}")
    m = c.model
    return dict(
        L=m.num_layers,
        D=m.embed_dim,
        N=m.num_heads,
        K=m.num_kv_heads,
        H=m.head_dim,
        F=m.mlp_dim,
        V=m.vocab_size,
        T=c.data.seq_len,
        B=c.data.global_batch_size,
    )


def matmul_params(s: dict) -> int:
    """Weights that enter a matmul: per layer q, k, v, o and SwiGLU, plus the head.

    The embedding table (a gather) and the norms' scales (elementwise) are left out.
    """
    d, n, k, h, f = s["D"], s["N"], s["K"], s["H"], s["F"]
    per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
    return s["L"] * per_layer + d * s["V"]


def step_flops(s: dict, *, batch: int | None = None, seq_len: int | None = None) -> int:
    """Model FLOPs of one training step (forward + backward = 3x forward):

      6 * P * B*T  +  12 * L * B * T^2 * N*H

    P = `matmul_params`; the second term is q.k and probs.v (2 * 2 * T^2 * N*H per
    layer and sequence forward), counted over the full T x T square (no causal
    halving, as in the PaLM MFU convention). Softmax, norms, rotation and the
    optimiser are not counted.
    """
    b = s["B"] if batch is None else batch
    t = s["T"] if seq_len is None else seq_len
    return 6 * matmul_params(s) * b * t + 12 * s["L"] * b * t * t * s["N"] * s["H"]


def synthetic_batch(b: int, t: int, seed: int = 0) -> dict:
    """{"inputs", "targets"} int32 [B, T] of random bytes, "weights" float32 ones."""
    tokens = np.random.default_rng(seed).integers(0, 256, (b, t + 1)).astype(np.int32)
    return {
        "inputs": np.ascontiguousarray(tokens[:, :-1]),
        "targets": np.ascontiguousarray(tokens[:, 1:]),
        "weights": np.ones((b, t), np.float32),
    }
