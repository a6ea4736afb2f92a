"""LLaMA-like decoder in Flax NNX: RMSNorm, GQA attention with rotation sites, SwiGLU.

  x = embed(tokens)            (patch vectors replace token embeddings where is_patch)
  for each block:  x = x + attn(norm(x));  x = x + mlp(norm(x))
  logits = head(norm(x))       (float32; head = embed^T with model.tie_embeddings)

`cfg` is `config.model`; `check_config` validates it before anything is built or
compiled. The number of position axes A is not a model field: the data decides it
(1 for text, 2 for images, 3 for videos) and passes it as `num_axes`. Likewise the
training length `train_seq_len` (the data's `seq_len`) is the default of
`model.rope.max_position_embeddings`, the length context-scaling rules scale from.
Parameters are stored in `param_dtype` and cast to the compute `dtype` at use; norms,
softmax and logits are float32. Every RMSNorm uses `model.norm_eps` (1e-6 when a config
predates the field). The fields that published checkpoints need (`rope_jax.hf`):
`model.tie_embeddings` (the head is the embedding table), `model.attention.qkv_bias`
(Qwen2) and `model.attention.qk_norm` (Qwen3), all off by default.

Attention per layer (`nn.sliding.layer_types`): `model.attention.layer_types` gives
each layer "full", "sliding" (a window of `model.attention.window` W keys, HF's
`sliding_window`) or "chunked" (the keys of its own chunk of `model.attention.chunk` C
positions, HF's `attention_chunk_size`); `model.attention.sinks` gives every layer one
learned sink logit per query head (gpt-oss). Defaults: full layers, no sinks (the Llama
decoder, unchanged). iRoPE (Llama 4, `nn.irope`): NoPE layers by `rope.nope_every`,
chunked rotating layers, `attention.qk_l2_norm` on the rotating layers and the query
temperature `rope.nope_attn_scale` on the NoPE ones. DeepSeek-V4 (`nn.v4`): tied K/V with
`attention.kv_norm`, low-rank queries `attention.q_lora_rank` with `attention.q_l2_norm`,
and the grouped output `attention.o_groups`, `attention.o_lora_rank`.

Rotation per layer (`layer_rotations`, docs/maths.md#context-scaling): every layer uses
the spec of `cfg.rope` (base, ladder, layout, allocation, sections, pairs, scaling,
max_position_embeddings), except that with `rope.nope_every = k > 0` layers k-1, 2k-1,
... rotate nothing (Llama-4 style NoPE layers), and with `rope.global_every = g > 0`
only layers g-1, 2g-1, ... are global: the others use `rope.local_base` and no context
rule (the same pairs turn), as Gemma's local layers do. With `rope.learned`
("freqs" | "commuting", docs/maths.md#learned-rotations) every rotating layer trains its
own frequencies (and basis), starting from its spec; NoPE layers train none.

Shape legend: B batch, T positions, D embed dim, V vocab, A position axes, E patch
vector width.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from rope_jax import defaults, layouts, learned, rotary, sharding
from rope_jax.nn import biases, irope, kernels, sliding, v4
from rope_jax.nn.attention import Attention, check_kv, check_sites
from rope_jax.nn.layers import DTYPES, MLP, RMSNorm, dense_param
from rope_jax.nn.products import dense

# Activation rematerialisation: "block" keeps only each block's input for the backward
# pass and recomputes the rest (memory ~1/num_layers of "none" for ~1.3x the FLOPs).
REMAT = ("none", "block")
_SIZES = ("vocab_size", "num_layers", "embed_dim", "num_heads", "num_kv_heads", "head_dim")


def _fail(field: str, value: Any, allowed: str):
    raise ValueError(f"model.{field}={value!r} is invalid: {allowed}")


def _choice(field: str, value: Any, allowed) -> None:
    if value not in allowed:
        _fail(field, value, f"must be one of {', '.join(map(repr, allowed))}")


def check_config(cfg, num_axes: int = 1, *, train_seq_len: int | None = None):
    """The section filled and checked; ValueError naming the field, its value and what is
    allowed.

    `num_axes` is the data's number of position axes (the rotation sections need one
    entry per axis); `train_seq_len` the training length (the default of
    `model.rope.max_position_embeddings`). A partial section is filled from
    `rope_jax.defaults`; the filled one is returned.
    """
    cfg = defaults.fill_model(cfg)
    for field in (*_SIZES, "mlp_dim"):
        value = cfg[field]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            _fail(field, value, "must be a positive integer")
    if cfg.head_dim % 2:
        _fail("head_dim", cfg.head_dim, "must be even (rotation works on pairs)")
    if cfg.num_heads % cfg.num_kv_heads:
        _fail(
            "num_kv_heads",
            cfg.num_kv_heads,
            f"must divide num_heads={cfg.num_heads} (grouped-query attention)",
        )
    _choice("dtype", cfg.dtype, DTYPES)
    _choice("param_dtype", cfg.param_dtype, DTYPES)
    _choice("remat", cfg.remat, REMAT)
    eps = cfg.norm_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        _fail("norm_eps", eps, "must be a number in (0, 1) (the RMSNorm epsilon)")
    for field, value in (("tie_embeddings", cfg.tie_embeddings),
                         ("attention.qkv_bias", cfg.attention.qkv_bias),
                         ("attention.qk_norm", cfg.attention.qk_norm)):  # fmt: skip
        if not isinstance(value, bool):
            _fail(field, value, "must be True or False")
        if value and field.startswith("attention.") and cfg.attention.kv != "separate":
            _fail(field, value, f"needs model.attention.kv='separate' (got {cfg.attention.kv!r})")
    patch_dim = cfg.patch_dim
    if not isinstance(patch_dim, int) or patch_dim < 0:
        _fail("patch_dim", patch_dim, "must be a non-negative integer (0 = text only)")
    check_sites(cfg.rope.sites, field="model.rope.sites")
    _check_bias(cfg, num_axes)  # a term the kernel lacks is named before its backend
    kernels.check_impl(cfg.attention.impl, field="model.attention.impl")
    check_kv(cfg.attention.kv, cfg.rope.sites, kv_field="model.attention.kv",
             sites_field="model.rope.sites")  # fmt: skip
    sliding.layer_types(cfg.attention, cfg.num_layers, train_seq_len=train_seq_len)
    ropes = layer_rotations(cfg, num_axes, train_seq_len=train_seq_len)
    irope.check_config(cfg, tuple(rope is not None and bool(cfg.rope.sites) for rope in ropes))
    v4.check_config(cfg)
    _check_learned(cfg, rotation(cfg, num_axes, train_seq_len=train_seq_len))
    return cfg


def _check_bias(cfg, num_axes: int) -> None:
    """`model.attention.bias` names a scheme of `biases.SCHEMES`, read on 1-D positions,
    by a kernel that computes a logit bias (`kernels.choose`, the one place that says)."""
    scheme = biases.check(cfg.attention.bias, field="model.attention.bias")
    if scheme.fn is not None:
        kernels.choose(cfg.attention.impl, {"causal", "bias"}, field="model.attention.impl")
    if cfg.attention.stick_breaking:  # a kernel that computes it, or its fallback
        kernels.choose(cfg.attention.impl, {"causal", "stick_breaking"},
                       field="model.attention.impl")  # fmt: skip
    if scheme.fn is not None and num_axes != 1:
        _fail("attention.bias", cfg.attention.bias, f"reads 1-D text positions; the data has "
              f"{num_axes} position axes")  # fmt: skip


def _check_learned(cfg, spec: rotary.RopeSpec) -> None:
    """`model.rope.learned` is a kind of `learned.KINDS`; a trained one needs rotated sites
    (else nothing would train) and the fixed ladder over every pair (`learned.refusal`).
    NoPE and local layers are fine: the first train nothing, the second start from their
    own base."""
    kind = cfg.rope.learned
    _choice("rope.learned", kind, learned.KINDS)
    if kind == "none":
        return
    if not cfg.rope.sites:
        _fail("rope.learned", kind, "needs rotated model.rope.sites ('' rotates nothing: "
              "nothing would train); use model.rope.learned='none'")  # fmt: skip
    refused = learned.refusal(spec)
    if refused:
        _fail("rope.learned", kind, f"takes only the fixed ladder over every pair ({refused}); "
              "use model.rope.learned='none' with a scaling rule or a pair selection")  # fmt: skip


def rotation(cfg, num_axes: int = 1, *, train_seq_len: int | None = None) -> rotary.RopeSpec:
    """The model's (global layers') `rotary.RopeSpec` from `cfg.rope`, checked against H
    and A once.

    `model.rope.max_position_embeddings` None (or absent) = `train_seq_len`. Errors name
    the config field (`model.rope.<field>`, `model.rope.scaling.<key>`).
    """
    _check_num_axes(num_axes)
    max_pos = cfg.rope.max_position_embeddings
    _check_length("model.rope.max_position_embeddings", max_pos, " (None = the training length)")
    _check_length("train_seq_len", train_seq_len, " (the training data.seq_len)")
    max_pos = max_pos or train_seq_len
    try:
        # the rotation's own keys; the others say where, in which layer, whether trained
        rope = {k: v for k, v in cfg.rope.items() if k in rotary.SPEC_FIELDS}
        spec = rotary.RopeSpec.of(rope, max_position_embeddings=max_pos)
        _check_spec(spec, cfg.head_dim, num_axes)
    except ValueError as e:
        raise ValueError("model.rope." + _SCALING_KEY.sub(r"scaling.\1", str(e))) from None
    return spec


_SCALING_KEY = re.compile(r"scaling\['(\w+)'\]")  # scaling['factor'] -> scaling.factor


def _check_spec(spec: rotary.RopeSpec, head_dim: int, num_axes: int) -> None:
    """Builds the frequency table (and attention factor) once, at a length that every
    rule accepts: the errors of a bad spec come now, not at the first call."""
    seq_len = spec.max_position_embeddings or 1  # read only by dynamic / longrope
    rotary.pair_table(head_dim, spec, num_axes=num_axes, seq_len=seq_len)
    rotary.attention_factor(head_dim, spec, seq_len=seq_len)


def layer_rotations(
    cfg, num_axes: int = 1, *, train_seq_len: int | None = None
) -> tuple[rotary.RopeSpec | None, ...]:
    """Each layer's rotation, checked once: None for a NoPE layer (`rope.nope_every`),
    the local spec for a layer that is not global (`rope.local_base`, `rope.global_every`),
    else `rotation(cfg)`. Errors name the field.
    """
    rope = cfg.rope
    nope_every, global_every, local_base = rope.nope_every, rope.global_every, rope.local_base
    _check_every("rope.nope_every", nope_every, "layers k-1, 2k-1, ... rotate nothing")
    _check_every("rope.global_every", global_every, "layers g-1, 2g-1, ... use model.rope.base")
    if local_base is not None and (
        isinstance(local_base, bool) or not isinstance(local_base, (int, float))
        or not local_base > 1
    ):  # fmt: skip
        _fail("rope.local_base", local_base, "must be a number > 1 (None = one base)")
    if global_every and local_base is None:
        _fail("rope.global_every", global_every, "needs model.rope.local_base (the other layers)")
    if local_base is not None and not global_every:
        _fail("rope.local_base", local_base, "needs model.rope.global_every > 0 (global layers)")
    spec = rotation(cfg, num_axes, train_seq_len=train_seq_len)
    local = None if local_base is None else _local(spec, local_base, cfg.head_dim, num_axes)
    every = lambda k, layer: k > 0 and (layer + 1) % k == 0
    return tuple(
        None if every(nope_every, layer)
        else _of_layer(local if local is not None and not every(global_every, layer)
                       else spec, layer, cfg)
        for layer in range(cfg.num_layers)
    )  # fmt: skip


def _of_layer(spec: rotary.RopeSpec, layer: int, cfg) -> rotary.RopeSpec:
    """The spec of one layer: a per-head pair selection's slice of that layer, checked
    against the model's kv heads; any other spec as it is."""
    try:
        pairs = spec.pairs.layer(layer, cfg.num_layers)
        heads = pairs.heads(cfg.head_dim)
    except ValueError as e:
        raise ValueError(f"model.rope.{e}") from None
    if heads is None:
        return spec
    if heads.shape[0] != cfg.num_kv_heads:
        raise ValueError(f"model.rope.pairs.index lists {heads.shape[0]} kv heads in layer "
                         f"{layer}; the model has num_kv_heads={cfg.num_kv_heads}")  # fmt: skip
    return dataclasses.replace(spec, pairs=pairs)


