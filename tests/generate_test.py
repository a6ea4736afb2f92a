"""Tests for rope_jax.generate and the decoding cache: cached logits == one full pass."""

import itertools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from rope_jax import layouts
from rope_jax.nn import generate
from rope_jax.nn import model as model_lib

# One worker runs the module: its eager passes (17 site sets of one shape) share the ops
# they compile.
pytestmark = pytest.mark.xdist_group("generate")

B, V = 2, 19
ALL_SITES = ["".join(c) for r in range(5) for c in itertools.combinations("qkvo", r)]
# Every separate site set, and the tied cache (which needs sites "qkvo").
VARIANTS = [("separate", s) for s in ALL_SITES] + [("tied", "qkvo")]


def cfg(kv="separate", sites="qk", **extra):
    rope = dict(sites=sites, base=100.0, ladder="standard", layout="half",
                allocation="alternating", sections=())  # fmt: skip
    c = dict(vocab_size=V, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
             head_dim=8, mlp_dim=48, dtype="float32", param_dtype="float32", patch_dim=0,
             attention=dict(kv=kv), rope=rope)  # fmt: skip
    for key, value in extra.items():
        *parents, leaf = key.split(".")
        node = c
        for name in parents:
            node = node[name]
        node[leaf] = value
    return ml_collections.ConfigDict(c)


def tokens(seed, t):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, size=(B, t)), jnp.int32)


def _decode(model, tok, pos, cache, patches=None, is_patch=None):
    return model.decode(tok, pos, cache, patches=patches, is_patch=is_patch)


def cached_logits(model, tok, pos, chunks, *, patches=None, is_patch=None):
    """Logits [B, T, V] fed through the cache in `chunks` (lengths summing to T), and the
    cache's index after them."""
    cache = model.init_cache(B, tok.shape[1] + 3)  # spare slots stay masked
    out, start = [], 0
    for n in chunks:
        part = slice(start, start + n)
        extra = {}
        if patches is not None:
            extra = dict(patches=patches[:, part], is_patch=is_patch[:, part])
        logits, cache = _decode(model, tok[:, part], pos[:, part], cache, **extra)
        out.append(logits)
        start += n
    return jnp.concatenate(out, axis=1), cache["index"]


@nnx.jit(static_argnames="chunks")
def full_and_cached(model, tok, pos, chunks, full_pos=None, patches=None, is_patch=None):
    """(logits of one forward pass at `full_pos` (None: text positions), `cached_logits`)
    from one compiled program: a cold eager pass compiles each op on its own, several
    times slower, where a test's cases share no shapes."""
    full = model(tok, full_pos, patches=patches, is_patch=is_patch)
    return full, *cached_logits(model, tok, pos, chunks, patches=patches, is_patch=is_patch)


def assert_cached_equals_full(full, cached, index):
    """Cached logits equal the full pass's, and the cache's index counts every token."""
    assert int(index) == full.shape[1]
    np.testing.assert_allclose(np.asarray(cached), np.asarray(full), atol=2e-5, rtol=1e-5)


# A prompt of 6, single steps, a chunk of 3 after them (it wraps a ring of 4 slots), steps
CHUNKS = (6, 1, 1, 3, 1, 1)


def assert_decodes_as_it_runs_whole(model, t: int = 13) -> None:
    """`model` fed through its cache in CHUNKS gives the logits of one full pass."""
    tok = tokens(1, t)
    assert_cached_equals_full(*full_and_cached(model, tok, text_pos(t), CHUNKS))


def text_pos(t, num_axes=1):
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.float32)[None, :, None], (B, t, num_axes))


@pytest.mark.slow
@pytest.mark.parametrize("kv,sites", VARIANTS, ids=[f"{k}-{s or 'nope'}" for k, s in VARIANTS])
def test_prefill_then_decode_equals_full_forward(kv, sites):
    model = model_lib.Decoder(cfg(kv, sites), rngs=nnx.Rngs(0))
    tok = tokens(1, 13)
    full = model(tok)  # eager: the cases (and the sliding ones) share shapes: ops compile once
    assert_cached_equals_full(full, *cached_logits(model, tok, text_pos(13), CHUNKS))


