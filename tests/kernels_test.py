"""Tests for rope_jax.nn.kernels: every impl's output and gradients against the xla reference."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_jax.nn import kernels

B, H = 2, 8
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}  # atol = rtol


class Case(NamedTuple):
    name: str
    t: int
    s: int
    n: int = 4  # query heads
    kv: int = 2  # kv heads (GQA unless n == kv)
    causal: bool = False
    offset: int | None = 0  # q_offset (None: S - T)
    traced: bool = False  # pass q_offset as a traced int32 under jit
    segments: bool = False
    mask: str | None = None  # "batch": [B, 1, T, S]; "heads": [1, N, T, S]
    block: int = 4  # chunked block size: T and S are not multiples of it
    sinks: bool = False  # one learned sink logit per query head
    window: int | None = None  # sliding window W (causal cases only)
    chunk: int | None = None  # chunk C (causal cases only): keys of the query's own chunk


CASES = [
    Case("gqa", t=13, s=11),  # not causal, T != S
    Case("mha-causal", t=13, s=13, n=2, kv=2, causal=True, block=8),
    Case("gqa-causal", t=13, s=13, causal=True),
    Case("decode-static-mha", t=1, s=16, n=2, kv=2, causal=True, offset=15),
    Case("decode-traced", t=1, s=16, causal=True, offset=7, traced=True),
    Case("chunk-static", t=3, s=16, causal=True, offset=5),
    Case("chunk-traced", t=3, s=16, causal=True, offset=9, traced=True),
    Case("offset-none", t=5, s=16, causal=True, offset=None),  # old semantics: S - T
    Case("offset-negative", t=6, s=4, causal=True, offset=None),  # S - T < 0: empty rows
    Case("segments-mask-heads", t=7, s=9, segments=True, mask="heads"),
    Case("segments-causal-mha", t=12, s=12, n=2, kv=2, causal=True, segments=True),
    Case("mask-batch-causal", t=10, s=10, causal=True, mask="batch"),
    Case("everything", t=3, s=16, causal=True, offset=6, traced=True, segments=True, mask="batch"),
    # sinks (gpt-oss) and sliding windows (Mistral): alone, together, with segments and
    # decoding offsets; windows of 1, of a few blocks, and wider than every row's reach
    Case("sinks", t=13, s=11, sinks=True),
    Case("sinks-causal-segments", t=12, s=12, causal=True, segments=True, sinks=True),
    Case("sinks-empty-rows", t=6, s=4, causal=True, offset=None, sinks=True),
    Case("window", t=21, s=21, causal=True, window=6),
    Case("window-1", t=9, s=9, n=2, kv=2, causal=True, window=1),
    Case("window-wide", t=9, s=9, causal=True, window=64),
    Case("window-segments", t=16, s=16, causal=True, segments=True, window=5),
    Case("window-decode", t=1, s=16, causal=True, offset=11, traced=True, window=4),
    Case("window-chunk", t=5, s=16, causal=True, offset=7, window=6, block=2),
    Case("window-sinks-mask", t=14, s=14, causal=True, mask="heads", sinks=True, window=5),
    Case(
        "window-sinks-everything",
        t=6,
        s=20,
        causal=True,
        offset=9,
        traced=True,
        segments=True,
        mask="batch",
        sinks=True,
        window=7,
    ),  # fmt: skip
    # chunks (Llama 4): training, decoding offsets, with segments, sinks and a window
    Case("chunk", t=21, s=21, causal=True, chunk=5),
    Case("chunk-1", t=9, s=9, n=2, kv=2, causal=True, chunk=1),
    Case("chunk-decode", t=1, s=16, causal=True, offset=11, traced=True, chunk=4),
    Case("chunk-prefill-offset", t=7, s=16, causal=True, offset=6, block=2, chunk=3),
    Case(
        "chunk-sinks-segments-mask",
        t=14,
        s=14,
        causal=True,
        segments=True,
        mask="heads",
        sinks=True,
        chunk=4,
    ),
    Case("chunk-window", t=16, s=16, causal=True, window=3, chunk=6),
]
CASE = {c.name: c for c in CASES}
BF16_CASES = ("gqa", "mha-causal", "decode-traced", "everything", "sinks-causal-segments",
              "window-segments", "window-sinks-everything",
              "chunk-sinks-segments-mask")  # fmt: skip
GRID = [(c, "float32") for c in CASES] + [(CASE[name], "bfloat16") for name in BF16_CASES]
QUICK = {
    ("gqa-causal", "float32"),
    ("everything", "float32"),
    ("window-sinks-everything", "float32"),
    ("chunk-sinks-segments-mask", "float32"),
}  # the rest: full suite only


def group(case: Case, dtype: str):
    """The xdist group of a case: its tests run on one worker, which compiles its
    impls (`run_all`) once for all of them."""
    return pytest.mark.xdist_group(f"kernels-{case.name}-{dtype}")


GRID_PARAMS = [
    pytest.param(c, d, id=f"{c.name}-{d}",
                 marks=(group(c, d),) + (() if (c.name, d) in QUICK else (pytest.mark.slow,)))
    for c, d in GRID
]  # fmt: skip


def make_segments(case: Case):
    """kv ids in thirds 0 | 1 | 2; each query takes its own position's id, except two rows
    with no key at all: batch 0 row 1 takes id 2, whose keys are all in its future (empty
    when causal), batch 1's last row an id no key has."""
    kv = np.broadcast_to(np.arange(case.s) * 3 // case.s, (B, case.s))
    pos = np.clip(np.arange(case.t) + (case.offset or 0), 0, case.s - 1)
    q = kv[:, pos].copy()
    q[0, min(1, case.t - 1)] = 2
    q[1, -1] = 5
    return jnp.asarray(q, jnp.int32), jnp.asarray(kv, jnp.int32)


def make_mask(case: Case, rng):
    shape = (B, 1) if case.mask == "batch" else (1, case.n)
    mask = rng.random((*shape, case.t, case.s)) < 0.7
    mask[0, :, min(2, case.t - 1)] = False  # a row with no key
    return jnp.asarray(mask)


@functools.cache
def inputs(case: Case, dtype: str):
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q = normal(B, case.t, case.n, H).astype(dtype)
    k = normal(B, case.s, case.kv, H).astype(dtype)
    v = normal(B, case.s, case.kv, H).astype(dtype)
    w = normal(B, case.t, case.n, H)  # loss = sum(out * w)
    segments = make_segments(case) if case.segments else (None, None)
    mask = make_mask(case, rng) if case.mask else None
    sinks = jnp.asarray(rng.normal(size=case.n), jnp.float32) if case.sinks else None
    return q, k, v, w, segments, mask, sinks


def mix_fn(case: Case, impl: str, block: int | None = None):
    """(q, k, v, q_offset, sinks) -> out; q_offset is used only if the case traces it."""
    q, k, v, w, (q_seg, kv_seg), mask, _ = inputs(case, "float32")

    def fn(q, k, v, offset, sinks=None):
        return kernels.mix(
            q,
            k,
            v,
            impl=impl,
            causal=case.causal,
            q_offset=offset if case.traced else case.offset,
            q_segments=q_seg,
            kv_segments=kv_seg,
            mask=mask,
            block_size=block or case.block,
            sinks=sinks,
            window=case.window,
            chunk=case.chunk,
        )

    return fn


def loss_fn(case: Case, impl: str):
    w = inputs(case, "float32")[3]
    fn = mix_fn(case, impl)

    def loss(q, k, v, offset, sinks=None):
        out = fn(q, k, v, offset, sinks)
        return jnp.sum(out * w), out

    return loss


LOCAL_IMPLS = ("xla", "dot_product", "chunked")  # every impl but splash (TPU only)
_RUNS = {}  # (case, impl, dtype) -> (out, grads), from `run` or `run_all`


def _run_jitted(case: Case, impls, dtype: str):
    """{impl: (out, (dq, dk, dv[, dsinks]))} as float32 numpy: one jitted program holding
    a value_and_grad of each impl (each its own, side by side: nothing is shared)."""
    q, k, v, *_, sinks = inputs(case, dtype)
    argnums = (0, 1, 2, 4) if case.sinks else (0, 1, 2)

    def grads(*args):
        return {impl: jax.value_and_grad(loss_fn(case, impl), argnums=argnums, has_aux=True)(
            *args) for impl in impls}  # fmt: skip

    results = {}
    for impl, ((_, out), g) in jax.jit(grads)(q, k, v, jnp.int32(case.offset or 0), sinks).items():
        assert out.dtype == jnp.float32, impl
        assert [x.dtype for x in g[:3]] == [q.dtype] * 3, impl
        result = (np.asarray(out), [np.asarray(x, np.float32) for x in g])
        results[impl] = _RUNS[case, impl, dtype] = result
    return results


def run(case: Case, impl: str, dtype: str):
    """(out, (dq, dk, dv[, dsinks])) as float32 numpy, from a jitted value_and_grad (or
    from `run_all`, if this worker already ran the case)."""
    if (case, impl, dtype) not in _RUNS:
        _run_jitted(case, (impl,), dtype)
    return _RUNS[case, impl, dtype]


@functools.cache
def run_all(case: Case, dtype: str):
    """`run` of every local impl, compiled together once per case (one compile for the
    three instead of three: a case's tests share an xdist group, so one worker)."""
    return _run_jitted(case, LOCAL_IMPLS, dtype)


def empty_rows(case: Case) -> np.ndarray:
    """[B, T, N] bool: query rows with no allowed key, computed in numpy."""
    t, s = np.arange(case.t)[:, None], np.arange(case.s)[None, :]
    keep = np.ones((B, case.n, case.t, case.s), bool)
    if case.causal:
        keep &= s <= t + (case.s - case.t if case.offset is None else case.offset)
    _, _, _, _, (q_seg, kv_seg), mask, _ = inputs(case, "float32")
    if case.segments:
        keep &= (np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :])[:, None]
    if case.mask:
        keep &= np.asarray(mask)
    return ~keep.any(-1).transpose(0, 2, 1)