def _local(spec: rotary.RopeSpec, base: float, head_dim: int, num_axes: int) -> rotary.RopeSpec:
    """A local layer's spec: `base`, the same pairs (every layer rotates the same numbers),
    no context rule."""
    local = dataclasses.replace(spec, base=float(base), scaling=None)
    _check_spec(local, head_dim, num_axes)
    return local


def _check_every(field: str, value: Any, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        _fail(field, value, f"must be a non-negative integer (0 = off; k > 0: {meaning})")


def _check_length(name: str, value: Any, hint: str = "") -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r} is invalid: must be a positive integer or None{hint}")


def _check_num_axes(num_axes) -> None:
    if isinstance(num_axes, bool) or not isinstance(num_axes, int) or num_axes < 1:
        raise ValueError(
            f"num_axes={num_axes!r} is invalid: must be a positive integer (position axes: "
            "1 text, 2 image, 3 video)"
        )


def kv_cache_bytes_per_token(cfg) -> int:
    """Decoding cache per token: layers x K x H x (2 separate k, v | 1 tied c) x dtype bytes
    (an upper bound with sliding layers, which stop growing at W tokens: `kv_cache_bytes`)."""
    per_head = 1 if cfg.attention.kv == "tied" else 2
    itemsize = jnp.dtype(DTYPES[cfg.dtype]).itemsize  # the cache holds compute-dtype arrays
    return cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * per_head * itemsize