@pytest.mark.slow
@pytest.mark.parametrize("kv,sites", [("separate", "qk"), ("separate", "vo"), ("tied", "qkvo")])
def test_cache_layout_and_chunked_prefill(kv, sites):
    """The cache holds rotated k/v (or c) only; a prompt fed in chunks gives the same logits."""
    config = cfg(kv, sites)
    model = model_lib.Decoder(config, num_axes=2, rngs=nnx.Rngs(1))
    tok = tokens(2, 9)
    pos = jnp.asarray(np.random.default_rng(3).uniform(0, 30, (B, 9, 2)), jnp.float32)
    assert_cached_equals_full(*full_and_cached(model, tok, pos, (4, 3, 2), pos))
    cache = model.init_cache(B, 12)
    names = {"tied": ["c"], "separate": ["k", "v"]}[kv]
    assert all(sorted(layer) == names for layer in cache["layers"])
    assert all(a.shape == (B, 12, 2, 8) for layer in cache["layers"] for a in layer.values())
    nbytes = sum(a.nbytes for layer in cache["layers"] for a in layer.values())
    assert nbytes == B * 12 * model_lib.kv_cache_bytes_per_token(config)


def mm_model(kv="separate", sites="qkvo"):
    rope = {"rope.allocation": "sections", "rope.sections": (1, 1, 2)}
    config = cfg(kv, sites, patch_dim=6, **rope)
    return model_lib.Decoder(config, num_axes=3, rngs=nnx.Rngs(4))


def mm_inputs(prompt, generated: int, seed=5):
    """Tokens, patches, is_patch and rope_tv positions of `prompt` + Text(generated)."""
    segments = [*prompt, layouts.Text(generated)]
    t = layouts.num_tokens(segments)
    pos = layouts.positions(segments, "rope_tv", 3)
    is_patch = layouts.modality(segments) != layouts.TEXT
    rng = np.random.default_rng(seed)
    patches = rng.normal(size=(B, t, 6)).astype(np.float32)
    return (tokens(seed, t), jnp.asarray(np.broadcast_to(pos, (B, t, 3))), jnp.asarray(patches),
            jnp.asarray(np.broadcast_to(is_patch, (B, t))))  # fmt: skip


PROMPTS = {  # 11 tokens each: the eager passes of one prompt compile the other's ops too
    "text-image-text": [layouts.Text(3), layouts.Image(2, 3), layouts.Text(2)],
    "text-video": [layouts.Text(3), layouts.Video(2, 2, 2)],  # ends with a patch
}


@pytest.mark.slow
@pytest.mark.parametrize("kv,sites", [("separate", "qkvo"), ("separate", "qk"), ("tied", "qkvo")])
@pytest.mark.parametrize("prompt_id", list(PROMPTS))
def test_multimodal_prompt_then_text_decode(prompt_id, kv, sites):
    """rope_tv on 3 axes, sections allocation: decoded text continues at next_position."""
    prompt = PROMPTS[prompt_id]
    model = mm_model(kv, sites)
    tok, pos, patches, is_patch = mm_inputs(prompt, 4)
    n = layouts.num_tokens(prompt)
    start = layouts.next_position(prompt, "rope_tv", 3)
    np.testing.assert_array_equal(np.asarray(pos[:, n:]), layouts.text_positions([start] * B, 4, 3))
    if prompt_id == "text-video":
        assert start != float(pos[0, n - 1].max()) + 1  # not "last position + 1"
    full = model(tok, pos, patches=patches, is_patch=is_patch)  # eager: cases share shapes
    assert_cached_equals_full(full, *cached_logits(model, tok, pos, [n, 1, 1, 1, 1],
                                                   patches=patches, is_patch=is_patch))  # fmt: skip


@nnx.jit
def _forward(model, tok, pos, patches=None, is_patch=None):
    return model(tok, pos, patches=patches, is_patch=is_patch)


def naive_greedy(model, tok, m, pos, **extra):
    """Greedy decoding by re-running the full model; pos [B, T + m, A] covers every token.

    The sequence is zero-padded to T + m (causal: padding never changes earlier logits),
    so the full pass compiles once.
    """
    t = tok.shape[1]
    tok = jnp.concatenate([tok, jnp.zeros((B, m), jnp.int32)], axis=1)
    extra = {k: jnp.concatenate([v, jnp.zeros_like(v[:, :m])], axis=1) for k, v in extra.items()}
    for i in range(t, t + m):
        logits = _forward(model, tok, pos, **extra)
        tok = tok.at[:, i].set(jnp.argmax(logits[:, i - 1], axis=-1).astype(jnp.int32))
    return tok[:, t:]