@pytest.mark.parametrize("impl", ["dot_product", "chunked", "splash"])
@pytest.mark.parametrize("case, dtype", GRID_PARAMS)
def test_matches_xla(case, dtype, impl):
    if impl == "splash" and jax.default_backend() != "tpu":
        pytest.skip(f"splash attention needs a TPU; this backend is {jax.default_backend()}")
    results = run_all(case, dtype)
    out, grads = run(case, impl, dtype) if impl == "splash" else results[impl]
    ref_out, ref_grads = results["xla"]
    assert out.shape == (B, case.t, case.n, H)
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(out, ref_out, atol=tol, rtol=tol, err_msg="out")
    for name, g, ref in zip(["q", "k", "v", "sinks"], grads, ref_grads, strict=False):
        assert np.isfinite(g).all(), f"d{name} has NaN/inf"
        np.testing.assert_allclose(g, ref, atol=tol, rtol=tol, err_msg=f"d{name}")
    assert len(grads) == 3 + case.sinks


@pytest.mark.parametrize("impl", LOCAL_IMPLS)
@pytest.mark.parametrize(
    "case",
    [pytest.param(CASE[name], marks=group(CASE[name], "float32"))  # test_matches_xla's runs
     for name in ("offset-negative", "segments-causal-mha", "everything", "sinks-empty-rows",
                  "window-sinks-everything")],
)  # fmt: skip
def test_rows_with_no_key_are_zero(case, impl):
    empty = empty_rows(case)
    assert empty.any() and not empty.all()  # the case has both kinds of rows
    out, grads = run(case, impl, "float32")
    assert np.isfinite(out).all() and all(np.isfinite(g).all() for g in grads)
    assert (out[empty] == 0).all()
    assert (np.abs(out[~empty]).sum(-1) > 0).all()
    dq = grads[0].reshape(B, case.t, case.n, H)
    assert (dq[empty] == 0).all()  # nothing flows back through an empty row


