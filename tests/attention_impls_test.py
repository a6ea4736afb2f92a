"""The attention kernels inside the model: every `model.attention.impl` equals `xla`.

Rotations stay outside the kernel, so for every rotation site subset (and the tied
key/value cache) the decoder's loss and gradients must not depend on the kernel;
decoding through the cache and packed documents (segment ids) too.
"""

import itertools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from rope_jax.nn import attention, kernels
from rope_jax.nn import model as model_lib

# One worker runs the module: the ops its tests run eagerly (building the same decoders)
# compile once.
pytestmark = pytest.mark.xdist_group("attention_impls")

B, T, V = 2, 12, 19
ALL_SITES = ["".join(c) for r in range(5) for c in itertools.combinations("qkvo", r)]
VARIANTS = [("separate", s) for s in ALL_SITES] + [("tied", "qkvo")]
IMPLS = [i for i in kernels.IMPLS if i not in ("xla", "splash")]
TOL = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=3e-2, rtol=3e-2)}


def cfg(kv="separate", sites="qk", impl="xla", dtype="float32", **attention):
    rope = dict(sites=sites, base=100.0, ladder="standard", layout="half",
                allocation="alternating", sections=())  # fmt: skip
    return ml_collections.ConfigDict(
        dict(
            vocab_size=V,
            num_layers=2,
            embed_dim=32,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            mlp_dim=48,
            dtype=dtype,
            param_dtype="float32",
            patch_dim=0,
            attention=dict(kv=kv, impl=impl, **attention),
            rope=rope,
        )  # fmt: skip
    )


def tokens(seed, t=T):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, size=(B, t)), jnp.int32)


def decoder_runs(config_of, tok, *, grads=True, prepare=lambda model: model, **call):
    """{impl: (loss, parameter gradients)} for xla and every impl of IMPLS: each impl's
    next-token loss on `tok` of a fresh (seeded) decoder, `config_of(impl)`, made ready by
    `prepare`. One jitted program holds every impl's value_and_grad (each on its own
    parameters, side by side), so the impls compile once together; `grads=False`: the
    losses alone (gradients None)."""
    models = {impl: nnx.split(prepare(model_lib.Decoder(config_of(impl), rngs=nnx.Rngs(0))),
                              nnx.Param) for impl in ("xla", *IMPLS)}  # fmt: skip

    def run(params):
        out = {}
        for impl, (graphdef, _) in models.items():

            def loss_fn(p, graphdef=graphdef):
                logits = nnx.merge(graphdef, p)(tok[:, :-1], **call)
                return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

            out[impl] = jax.value_and_grad(loss_fn)(params[impl]) if grads else (
                loss_fn(params[impl]), None)  # fmt: skip
        return out

    out = jax.jit(run)({impl: params for impl, (_, params) in models.items()})
    return {impl: (float(loss), g) for impl, (loss, g) in out.items()}


def attention_loss(q, k, v, qpos, kpos, *, kv, sites, impl, dtype):
    """A scalar of the attention output (random weights), for loss-and-gradient checks."""
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    kw = dict(q_positions=qpos, k_positions=kpos, rope={"base": 100.0}, causal=True, impl=impl)
    if kv == "tied":
        o = attention.attend_tied(q, k, **kw)
    else:
        o = attention.attend(q, k, v, sites=sites, **kw)
    weights = jnp.linspace(-1.0, 1.0, o.size).reshape(o.shape)
    return jnp.sum(o.astype(jnp.float32) * weights)


