"""Tests for benchmarks/: FLOP formula, table renderer, both measurement sides, profiles."""

import importlib.util
import math
import pathlib
import subprocess
import sys

import pytest

_BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    """benchmarks/NAME.py loaded by path (benchmarks/ is not a package).

    Its modules import each other by bare name, as when run as scripts, so benchmarks/
    goes on sys.path first.
    """
    if str(_BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(_BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, _BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load("train_bench")  # the command line, over the modules below
bench_shapes = _load("bench_shapes")
train_ours = _load("train_ours")
train_peer = _load("train_peer")
train_report = _load("train_report")

# A micro shape: L=1, D=8, N=2, K=1, H=4, F=16, V=5, T=3, B=2.
MICRO = dict(L=1, D=8, N=2, K=1, H=4, F=16, V=5, T=3, B=2)


def test_flops_match_a_hand_count():
    # q 8*2*4=64, k 8*1*4=32, v 32, o 2*4*8=64, SwiGLU 3*8*16=384, head 8*5=40.
    assert bench_shapes.matmul_params(MICRO) == 64 + 32 + 32 + 64 + 384 + 40
    # 6 * 616 * (2*3) + 12 * 1 * 2 * 3^2 * (2*4) = 22176 + 1728
    assert bench_shapes.step_flops(MICRO) == 22176 + 1728
    assert bench_shapes.step_flops(MICRO, batch=4, seq_len=6) == 6 * 616 * 24 + 12 * 4 * 36 * 8
    # causal attention counted as half the square: 6 * 1 * 2 * 3^2 * (2*4) = 864
    assert bench_shapes.step_flops(MICRO, causal=True) == 22176 + 864


@pytest.mark.slow
def test_matmul_params_equal_the_tiny_model_less_embedding_and_norms():
    from configs import lm
    from rope_jax.nn import model

    config = lm.get_config("size=tiny")
    config.model.num_layers = 1  # same per-layer count, a faster build
    s = bench_shapes.shape("tiny")
    s["L"] = 1
    m = config.model
    net = model.Decoder(m, rngs=model.nnx.Rngs(0))
    norms = (2 * m.num_layers + 1) * m.embed_dim
    assert (
        bench_shapes.matmul_params(s)
        == model.count_params(net) - m.vocab_size * m.embed_dim - norms
    )


def test_render_table_and_rejects_ragged_rows():
    text = train_report.render_table(["a", "b"], [[1, "x"], ["2.50", 3]])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| 1 | x |", "| 2.50 | 3 |"]
    with pytest.raises(ValueError, match="2 cells"):
        train_report.render_table(["a"], [[1, 2]])


def test_target_marks():
    assert train_report._mark(1.2, 1.0) == "1.20 (met)"
    assert train_report._mark(0.8, 1.0) == "0.80 (NOT met)"
    assert train_report._mark(1.04, 1.05, higher=False) == "1.04 (met)"
    assert train_report._mark(None, 1.0) == "n/a"


def _micro_config(monkeypatch):
    """Makes `lm.get_config("size=tiny")` a micro model so both sides run in seconds."""
    from configs import common

    micro = dict(num_layers=1, embed_dim=16, num_heads=2, num_kv_heads=1, head_dim=8,
                 mlp_dim=32, seq_len=8, global_batch_size=2)  # fmt: skip
    monkeypatch.setitem(common.SIZES, "tiny", micro)


@pytest.mark.slow
def test_ours_side_returns_positive_numbers(monkeypatch):
    _micro_config(monkeypatch)
    out = train_ours.measure_ours("tiny", ["nope", "qk"], warmup=1, steps=2)
    for name in ("nope", "qk"):
        v = out["variants"][name]
        assert v["step_s"] > 0 and v["tokens_per_s"] > 0 and v["compile_s"] > 0
        assert v["first_loss"] == pytest.approx(v["first_loss"])  # finite
    assert out["rss_mib"] > 0
    row = train_report.summarize("tiny", out, None, out, {"f32_gflops": 100.0, "bf16_gflops": 1.0})
    assert row["ours_tok_s"] > 0 and row["ours_mfu"] > 0 and row["qk_vs_nope"] > 0
    assert row["ours_vs_peer"] is None and row["peer_mfu"] is None


def test_layouts_sequences_have_the_requested_length():
    from rope_jax import layouts

    batch = bench.pipeline_bench.mixed_sequences(4, 300, seed=1)
    assert [layouts.num_tokens(s) for s in batch] == [300] * 4
    kinds = {type(seg).__name__ for s in batch for seg in s}
    assert kinds == {"Text", "Image", "Video"}


@pytest.mark.slow
def test_peer_side_returns_positive_numbers(monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _micro_config(monkeypatch)
    out = train_peer.measure_peer("tiny", warmup=1, steps=2)
    assert out["step_s"] > 0 and out["tokens_per_s"] > 0 and out["rss_mib"] > 0
    assert out["attn"] == "sdpa"
    s = bench_shapes.shape("tiny")
    model = train_peer.peer_model(s)
    total = sum(p.numel() for p in model.parameters())
    norms = (2 * s["L"] + 1) * s["D"]
    assert bench_shapes.matmul_params(s) == total - s["V"] * s["D"] - norms  # same shape as ours


@pytest.mark.slow
def test_compiled_peer_runs_and_matches_the_eager_losses(monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _micro_config(monkeypatch)
    eager = train_peer.measure_peer("tiny", warmup=1, steps=2)
    compiled = train_peer.measure_peer("tiny", warmup=1, steps=2, compile="default")
    assert compiled["compile"] == "default" and eager["compile"] == ""
    assert compiled["step_s"] > 0 and compiled["tokens_per_s"] > 0
    assert compiled["first_step_s"] > compiled["step_s"]  # the first step compiles
    # the same model, seed and batches: the same first loss to float rounding
    assert compiled["first_loss"] == pytest.approx(eager["first_loss"], rel=1e-4)


def test_report_puts_the_compiled_peer_beside_the_eager_one():
    ours = {"variants": {"qk": {"step_s": 0.5, "tokens_per_s": 4096.0}}, "rss_mib": 1.0}
    peer = {"step_s": 0.4, "tokens_per_s": 5120.0, "rss_mib": 1.0}
    compiled = {"step_s": 0.25, "tokens_per_s": 8192.0, "first_step_s": 60.0}
    ceiling = {"f32_gflops": 100.0, "bf16_gflops": 250.0, "n": 8}
    row = train_report.summarize("tiny", ours, peer, None, ceiling, peer_compiled=compiled)
    assert row["ours_vs_peer"] == pytest.approx(0.8)
    assert row["ours_vs_peer_compiled"] == pytest.approx(0.5)
    assert row["ours_mfu_causal"] < row["ours_mfu"]  # the causal count is smaller
    s = bench_shapes.shape("tiny")
    assert row["ours_mfu_causal"] == pytest.approx(
        bench_shapes.step_flops(s, causal=True) / 0.5 / 100e9
    )
    meta = {"command": "c", "date": "d", "machine": "m", "versions": "v", "threads": 2,
            "steps": {"tiny": (1, 2), "small": (1, 2)}, "peer_compile": "default"}  # fmt: skip
    text = train_report.report([row], ceiling, [], None, meta)
    lines = text.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("| size | ours tok/s f32"))
    header, cells = lines[at], lines[at + 2]
    named = dict(zip(header.split(" | "), cells.split(" | "), strict=True))
    assert named["peer compiled tok/s f32"] == "8,192" and named["ours/peer compiled f32"] == "0.50"
    assert "MFU ours causal" in named and "MFU peer full" in named
    assert "torch.compile(mode='default')" in text
    row = train_report.summarize("tiny", ours, peer, None, ceiling)  # no compiled peer
    assert row["ours_vs_peer_compiled"] is None


# The library's performance fixes (results/performance/perf.md) must not change the numbers.


@pytest.mark.slow
def test_swiglu_custom_gradient_equals_autodiff():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rope_jax.nn import layers

    gate_up = jax.random.normal(jax.random.key(0), (3, 5, 2, 7), jnp.float32) * 3
    dh = jax.random.normal(jax.random.key(1), (3, 5, 7), jnp.float32)
    plain = lambda a: jax.nn.silu(a[..., 0, :]) * a[..., 1, :]  # noqa: E731
    np.testing.assert_allclose(layers.swiglu(gate_up), plain(gate_up), rtol=1e-6)
    ours = jax.vjp(layers.swiglu, gate_up)[1](dh)[0]
    ref = jax.vjp(plain, gate_up)[1](dh)[0]
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


def test_attention_with_a_per_head_mask_matches_a_numpy_reference():
    import jax
    import numpy as np

    from rope_jax.nn import attention

    b, t, s, n, kh, h = 2, 3, 5, 4, 2, 8
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=shp).astype(np.float32) for shp in
               ((b, t, n, h), (b, s, kh, h), (b, s, kh, h)))  # fmt: skip
    mask = rng.random((b, n, t, s)) < 0.6
    mask[..., -1] = True
    out = jax.jit(lambda *a: attention.attend(*a, q_positions=None, k_positions=None,
                                              sites="", rope={}, mask=mask))(q, k, v)  # fmt: skip
    kv = np.arange(n) // (n // kh)  # head n reads kv head n // G
    logits = np.einsum("btnh,bsnh->bnts", q, k[:, :, kv]) / np.sqrt(h)
    logits = np.where(mask, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ref = np.einsum("bnts,bsnh->btnh", probs, v[:, :, kv])
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)


# benchmarks/matmul_bench.py: the step's matrix products, one by one.

mm = _load("matmul_bench")


@pytest.mark.parametrize("size", ["tiny", "small", "1b"])
def test_matmul_products_add_up_to_the_step_flops(size):
    flops = sum(p["count"] * 2 * p["batch"] * math.prod(p["mkn"]) for p in mm.products(size))
    assert flops == bench_shapes.step_flops(bench_shapes.shape(size))


def test_matmul_operands_are_stored_as_the_form_says():
    p = dict(batch=1, mkn=(6, 4, 5), ta=True, tb=False)
    assert mm._operands(p) == ((4, 6), (4, 5))
    p = dict(batch=3, mkn=(6, 4, 5), ta=False, tb=True)
    assert mm._operands(p) == ((3, 6, 4), (3, 5, 4))


@pytest.mark.slow
def test_matmul_sides_time_every_product_and_the_report_adds_them(monkeypatch):
    _micro_config(monkeypatch)
    ours = mm.measure_jax("tiny", repeats=1)
    keys = {f"{d}|{p['name']}" for d in mm.DTYPES for p in mm.products("tiny")}
    assert set(ours["times"]) == keys and all(t > 0 for t in ours["times"].values())
    peer = {"times": {k: 2 * t for k, t in ours["times"].items()}, "version": "x"}
    text = mm.report("tiny", ours, peer, "cmd")
    total = sum(p["count"] * ours["times"][f"float32|{p['name']}"] for p in mm.products("tiny"))
    gflop = sum(p["count"] * 2 * p["batch"] * math.prod(p["mkn"]) for p in mm.products("tiny"))
    assert f"| float32 | {gflop / 1e9:.1f} | {1e3 * total:.0f} |" in text
    assert text.count("| 2.00 |") == 2 * len(mm.products("tiny")) + 2  # peer half as fast


# benchmarks/step_profile.py: kernel time per source operation.

sp = _load("step_profile")


def test_dot_flops_of_an_hlo_snippet():
    hlo = """
  %p0 = f32[4,6,5]{2,1,0} parameter(0)
  %p1 = f32[4,5,3]{2,1,0} parameter(1)
  %dot.1 = f32[4,6,3]{2,1,0} dot(%p0, %p1), lhs_batch_dims={0}, lhs_contracting_dims={2}, \
rhs_batch_dims={0}, rhs_contracting_dims={1}
  %e = f32[4,6,3]{2,1,0} exponential(%dot.1)
"""
    assert sp.dot_flops(hlo) == 2 * (4 * 6 * 3) * 5
    assert sp.dot_flops("%e = f32[3]{0} exponential(%x)") == 0


def test_parse_sets():
    from configs import lm

    config = lm.get_config("size=tiny")
    assert sp.parse_sets(["model.rope.sites=qkvo", "train.num_steps=3,optim.lr=0.5"], config) == {
        "model.rope.sites": "qkvo", "train.num_steps": 3, "optim.lr": 0.5}  # fmt: skip
    with pytest.raises(ValueError, match="is not key=value"):
        sp.parse_sets(["model.rope.sites"], config)


@pytest.mark.slow
def test_profile_finds_the_products_of_a_real_step(monkeypatch):
    from configs import lm

    _micro_config(monkeypatch)
    config = lm.get_config("size=tiny")
    step_s, rows, hlo = sp.profile(config, steps=1, warmup=1)
    assert step_s > 0 and rows and all(r["ms"] > 0 for r in rows)
    products = [r for r in rows if r["gflops"]]
    s = bench_shapes.shape("tiny")  # the SwiGLU input product, named by its weight's shape
    assert any(f"dense_{s['D']}x2x{s['F']}" in r["op"] for r in products)
    assert any(r["op"].startswith("transpose(jvp(") for r in products)  # and a backward one
    # Every product of the step is found: their FLOPs add up to the compiled HLO's.
    # (plus the rotation's small cos/sin table product, `rotary._cos_sin_table`).
    found = sum(f for _, f in sp.kernel_table(hlo).values())
    model_flops = bench_shapes.step_flops(bench_shapes.shape("tiny"))
    assert model_flops <= found <= 1.05 * model_flops


@pytest.mark.slow
def test_products_bench_times_every_dense_layer_in_every_form(monkeypatch):
    pb = _load("products_bench")
    _micro_config(monkeypatch)
    rows = pb.measure("tiny", repeats=1)
    assert [r["name"] for r in rows] == ["q", "k, v", "o", "gate+up", "down", "head"]
    assert all(r["seconds"][f] > 0 for r in rows for f in pb.FORMS)
    # M x I x O of the o projection: B*T tokens, two contracted axes N, H into D.
    assert rows[2]["flops"] == 3 * 2 * (2 * 8) * (2 * 8 * 16)
    text = pb.report("tiny", rows, {"f32_gflops": 100.0, "bf16_gflops": 250.0}, "cmd")
    assert "(2.50x)" in text and text.count("\n| ") == 1 + len(rows) + 1  # header, layers, total


@pytest.mark.slow
def test_scale_smoke_trains_saves_restores_and_decodes_a_preset(tmp_path):
    """benchmarks/scale_smoke.py end to end on the tiny preset (the 1b run is its page)."""
    out = tmp_path / "scale.md"
    proc = subprocess.run(
        [sys.executable, str(_BENCHMARKS / "scale_smoke.py"), "--size=tiny",
         "--batch=2", "--seq_len=32", "--steps=2", f"--out={out}", f"--tmp={tmp_path}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = out.read_text()
    assert "restored state bit-identical: True" in page
    for phase in ("init", "compile", "train", "save", "restore", "eval", "decode"):
        assert f"| {phase} | " in page
    assert "decoded 8 tokens" in page


def test_scale_smoke_breaks_each_phases_peak_down_apart():
    """The 1b page's numbers: training's rest is its own peak less the state and the step's
    temporaries (0.82 GiB), never a decoding peak less a training temporary; decoding's
    peak is the state, the bfloat16 weights and a rest the run does not break down."""
    scale_smoke = _load("scale_smoke")
    gib, params = 2**30, 974_206_976 * 4
    m = {"params": params, "opt": 2 * params, "temp": 4.45 * gib,
         "peaks": {"init": 16.24 * gib, "train": 16.16 * gib, "decode": 19.44 * gib}}  # fmt: skip
    rows = dict(line.rsplit(" | ", 1) for line in scale_smoke.breakdown(m)[2:])
    named = {k.strip("| *"): float(v.strip("| *")) for k, v in rows.items()}
    assert named["training: the rest of its peak (runtime, program, host copies)"] == 0.82
    assert named["training peak RSS"] == 16.16 and named["decoding peak RSS"] == 19.44
    assert named["decoding: the weights in bfloat16"] == 1.81  # 974.2M x 2 bytes
    rest = next(v for k, v in named.items() if k.startswith("decoding: the rest"))
    assert rest == pytest.approx(19.44 - 3 * 3.629 - 1.815, abs=0.01)  # 6.74
    assert not any(k.startswith("rest") for k in named)


def test_a_bad_size_or_an_out_that_cannot_be_written_stops_a_benchmark_before_it_measures(
    tmp_path,
):
    """Both were tracebacks; an --out under a file came after the whole measurement."""
    (tmp_path / "file").write_text("")
    for script, flag, message in [
        ("matmul_bench", "--size=bogus",
         "argument --size: 'bogus' is not one of tiny, small, l8, 1b"),
        ("rotary_bench", f"--out={tmp_path}/file/page.md",
         f"argument --out: {tmp_path}/file/page.md: {tmp_path}/file is not a writable directory"),
        ("compile_threads", "--out=x.md", "unrecognized arguments: --out=x.md"),  # it ran anyway
    ]:  # fmt: skip
        proc = subprocess.run([sys.executable, str(_BENCHMARKS / f"{script}.py"), flag],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.strip().splitlines()[-1] == f"{script}.py: error: {message}"
    child = _load("bench_child")
    assert child.page_path(str(tmp_path / "new" / "dir" / "page.md"))  # made when written


def test_step_profile_page_names_the_cpu():
    """A CPU profile (bf16 or float32 step times) names its CPU model: jax calls every
    CPU "cpu", and bf16's speed against float32 differs from one CPU to the next."""
    from rope_jax import provenance

    rows = [{"ms": 2.0, "kernels": 1, "gflops": 10.0, "op": "dot"}]
    text = _load("step_profile").report("tiny", {}, 0.1, rows, 5, "cmd")
    assert f"Device: {provenance.devices()}," in text
    assert f"({provenance.cpu_name()})" in text