@pytest.mark.parametrize("q_offset", [6, None])
def test_xla_matches_plain_softmax(q_offset):
    """The reference itself, against an explicit numpy softmax (GQA, causal + offset).

    q_offset None means S - T = 13: the queries are the last 3 of the 16 keys.
    """
    q, k, v, *_ = inputs(Case("plain", t=3, s=16), "float32")
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    kn, vn = np.repeat(kn, 2, axis=2), np.repeat(vn, 2, axis=2)  # head n -> kv head n // 2
    x = np.einsum("btnh,bsnh->bnts", qn, kn) / np.sqrt(H)
    offset = 13 if q_offset is None else q_offset
    x = np.where(np.arange(16)[None, :] <= np.arange(3)[:, None] + offset, x, -np.inf)
    p = np.exp(x - x.max(-1, keepdims=True))
    want = np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), vn)
    got = kernels.mix(q, k, v, causal=True, q_offset=q_offset)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_sinks_and_window_match_hf_eager_attention():
    """xla against HF's eager gpt-oss attention in numpy: a sink column joins the masked
    scores [.., S], softmax, the column dropped; the sliding window keeps t - W < s <= t."""
    case = Case("hf", t=9, s=9, causal=True, sinks=True, window=3)
    q, k, v, *_, sinks = inputs(case, "float32")
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    kn, vn = np.repeat(kn, 2, axis=2), np.repeat(vn, 2, axis=2)
    x = np.einsum("btnh,bsnh->bnts", qn, kn) / np.sqrt(H)
    t, s = np.arange(9)[:, None], np.arange(9)[None, :]
    x = np.where((s <= t) & (s > t - 3), x, -np.inf)
    column = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (B, 4, 9, 1))
    combined = np.concatenate([x, column], axis=-1)
    p = np.exp(combined - combined.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True))[..., :-1]
    want = np.einsum("bnts,bsnh->btnh", p, vn)
    ours = lambda q, k, v, z: kernels.mix(q, k, v, causal=True, sinks=z, window=3)
    plain = lambda q, k, v: kernels.mix(q, k, v, causal=True, window=3)

    def concatenated(q, k, v, z):  # the same in jnp, differentiated automatically
        kr, vr = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        x = jnp.einsum("btnh,bsnh->bnts", q, kr) / np.sqrt(H)
        x = jnp.where((s <= t) & (s > t - 3), x, -jnp.inf)
        column = jnp.broadcast_to(z[None, :, None, None], (B, 4, 9, 1))
        p = jax.nn.softmax(jnp.concatenate([x, column], axis=-1), axis=-1)[..., :-1]
        return jnp.einsum("bnts,bsnh->btnh", p, vr)

    w = inputs(case, "float32")[3]

    @jax.jit  # one compiled program (eager jax.grad compiles each op on its own)
    def outputs_and_grads(q, k, v, z):
        grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * w), argnums=(0, 1, 2, 3))(q, k, v, z)
                 for f in (ours, concatenated)]  # fmt: skip
        return ours(q, k, v, z), plain(q, k, v), grads

    got, without_sinks, grads = outputs_and_grads(q, k, v, sinks)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.abs(np.asarray(without_sinks) - want).max() > 1e-2  # the sink changes the output
    for name, got, ref in zip(["q", "k", "v", "sinks"], *grads, strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


@pytest.mark.slow  # eager jax.grad dispatches op by op: ~3 s alone, more on a busy machine
@group(CASE["gqa-causal"], "float32")  # its xla reference is test_matches_xla's
def test_chunked_eager_jit_and_grad():
    """Chunked outside jit, under jax.jit, and under jax.grad: all equal xla.

    (jax.jit(jax.value_and_grad(...)) is what every case of test_matches_xla runs.)
    """
    case = CASE["gqa-causal"]
    q, k, v, *_ = inputs(case, "float32")
    want_out, want_grads = run(case, "xla", "float32")
    loss = lambda q, k, v: loss_fn(case, "chunked")(q, k, v, 0)[0]
    for g, ref in zip(jax.grad(loss, argnums=(0, 1, 2))(q, k, v), want_grads, strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-5, rtol=1e-5)
    fn = mix_fn(case, "chunked")
    for out in (fn(q, k, v, 0), jax.jit(fn)(q, k, v, 0)):
        np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)