@pytest.mark.parametrize(
    "kv,sites,dtype",
    [("separate", "vo", "float32")]  # the quick loop's case; all in the full suite
    + [pytest.param(k, s, d, id=f"{k}-{s or 'nope'}-{d}", marks=pytest.mark.slow)
       for k, s in VARIANTS for d in ("float32", "bfloat16")],
)  # fmt: skip
def test_loss_and_gradients_equal_xla_for_every_site_subset(kv, sites, dtype):
    """Rotations stay outside the kernel: any site set gives xla's loss and gradients."""
    rng = np.random.default_rng(len(sites) + 10 * (kv == "tied"))
    q = jnp.asarray(rng.normal(size=(B, T, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, T, 2, 8)), jnp.float32) for _ in range(2))
    pos = jnp.asarray(rng.uniform(0, 30, size=(B, T)), jnp.float32)
    loss = lambda impl: lambda q, k, v: attention_loss(q, k, v, pos, pos, kv=kv, sites=sites,
                                                       impl=impl, dtype=dtype)  # fmt: skip

    def losses_and_grads(q, k, v):  # one program, each impl side by side: one compile
        return {impl: jax.value_and_grad(loss(impl), argnums=(0, 1, 2))(q, k, v)
                for impl in ("xla", *IMPLS)}  # fmt: skip

    results = jax.jit(losses_and_grads)(q, k, v)
    ref_loss, ref_grads = results["xla"]
    tol = TOL[dtype]
    for impl in IMPLS:  # every kernel against the one reference
        loss, grads = results[impl]
        np.testing.assert_allclose(float(loss), float(ref_loss), **tol, err_msg=impl)
        for name, g, r in zip("qkv", grads, ref_grads, strict=True):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                       **tol, err_msg=f"{impl} d{name}")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kv,sites", [("separate", "qkvo"), ("tied", "qkvo")])
def test_decoder_loss_and_gradients_equal_xla(kv, sites):
    runs = decoder_runs(lambda impl: cfg(kv, sites, impl), tokens(1, T + 1))
    ref_loss, ref_grads = runs["xla"]
    for impl in IMPLS:
        loss, grads = runs[impl]
        np.testing.assert_allclose(loss, ref_loss, **TOL["float32"], err_msg=impl)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=5e-5, rtol=1e-4,
                                       err_msg=impl)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("sites", ["qk", "vo"])
def test_bfloat16_compute_stays_close_to_xla(sites):
    runs = decoder_runs(lambda impl: cfg(sites=sites, impl=impl, dtype="bfloat16"),
                        tokens(2, T + 1), grads=False)  # fmt: skip
    for impl in IMPLS:
        np.testing.assert_allclose(runs[impl][0], runs["xla"][0], **TOL["bfloat16"], err_msg=impl)


@nnx.jit
def full_and_decoded(model, tok):
    """(logits of one forward pass over `tok` [B, T], the same logits decoded through a
    cache of T + 2 slots: a prompt of 7, two single steps, then the last 3 tokens), from
    one compiled program (one compile instead of one per shape of an eager pass)."""
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32)[None, :, None], (B, T, 1))
    cache, out = model.init_cache(B, T + 2), []
    for start, stop in [(0, 7), (7, 8), (8, 9), (9, T)]:  # a prompt, then single steps
        logits, cache = model.decode(tok[:, start:stop], pos[:, start:stop], cache)
        out.append(logits)
    return model(tok), jnp.concatenate(out, axis=1)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kv,sites", [("separate", "qk"), ("separate", "qkvo"), ("tied", "qkvo")])
def test_prefill_then_decode_equals_the_full_forward(kv, sites, impl):
    model = model_lib.Decoder(cfg(kv, sites, impl), rngs=nnx.Rngs(3))
    full, decoded = full_and_decoded(model, tokens(4))
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full), atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "impl,kv,sites",
    [(i, k, s) for i in ("xla", *IMPLS)
     for k, s in [("separate", "qk"), ("separate", "vo"), ("tied", "qkvo")]],
)  # fmt: skip
@pytest.mark.slow
def test_packed_documents_equal_the_documents_run_separately(kv, sites, impl):
    """Segment ids keep attention inside each document; positions restart at 0 in each."""
    model = model_lib.Decoder(cfg(kv, sites, impl), rngs=nnx.Rngs(5))
    lengths = [5, 4, 3]  # three documents packed into one row of T = 12
    tok = tokens(6)[:1]
    segments = jnp.asarray(np.repeat(np.arange(3), lengths)[None], jnp.int32)
    restart = np.concatenate([np.arange(n) for n in lengths]).astype(np.float32)
    pos = jnp.asarray(restart[None, :, None])
    starts = np.cumsum([0, *lengths[:-1]])
    # each document alone in a row of its own, zero-padded to the longest (causal: padding
    # at the end never changes the logits before it)
    docs = jnp.stack([jnp.pad(tok[0, a : a + n], (0, max(lengths) - n))
                      for a, n in zip(starts, lengths, strict=True)])  # fmt: skip

    @nnx.jit  # the packed row and the documents alone: one compile
    def packed_and_alone(model):
        return model(tok, pos, segments=segments), model(docs)

    packed, alone = packed_and_alone(model)
    for i, (a, n) in enumerate(zip(starts, lengths, strict=True)):
        np.testing.assert_allclose(np.asarray(packed[0, a : a + n]), np.asarray(alone[i, :n]),
                                   atol=3e-5, rtol=1e-5, err_msg=f"document at {a}")  # fmt: skip


