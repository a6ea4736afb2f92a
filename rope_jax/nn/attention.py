"""Grouped-query attention with rotation at any subset of the sites q, k, v, o.

With positions p_i (queries) and p_j (keys) (docs/maths.md#rotation-sites-vo-rope):

  q   q_i -> R_i q_i        k   k_j -> R_j k_j        (QK-RoPE = standard RoPE)
  v   v_j -> R_j v_j        o   o_i -> R_i^T o_i      (VO-RoPE: o_i = sum_j a_ij R_{j-i} v_j)

`sites` is a string subset of "qkvo" ("" = NoPE). Every rotation goes through
`rotary.rotate`; this module only decides where it is applied.

Context scaling (docs/maths.md#context-scaling): the rule's frequencies come with the
spec; its attention factor m (`rotary.attention_factor`, yarn / longrope) multiplies the
logits once per rotated q or k site (m^2 for qk, as HF's cos * m, sin * m on q and k)
and never touches values or outputs, so sites "vo" ignore it. The current length that
`dynamic` and `longrope` read is S, the number of key slots: T in a forward pass, the
cache size when decoding (so cached keys and new queries share one ladder).

Tied key/value (`kv="tied"`, MLA-style cache): one latent c_j per token and kv head is
rotated once, c_j -> R_j c_j, and serves as both key and value; the output is rotated
back with R_i^T, so o_i = sum_j a_ij R_{j-i} c_j with a_ij from <R_i q_i, R_j c_j>
(relative). A cache then holds only the rotated c: half the bytes of separate k and v.

Checkpoint features (`qkv_bias`, `qk_norm`; Qwen2 and Qwen3): learned biases added to
the q, k, v projections, and an RMSNorm over H of every q and k head (one scale [H] each,
shared by the heads) after the projection and before any rotation.

Attention sinks and sliding windows (`sinks`, `window`; gpt-oss, Mistral, Gemma): a
layer with sinks holds one learned logit per query head ("sinks" [N], zeros at init)
that joins every softmax denominator and carries no value; a sliding layer attends the
W latest keys (t - W < s <= t) and decodes through a ring of W cache slots
(`nn.sliding`). Both are attention terms (`kernels.Terms`, handed to the kernel whole
with the causal mask, segment ids and any logit bias), so every impl runs them.
A chunked layer (`chunk`, Llama 4) attends keys s <= t of its own chunk of C positions,
s // C == t // C, and decodes through a ring of C slots whose segment ids are the
tokens' chunks.

iRoPE (`qk_l2_norm`, `nope_attn_scale`; Llama 4, `nn.irope`): a rotating layer may scale
q and k to unit RMS (no weight); a NoPE layer may multiply its queries by a temperature
that grows with the log of the position.

DeepSeek-V4 (`q_lora_rank`, `q_l2_norm`, `kv_norm`, `o_groups`, `o_lora_rank`; `nn.v4`):
low-rank queries with an RMSNorm on their latent, every query head scaled to unit RMS,
an RMSNorm on the tied latent, and a grouped low-rank output projection.

Learned rotations (`learned`, docs/maths.md#learned-rotations): the layer trains
frequencies theta [K, P, A] ("freqs", "commuting") and a basis generator S [H, H]
("commuting"), float32 `nnx.Param`s named `learned.PARAM_NAMES` that start at the fixed
rotation; `attend` then takes a `learned.LearnedRotation` as `rope` and applies it at
the same sites, outside the kernels. Query head n uses kv head n // G's frequencies.

Shape legend:
  B batch, T query positions, S key positions, N query heads, K kv heads,
  G = N / K query heads per kv head, H head dim, D model dim, A position axes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rope_jax import rotary, sharding
from rope_jax.learned import KINDS, LearnedRotation, cayley, check_kind, initial_freqs
from rope_jax.nn import biases, irope, kernels, sliding, v4
from rope_jax.nn.layers import DTYPES, RMSNorm, dense_param
from rope_jax.nn.products import dense
from rope_jax.rotary import RopeSpec

SITES = "qkvo"

# How keys and values are produced. "separate": their own projections (standard).
# "tied": one latent c_j = x_j W_c per kv head serves as both key and value
# (docs/maths.md#the-tied-keyvalue-cache); it needs every site ("qkvo"): c rotated
# once, the output rotated back.
KV_MODES = ("separate", "tied")
TIED_SITES = "qkvo"


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


def check_kv(kv: str, sites: str, *, kv_field: str = "kv", sites_field: str = "sites") -> None:
    """The key/value mode: one of KV_MODES; "tied" only with every site rotated.

    The field names are those of the caller (`model.attention.kv` in a config).
    """
    if kv not in KV_MODES:
        raise ValueError(f"{kv_field}={kv!r} is not one of {', '.join(map(repr, KV_MODES))}")
    if kv == "tied" and sorted(sites) != sorted(TIED_SITES):
        raise ValueError(
            f"{kv_field}='tied' needs {sites_field}={TIED_SITES!r} (one rotated latent is both "
            f"key and value, the output is rotated back), got {sites_field}={sites!r}; use "
            f"{kv_field}='separate' for other sites"
        )


def attend(
    q,
    k,
    v,
    *,
    q_positions,
    k_positions,
    sites: str,
    rope: RopeSpec | Any = None,
    terms: kernels.Terms | None = None,
    scale: float | None = None,
    impl: str = "xla",
    cached: bool = False,
    seq_len: int | None = None,
    xpos: float = 0.0,
    **fields,
) -> jax.Array:
    """Softmax attention with rotation at `sites`.

    Args:
      q: [B, T, N, H] queries.
      k, v: [B, S, K, H] keys and values; N % K == 0, head n uses kv head n // (N / K).
      q_positions: [B, T, A] (or [B, T]) query positions, int or float.
      k_positions: [B, S, A] (or [B, S]) key positions; unused (may be None) when
        sites has neither "k" nor "v", e.g. keys and values read from a decoding cache,
        which stores them already rotated.
      sites: subset of "qkvo" ("" = NoPE).
      rope: the rotation, a `rotary.RopeSpec` (or a mapping of its fields; None =
        the defaults), or a `learned.LearnedRotation` (trained frequencies and basis).
      terms: what masks or biases the logits (`kernels.Terms`: causal, q_offset, segment
        ids, a dense mask, window, chunk, sinks, a logit bias), handed to the kernel
        whole; `fields` (its field names, e.g. causal=True, window=8) replace its fields.
      scale: logit scale, default 1 / sqrt(H).
      impl: the softmax-attention kernel, one of `kernels.IMPLS` (xla, dot_product,
        chunked, splash); rotations stay outside it, so every site set runs on each.
      cached: k and v come from a decoding cache, already rotated at their sites: only
        q and o are rotated here (k_positions unused); the attention factor still
        counts the k site.
      seq_len: the static length the dynamic / longrope rules read; default S.
      xpos: gamma of xPos (`rotary.xpos_scale`, centred at seq_len // 2): rotated queries
        times zeta ** (p / gamma), keys (unless cached, where they are stored so) divided;
        0 = off. Needs sites q and k.

    Returns:
      [B, T, N, H] in q's dtype. Scores and softmax are float32.
    """
    check_sites(sites)
    _check_shapes(q, k, v)
    terms = kernels.Terms.of(terms, **fields)
    seq_len = k.shape[1] if seq_len is None else seq_len
    spec, rot = rotation_of(rope, seq_len)
    if "q" in sites:
        q = rot(q, q_positions)
    if "k" in sites and not cached:
        k = rot(k, k_positions)
    if "v" in sites and not cached:
        v = rot(v, k_positions)  # values rotate with their key's position
    if xpos:
        q = decay(q, q_positions, xpos, seq_len, spec.layout)
        k = k if cached else decay(k, k_positions, xpos, seq_len, spec.layout, key=True)

    scale = logit_scale(spec, sites, head_dim=q.shape[-1], seq_len=seq_len, scale=scale)
    o = kernels.mix(q, k, v, terms, impl=impl, scale=scale)
    if "o" in sites:
        o = rot(o, q_positions, inverse=True)  # o_i -> R_i^T o_i at the query position
    return o.astype(q.dtype)


def attend_tied(
    q,
    c,
    *,
    q_positions,
    k_positions,
    rope: RopeSpec | Any = None,
    terms: kernels.Terms | None = None,
    scale: float | None = None,
    impl: str = "xla",
    seq_len: int | None = None,
    **fields,
) -> jax.Array:
    """Attention with one latent per key serving as key and value (sites "qkvo" implied).

    c_j is rotated once, c_j -> R_j c_j, and used for both the scores and the values;
    queries q_i -> R_i q_i; the output o_i -> R_i^T o_i. Equals `attend(q, c, c,
    sites="qkvo")`, with one rotation of c instead of two.

    Args:
      q: [B, T, N, H] queries.
      c: [B, S, K, H] key/value latents; N % K == 0.
      q_positions, k_positions, rope, terms, scale, impl, seq_len, fields: as in `attend`.

    Returns:
      [B, T, N, H] in q's dtype.
    """
    _check_shapes(q, c, c)
    terms = kernels.Terms.of(terms, **fields)
    seq_len = c.shape[1] if seq_len is None else seq_len
    spec, rot = rotation_of(rope, seq_len)
    q = rot(q, q_positions)
    c = rot(c, k_positions)  # once: the key and the value
    scale = logit_scale(spec, TIED_SITES, head_dim=q.shape[-1], seq_len=seq_len, scale=scale)
    o = kernels.mix(q, c, c, terms, impl=impl, scale=scale)
    return rot(o, q_positions, inverse=True).astype(q.dtype)


def decay(x, positions, gamma: float, seq_len: int, layout: str, *, key: bool = False):
    """xPos on rotated queries x [B, T, N, H] (keys with `key`: divided), centred at
    seq_len // 2, the same centre for the keys a cache holds and the queries that read
    them."""
    scale = rotary.xpos_scale(_text_positions(positions), x.shape[-1], gamma, seq_len // 2)
    return rotary.scale_pairs(x, 1.0 / scale if key else scale, layout)


def offset_keys(k, still, prev=None, starts=None):
    """modded-nanogpt's partial key offset: key t's stationary numbers (`still`, bool [H]
    or [K, H]: `rotary.stationary`) are key t-1's, so a query can match the previous
    token's content in one layer (an induction head); the first key (of the sequence,
    or of a document where `starts` [B, T] is True) keeps its own.

    k: [B, T, K, H] before rotation; `prev` [B, 1, K, H] is the key before k[:, 0] (a
    decoding cache's last), None when k[:, 0] starts the sequence.
    """
    before = k[:, :1] if prev is None else prev.astype(k.dtype)
    shifted = jnp.concatenate([before, k[:, :-1]], axis=1)
    keep = jnp.zeros(k.shape[:2], bool) if starts is None else starts
    still = np.asarray(still, bool)
    take = still[None, None] if still.ndim == 2 else still[None, None, None]
    return jnp.where(take & ~keep[:, :, None, None], shifted, k)


def _document_starts(segments):
    """bool [B, T]: where a packed row's document begins (None without segments)."""
    if segments is None:
        return None
    first = jnp.ones_like(segments[:, :1], bool)
    return jnp.concatenate([first, segments[:, 1:] != segments[:, :-1]], axis=1)


def check_xpos(xpos: Any, sites: str, kv: str, num_axes: int) -> float:
    """gamma of xPos as a float (0 = off); ValueError naming model.rope.xpos_scale_base
    when it is not a number >= 0, or is set without rotated q and k, with tied K/V
    (the latent is also the value) or N-D positions."""
    field = "model.rope.xpos_scale_base"
    if isinstance(xpos, bool) or not isinstance(xpos, (int, float)) or xpos < 0:
        raise ValueError(f"{field}={xpos!r} must be a number >= 0 (0 = off; xPos's gamma, "
                         "e.g. 512)")  # fmt: skip
    if xpos and not ("q" in sites and "k" in sites):
        raise ValueError(f"{field}={xpos!r} scales rotated queries and keys: needs sites with "
                         f"q and k, got model.rope.sites={sites!r}")  # fmt: skip
    if xpos and kv == "tied":
        raise ValueError(f"{field}={xpos!r} divides the keys, and a tied latent is also the "
                         "value: needs model.attention.kv='separate'")  # fmt: skip
    if xpos and num_axes != 1:
        raise ValueError(f"{field}={xpos!r} decays with 1-D text distance; the data has "
                         f"{num_axes} position axes")  # fmt: skip
    return float(xpos)


def rotation_of(rope: RopeSpec | LearnedRotation | Any, seq_len: int | None):
    """(spec, rot) of a fixed spec (or mapping, or None) or a learned rotation, with
    rot(x, positions, inverse=False) -> R_p x (R_p^T x) for x [B, T, N or K, H].

    A learned rotation's spec has no scaling rule (its attention factor is 1) and only
    lends the pair layout; `seq_len` is read by the fixed dynamic / longrope rules.
    """
    if isinstance(rope, LearnedRotation):
        return rope.spec, rope.rotate
    spec = RopeSpec.of(rope)
    rot = lambda x, p, inverse=False: rotary.rotate(x, p, spec, inverse=inverse, seq_len=seq_len)
    return spec, rot


def logit_scale(
    rope: RopeSpec | Any, sites: str, *, head_dim: int, seq_len: int, scale: float | None = None
) -> float | None:
    """The logit scale with the scaling rule's attention factor m applied once per
    rotated q or k site: scale * m^n, n = number of "q", "k" in sites (scale None =
    1 / sqrt(H)). Without a factor (m = 1, or no q/k site) `scale` is returned as given.
    """
    spec = RopeSpec.of(rope)
    factor = rotary.attention_factor(head_dim, spec, seq_len=seq_len)
    times = sum(site in sites for site in "qk")
    if factor == 1.0 or not times:
        return scale
    return (head_dim**-0.5 if scale is None else scale) * factor**times


def _check_shapes(q, k, v) -> None:
    (b, _, n, h), kh = q.shape, k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != h:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} do not fit [B,T,N,H] [B,S,K,H]")
    if n % kh:
        raise ValueError(f"num_heads={n} is not divisible by num_kv_heads={kh}")


