"""Grouped-query attention with rotation at any subset of the sites q, k, v, o.

SPEC.md section 2. With positions p_i (queries) and p_j (keys):

  q   q_i -> R_i q_i        k   k_j -> R_j k_j        (QK-RoPE = standard RoPE)
  v   v_j -> R_j v_j        o   o_i -> R_i^T o_i      (VO-RoPE: o_i = sum_j a_ij R_{j-i} v_j)

`sites` is a string subset of "qkvo" ("" = NoPE). Every rotation goes through
`rotary.rotate`; this module only decides where it is applied.

Shape legend:
  B batch, T query positions, S key positions, N query heads, K kv heads,
  G = N / K query heads per kv head, H head dim, D model dim, A position axes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rope_jax import rotary, sharding

SITES = "qkvo"
ROPE_KEYS = ("base", "ladder", "layout", "allocation", "sections")

# How keys and values are produced. "separate": their own projections (standard).
# Planned: "tied", one latent c_j = x_j W_c per token serving as both key and value
# (MLA-style cache, SPEC.md section 2): rotate c_j once with R_j, use it for scores and
# values, rotate the output back with R_i^T. It slots into `Attention.__init__` (one
# projection instead of k_proj/v_proj) and `Attention.__call__` (k = v = c).
KV_MODES = ("separate",)


def check_sites(sites: Any, field: str = "sites") -> str:
    """Returns `sites` if it is a string of distinct letters from "qkvo", else raises."""
    if not isinstance(sites, str):
        raise ValueError(f"{field}={sites!r} must be a string subset of {SITES!r} ('' = NoPE)")
    bad = sorted(set(sites) - set(SITES))
    if bad:
        raise ValueError(
            f"{field}={sites!r} has unknown site(s) {''.join(bad)!r}: "
            f"allowed letters are {SITES!r} ('' = NoPE)"
        )
    if len(set(sites)) != len(sites):
        raise ValueError(f"{field}={sites!r} repeats a site: each of {SITES!r} at most once")
    return sites


def rope_kwargs(rope: Any) -> dict:
    """The `rotary.rotate` keyword arguments from a rope dict/ConfigDict (other keys ignored)."""
    kwargs = {k: rope[k] for k in ROPE_KEYS if k in rope}
    if kwargs.get("sections") is not None:
        kwargs["sections"] = tuple(kwargs["sections"]) or None
    return kwargs


def attend(
    q,
    k,
    v,
    *,
    q_positions,
    k_positions,
    sites: str,
    rope: Any,
    mask=None,
    causal: bool = False,
    scale: float | None = None,
) -> jax.Array:
    """Softmax attention with rotation at `sites`.

    Args:
      q: [B, T, N, H] queries.
      k, v: [B, S, K, H] keys and values; N % K == 0, head n uses kv head n // (N / K).
      q_positions: [B, T, A] (or [B, T]) query positions, int or float.
      k_positions: [B, S, A] (or [B, S]) key positions.
      sites: subset of "qkvo" ("" = NoPE).
      rope: rotation kwargs for `rotary.rotate` (base, ladder, layout, allocation,
        sections); extra keys (sites, num_axes, scheme) are ignored.
      mask: optional bool [B or 1, 1 or N, T, S], True = attend.
      causal: if True, query t attends keys s <= t + (S - T) (queries are the last T keys).
      scale: logit scale, default 1 / sqrt(H).

    Returns:
      [B, T, N, H] in q's dtype. Scores and softmax are float32.
    """
    check_sites(sites)
    (b, t, n, h), s, kh = q.shape, k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != h:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} do not fit [B,T,N,H] [B,S,K,H]")
    if n % kh:
        raise ValueError(f"num_heads={n} is not divisible by num_kv_heads={kh}")
    kw = rope_kwargs(rope)
    rot = lambda x, p, inverse=False: rotary.rotate(x, p, inverse=inverse, **kw)
    if "q" in sites:
        q = rot(q, q_positions)
    if "k" in sites:
        k = rot(k, k_positions)
    if "v" in sites:
        v = rot(v, k_positions)  # values rotate with their key's position

    scale = h**-0.5 if scale is None else scale
    qg = q.reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]: head n = k * G + g
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    logits = logits.reshape(b, n, t, s) * scale  # [B, N, T, S]
    keep = _mask(mask, causal, t, s)
    if keep is not None:
        logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).reshape(b, kh, n // kh, t, s)
    o = jnp.einsum(
        "BKGTS,BSKH->BTKGH", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    ).reshape(b, t, n, h)  # float32 until the final cast
    if "o" in sites:
        o = rot(o, q_positions, inverse=True)  # o_i -> R_i^T o_i at the query position
    return o.astype(q.dtype)


def _mask(mask, causal: bool, t: int, s: int):
    """Combined bool keep-mask broadcastable to [B, N, T, S], or None."""
    keep = None
    if causal:
        keep = (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + (s - t))[None, None]
    if mask is not None:
        mask = jnp.asarray(mask, bool)
        if mask.ndim != 4:
            raise ValueError(f"mask has shape {mask.shape}: expected [B or 1, 1 or N, T, S]")
        keep = mask if keep is None else keep & mask
    return keep


# ----------------------------------------------------------------------------- module


def dense_param(rngs: nnx.Rngs, shape, names, *, fan_in: int, dtype, scale: float = 1.0):
    """A normal(std = scale / sqrt(fan_in)) parameter carrying logical axis `names`.

    The names live in the Variable's `out_sharding` metadata; eager sharding is off, so
    the model builds anywhere and `rope_jax.sharding` places it on a mesh explicitly.
    """
    init = jax.nn.initializers.normal(scale * fan_in**-0.5)
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names, eager_sharding=False)


class Attention(nnx.Module):
    """Causal GQA self-attention with rotation sites (no biases).

    Parameters (logical axes): q [D, N, H] (embed, heads, head_dim), k and v [D, K, H]
    (embed, kv, head_dim), o [N, H, D] (heads, head_dim, embed).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        sites: str,
        rope: Any,
        kv: str = "separate",
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        out_scale: float = 1.0,
        rngs: nnx.Rngs,
    ):
        if kv == "tied":
            raise NotImplementedError("kv='tied' (shared key/value latent) is not implemented yet")
        if kv not in KV_MODES:
            raise ValueError(f"kv={kv!r} is not one of {', '.join(map(repr, KV_MODES))}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}"
            )
        self.sites = check_sites(sites)
        self.rope = rope_kwargs(rope)
        self.kv = kv
        self.dtype = dtype
        d, n, kh, h = embed_dim, num_heads, num_kv_heads, head_dim
        p = dict(dtype=param_dtype, fan_in=d)
        self.q_proj = dense_param(rngs, (d, n, h), ("embed", "heads", "head_dim"), **p)
        self.k_proj = dense_param(rngs, (d, kh, h), ("embed", "kv", "head_dim"), **p)
        self.v_proj = dense_param(rngs, (d, kh, h), ("embed", "kv", "head_dim"), **p)
        self.o_proj = dense_param(
            rngs,
            (n, h, d),
            ("heads", "head_dim", "embed"),
            dtype=param_dtype,
            fan_in=n * h,
            scale=out_scale,
        )

    def __call__(self, x, positions, mask=None, *, causal: bool = True) -> jax.Array:
        """x [B, T, D], positions [B, T, A] -> [B, T, D] in the compute dtype."""
        x = x.astype(self.dtype)
        w = lambda p: p[...].astype(self.dtype)
        q = jnp.einsum("BTD,DNH->BTNH", x, w(self.q_proj))
        k = jnp.einsum("BSD,DKH->BSKH", x, w(self.k_proj))
        v = jnp.einsum("BSD,DKH->BSKH", x, w(self.v_proj))
        q = sharding.constrain(q, ("batch", "seq", "heads", "head_dim"))
        k = sharding.constrain(k, ("batch", "seq", "kv", "head_dim"))
        o = attend(
            q,
            k,
            v,
            q_positions=positions,
            k_positions=positions,
            sites=self.sites,
            rope=self.rope,
            mask=mask,
            causal=causal,
        )
        return jnp.einsum("BTNH,NHD->BTD", o, w(self.o_proj))