@pytest.mark.xdist_group("kernels-block-sizes")  # one worker computes the reference once
@pytest.mark.parametrize("block", [1, 5, 64])
def test_chunked_block_sizes(block):
    """One key per block, an odd block, and a block longer than T and S (forward)."""
    case = CASE["everything"]._replace(t=7, s=11, offset=2)
    q, k, v, *_ = inputs(case, "float32")
    want = run(case, "xla", "float32")[0]
    got = jax.jit(mix_fn(case, "chunked", block))(q, k, v, 2)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_chunked_memory_is_blockwise():
    """Causal forward + backward at T = S = 4096: chunked temp << T * S * 4 bytes < xla's."""
    t = 4096
    x = jax.ShapeDtypeStruct((1, t, 1, 32), jnp.float32)

    def temp_bytes(impl):
        loss = lambda q, k, v: jnp.sum(kernels.mix(q, k, v, impl=impl, causal=True))
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    scores = t * t * 4
    assert temp_bytes("chunked") < scores / 4
    assert temp_bytes("xla") > scores


def test_dot_product_avoids_dense_masks(monkeypatch):
    """is_causal for offset 0, key lengths for one decoded token, a mask only for segments."""
    calls = []
    real = jax.nn.dot_product_attention

    def spy(*args, **kw):
        calls.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(kernels.jax.nn, "dot_product_attention", spy)
    seg = CASE["segments-causal-mha"]
    q, k, v, *_ = inputs(seg, "float32")
    mix = lambda q, **kw: jax.eval_shape(  # tracing is enough to see the call
        lambda q, o: kernels.mix(q, k, v, impl="dot_product", causal=True, q_offset=o, **kw),
        q,
        jnp.int32(3),
    )
    kernels.mix(q, k, v, impl="dot_product", causal=True)  # q_offset=0
    assert calls[-1]["mask"] is None and calls[-1]["is_causal"]
    assert calls[-1]["implementation"] == "xla"  # CPU
    mix(q[:, :1])  # one token, traced q_offset
    assert calls[-1]["mask"] is None and calls[-1]["key_value_seq_lengths"] is not None
    q_seg, kv_seg = inputs(seg, "float32")[4]
    mix(q, q_segments=q_seg, kv_segments=kv_seg)
    assert calls[-1]["mask"].shape == (B, 1, seg.t, seg.s) and not calls[-1]["is_causal"]


