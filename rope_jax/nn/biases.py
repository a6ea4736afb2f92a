"""Position biases on the attention logits: telling a head where a token is by adding a
term b(p_t, p_s, n) to its logits, beside or instead of rotating q and k.

One registry, `SCHEMES`; `model.attention.bias` names an entry. A scheme is its bias
function (the `kernels.Bias` hook: called per block with the block's query rows and key
slots, so every kernel that takes a bias runs it, "chunked" block by block), the
per-head constants it reads and the initial values of any parameters it learns (one set
per layer, float32 `nnx.Param`s named `bias_<name>`). The layer hands the function the
1-D positions of its queries and keys (a decoding cache keeps the keys' positions), so
a bias sees positions, never slot indices. Adding a scheme is one entry here, its test
and a line of docs/maths.md#position-biases.

  none   no bias.
  alibi  b = -m_n |p_t - p_s| (Press et al. 2022), with the geometric slopes m_n of
         `alibi_slopes` for any head count (HF's `build_alibi_tensor`); no parameters.
  fire   b = f_n(psi(p_t - p_s) / psi(max(L, p_t))), psi(x) = log(|c| x + 1) (Li et al.
         2023, FIRE): a learned MLP f (1 -> 32 -> N, ReLU) of the log distance divided by
         the log of the query's position, progressively interpolated: below the learned
         threshold L (|L_multiplier| * 512) the divisor is fixed, so short contexts see
         the distances themselves; c (0.1 at init) and L are learned with the MLP.
  forget b = c_t - c_s, c_t = sum_{l <= t} log sigmoid(w_n . x_l + b_n): the Forgetting
         Transformer's forget gate (FoX, Lin et al. 2025), a data-dependent decay of
         each head's logits with what lies between query and key (no position encoding
         needed: use it with model.rope.sites=""); w [D, N] and b [N] learned.

A data-dependent scheme (`Scheme.cumulative`) gives per-token increments of the layer's
input x; the layer takes their running sum along the sequence and hands it to the bias
function as parameters (so the gradient reaches the gate), the decoding cache keeping
each slot's sum and the last one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One position bias: `fn(params, (constants, q_positions [B, T], k_positions [B, S]),
    q_idx, k_idx)` -> float32 broadcastable to [B, N, t, s]; `constants(num_heads)` its
    fixed per-head numbers; `init(num_heads, key, embed_dim)` its learned parameters'
    initial values (name -> float array; `key` a JAX PRNG key). `cumulative(params, x)`,
    for a data-dependent scheme: float32 [B, T, N] increments of the layer input x
    [B, T, D] whose running sums the bias reads as params["q"] [B, T, N], params["k"]
    [B, S, N] (None for a scheme of positions alone)."""

    fn: Callable | None
    means: str
    constants: Callable[[int], np.ndarray | tuple] = lambda num_heads: ()
    init: Callable[[int, jax.Array, int], dict] = lambda num_heads, key, embed_dim: {}
    cumulative: Callable | None = None


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's slopes, float32 [N]: for N a power of two, m_n = 2 ** (-8 (n + 1) / N); else
    those of the largest power of two P below N, then every other slope of 2P (HF's
    `build_alibi_tensor`, Press et al.'s reference)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = base ** np.arange(1, closest + 1, dtype=np.float64)
    if closest != num_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        odd = np.arange(1, 1 + 2 * (num_heads - closest), 2, dtype=np.float64)
        slopes = np.concatenate([slopes, extra**odd])
    return slopes.astype(np.float32)


def _alibi(params, inputs, q_idx, k_idx):
    slopes, q_pos, k_pos = inputs  # [N], [B, T], [B, S]
    distance = jnp.abs(q_pos[:, q_idx][:, :, None] - k_pos[:, k_idx][:, None, :])  # [B, t, s]
    return -jnp.asarray(slopes)[None, :, None, None] * distance[:, None]


FIRE_WIDTH, FIRE_L, FIRE_EPS = 32, 512.0, 1e-6  # the MLP's width, L's scale, psi's guard


def _fire_init(num_heads: int, key, embed_dim: int = 0) -> dict:
    """FIRE's parameters: an MLP 1 -> 32 -> N initialised as torch's nn.Linear (uniform
    within 1/sqrt(fan_in)), c = 0.1, L_multiplier = 1."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    uniform = lambda k, shape, fan_in: (
        jax.random.uniform(k, shape, jnp.float32, -1, 1) / fan_in**0.5
    )
    one = lambda v: jnp.asarray(v, jnp.float32)
    return {"w1": uniform(k1, (1, FIRE_WIDTH), 1), "b1": uniform(k2, (FIRE_WIDTH,), 1),
            "w2": uniform(k3, (FIRE_WIDTH, num_heads), FIRE_WIDTH),
            "b2": uniform(k4, (num_heads,), FIRE_WIDTH), "c": one(0.1),
            "L_multiplier": one(1.0)}  # fmt: skip


def _fire(params, inputs, q_idx, k_idx):
    _, q_pos, k_pos = inputs
    p_t = q_pos[:, q_idx][:, :, None]  # [B, t, 1]
    distance = jnp.maximum(p_t - k_pos[:, k_idx][:, None, :], 0.0)  # causal: p_t >= p_s
    c, threshold = jnp.abs(params["c"]), jnp.abs(params["L_multiplier"] * FIRE_L)
    psi = lambda x: jnp.log(c * x + 1.0)
    x = psi(distance) / (psi(jnp.maximum(p_t, threshold)) + FIRE_EPS)  # [B, t, s] in [0, 1]
    hidden = jax.nn.relu(x[..., None] * params["w1"][0] + params["b1"])  # [B, t, s, 32]
    return jnp.moveaxis(hidden @ params["w2"] + params["b2"], -1, 1)  # [B, N, t, s]


def _forget_init(num_heads: int, key, embed_dim: int) -> dict:
    """FoX's forget gate, a linear map D -> N with a bias, initialised as torch's
    nn.Linear (uniform within 1/sqrt(D))."""
    kw, kb = jax.random.split(key)
    bound = embed_dim**-0.5
    return {"w": jax.random.uniform(kw, (embed_dim, num_heads), jnp.float32, -bound, bound),
            "b": jax.random.uniform(kb, (num_heads,), jnp.float32, -bound, bound)}  # fmt: skip


def _log_forget(params, x):
    """log f_t = log sigmoid(x_t . w + b), float32 [B, T, N]."""
    return jax.nn.log_sigmoid(x.astype(jnp.float32) @ params["w"] + params["b"])


def _forget(params, inputs, q_idx, k_idx):
    c_q, c_k = params["q"][:, q_idx], params["k"][:, k_idx]  # [B, t, N], [B, s, N]
    return jnp.transpose(c_q[:, :, None, :] - c_k[:, None, :, :], (0, 3, 1, 2))


SCHEMES: dict[str, Scheme] = {
    "none": Scheme(None, "no position bias"),
    "alibi": Scheme(_alibi, "-m_n |p_t - p_s|, geometric slopes", constants=alibi_slopes),
    "fire": Scheme(
        _fire, "a learned MLP of the progressively interpolated log distance", init=_fire_init
    ),
    "forget": Scheme(
        _forget,
        "FoX: the sum of log forget gates between key and query",
        init=_forget_init,
        cumulative=_log_forget,
    ),
}


def check(name: str, field: str = "bias") -> Scheme:
    """The scheme `name` names, else one ValueError line listing them."""
    if name not in SCHEMES:
        raise ValueError(f"{field}={name!r} is not one of {', '.join(map(repr, SCHEMES))}")
    return SCHEMES[name]