# ----------------------------------------------------------------------------- module


class Attention(nnx.Module):
    """Causal GQA self-attention with rotation sites (q/k/v biases and q/k norms optional).

    Parameters (logical axes): q [D, N, H] (embed, heads, head_dim), k and v [D, K, H]
    (embed, kv_heads, head_dim), o [N, H, D] (heads, head_dim, embed). With kv="tied" a
    single kv [D, K, H] (embed, kv_heads, head_dim) replaces k and v, and sites must be
    "qkvo". `nope=True` makes a position-free layer (`model.rope.nope_every`): nothing is
    rotated, whatever `sites` says (they are still checked, e.g. against kv="tied").

    `learned` (`learned.KINDS`, `model.rope.learned`) adds, in a layer that rotates,
    rope_freqs [K, P, A] (kv_heads, -, -) for "freqs" and "commuting" and rope_basis
    [H, H] (-, -) for "commuting", float32 whatever `param_dtype` (they feed the float32
    phase), initialised to the fixed rotation of `rope` over `num_axes` position axes.

    `qkv_bias` adds q_bias [N*H], k_bias and v_bias [K*H] (zeros at init, flat as in HF
    checkpoints: no weight decay); `qk_norm` adds q_norm and k_norm, RMSNorms of scale [H]
    with epsilon `norm_eps`. Both need kv="separate".

    `sinks=True` adds sinks [N] (heads), one logit per query head in every softmax
    denominator, zeros at init (gpt-oss draws them from N(0, 0.02^2): about zero; a 1-D
    parameter, so no weight decay); without it the layer has no such parameter (older
    checkpoints restore as they are). `window` W makes a sliding layer: keys
    t - W < s <= t, and a decoding cache of min(W, length) slots (`nn.sliding`); `chunk`
    C a chunked one: keys s <= t with s // C == t // C, a cache of min(C, length) slots.

    iRoPE (`nn.irope`): `qk_l2_norm` scales q and k of a rotating layer to unit RMS (no
    parameter; needs kv="separate"); `nope_attn_scale` a > 0 multiplies the queries of a
    NoPE layer by 1 + a log1p(floor((p + 1) / nope_floor_scale)). Each is ignored by the
    other kind of layer.

    DeepSeek-V4 (`nn.v4`, `v4_options`): `q_lora_rank` r > 0 replaces q by q_lora
    (`v4.LowRankQuery`); `q_l2_norm` scales every query head to unit RMS (no parameter);
    `kv_norm` adds an RMSNorm kv_norm of scale [H] on the tied latent (needs kv="tied");
    `o_groups` g > 0 with `o_lora_rank` R replaces o by o_lora (`v4.GroupedOutput`).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        sites: str,
        rope: RopeSpec | Any = None,
        kv: str = "separate",
        impl: str = "xla",
        nope: bool = False,
        learned: str = "none",
        num_axes: int = 1,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        sinks: bool = False,
        window: int | None = None,
        chunk: int | None = None,
        qk_l2_norm: bool = False,
        nope_attn_scale: float = 0.0,
        nope_floor_scale: float = 8192.0,
        v4_options: v4.Options = v4.OFF,
        bias: str = "none",
        xpos: float = 0.0,
        key_offset: bool = False,
        stick_breaking: bool = False,
        norm_eps: float = 1e-6,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        out_scale: float = 1.0,
        rngs: nnx.Rngs,
    ):
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}"
            )
        check_kv(kv, check_sites(sites))
        if kv != "separate" and (qkv_bias or qk_norm or qk_l2_norm):
            raise ValueError(f"qkv_bias and qk_(l2_)norm need kv='separate', got kv={kv!r}")
        if v4_options.kv_norm and kv != "tied":
            raise ValueError(f"kv_norm normalises the tied latent: needs kv='tied', got {kv!r}")
        self.sites = "" if nope else sites  # the sites this layer rotates
        self.rope = RopeSpec.of(rope)
        self.kv, self.impl = kv, kernels.check_impl(impl)
        self._schemes(xpos, key_offset, stick_breaking, sinks, num_axes, head_dim)
        self.dtype = dtype
        d, n, kh, h = embed_dim, num_heads, num_kv_heads, head_dim
        self.num_heads = n
        self.rope_freqs, self.rope_basis = _learned_params(  # a NoPE layer trains none
            learned if self.sites else "none", h, kh, self.rope, num_axes)  # fmt: skip
        p = dict(dtype=param_dtype, fan_in=d)
        norm = dict(eps=norm_eps, dtype=dtype, param_dtype=param_dtype, axis="head_dim")
        opt, v4_kw = v4_options, dict(eps=norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        r, g = opt.q_lora_rank, opt.o_groups  # low-rank queries, grouped output (nn.v4)
        self.q_lora = v4.LowRankQuery(d, n, h, r, **v4_kw) if r else None
        self.q_proj = (
            None if r else dense_param(rngs, (d, n, h), ("embed", "heads", "head_dim"), **p)
        )
        self.q_l2_norm, self.kv_norm = opt.q_l2_norm, RMSNorm(h, **norm) if opt.kv_norm else None
        if kv == "tied":
            self.kv_proj = dense_param(rngs, (d, kh, h), ("embed", "kv_heads", "head_dim"), **p)
        else:
            self.k_proj = dense_param(rngs, (d, kh, h), ("embed", "kv_heads", "head_dim"), **p)
            self.v_proj = dense_param(rngs, (d, kh, h), ("embed", "kv_heads", "head_dim"), **p)
        self.o_lora = (v4.GroupedOutput(d, n, h, g, opt.o_lora_rank, out_scale=out_scale,
                                        **v4_kw) if g else None)  # fmt: skip
        self.o_proj = None if g else dense_param(rngs, (n, h, d), ("heads", "head_dim", "embed"),
                                                 dtype=param_dtype, fan_in=n * h,
                                                 scale=out_scale)  # fmt: skip
        self._checkpoint_features(qkv_bias, qk_norm, (n, kh, h), norm, param_dtype)
        sink = lambda: nnx.Param(jnp.zeros((n,), param_dtype), out_sharding=("heads",),
                                 eager_sharding=False)  # fmt: skip
        self.sinks = sink() if sinks else None
        self.window, self.chunk = window, chunk  # W of a sliding layer, C of a chunked one
        self._position_bias(bias, n, d, rngs)
        self.norm_eps, self.qk_l2_norm = norm_eps, bool(qk_l2_norm and self.sites)
        self.temperature = (  # (a, f) of a NoPE layer's query temperature, else None
            (nope_attn_scale, nope_floor_scale) if nope_attn_scale and not self.sites else None
        )

    def _schemes(self, xpos, key_offset, stick_breaking, sinks, num_axes: int,
                 head_dim: int) -> None:  # fmt: skip
        """The position schemes beside the rotation, each checked (one line naming its
        field): xPos's gamma (0 = off), the partial key offset's stationary numbers
        (None = off), stick-breaking weights; a NoPE layer takes neither of the first two."""
        if stick_breaking and sinks:
            raise ValueError("model.attention.stick_breaking=True leaves a row's unbroken stick "
                             "unspent already; model.attention.sinks=True has no meaning "
                             "beside it")  # fmt: skip
        on = bool(self.sites)
        self.xpos = check_xpos(xpos, self.sites, self.kv, num_axes) if on else 0.0
        still = _key_offset(key_offset, self.rope, head_dim, self.kv) if on else None
        # a nested tuple, not an array: static, so the layer's state holds only parameters
        self.key_offset = None if still is None else _nested(still.tolist())
        self.stick_breaking = bool(stick_breaking)

    def _checkpoint_features(self, qkv_bias: bool, qk_norm: bool, shape, norm: dict,
                             param_dtype) -> None:  # fmt: skip
        """q_bias [N*H], k_bias, v_bias [K*H] (zeros, flat as in HF checkpoints) and q_norm,
        k_norm (RMSNorm over H), each None when off."""
        n, kh, h = shape
        flat = lambda size: nnx.Param(
            jnp.zeros((size,), param_dtype), out_sharding=(None,), eager_sharding=False
        )
        self.q_bias = flat(n * h) if qkv_bias else None
        self.k_bias = flat(kh * h) if qkv_bias else None
        self.v_bias = flat(kh * h) if qkv_bias else None
        self.q_norm = RMSNorm(h, **norm) if qk_norm else None
        self.k_norm = RMSNorm(h, **norm) if qk_norm else None

    def _position_bias(self, name: str, num_heads: int, embed_dim: int, rngs: nnx.Rngs) -> None:
        """The layer's position bias (`nn.biases`; None for "none") and its learned
        parameters, float32 `bias_<name>` (not sharded: a few numbers, or FoX's gate)."""
        scheme = biases.check(name)
        self.bias = name if scheme.fn is not None else None
        initial = scheme.init(num_heads, rngs.params(), embed_dim) if self.bias else {}
        self._bias_names = tuple(initial)
        for key, value in initial.items():
            param = nnx.Param(jnp.asarray(value, jnp.float32), eager_sharding=False)
            setattr(self, f"bias_{key}", param)

    @classmethod
    def from_config(
        cls, cfg, rope: RopeSpec | None, *, num_axes: int = 1, window: int | None = None,
        chunk: int | None = None, out_scale: float = 1.0, rngs: nnx.Rngs,
    ) -> Attention:  # fmt: skip
        """The layer a decoder config (`config.model`) describes: its shape, its
        `attention` section and the rotation settings of `rope` (None: a NoPE layer).
        `window` / `chunk` are this layer's (None for a full layer: `layer_types` decides);
        `out_scale` scales the output projection's init."""
        att = cfg.attention
        return cls(
            cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            sites=cfg.rope.sites, rope=rope, nope=rope is None, learned=cfg.rope.learned,
            num_axes=num_axes, kv=att.kv, impl=att.impl, qkv_bias=att.qkv_bias,
            qk_norm=att.qk_norm, sinks=att.sinks, window=window, chunk=chunk,
            qk_l2_norm=att.qk_l2_norm, nope_attn_scale=cfg.rope.nope_attn_scale,
            nope_floor_scale=cfg.rope.nope_floor_scale, v4_options=v4.Options.of(att),
            bias=att.bias, xpos=cfg.rope.xpos_scale_base, key_offset=cfg.rope.key_offset,
            stick_breaking=att.stick_breaking,
            norm_eps=cfg.norm_eps, dtype=DTYPES[cfg.dtype], param_dtype=DTYPES[cfg.param_dtype],
            out_scale=out_scale, rngs=rngs,
        )  # fmt: skip

    def rotation(self) -> RopeSpec | LearnedRotation:
        """What this layer rotates by: its spec, or the learned rotation of its parameters."""
        if self.rope_freqs is None:
            return self.rope
        basis = None if self.rope_basis is None else cayley(self.rope_basis[...])
        return LearnedRotation(self.rope, self.rope_freqs[...], basis)

    def _project(self, x, positions):
        """x [B, T, D] -> q [B, T, N, H] and k, v [B, T, K, H] (the same latent c if tied);
        `positions` [B, T, A] are read by a NoPE layer's temperature."""
        proj = lambda p: dense(x, p[...], dtype=self.dtype)  # [B, T, D] . [D, N|K, H]
        q = proj(self.q_proj) if self.q_lora is None else self.q_lora(x)
        if self.kv == "tied":
            k = v = proj(self.kv_proj)
            if self.kv_norm is not None:  # before the rotation
                k = v = self.kv_norm(k)
        else:
            k, v = proj(self.k_proj), proj(self.v_proj)
        w = lambda p: p[...].astype(self.dtype)
        if self.q_bias is not None:  # flat [N*H] / [K*H] as in checkpoints
            q = q + w(self.q_bias).reshape(q.shape[2:])
            k = k + w(self.k_bias).reshape(k.shape[2:])
            v = v + w(self.v_bias).reshape(v.shape[2:])
        if self.q_norm is not None:  # per head, before any rotation
            q, k = self.q_norm(q), self.k_norm(k)
        if self.q_l2_norm:  # every query head, rotating or not (V4's q_b_norm)
            q = irope.l2_norm(q, eps=self.norm_eps)
        if self.qk_l2_norm:  # commutes with the rotation (HF applies it after)
            q, k = irope.l2_norm(q, eps=self.norm_eps), irope.l2_norm(k, eps=self.norm_eps)
        if self.temperature is not None:
            a, f = self.temperature
            tau = irope.temperature(positions, attn_scale=a, floor_scale=f)  # [B, T]
            q = (q * tau[:, :, None, None]).astype(q.dtype)
        q = sharding.constrain(q, ("batch", "seq", "heads", "head_dim"))
        k = sharding.constrain(k, ("batch", "seq", "kv_heads", "head_dim"))
        return q, k, (k if self.kv == "tied" else v)

    def __call__(self, x, positions, mask=None, *, causal: bool = True, segments=None) -> jax.Array:
        """x [B, T, D], positions [B, T, A] -> [B, T, D] in the compute dtype.

        `segments` [B, T] int: document ids of packed sequences (attention stays inside
        each document); None = one sequence per row.
        """
        x = x.astype(self.dtype)
        q, k, v = self._project(x, positions)
        if self.key_offset is not None:
            k = offset_keys(k, self.key_offset, starts=_document_starts(segments))
        sums = self._sums(x)  # a data-dependent bias's, for its queries and keys alike
        terms = kernels.Terms(
            causal=causal, q_segments=segments, kv_segments=segments, mask=mask,
            window=self.window, chunk=self.chunk, sinks=self._sinks(),
            bias=self._bias(positions, positions, sums, sums),
            stick_breaking=self.stick_breaking,
        )  # fmt: skip
        kw = dict(q_positions=positions, k_positions=positions, rope=self.rotation(),
                  terms=terms, impl=self.impl)  # fmt: skip
        if self.kv == "tied" and self.sites:
            o = attend_tied(q, k, **kw)
        else:  # separate, or a tied NoPE layer (k = v = the latent, unrotated)
            o = attend(q, k, v, sites=self.sites, xpos=self.xpos, **kw)
        return self._out(o)

    def _sinks(self):
        return None if self.sinks is None else self.sinks[...]

    def _bias_params(self) -> dict:
        return {name: getattr(self, f"bias_{name}")[...] for name in self._bias_names}

    @property
    def _cumulative(self):
        """A data-dependent bias's increments (`biases.Scheme.cumulative`), or None."""
        return None if self.bias is None else biases.SCHEMES[self.bias].cumulative

    def _sums(self, x, last=None):
        """Running sums [B, T, N] of a data-dependent bias's increments of x [B, T, D], from
        `last` [B, 1, N] (a decoding cache's; None: from 0); None for a bias of positions
        alone."""
        if self._cumulative is None:
            return None
        sums = jnp.cumsum(self._cumulative(self._bias_params(), x), axis=1)
        return sums if last is None else sums + last

    def _bias(self, q_positions, k_positions, q_sums=None, k_sums=None):
        """The layer's position bias (`nn.biases`) between queries at q_positions [B, T, A]
        (or [B, T]) and keys at k_positions, as a `kernels.Bias`; None without one. A bias
        reads the first position axis (text positions); a data-dependent one the running
        sums of its queries and keys (`_sums`), as parameters: the gradient reaches them."""
        if self.bias is None:
            return None
        scheme = biases.SCHEMES[self.bias]
        params = self._bias_params()
        if q_sums is not None:
            params = {"q": q_sums, "k": k_sums}
        inputs = (scheme.constants(self.num_heads), _text_positions(q_positions),
                  _text_positions(k_positions))  # fmt: skip
        return kernels.Bias(scheme.fn, params, inputs)

    def _out(self, o):
        """o [B, T, N, H] . o_proj [N, H, D] (or the grouped o_a, o_b) -> [B, T, D] in the
        compute dtype."""
        if self.o_lora is not None:
            return self.o_lora(o)
        return dense(o, self.o_proj[...], num_in=2, dtype=self.dtype)

    # ------------------------------------------------------------ decoding cache

    def init_cache(self, batch_size: int, max_len: int) -> dict:
        """Empty cache of S = max_len slots: {"k", "v"} (separate) or {"c"} (tied) [B, S, K, H];
        a sliding (chunked) layer keeps C = min(W (chunk), max_len) slots, a ring
        (`nn.sliding`).

        Entries are stored after their rotation (k if "k" in sites, v if "v" in sites,
        c always when tied), in the compute dtype; a layer with a position bias also
        keeps each slot's position, "pos" [B, S] float32.
        """
        proj = self.kv_proj if self.kv == "tied" else self.k_proj
        reach = self.window or self.chunk  # None for a full layer
        slots = max_len if reach is None else sliding.ring_slots(reach, max_len)
        shape = (batch_size, slots, *proj.shape[1:])
        names = ("c",) if self.kv == "tied" else ("k", "v")
        cache = {name: jnp.zeros(shape, self.dtype) for name in names}
        if self.bias is not None:  # a position bias reads the keys' positions
            cache["pos"] = jnp.zeros(shape[:2], jnp.float32)
        if self.key_offset is not None:  # the last key before its offset, for the next
            cache["k_last"] = jnp.zeros((batch_size, 1, *proj.shape[1:]), self.dtype)
        if self._cumulative is not None:
            cache["sum"] = jnp.zeros((*shape[:2], self.num_heads), jnp.float32)  # per slot
            cache["sum_last"] = jnp.zeros((batch_size, 1, self.num_heads), jnp.float32)
        return cache

    def decode(
        self, x, positions, cache: dict, index, seq_len: int | None = None
    ) -> tuple[jax.Array, dict]:
        """T new tokens written at cache slots index..index+T-1, attending to slots <= their own
        (a sliding layer: to the W latest tokens, a chunked one: to its chunk's, through a
        ring of C slots).

        Args:
          x: [B, T, D] (T = prompt length when prefilling, 1 per decoding step).
          positions: [B, T, A] positions of the new tokens.
          cache: from `init_cache` (or a previous `decode`), S slots.
          index: int32 scalar, the number of tokens already decoded (filled slots).
          seq_len: the static length the dynamic / longrope rules read; default S.

        Returns:
          ([B, T, D] output, the cache with the new rotated entries).
        """
        x = x.astype(self.dtype)
        q, k, v = self._project(x, positions)
        last, sum_last = cache.get("k_last"), cache.get("sum_last")
        cache = {name: a for name, a in cache.items() if name not in _NOT_SLOTS}
        k, last = self._offset_step(k, last, index)
        if seq_len is None:  # S: the length dynamic / longrope read
            seq_len = next(iter(cache.values())).shape[1]
        rope = self.rotation()
        spec, rotate = rotation_of(rope, seq_len)
        rot = lambda y: rotate(y, positions)
        if self.kv == "tied":
            new = {"c": rot(k) if self.sites else k}  # rotated once (unless a NoPE layer)
        else:
            new = {"k": rot(k) if "k" in self.sites else k, "v": rot(v) if "v" in self.sites else v}
            if self.xpos:  # stored decayed, as attend decays uncached keys
                new["k"] = decay(new["k"], positions, self.xpos, seq_len, spec.layout, key=True)
        if self.bias is not None:
            new["pos"] = _text_positions(positions)
        sums = self._sums(x, sum_last)
        if sums is not None:
            new["sum"], sum_last = sums, sums[:, -1:]
        terms = kernels.Terms(causal=True, sinks=self._sinks(),
                              stick_breaking=self.stick_breaking)  # fmt: skip
        ring = self.window is not None or self.chunk is not None
        if not ring:  # new token t sees the filled slots and itself
            at = (0, index, 0, 0)
            cache = {name: jax.lax.dynamic_update_slice(cache[name], new[name],
                                                        at[: new[name].ndim])
                     for name in new}  # fmt: skip
            terms = kernels.Terms.of(terms, q_offset=index)
        else:  # the ring in token order, then the new entries: query 0 at offset C
            slots = next(iter(cache.values())).shape[1]
            cache = {name: sliding.ring_keys(cache[name], new[name], index) for name in new}
            q_ids, kv_ids = self._ring_segments(*x.shape[:2], slots, index)
            terms = kernels.Terms.of(terms, q_offset=slots, window=self.window,
                                     q_segments=q_ids, kv_segments=kv_ids)  # fmt: skip
        keys = cache["c"] if self.kv == "tied" else cache["k"]
        values = cache["c"] if self.kv == "tied" else cache["v"]
        if self.bias is not None:
            extra = () if sums is None else (sums, cache["sum"])
            terms = kernels.Terms.of(terms, bias=self._bias(positions, cache["pos"], *extra))
        o = attend(
            q,
            keys,
            values,
            q_positions=positions,
            k_positions=None,
            sites=self.sites,
            rope=rope,
            terms=terms,
            impl=self.impl,
            cached=True,
            seq_len=seq_len,
            xpos=self.xpos,
        )  # fmt: skip  (keys, values: already rotated)
        if ring:
            cache = {name: sliding.ring_store(cache[name], slots, index) for name in cache}
        if last is not None:
            cache["k_last"] = last
        if sum_last is not None:
            cache["sum_last"] = sum_last
        return self._out(o), cache

    def _offset_step(self, k, last, index):
        """(keys with the partial key offset, the last raw key) of a decode step; k and
        `last` as they are without the offset. The first token of all keeps its own."""
        if last is None:
            return k, None
        starts = jnp.broadcast_to(jnp.arange(k.shape[1]) + index == 0, k.shape[:2])
        return offset_keys(k, self.key_offset, last, starts), k[:, -1:]

    def _ring_segments(self, batch: int, new: int, slots: int, index):
        """(q ids [B, T], kv ids [B, C + T]) of a ring step: the filled slots (a sliding
        layer, whose window the kernel applies) or each token's chunk (a chunked layer)."""
        if self.chunk is not None:
            return sliding.chunk_segments(batch, slots, new, index, self.chunk)
        return sliding.ring_segments(batch, slots, new, index)


def _nested(value):
    return tuple(_nested(v) for v in value) if isinstance(value, list) else value


# cache entries that are not one value per slot (the ring and slot updates skip them)
_NOT_SLOTS = ("k_last", "sum_last")


def _key_offset(on: Any, rope: RopeSpec, head_dim: int, kv: str):
    """The stationary numbers the partial key offset moves (`rotary.stationary`), or None
    when it is off; ValueError naming model.rope.key_offset where it has no meaning."""
    field = "model.rope.key_offset"
    if not isinstance(on, bool):
        raise ValueError(f"{field}={on!r} must be True or False")
    if not on:
        return None
    if kv == "tied":
        raise ValueError(f"{field}=True shifts the keys, and a tied latent is also the value: "
                         "needs model.attention.kv='separate'")  # fmt: skip
    still = rotary.stationary(head_dim, rope)
    if not still.any():
        raise ValueError(f"{field}=True shifts a head's stationary numbers, and "
                         f"model.rope.pairs.rule={rope.pairs.rule!r} turns every pair: use a rule "
                         "that freezes some, e.g. half_truncated")  # fmt: skip
    return still


def _text_positions(positions) -> jax.Array:
    """float32 [B, T]: the first axis of positions [B, T, A] (or [B, T] as they are), what a
    position bias reads."""
    return (positions if positions.ndim == 2 else positions[..., 0]).astype(jnp.float32)


def _learned_params(kind: str, head_dim: int, num_kv_heads: int, rope: RopeSpec, num_axes: int):
    """(rope_freqs, rope_basis) of a layer training `kind` (`learned.KINDS`), each None when
    not trained (assigned once: None is static): theta [K, P, A] from the fixed ladder,
    S = 0 [H, H] (Q = I)."""
    trained = KINDS[check_kind(kind)]
    freqs = (
        _rotation_param(
            initial_freqs(head_dim, num_kv_heads, rope, num_axes=num_axes), ("kv_heads", None, None)
        )
        if "rope_freqs" in trained
        else None
    )
    basis = (_rotation_param(jnp.zeros((head_dim, head_dim), jnp.float32), (None, None))
             if "rope_basis" in trained else None)  # fmt: skip
    return freqs, basis


def _rotation_param(value, names) -> nnx.Param:
    """A float32 rotation parameter carrying logical axis `names` (placed by `sharding`)."""
    return nnx.Param(jnp.asarray(value, jnp.float32), out_sharding=names, eager_sharding=False)
