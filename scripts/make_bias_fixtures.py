"""Writes the position schemes' references for the tests, which read them in CI without
torch: tests/data/biases/alibi.npz, HF transformers' ALiBi (BLOOM's `build_alibi_tensor`,
for tests/biases_test.py), and tests/data/biases/xpos.npz, rotary-embedding-torch's xPos
(`RotaryEmbedding(use_xpos=True).rotate_queries_and_keys`, for tests/xpos_test.py), and
tests/data/biases/forget.npz, fla-core's naive forgetting attention (FoX,
`fla/ops/forgetting_attn/naive.py`, its gradients by torch autograd; for
tests/biases_test.py), and tests/data/biases/stick_breaking.npz, fla-core's naive
stick-breaking attention (`fla/ops/stickbreaking_attn/naive.py`; for
tests/stick_breaking_test.py).

Run once in the bench venv (torch + transformers, requirements-bench.txt, and
`pip install rotary-embedding-torch==0.9.1` and `pip install --no-deps fla-core==0.6.0`):
  python scripts/make_bias_fixtures.py

Holds, for each head count N in HEADS, HF's slopes (the alibi tensor at key position 1,
all keys present), and one causal attention of BLOOM's form, softmax(alibi + q k^T /
sqrt(H)) v, computed in torch on random q, k, v with a padded row (its mask has zeros at
the start, so HF's positions are the cumulative count of present keys).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                   "biases", "alibi.npz")  # fmt: skip
HEADS = (1, 2, 3, 4, 5, 8, 12, 16, 20, 32, 48, 64)
B, T, N, H = 2, 10, 12, 8


def slopes(num_heads: int) -> np.ndarray:
    mask = torch.ones(1, 2)
    alibi = build_alibi_tensor(mask, num_heads, torch.float32)  # [N, 1, 2]: m_n * position
    return alibi[:, 0, 1].numpy()


def attention(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, N, H, generator=gen) for _ in range(3))
    mask = torch.ones(B, T)
    mask[1, :3] = 0  # row 1: three pad tokens first
    alibi = build_alibi_tensor(mask, N, torch.float32).reshape(B, N, 1, T)  # m_n * position
    scores = torch.einsum("btnh,bsnh->bnts", q, k) / H**0.5 + alibi
    allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None] & (mask[:, None, None] > 0)
    probs = torch.softmax(scores.masked_fill(~allowed, torch.finfo(torch.float32).min), -1)
    out = torch.einsum("bnts,bsnh->btnh", probs, v)
    positions = (mask.cumsum(-1) - 1) * mask  # HF's: the count of present keys before
    return {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "mask": mask.numpy(),
            "positions": positions.numpy(), "out": out.numpy()}  # fmt: skip


def xpos(seed: int = 1, length: int = 40, head_dim: int = 16, gamma: float = 32.0) -> dict:
    """rotary-embedding-torch's xPos on random q, k [B, N, T, H] (its interleaved pairs,
    base 10000) with a small gamma, so the decay is large over T positions."""
    from rotary_embedding_torch import RotaryEmbedding

    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 3, length, head_dim, generator=gen) for _ in range(2))
    rotary = RotaryEmbedding(dim=head_dim, use_xpos=True, xpos_scale_base=gamma)
    rq, rk = rotary.rotate_queries_and_keys(q, k)
    return {"q": q.numpy(), "k": k.numpy(), "rq": rq.numpy(), "rk": rk.numpy(),
            "gamma": np.float32(gamma)}  # fmt: skip


def _naive(package_dir: str, name: str):
    """fla-core's naive reference file alone (the package's kernels need triton)."""
    import importlib.util

    path = os.path.join(os.path.dirname(importlib.util.find_spec("fla").origin), "ops",
                        package_dir, "naive.py")  # fmt: skip
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stick_breaking(seed: int = 3) -> dict:
    """Stick-breaking attention on random q [B, T, 4, H], k, v [B, T, 2, H] (logits
    scaled up, so sticks run out), and the gradients of sum(out * r) by autograd."""
    naive = _naive("stickbreaking_attn", "sb_naive")
    gen = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(2, 11, 4, 8, generator=gen)).requires_grad_()
    k, v = (torch.randn(2, 11, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    out, rem = naive.naive_stickbreaking_attn(q, k, v)
    r = torch.randn(out.shape, generator=gen)
    (out * r).sum().backward()
    t_ = lambda a: a.detach().numpy()
    return {"q": t_(q), "k": t_(k), "v": t_(v), "out": t_(out), "rem": t_(rem), "r": t_(r),
            "grad_q": t_(q.grad), "grad_k": t_(k.grad), "grad_v": t_(v.grad)}  # fmt: skip


def forget(seed: int = 2) -> dict:
    """FoX on random q, k, v [B, T, N, H] (2 kv heads for 4 query heads) with the gate
    log sigmoid(x w + b) of random x [B, T, D]; `grad_*` of sum(out * r) for random r."""
    naive = _naive("forgetting_attn", "fox_naive")
    gen = torch.Generator().manual_seed(seed)
    b, t, n, kv, h, d = 2, 12, 4, 2, 8, 16
    q = torch.randn(b, t, n, h, generator=gen, requires_grad=True)
    k, v = (torch.randn(b, t, kv, h, generator=gen, requires_grad=True) for _ in range(2))
    x = torch.randn(b, t, d, generator=gen)
    w = (torch.randn(d, n, generator=gen) / d**0.5).requires_grad_()
    bias = torch.randn(n, generator=gen).requires_grad_()
    g = torch.nn.functional.logsigmoid(x @ w + bias)  # [B, T, N]
    out = naive.naive_forgetting_attn(q, k, v, g)
    r = torch.randn(out.shape, generator=gen)
    (out * r).sum().backward()
    t_ = lambda a: a.detach().numpy()
    return {"q": t_(q), "k": t_(k), "v": t_(v), "x": t_(x), "w": t_(w), "b": t_(bias),
            "out": t_(out), "r": t_(r), "grad_q": t_(q.grad), "grad_k": t_(k.grad),
            "grad_w": t_(w.grad), "grad_b": t_(bias.grad)}  # fmt: skip


def main() -> None:
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    np.savez(os.path.join(os.path.dirname(OUT), "forget.npz"), **forget())
    np.savez(os.path.join(os.path.dirname(OUT), "stick_breaking.npz"), **stick_breaking())
    np.savez(os.path.join(os.path.dirname(OUT), "xpos.npz"), **xpos())
    arrays = {f"slopes_{n}": slopes(n) for n in HEADS}
    arrays.update({f"attention_{k}": v for k, v in attention().items()})
    np.savez(OUT, heads=np.asarray(HEADS), **arrays)
    print(f"wrote {OUT}: slopes for N in {HEADS}, one causal BLOOM attention [B={B}, T={T}, "
          f"N={N}, H={H}]")  # fmt: skip


if __name__ == "__main__":
    main()
