"""Model FLOPs of a run: parameters, FLOPs per token and per token budget, MFU.

Model FLOPs per token, under two conventions that differ only in the attention term:

  full    6 * P  +  12 * L * T * N * H    PaLM (appendix B): the whole T x T square
  causal  6 * P  +   6 * L * T * N * H    MaxText, Megatron-LM: causal attention halved

P = `matmul_params` (every weight that enters a matmul: q, k, v (or the tied kv), o,
SwiGLU, the LM head and the patch embedding; not the embedding table, a gather, nor
the norms' scales), 6 = 2 (multiply-add) x 3 (forward + backward for the activations
and for the weights). The attention term is q.k^T and probs.v, 2 * 2 * T * N * H per
token and layer forward, times 3: over the full T x T square (`causal=False`, the
default), or over half of it (`causal=True`: the T^2 / 2 that a causal kernel needs, as
MaxText and Megatron count it; not T (T + 1) / 2). The same measured step is a lower MFU
under the causal count. Softmax, norms, rotations and the optimiser are not counted.
A local layer (`nn.sliding`) counts the keys its mask keeps, T in each term above becoming
its keys per query, under each convention twice the causal count as for a full layer:
a sliding window W, 2W - W^2 / T (the band |t - s| < W of the square) or W - W^2 / (2T)
(its half under the diagonal); chunks of C, C or C / 2 (T a whole number of chunks; the
last chunk's share otherwise). Both reach T and T / 2 at W = C = T.
MFU = model FLOPs / (devices * peak * seconds); rematerialisation does not change the
model FLOPs, only the hardware FLOPs (`remat_flops_per_token`), reported separately.

`python -m rope_jax.harness.cost` turns these into a cost plan (`harness/cost.py`).

Shape letters: L layers, D embed dim, N query heads, K kv heads, H head dim, F mlp dim,
V vocab, E patch width, T training context, B global batch (sequences).
"""

from __future__ import annotations

import math

from rope_jax import learned
from rope_jax.nn import model, sliding


def block_matmul_params(model_cfg) -> int:
    """Matmul weights of the L decoder blocks: q D*N*H (low-rank, `attention.q_lora_rank`
    r: D*r + r*N*H), k and v 2*D*K*H (tied: one D*K*H), o N*H*D (grouped,
    `attention.o_groups` g of rank R: N*H*R + g*R*D), SwiGLU 3*D*F, per layer."""
    m, a = model_cfg, model_cfg.attention
    d, n, k, h, f = m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
    kv = 1 if a.kv == "tied" else 2
    r, g, ro = a.q_lora_rank, a.o_groups, a.o_lora_rank
    q = (d + n * h) * r if r else d * n * h
    o = (n * h + g * d) * ro if g else n * h * d
    return m.num_layers * (q + o + kv * d * k * h + 3 * d * f)


def matmul_params(model_cfg) -> int:
    """P: every weight that enters a matmul: the blocks', the LM head D*V and the patch
    embedding E*D (applied at every position). Not the embedding table (a gather) or
    the norms' scales (elementwise)."""
    m = model_cfg
    return block_matmul_params(m) + m.embed_dim * m.vocab_size + m.patch_dim * m.embed_dim