def kv_cache_bytes(cfg, length: int) -> int:
    """Decoding cache of one sequence of `length` tokens: a full layer holds `length`
    slots, a sliding (chunked) one min(W (C), length) (`Attention.init_cache`)."""
    windows = sliding.layer_windows(cfg.attention, cfg.num_layers)
    chunks = sliding.layer_chunks(cfg.attention, cfg.num_layers)
    reaches = [w or c for w, c in zip(windows, chunks, strict=True)]
    slots = sum(length if r is None else sliding.ring_slots(r, length) for r in reaches)
    return kv_cache_bytes_per_token(cfg) // cfg.num_layers * slots


class Block(nnx.Module):
    """Pre-norm decoder block: x = x + attn(norm(x)); x = x + mlp(norm(x))."""

    def __init__(
        self,
        cfg,
        rope: rotary.RopeSpec | None,
        *,
        num_axes: int = 1,
        window: int | None = None,
        chunk: int | None = None,
        rngs: nnx.Rngs,
    ):
        """`rope` None: a NoPE layer (nothing rotated, whatever `cfg.rope.sites` says).
        `num_axes`: the position axes A (the shape of learned frequencies). `window`: W
        of a sliding layer, `chunk`: C of a chunked one, both None for a full one."""
        dtype, param_dtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
        out_scale = 1.0 / math.sqrt(2 * cfg.num_layers)  # residual branches (GPT-2 style)
        norm = dict(eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.attn_norm = RMSNorm(cfg.embed_dim, **norm)
        self.attn = Attention.from_config(cfg, rope, num_axes=num_axes, window=window,
                                          chunk=chunk, out_scale=out_scale, rngs=rngs)  # fmt: skip
        self.mlp_norm = RMSNorm(cfg.embed_dim, **norm)
        self.mlp = MLP(
            cfg.embed_dim,
            cfg.mlp_dim,
            dtype=dtype,
            param_dtype=param_dtype,
            out_scale=out_scale,
            rngs=rngs,
        )

    def __call__(self, x, positions, segments=None):
        x = x + self.attn(self.attn_norm(x), positions, segments=segments)
        x = x + self.mlp(self.mlp_norm(x))
        return sharding.constrain(x, ("batch", "seq", "embed"))

    def decode(self, x, positions, cache: dict, index, seq_len=None) -> tuple[jax.Array, dict]:
        """`__call__` for new tokens against a layer cache (`Attention.decode`)."""
        y, cache = self.attn.decode(self.attn_norm(x), positions, cache, index, seq_len)
        x = x + y
        x = x + self.mlp(self.mlp_norm(x))
        return sharding.constrain(x, ("batch", "seq", "embed")), cache


class Decoder(nnx.Module):
    """Token (and patch) embedding, `num_layers` blocks, final norm, head (untied unless
    `model.tie_embeddings`: then `head` is None and the logits use `embed`).

    `num_axes` is A, the number of position axes of the data (1 text, 2 image, 3 video);
    `train_seq_len` the training length, the default of `model.rope.max_position_embeddings`.
    `cfg` is `config.model`: a resolved (frozen) section as it is, any other (a dict or
    ConfigDict, any subset of the fields) filled from `rope_jax.defaults` and checked.
    """

    def __init__(self, cfg, *, num_axes: int = 1, train_seq_len: int | None = None, rngs: nnx.Rngs):
        if not isinstance(cfg, ml_collections.FrozenConfigDict):  # frozen = resolved: checked
            cfg = check_config(cfg, num_axes, train_seq_len=train_seq_len)
        ropes = layer_rotations(cfg, num_axes, train_seq_len=train_seq_len)  # checked once
        windows = sliding.layer_windows(cfg.attention, cfg.num_layers)
        chunks = sliding.layer_chunks(cfg.attention, cfg.num_layers)
        self.num_axes = num_axes
        self.remat, self.patch_dim = cfg.remat, cfg.patch_dim
        self.dtype, param_dtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
        d, v = cfg.embed_dim, cfg.vocab_size
        self.embed = nnx.Param(
            jax.random.normal(rngs.params(), (v, d), param_dtype),
            out_sharding=("vocab", "embed"),
            eager_sharding=False,
        )
        # Assigned once: an attribute first set to None is static and cannot take a Param.
        self.patch_embed = (
            dense_param(
                rngs,
                (self.patch_dim, d),
                ("patch", "embed"),
                dtype=param_dtype,
                fan_in=self.patch_dim,
            )
            if self.patch_dim
            else None
        )
        self.blocks = nnx.List([
            Block(cfg, rope, num_axes=num_axes, window=window, chunk=chunk, rngs=rngs)
            for rope, window, chunk in zip(ropes, windows, chunks, strict=True)
        ])  # fmt: skip
        self.norm = RMSNorm(d, eps=cfg.norm_eps, dtype=self.dtype, param_dtype=param_dtype)
        self.head = (
            None
            if cfg.tie_embeddings
            else dense_param(rngs, (d, v), ("embed", "vocab"), dtype=param_dtype, fan_in=d)
        )

    def __call__(
        self, tokens, positions=None, *, patches=None, is_patch=None, segments=None
    ) -> jax.Array:
        """Logits of the next token.

        Args:
          tokens: int [B, T] (ignored where is_patch).
          positions: [B, T, A] float/int; None = text positions arange(T) on every axis.
          patches: [B, T, E] visual patch vectors (needs model.patch_dim = E).
          is_patch: bool [B, T], True where the stream holds a patch instead of a token.
          segments: int [B, T] document ids of packed rows: attention stays inside each
            document (positions restarting at every document come with the batch).

        Returns:
          float32 [B, T, V].
        """
        return self._logits(self.hidden(tokens, positions, patches=patches, is_patch=is_patch,
                                        segments=segments))  # fmt: skip

    def hidden(self, tokens, positions=None, *, patches=None, is_patch=None, segments=None):
        """The last block's output [B, T, D] in the compute dtype (arguments as `__call__`):
        `logits_of(hidden(...))` is `__call__`, for a caller that projects a few positions
        at a time onto the vocabulary (a long context's loss, position by position)."""
        b, t = tokens.shape
        if positions is None:
            positions = layouts.text_positions(jnp.zeros((b,)), t, self.num_axes, xp=jnp)
        x = self._embed(tokens, positions, patches, is_patch)
        call = nnx.remat(Block.__call__) if self.remat == "block" else Block.__call__
        for block in self.blocks:
            x = call(block, x, positions, segments)
        return x

    def logits_of(self, x) -> jax.Array:
        """float32 logits [..., V] of hidden states `x` [..., D] (final norm, then head)."""
        return self._logits(x)

    def _embed(self, tokens, positions, patches, is_patch) -> jax.Array:
        """Checks shapes; token (or patch) vectors [B, T, D] in the compute dtype."""
        b, t = tokens.shape
        if positions.shape != (b, t, self.num_axes):
            raise ValueError(
                f"positions have shape {positions.shape}: "
                f"expected [B, T, A]={(b, t, self.num_axes)}"
            )
        table = sharding.constrain(self.embed[...], ("vocab", None))  # gathered over embed
        x = jnp.take(table, tokens, axis=0).astype(self.dtype)  # [B, T, D]
        if patches is not None:
            if self.patch_embed is None:
                raise ValueError("patches were given but model.patch_dim=0 (text only)")
            if is_patch is None or patches.shape != (b, t, self.patch_dim):
                raise ValueError(
                    f"patches {patches.shape} need shape [B, T, E]={(b, t, self.patch_dim)} "
                    "and an is_patch [B, T] mask"
                )
            px = patches.astype(self.dtype) @ self.patch_embed[...].astype(self.dtype)
            x = jnp.where(is_patch[..., None], px, x)
        return sharding.constrain(x, ("batch", "seq", "embed"))

    def _logits(self, x) -> jax.Array:
        x = self.norm(x)
        head = self.embed[...].T if self.head is None else self.head[...]  # [D, V]; tied: E^T
        logits = dense(x, head, dtype=self.dtype, out_dtype=jnp.float32)  # [B, T, V]
        return sharding.constrain(logits, ("batch", "seq", "vocab"))

    # ------------------------------------------------------------ decoding cache

    def init_cache(self, batch_size: int, max_len: int) -> dict:
        """Empty decoding cache for `max_len` tokens: {"index": int32 0, "layers": [...]}.

        Each layer holds its keys/values after rotation (`Attention.init_cache`), a
        sliding (chunked) layer only its W (C) latest: `kv_cache_bytes(cfg, max_len)` per sequence.
        """
        layers = [block.attn.init_cache(batch_size, max_len) for block in self.blocks]
        return {"index": jnp.zeros((), jnp.int32), "layers": layers}

    def decode(
        self,
        tokens,
        positions,
        cache: dict,
        *,
        patches=None,
        is_patch=None,
        seq_len=None,
        last_only: bool = False,
    ) -> tuple[jax.Array, dict]:
        """Logits of T new tokens that follow the cached ones, and the updated cache.

        Prefill with the whole prompt, then call once per generated token (T = 1); the
        logits equal those of one `__call__` over the whole sequence (float tolerance).

        Args:
          tokens: int [B, T].
          positions: [B, T, A] positions of the new tokens (text continues at
            `layouts.next_position`, not at the token count, after visual segments).
          cache: from `init_cache` or a previous `decode`; index + T <= its length.
          patches, is_patch: as in `__call__`.
          seq_len: the static length a length-reading scaling rule (dynamic, longrope)
            reads; default the cache's length, its longest layer's (a full pass over L
            tokens reads L, so a prefill of L tokens with seq_len=L equals it in any
            cache; with sliding layers only, whose rings hold W slots, pass it).

        Returns:
          (float32 [B, T, V], cache with index advanced by T).
        """
        x = self._embed(tokens, positions, patches, is_patch)
        if seq_len is None:  # the longest layer cache: a full layer's length
            seq_len = max(next(iter(c.values())).shape[1] for c in cache["layers"])
        index, layers = cache["index"], []
        for block, layer_cache in zip(self.blocks, cache["layers"], strict=True):
            x, layer_cache = block.decode(x, positions, layer_cache, index, seq_len)
            layers.append(layer_cache)
        x = x[:, -1:] if last_only else x
        return self._logits(x), {"index": index + tokens.shape[1], "layers": layers}


def count_params(model: nnx.Module) -> int:
    """Number of scalar parameters (nnx.Param leaves)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