def test_unknown_or_unavailable_impl_is_one_clear_line():
    with pytest.raises(ValueError, match=r"model\.attention\.impl='flash'.*'chunked'"):
        model_lib.check_config(cfg(impl="flash"))
    if jax.default_backend() != "tpu":
        with pytest.raises(ValueError, match=r"model\.attention\.impl='splash' needs a TPU"):
            model_lib.check_config(cfg(impl="splash"))


# Sinks (gpt-oss) and sliding windows (Mistral) inside the model: layer 0 sliding with a
# window of 5 (T = 12: keys fall out of it), layer 1 full, a sink logit per head
SLIDING = dict(sinks=True, window=5, layer_types=("sliding", "full"))


def _with_sinks(model, values=(-1.0, 0.5, 1.5, 0.0)):
    for block in model.blocks:
        block.attn.sinks[...] = jnp.asarray(values)
    return model


@pytest.mark.parametrize(
    "kv,sites,dtype",
    [("separate", "qk", "float32")]
    + [pytest.param(k, s, d, marks=pytest.mark.slow)
       for k, s, d in [("separate", "vo", "float32"), ("tied", "qkvo", "float32"),
                       ("separate", "qk", "bfloat16"), ("tied", "qkvo", "bfloat16")]],
)  # fmt: skip
def test_sinks_and_windows_equal_xla_in_loss_gradients_and_packed_documents(kv, sites, dtype):
    """Every impl against xla: the decoder's loss and every gradient (the sinks' too) on
    packed documents (segment ids, positions restarting) with a sliding layer."""
    tok = tokens(8, T + 1)
    segments = jnp.asarray(np.repeat(np.arange(2), [7, 5])[None].repeat(B, 0), jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(7), np.arange(5)])[None, :, None]
                      .repeat(B, 0), jnp.float32)  # fmt: skip

    runs = decoder_runs(lambda impl: cfg(kv, sites, impl, dtype, **SLIDING), tok,
                        prepare=_with_sinks, positions=pos, segments=segments)  # fmt: skip
    runs = {impl: (loss, nnx.to_flat_state(grads)) for impl, (loss, grads) in runs.items()}
    ref_loss, ref_grads = runs["xla"]
    sink_grads = [v for path, v in ref_grads if path[-1] == "sinks"]
    assert len(sink_grads) == 2 and all(np.abs(g.get_value()).max() > 0 for g in sink_grads)
    tol = TOL[dtype] if dtype == "bfloat16" else dict(atol=5e-5, rtol=1e-4)
    for impl in IMPLS:
        loss, grads = runs[impl]
        np.testing.assert_allclose(loss, ref_loss, **TOL[dtype], err_msg=impl)
        for (path, g), (_, r) in zip(grads, ref_grads, strict=True):
            np.testing.assert_allclose(np.asarray(g.get_value(), np.float32),
                                       np.asarray(r.get_value(), np.float32), **tol,
                                       err_msg=f"{impl} {'/'.join(map(str, path))}")  # fmt: skip


@pytest.mark.slow  # the quick loop decodes windows in generate_test, sinks in v4_test
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kv,sites", [("separate", "qk"), ("tied", "qkvo")])
def test_sliding_layers_with_sinks_decode_equal_to_the_full_forward(kv, sites, impl):
    """Each impl: prefill past the window, then single steps through the ring."""
    model = _with_sinks(model_lib.Decoder(cfg(kv, sites, impl, **SLIDING), rngs=nnx.Rngs(3)))
    full, decoded = full_and_decoded(model, tokens(4))
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full), atol=3e-5, rtol=1e-5)
