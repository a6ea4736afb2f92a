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


def _config(s: dict, seq_len: int):
    """A config of shape `s` at `seq_len`, for the model FLOPs' one owner,
    `rope_jax.harness.flops` (imported here: the peer's child needs no JAX otherwise)."""
    from configs import lm

    c = lm.get_config("size=tiny")
    c.model.update(num_layers=s["L"], embed_dim=s["D"], num_heads=s["N"],
                   num_kv_heads=s["K"], head_dim=s["H"], mlp_dim=s["F"],
                   vocab_size=s["V"])  # fmt: skip
    c.data.seq_len = seq_len
    return c


def matmul_params(s: dict) -> int:
    """Weights that enter a matmul: per layer q, k, v, o and SwiGLU, plus the head
    (`flops.matmul_params`). The embedding table (a gather) and the norms' scales
    (elementwise) are left out."""
    from rope_jax.harness import flops

    return flops.matmul_params(_config(s, s["T"]).model)


def step_flops(s: dict, *, batch: int | None = None, seq_len: int | None = None,
               causal: bool = False) -> int:  # fmt: skip
    """Model FLOPs of one training step, B * T * `flops.flops_per_token`:

      6 * P * B*T  +  12 * L * B * T^2 * N*H     (full T x T attention, PaLM)
      6 * P * B*T  +   6 * L * B * T^2 * N*H     (`causal`: half of it, MaxText/Megatron)

    P = `matmul_params`; softmax, norms, rotation and the optimiser are not counted.
    """
    from rope_jax.harness import flops

    b = s["B"] if batch is None else batch
    t = s["T"] if seq_len is None else seq_len
    return b * t * flops.flops_per_token(_config(s, t), causal=causal)


def synthetic_batch(b: int, t: int, seed: int = 0) -> dict:
    """{"inputs", "targets"} int32 [B, T] of random bytes, "weights" float32 ones."""
    tokens = np.random.default_rng(seed).integers(0, 256, (b, t + 1)).astype(np.int32)
    return {
        "inputs": np.ascontiguousarray(tokens[:, :-1]),
        "targets": np.ascontiguousarray(tokens[:, 1:]),
        "weights": np.ones((b, t), np.float32),
    }