@pytest.mark.slow
@pytest.mark.parametrize("kv,sites", [("separate", "qk"), ("separate", "vo"), ("tied", "qkvo")])
def test_greedy_generate_equals_naive_greedy(kv, sites):
    model = model_lib.Decoder(cfg(kv, sites), rngs=nnx.Rngs(6))
    prompt = tokens(7, 5)
    new = generate.generate(model, prompt, max_new_tokens=6)
    assert new.shape == (B, 6) and new.dtype == jnp.int32
    expected = naive_greedy(model, prompt, 6, text_pos(11))
    np.testing.assert_array_equal(np.asarray(new), np.asarray(expected))
    # explicit positions: shifted text positions give the same tokens (relative sites)
    shifted = generate.generate(model, prompt, max_new_tokens=6, positions=text_pos(5) + 40.0)
    np.testing.assert_array_equal(np.asarray(shifted), np.asarray(expected))


@pytest.mark.slow
def test_decoding_in_chunks_changes_no_token_and_a_watch_stops_it_between_them(monkeypatch):
    """`generate` decodes CHUNK tokens per compiled call (progress and signals between
    calls): the tokens do not depend on CHUNK, greedy or sampled."""
    model = model_lib.Decoder(cfg(), rngs=nnx.Rngs(6))
    prompt = tokens(7, 5)
    greedy = generate.generate(model, prompt, max_new_tokens=6)  # one call of 32 steps
    sampled = generate.generate(model, prompt, max_new_tokens=6, temperature=1.0, seed=4)
    monkeypatch.setattr(generate, "CHUNK", 2)
    seen = []

    def watch(items):
        for item in items:
            seen.append(item)
            yield item

    again = generate.generate(model, prompt, max_new_tokens=6, watch=watch)
    assert seen == [0, 1, 2] and generate.chunks(6) == 3  # 1 token, then 5 in calls of 2
    np.testing.assert_array_equal(np.asarray(again), np.asarray(greedy))
    np.testing.assert_array_equal(np.asarray(naive_greedy(model, prompt, 6, text_pos(11))),
                                  np.asarray(greedy))  # fmt: skip
    resampled = generate.generate(model, prompt, max_new_tokens=6, temperature=1.0, seed=4)
    np.testing.assert_array_equal(np.asarray(resampled), np.asarray(sampled))

    def stop_at_the_second(items):
        for item in items:
            if item == 1:
                raise KeyboardInterrupt
            yield item

    with pytest.raises(KeyboardInterrupt):
        generate.generate(model, prompt, max_new_tokens=6, watch=stop_at_the_second)


@pytest.mark.slow
def test_greedy_generate_after_a_visual_prompt_end():
    prompt = PROMPTS["text-video"]
    model = mm_model()
    tok, pos, patches, is_patch = mm_inputs(prompt, 3)
    n = layouts.num_tokens(prompt)
    kw = dict(positions=pos[:, :n], patches=patches[:, :n], is_patch=is_patch[:, :n])
    with pytest.raises(ValueError, match="next_position"):
        generate.generate(model, tok[:, :n], max_new_tokens=3, **kw)
    start = layouts.next_position(prompt, "rope_tv", 3)
    new = generate.generate(model, tok[:, :n], max_new_tokens=3, next_position=start, **kw)

    expected = naive_greedy(model, tok[:, :n], 3, pos, patches=kw["patches"],
                            is_patch=kw["is_patch"])  # fmt: skip
    np.testing.assert_array_equal(np.asarray(new), np.asarray(expected))