def rotation_params(model_cfg, num_axes: int = 1) -> int:
    """Learned-rotation parameters (`rope.learned`), per layer that rotates: frequencies
    K*(H/2)*A, and with `commuting` the basis generator H*H; 0 for the fixed rotation."""
    m = model_cfg
    trained = learned.KINDS[m.rope.learned]
    if not trained:
        return 0
    rotating = sum(spec is not None for spec in model.layer_rotations(m, num_axes))
    per_layer = m.num_kv_heads * (m.head_dim // 2) * num_axes if "rope_freqs" in trained else 0
    per_layer += m.head_dim**2 if "rope_basis" in trained else 0
    return rotating * per_layer


def num_params(model_cfg, num_axes: int = 1) -> int:
    """All parameters: `matmul_params` + the embedding table V*D (not again when the head
    is the table, `tie_embeddings`) + 2L + 1 norm scales of D + `rotation_params` (A
    position axes: 1 for text) + per layer the q/k/v biases (N + 2K)*H, q/k norm scales
    2*H, sinks N, the low-rank query's norm scale r and the tied latent's norm scale H
    when the model has them."""
    m, a = model_cfg, model_cfg.attention
    table = 0 if m.tie_embeddings else m.vocab_size * m.embed_dim
    extra = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim if a.qkv_bias else 0
    extra += 2 * m.head_dim if a.qk_norm else 0
    extra += (m.num_heads if a.sinks else 0) + a.q_lora_rank + (m.head_dim if a.kv_norm else 0)
    return (matmul_params(m) + table + (2 * m.num_layers + 1) * m.embed_dim
            + rotation_params(m, num_axes) + m.num_layers * extra)  # fmt: skip


CONVENTIONS = {
    "full": "full T x T attention, PaLM",
    "causal": "causal attention halved, MaxText/Megatron",
}  # convention -> how a page names it; `causal=(convention == "causal")`


def attention_flops_per_token(model_cfg, seq_len: int, *, causal: bool = False) -> int:
    """q.k^T and probs.v, forward + backward: 12 * N * H * (keys per query), summed over
    the layers: 12 * L * T * N * H over the full T x T square, or half of it, 6 * L * T
    * N * H, with `causal`, when every layer is full (`keys_per_query`)."""
    m = model_cfg
    types = sliding.layer_types(m.attention, m.num_layers)  # checked, whatever the length
    sizes = {"full": seq_len, "sliding": m.attention.window, "chunked": m.attention.chunk}
    keys = sum(keys_per_query(t, sizes[t], seq_len, causal=causal) for t in types)
    return round(12 * m.num_heads * m.head_dim * keys)


def keys_per_query(kind: str, size: int, seq_len: int, *, causal: bool = False) -> float:
    """The keys a query of a `kind` layer ("full", "sliding" with window `size`, "chunked"
    with chunk `size`) attends to, averaged over T = `seq_len` queries, with `causal`:
    the area of its causal mask over T, as triangles (T / 2 for a full layer, not
    (T + 1) / 2); without, twice that (the full-square convention)."""
    size = min(size, seq_len)
    if kind == "sliding":
        half = size - size**2 / (2 * seq_len)
    elif kind == "chunked":
        whole, rest = divmod(seq_len, size)
        half = (whole * size**2 + rest**2) / (2 * seq_len)
    else:
        half = seq_len / 2
    return half if causal else 2 * half


def flops_per_token(config, *, causal: bool = False) -> int:
    """Model FLOPs per training token: 6 * P + 12 * L * T * N * H, or with `causal`
    6 * P + 6 * L * T * N * H (see the module doc)."""
    return 6 * matmul_params(config.model) + attention_flops_per_token(
        config.model, config.data.seq_len, causal=causal
    )


def mfu_both(tokens_per_s: float, config, devices: int, peak: float) -> dict[str, float]:
    """A measured throughput's MFU under each convention: {"full": .., "causal": ..}."""
    return {
        name: measured_mfu(tokens_per_s, flops_per_token(config, causal=name == "causal"),
                           devices, peak)
        for name in CONVENTIONS
    }  # fmt: skip


def causal_mfu(full_mfu: float, config) -> float:
    """The causal-convention MFU of a step whose full-square MFU is `full_mfu`."""
    return full_mfu * flops_per_token(config, causal=True) / flops_per_token(config)


def remat_flops_per_token(config) -> int:
    """Hardware FLOPs per token that rematerialisation adds to the model FLOPs.

    With `model.remat=block` the backward pass recomputes each block's forward:
    2 * `block_matmul_params` + 4 * L * T * N * H (the head is outside the blocks). 0
    without remat. Attention kernels that recompute scores in their backward (chunked,
    cuDNN flash) add up to 2 * L * T * N * H more, not counted here.
    """
    if config.model.remat != "block":
        return 0
    return (
        2 * block_matmul_params(config.model)
        + attention_flops_per_token(config.model, config.data.seq_len) // 3
    )


def tokens_per_step(config) -> int:
    """B * T training tokens per optimiser step (microbatches do not change it)."""
    return config.data.global_batch_size * config.data.seq_len


def token_budget(config) -> int:
    """`train.num_tokens` when set (> 0), else num_steps * B * T."""
    num_tokens = int(config.train.num_tokens)
    return num_tokens or config.train.num_steps * tokens_per_step(config)


def steps_for_budget(config) -> int:
    """Optimiser steps that cover `token_budget` (rounded up): set train.num_steps to it."""
    return math.ceil(token_budget(config) / tokens_per_step(config))


def total_flops(config, *, causal: bool = False) -> int:
    """Model FLOPs of one run: `flops_per_token` * `token_budget`."""
    return flops_per_token(config, causal=causal) * token_budget(config)


def wall_seconds(flops: float, devices: int, peak: float, mfu: float) -> float:
    """Seconds for `flops` model FLOPs on `devices` devices of `peak` FLOP/s at `mfu`."""
    return flops / (devices * peak * mfu)


def measured_mfu(tokens_per_s: float, flops_per_token_: float, devices: int, peak: float) -> float:
    """MFU of a measured throughput: tokens/s * FLOPs/token / (devices * peak)."""
    return tokens_per_s * flops_per_token_ / (devices * peak)