def test_dot_product_backend_choice(monkeypatch):
    """cuDNN only on a CUDA GPU for fp16/bf16 and head dims it takes; XLA for float32."""
    from rope_jax.nn.kernels.dot_product import _dot_product_backend as choose

    assert choose(jnp.bfloat16, 64, 8, 8, dense_mask=False) == "xla"  # this CPU

    class Device:
        compute_capability = "9.0"

    monkeypatch.setattr(kernels.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(kernels.jax, "devices", lambda: [Device()])
    assert choose(jnp.bfloat16, 64, 8, 8, dense_mask=False) == "cudnn"
    assert choose(jnp.float16, 256, 7, 8, dense_mask=False) == "cudnn"
    assert choose(jnp.float32, 64, 8, 8, dense_mask=False) == "xla"
    assert choose(jnp.bfloat16, 12, 8, 8, dense_mask=False) == "xla"
    assert choose(jnp.bfloat16, 64, 7, 8, dense_mask=True) == "xla"  # bias needs even T, S
    Device.compute_capability = "8.0"
    assert choose(jnp.bfloat16, 256, 8, 8, dense_mask=False) == "xla"  # H <= 128 before Hopper


def test_splash_needs_a_tpu():
    q, k, v, *_ = inputs(CASES[0], "float32")
    with pytest.raises(ValueError, match="needs a TPU.*'chunked'"):
        kernels.mix(q, k, v, impl="splash")


def test_unknown_impl():
    q, k, v, *_ = inputs(CASES[0], "float32")
    with pytest.raises(ValueError, match="'xla', 'dot_product', 'chunked', 'splash'"):
        kernels.mix(q, k, v, impl="flash")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(q_segments=jnp.zeros((B, 13), jnp.int32)), "both or neither"),
        (
            dict(q_segments=jnp.zeros((B, 12), int), kv_segments=jnp.zeros((B, 13), int)),
            r"\[B, T\]",
        ),
        (dict(mask=jnp.ones((13, 13), bool)), r"\[B or 1, 1 or N, T, S\]"),
        (dict(mask=jnp.ones((1, 1, 13, 12), bool)), "T, S"),
        (dict(causal=True, q_offset=jnp.zeros(2, jnp.int32)), "int scalar"),
        (dict(causal=True, window=0), r"window=0 must be a positive int"),
        (dict(causal=True, window=2.5), r"window=2.5 must be a positive int"),
        (dict(window=4), r"window=4 needs causal=True"),
        (dict(sinks=jnp.zeros(3)), r"sinks must be a float array \[N\] = \(4,\)"),
        (dict(sinks=jnp.zeros(4, jnp.int32)), r"sinks must be a float array"),
    ],
)
def test_bad_arguments(kwargs, match):
    q, k, v, *_ = inputs(CASES[0], "float32")
    with pytest.raises(ValueError, match=match):
        kernels.mix(q, k, v, **kwargs)