@pytest.mark.slow
def test_sampling_is_seeded():
    model = model_lib.Decoder(cfg(), rngs=nnx.Rngs(8))
    prompt = tokens(9, 4)
    kw = dict(max_new_tokens=16, temperature=1.0)
    a = generate.generate(model, prompt, seed=1, **kw)
    b = generate.generate(model, prompt, seed=1, **kw)
    c = generate.generate(model, prompt, seed=2, **kw)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    assert a.shape == (B, 16) and int(a.min()) >= 0 and int(a.max()) < V
    # a tiny temperature is greedy
    cold = generate.generate(model, prompt, max_new_tokens=16, temperature=1e-6, seed=3)
    greedy = generate.generate(model, prompt, max_new_tokens=16)
    np.testing.assert_array_equal(np.asarray(cold), np.asarray(greedy))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(max_new_tokens=2.5), "max_new_tokens=2.5"),
        (dict(max_new_tokens=3, temperature=-1.0), "temperature=-1.0"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    model = model_lib.Decoder(cfg(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=message):
        generate.generate(model, tokens(0, 3), **kwargs)


def test_jax_jit_of_decode_has_one_compile_per_shape():
    """A decoding step is shape-stable: the cache length is fixed at init."""
    model = model_lib.Decoder(cfg(), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    calls = []

    @jax.jit
    def step(state, tok, pos, cache):
        calls.append(1)
        return nnx.merge(graphdef, state).decode(tok, pos, cache)

    cache = model.init_cache(B, 8)
    for k in range(4):
        _, cache = step(state, tokens(k, 1), text_pos(1) + k, cache)
    assert len(calls) == 1 and int(cache["index"]) == 4


@pytest.mark.slow
def test_a_length_reading_rule_decodes_at_the_length_of_the_whole_continuation(monkeypatch):
    """Under `dynamic` (frequencies from the current length) every token of a continuation
    reads prompt + max_new_tokens, as one full pass over it does, whatever CHUNK and the
    cache's spare slots."""
    rule = {"rope.scaling": {"rope_type": "dynamic", "factor": 4.0},
            "rope.max_position_embeddings": 4}  # fmt: skip
    model = model_lib.Decoder(cfg(**rule), rngs=nnx.Rngs(1))  # one whose tokens it changes
    prompt, m = tokens(7, 5), 6
    # a prefill of L tokens with seq_len=L equals the full pass over them in a longer cache
    whole = _forward(model, prompt, text_pos(5))
    spare = model.init_cache(B, 5 + 9)
    np.testing.assert_allclose(model.decode(prompt, text_pos(5), spare, seq_len=5)[0], whole,
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    assert not np.allclose(model.decode(prompt, text_pos(5), spare)[0], whole, atol=1e-3)
    expected = np.asarray(naive_greedy(model, prompt, m, text_pos(5 + m)))  # reads T + m
    np.testing.assert_array_equal(np.asarray(generate.generate(model, prompt, max_new_tokens=m)),
                                  expected)  # fmt: skip
    monkeypatch.setattr(generate, "CHUNK", 2)
    np.testing.assert_array_equal(np.asarray(generate.generate(model, prompt, max_new_tokens=m)),
                                  expected)  # fmt: skip


def _sliding(kv, sites, sinks, seed=0):
    """Layer 0 sliding (a window of 4), layer 1 full; sinks set away from their zero init."""
    config = cfg(kv, sites, **{"attention.window": 4, "attention.sinks": sinks,
                               "attention.layer_types": ("sliding", "full")})  # fmt: skip
    model = model_lib.Decoder(config, rngs=nnx.Rngs(seed))
    for block in model.blocks if sinks else ():
        block.attn.sinks[...] = jnp.linspace(-1.0, 1.5, 4)
    return model


@pytest.mark.parametrize(
    "kv,sites,sinks",
    [pytest.param(*v, marks=pytest.mark.slow)  # the quick loop's ring: v4_test, irope_test
     for v in [("separate", "qk", True), ("separate", "qk", False), ("separate", "vo", True),
               ("tied", "qkvo", True)]],
)  # fmt: skip
def test_sliding_layers_decode_through_a_ring_of_w_slots_equal_to_the_full_forward(
    kv, sites, sinks
):
    """A prompt longer than the window, chunks that wrap the ring, single steps."""
    model = _sliding(kv, sites, sinks)
    tok = tokens(1, 13)
    full = model(tok)  # eager: the shapes of test_prefill_then_decode_equals_full_forward
    shapes = [c[next(iter(c))].shape[1] for c in model.init_cache(B, 16)["layers"]]
    assert shapes == [4, 16]  # the sliding layer holds W slots, the full one every token
    assert_cached_equals_full(full, *cached_logits(model, tok, text_pos(13), CHUNKS))
    for block in model.blocks:  # the window is not a no-op: without it, other logits
        block.attn.window = None
    assert np.abs(np.asarray(model(tok)[:, 5:] - full[:, 5:])).max() > 1e-3


@pytest.mark.slow
def test_greedy_generate_with_sliding_layers_and_sinks_equals_naive_greedy():
    model = _sliding("separate", "qk", True, seed=6)
    prompt = tokens(7, 5)
    new = generate.generate(model, prompt, max_new_tokens=9)
    want = naive_greedy(model, prompt, 9, text_pos(14))
    np.testing.assert_array_equal(np.asarray(new), np.asarray(want))
