"""The stages of `benchmarks/gpu_suite.py`; each runs in its own child process.

A stage reads and extends `ctx.result` (its OUT/<stage>.json), calls `ctx.save()` after
every finished item, skips items already there, and starts an item only when
`ctx.fits(seconds)` says its estimate ends before the stage's deadline. `done` is set
when every item ran.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import json
import math
import os
import statistics
import subprocess
import time
from collections.abc import Callable

ALL_SITES = ["".join(c) for r in range(5) for c in itertools.combinations("qkvo", r)]

# step1b: tried in this order while time lasts (remat none first: no recomputation)
STEP1B_SETTINGS = (
    dict(impl="dot_product", remat="none", batch=8, microbatches=1),
    dict(impl="dot_product", remat="block", batch=16, microbatches=1),
    dict(impl="chunked", remat="none", batch=8, microbatches=1),
)
# the rung's model (about 25M weights in the blocks) and its batch
RUNG_SHAPE = dict(num_layers=8, embed_dim=512, num_heads=8, num_kv_heads=4, head_dim=64,
                  mlp_dim=1536, seq_len=512, batch=64, lr=1e-3, warmup=100)  # fmt: skip
# tokens each row of the rung trains on (a sample drawn at random from the carried corpus)
RUNG_TOKENS, SMOKE_RUNG_TOKENS = 100_000_000, 20 * 4 * 32
LOGIT_SAMPLES = 100  # largest-attention-logit probes in a rung row (a forward each)
SMOKE_RUNG_SHAPE = dict(num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16,
                        mlp_dim=64, seq_len=32, batch=4, lr=3e-3, warmup=2)  # fmt: skip
# tolerances of `kernels`: (loss, gradients), relative to the reference's size
TOL = {"float32": (1e-5, 1e-3), "bfloat16": (2e-2, 5e-2)}
# `kernels` compiles: no GEMM autotuning (it checks results, not speed; on the H200 a case
# spent 14-98 s compiling, and the stage reached 7 of 19 cases in its call)
CHECK_COMPILE = {"xla_gpu_autotune_level": 0}


@dataclasses.dataclass
class Context:
    out: str
    smoke: bool
    deadline: float
    data: str
    result: dict
    save: Callable[[], None]
    load: Callable[[str], dict]
    rung_tokens: int = 0  # 0: RUNG_TOKENS (SMOKE_RUNG_TOKENS in smoke mode)
    rung_seed: int = 0  # init and data order of the rows run (0: the rung's own)
    rung_rows: tuple = ()  # the rows to run; () for every row
    rung_variant: str = ""  # "" the rung's own setup; else `rung_variant`'s label

    def left(self) -> float:
        return self.deadline - time.time()

    def fits(self, seconds: float) -> bool:
        """Whether an item estimated at `seconds` ends before the deadline; if not, the
        stage records that it stopped for time."""
        if self.left() >= seconds:
            return True
        self.result["stopped_for_time"] = True
        return False


def _log(*parts) -> None:
    print(*parts, flush=True)


def _jax_facts() -> dict:
    """The backend and devices, and the code (the commit of a tree that travelled without
    .git comes from its stamp: `python -m rope_jax.provenance --stamp` before the call)."""
    import jax

    from rope_jax import provenance

    kind = jax.devices()[0].device_kind
    return {"backend": jax.default_backend(), "device": kind, "devices": jax.device_count(),
            "code": provenance.describe(provenance.code_version())}  # fmt: skip


# ------------------------------------------------------------------ check


def _cudnn_version():
    try:
        from jax._src.lib import cuda_versions

        return cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception:  # not a CUDA build
        return None


def _nvidia_smi() -> str | None:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30,
        ).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "torch",
                 "transformers"):  # fmt: skip
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def check(ctx: Context) -> None:
    import jax
    from train_ours import measure_ceiling

    r = ctx.result
    r.update(_jax_facts())
    r["versions"] = _versions()
    r["cudnn"] = _cudnn_version()
    r["nvidia_smi"] = _nvidia_smi()
    r["memory_bytes"] = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    ctx.save()
    r["ceiling"] = measure_ceiling(n=256 if ctx.smoke else None)
    r["done"] = True


# ------------------------------------------------------------------ kernels


def _small_model_config(kv: str, sites: str, impl: str, dtype: str, smoke: bool):
    from configs import lm

    c = lm.get_config("size=tiny").model
    shape = (dict(vocab_size=19, embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8,
                  mlp_dim=48) if smoke else
             dict(vocab_size=512, embed_dim=256, num_heads=4, num_kv_heads=2, head_dim=64,
                  mlp_dim=512))  # fmt: skip
    c.update_from_flattened_dict(
        {
            **shape,
            "num_layers": 2,
            "dtype": dtype,
            "attention.kv": kv,
            "attention.impl": impl,
            "rope.sites": sites,
        }  # fmt: skip
    )
    return c


def _kernel_shape(smoke: bool) -> tuple[int, int]:
    return (2, 12) if smoke else (2, 256)  # B, T


def kernel_impls(backend: str) -> list[str]:
    """The impls compared with xla here: splash only runs on a TPU."""
    from rope_jax.nn import kernels

    return [i for i in kernels.IMPLS if i != "xla" and (i != "splash" or backend == "tpu")]


def _rel_err(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def _compare(outs: dict, impls: list[str], dtypes) -> list[dict]:
    """Each (impl, dtype)'s loss and gradients against (xla, dtype)'s."""
    import jax

    rows = []
    for dtype in dtypes:
        ref_loss, ref_grads = outs[("xla", dtype)]
        ref_leaves = jax.tree.leaves(ref_grads)
        for impl in impls:
            loss, grads = outs[(impl, dtype)]
            loss_err = abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-30)
            grad_err = max(_rel_err(g, r) for g, r in zip(jax.tree.leaves(grads), ref_leaves,
                                                          strict=True))  # fmt: skip
            tol_loss, tol_grad = TOL[dtype]
            ok = loss_err <= tol_loss and grad_err <= tol_grad
            rows.append(dict(impl=impl, dtype=dtype, loss=float(loss), loss_err=loss_err,
                             grad_err=grad_err, ok=ok))  # fmt: skip
    return rows


def _loss_and_grads_all(kv: str, sites: str, impls: list[str], dtypes, smoke: bool, *,
                        segments: bool = False):  # fmt: skip
    """One jitted program with every (impl, dtype)'s loss and gradients of the same
    decoder (same parameters): ({(impl, dtype): (loss, grads)}, cuDNN fused-attention
    calls in the compiled program)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from rope_jax.nn import model as model_lib

    b, t = _kernel_shape(smoke)
    combos = [(i, d) for d in dtypes for i in ("xla", *impls)]
    cfgs = {c: _small_model_config(kv, sites, c[0], c[1], smoke) for c in combos}
    net = model_lib.Decoder(cfgs[combos[0]], train_seq_len=t, rngs=nnx.Rngs(0))
    _, params = nnx.split(net, nnx.Param)
    graphdefs = {
        c: nnx.graphdef(nnx.eval_shape(
            lambda c=c: model_lib.Decoder(cfgs[c], train_seq_len=t, rngs=nnx.Rngs(0))))
        for c in combos
    }  # fmt: skip
    vocab = cfgs[combos[0]].vocab_size
    rng = np.random.default_rng(len(sites) + 10 * (kv == "tied"))
    tok = jnp.asarray(rng.integers(0, vocab, size=(b, t + 1)), jnp.int32)
    call = {}
    if segments:  # three packed documents per row, positions restarting in each
        lengths = [t // 2, t // 4, t - t // 2 - t // 4]
        seg = np.repeat(np.arange(3), lengths)
        pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.float32)
        pos = np.broadcast_to(pos[None, :, None], (b, t, 1))
        seg = np.broadcast_to(seg[None], (b, t))
        call = dict(positions=jnp.asarray(pos), segments=jnp.asarray(seg, jnp.int32))

    def loss_fn(p, gd):
        logits = nnx.merge(gd, p)(tok[:, :-1], call.get("positions"),
                                  segments=call.get("segments"))  # fmt: skip
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tok[:, 1:]).mean()  # fmt: skip

    def everything(p):
        return {c: jax.value_and_grad(lambda q, gd=graphdefs[c]: loss_fn(q, gd))(p)
                for c in combos}  # fmt: skip

    with jax.default_matmul_precision("highest"):  # float32 compared in float32, not TF32
        lowered = jax.jit(everything).lower(params)
        compiled = lowered.compile(compiler_options=CHECK_COMPILE)
    outs = jax.device_get(compiled(params))
    # cuDNN's fused attention is a custom call of that name, before and after compiling
    return outs, max(
        lowered.as_text().count("__cudnn$fmha"), compiled.as_text().count("__cudnn$fmha")
    )


def _decode_error(kv: str, sites: str, impl: str, dtype: str, smoke: bool) -> float:
    """Prefill T - 3 tokens, then 3 single steps through the cache with `impl`, against
    xla's full forward: max |difference| / max |logit|."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rope_jax.nn import model as model_lib

    b, t = _kernel_shape(smoke)
    ref = model_lib.Decoder(_small_model_config(kv, sites, "xla", dtype, smoke),
                            train_seq_len=t, rngs=nnx.Rngs(3))  # fmt: skip
    _, params = nnx.split(ref, nnx.Param)
    cfg = _small_model_config(kv, sites, impl, dtype, smoke)
    gd = nnx.graphdef(nnx.eval_shape(lambda: model_lib.Decoder(cfg, train_seq_len=t,
                                                               rngs=nnx.Rngs(3))))  # fmt: skip
    tok = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.float32)[None, :, None], (b, t, 1))
    with jax.default_matmul_precision("highest"):
        jit = functools.partial(jax.jit, compiler_options=CHECK_COMPILE)
        full = jit(lambda p: nnx.merge(nnx.graphdef(ref), p)(tok))(params)
        step = jit(lambda p, x, q, cache: nnx.merge(gd, p).decode(x, q, cache))
        cache = nnx.merge(gd, params).init_cache(b, t + 2)
        out = []
        for start, stop in [(0, t - 3), (t - 3, t - 2), (t - 2, t - 1), (t - 1, t)]:
            logits, cache = step(params, tok[:, start:stop], pos[:, start:stop], cache)
            out.append(logits)
    return _rel_err(jnp.concatenate(out, axis=1).astype(jnp.float32), full.astype(jnp.float32))


FIRST_SITES = ("qk", "qkvo", "vo", "")  # checked first: the rows most runs use


def kernel_items(impls: list[str], dtypes, smoke: bool) -> list[tuple]:
    """(kind, key, args) of every check, the most used first: loss and gradients of a few
    site subsets, tied, packed documents, decoding, then the other site subsets. Smoke:
    one of each kind."""
    loss = lambda kv, s, seg=False: ("loss", f"{'segments ' if seg else ''}{kv}/{s or 'nope'}",
                                     (kv, s, seg))  # fmt: skip
    first = [loss("separate", s) for s in FIRST_SITES] + [loss("tied", "qkvo")]
    first += [loss("separate", "qkvo", True), loss("tied", "qkvo", True)]
    decode = [("decode", f"{kv}/qkvo {i} {d}", (kv, "qkvo", i, d))
              for kv in ("separate", "tied") for i in ("xla", *impls) for d in dtypes]  # fmt: skip
    rest = [loss("separate", s) for s in ALL_SITES if s not in FIRST_SITES]
    if smoke:
        return [first[0], first[6], decode[-1]]
    return first + decode + rest


def kernels(ctx: Context) -> None:
    import jax

    r = ctx.result
    r.update(_jax_facts())
    impls = kernel_impls(jax.default_backend())
    dtypes = ("float32", "bfloat16")
    r["impls"], r["tolerances"], r["compile_options"] = impls, TOL, CHECK_COMPILE
    cases = r.setdefault("cases", {})
    decode = r.setdefault("decode", {})
    for kind, key, args in kernel_items(impls, dtypes, ctx.smoke):
        if key in (cases if kind == "loss" else decode):
            continue
        if not ctx.fits((3 if ctx.smoke else 12) if kind == "loss" else (2 if ctx.smoke else 6)):
            return
        t0 = time.time()
        if kind == "loss":
            kv, sites, segments = args
            outs, cudnn_calls = _loss_and_grads_all(kv, sites, impls, dtypes, ctx.smoke,
                                                    segments=segments)  # fmt: skip
            cases[key] = dict(rows=_compare(outs, impls, dtypes), cudnn_calls=cudnn_calls,
                              seconds=time.time() - t0)  # fmt: skip
            ok = all(row["ok"] for row in cases[key]["rows"])
            _log(f"kernels: {key} {time.time() - t0:.1f} s, cuDNN calls {cudnn_calls}, ok {ok}")
        else:
            kv, sites, impl, dtype = args
            err = _decode_error(kv, sites, impl, dtype, ctx.smoke)
            decode[key] = dict(rel_err=err, ok=err <= (1e-4 if dtype == "float32" else 5e-2))
        ctx.save()
    r["done"] = True


# ------------------------------------------------------------------ step1b


def _peak(kind: str) -> float | None:
    from rope_jax.harness import cost

    for name, peak in cost.PEAK_BF16.items():
        if name.split()[0] in kind:
            return peak
    return None


def _oom(e: Exception) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def _time_train(config, *, warmup: int, steps: int) -> dict:
    """Builds `config`, compiles its train step, times `steps` steps after `warmup`."""
    import jax
    from bench_shapes import synthetic_batch

    from rope_jax import harness, sharding
    from rope_jax.harness import flops

    run = harness.build(config, vocab_from_data=False)
    b, t = config.data.global_batch_size, config.data.seq_len
    before = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    t0 = time.time()
    with sharding.use_mesh(run.mesh, run.rules):
        state = jax.jit(run.init_fn, out_shardings=run.shardings)()
        batches = [harness.put_batch(synthetic_batch(b, t, s), run.batch_sharding)
                   for s in range(2)]  # fmt: skip
        compiled = run.train_step.lower(state, batches[0]).compile()
        mem = compiled.memory_analysis()
        compile_s = time.time() - t0
        times, losses = [], []
        for i in range(warmup + steps):
            start = time.perf_counter()
            state, m = compiled(state, batches[i % 2])
            losses.append(float(jax.block_until_ready(m)["loss"]))
            if i >= warmup:
                times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    stats = jax.devices()[0].memory_stats() or {}
    del state, batches, compiled
    gc.collect()
    return dict(
        step_s=step_s,
        tokens_per_s=b * t / step_s,
        compile_s=compile_s,
        flops_per_token=flops.flops_per_token(config),
        flops_per_token_causal=flops.flops_per_token(config, causal=True),
        remat_flops_per_token=flops.remat_flops_per_token(config),
        params=flops.num_params(config.model),
        first_loss=losses[0],
        last_loss=losses[-1],
        peak_bytes=stats.get("peak_bytes_in_use"),  # the process's peak so far
        peak_bytes_before=before,  # ... before this setting: equal after = not raised by it
        program_bytes=None if mem is None else dict(
            arguments=mem.argument_size_in_bytes, outputs=mem.output_size_in_bytes,
            temp=mem.temp_size_in_bytes, aliased=mem.alias_size_in_bytes),
    )  # fmt: skip


def step1b(ctx: Context) -> None:
    import jax

    from configs import lm

    r = ctx.result
    r.update(_jax_facts())
    peak = _peak(r["device"])
    ceiling = (ctx.load("check").get("ceiling") or {}).get("bf16_gflops")
    r["peak_flops"], r["ceiling_gflops"] = peak, ceiling
    runs = r.setdefault("settings", {})
    size = "tiny" if ctx.smoke else "1b"
    settings = STEP1B_SETTINGS[:1] if ctx.smoke else STEP1B_SETTINGS
    for s in settings:
        key = f"{s['impl']} remat={s['remat']} B={s['batch']} k={s['microbatches']}"
        if key in runs:
            continue
        if not ctx.fits(15 if ctx.smoke else 90):
            return
        config = lm.get_config(f"size={size}")
        config.update_from_flattened_dict({
            "model.dtype": "bfloat16", "model.attention.impl": s["impl"],
            "model.remat": s["remat"], "data.global_batch_size": 4 if ctx.smoke else s["batch"],
            "train.microbatches": s["microbatches"]})  # fmt: skip
        _log(f"step1b: {key}")
        try:
            m = _time_train(config, warmup=1 if ctx.smoke else 2, steps=2 if ctx.smoke else 5)
        except Exception as e:  # an OOM is a result: this setting does not fit
            if not _oom(e):
                raise
            runs[key] = dict(setting=s, oom=True, error=str(e).splitlines()[0][:300])
            jax.clear_caches()
            gc.collect()
            ctx.save()
            continue
        m["setting"], m["order"], m["size"] = s, len(runs), size  # order: as run, all calls
        m["seq_len"], m["batch"] = config.data.seq_len, config.data.global_batch_size
        if peak:
            m["mfu"] = m["tokens_per_s"] * m["flops_per_token"] / peak
            m["mfu_causal"] = m["tokens_per_s"] * m["flops_per_token_causal"] / peak
        if ceiling:
            m["of_ceiling"] = m["tokens_per_s"] * m["flops_per_token"] / (ceiling * 1e9)
        runs[key] = m
        _log(f"step1b: {key}: {m['tokens_per_s']:,.0f} tok/s, MFU {m.get('mfu')}, "
             f"compile {m['compile_s']:.0f} s")  # fmt: skip
        jax.clear_caches()
        ctx.save()
    r["done"] = True


def best_step1b(result: dict) -> dict | None:
    """The fastest setting step1b ran (no OOM), or None."""
    ran = [m for m in result.get("settings", {}).values() if not m.get("oom")]
    return max(ran, key=lambda m: m["tokens_per_s"]) if ran else None


# ------------------------------------------------------------------ rung


def _rung_data(path: str):
    from gpu_data import load

    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    names = ("train", "validation", "validation_bytes")
    train, val, val_bytes = (load(os.path.join(path, n)) for n in names)
    return meta, train, (val, val_bytes)


def _windows(tokens, starts, t: int, nbytes=None) -> dict:
    """Windows of T + 1 tokens at `starts`: inputs, targets, weights (and the targets'
    UTF-8 bytes when `nbytes` is given, for bits per byte)."""
    import numpy as np

    rows = np.stack([np.asarray(tokens[s : s + t + 1], np.int32) for s in starts])
    out = {"inputs": rows[:, :-1], "targets": rows[:, 1:],
           "weights": np.ones((len(starts), t), np.float32)}  # fmt: skip
    if nbytes is not None:
        out["target_bytes"] = np.stack([np.asarray(nbytes[s + 1 : s + t + 1], np.int32)
                                        for s in starts])  # fmt: skip
    return out


def _random_windows(tokens, rng, b: int, t: int) -> dict:
    """A training batch: B windows of T + 1 tokens at random starts drawn from `rng`."""
    return _windows(tokens, rng.integers(0, len(tokens) - t - 1, b), t)


def rung_variant(spec: str) -> tuple[str, dict]:
    """--rung_variant as (label, config changes): "" the rung's own setup (bfloat16 compute
    at the shape's peak learning rate), or a comma list of `float32` (compute in float32)
    and `lr=X` (peak learning rate X); anything else is a one-line SystemExit."""
    changes, parts = {}, [p.strip() for p in spec.split(",") if p.strip()]
    for part in parts:
        key, eq, value = part.partition("=")
        if part == "float32":
            changes["model.dtype"] = "float32"
            continue
        try:
            lr = float(value) if key == "lr" and eq else None
        except ValueError:
            lr = None
        if lr is None or not lr > 0:
            raise SystemExit(f"gpu_suite: --rung_variant={spec!r}: {part!r} is neither "
                             "'float32' nor 'lr=X' with X > 0")  # fmt: skip
        changes["optim.lr"] = lr
    if len(changes) != len(parts):
        raise SystemExit(f"gpu_suite: --rung_variant={spec!r} names a change twice")
    return ",".join(sorted(parts)), changes


def _rung_config(shape: dict, sites: str, vocab: int, steps: int, impl: str, seed: int = 0,
                 changes: dict | None = None):  # fmt: skip
    from configs import lm

    config = lm.get_config("size=small")
    config.update_from_flattened_dict({"seed": seed,
        "model.num_layers": shape["num_layers"], "model.embed_dim": shape["embed_dim"],
        "model.num_heads": shape["num_heads"], "model.num_kv_heads": shape["num_kv_heads"],
        "model.head_dim": shape["head_dim"], "model.mlp_dim": shape["mlp_dim"],
        "model.vocab_size": vocab, "model.dtype": "bfloat16", "model.rope.sites": sites,
        "model.attention.impl": impl, "data.seq_len": shape["seq_len"],
        "data.global_batch_size": shape["batch"], "train.num_steps": steps,
        "optim.lr": shape["lr"],
        # a short run still reaches the peak learning rate: warm-up <= a tenth of it
        "optim.warmup_steps": min(shape["warmup"], max(steps // 10, 1))})  # fmt: skip
    config.update_from_flattened_dict(changes or {})  # a variant's (`rung_variant`)
    return config


@dataclasses.dataclass
class _Row:
    """One row's built setup and its compiled train and eval programs."""

    config: object
    run: object
    train: object = None
    evals: dict = dataclasses.field(default_factory=dict)  # {length: compiled eval step}
    compile_s: float = 0.0


def eval_lengths(t: int) -> tuple[int, ...]:
    """The held-out lengths of the rung: T, 2T and 4T (extrapolation past training's T)."""
    return (t, 2 * t, 4 * t)


def _batch_specs(sharding, rows: int, length: int, *, nbytes: bool = False) -> dict:
    """The abstract batch of `_windows` (rows x length), placed with `sharding`."""
    import jax
    import numpy as np

    names = ("inputs", "targets", "weights") + (("target_bytes",) if nbytes else ())
    return {k: jax.ShapeDtypeStruct((rows, length), np.float32 if k == "weights" else np.int32,
                                    sharding=sharding) for k in names}  # fmt: skip


def _compile_rows(configs: dict) -> dict:
    """{row: _Row}: every row's train program and its eval programs at `eval_lengths` (each
    eval batch holds B x T tokens), traced here one after another and compiled in
    parallel threads (XLA compiles outside Python's lock; on 2 CPU cores that makes no
    reliable difference, `benchmarks/compile_threads.py`; the rung records the wall time
    of its compiles on the GPU host)."""
    import concurrent.futures

    from rope_jax import harness, sharding

    rows, lowered = {}, {}
    for name, config in configs.items():
        run = harness.build(config, vocab_from_data=False)
        b, t = config.data.global_batch_size, config.data.seq_len
        with sharding.use_mesh(run.mesh, run.rules):
            specs = _batch_specs(run.batch_sharding, b, t)
            lowered[name] = {"train": run.train_step.lower(run.abstract, specs)}
            for length in eval_lengths(t):
                specs = _batch_specs(run.batch_sharding, b * t // length, length, nbytes=True)
                lowered[name][length] = run.eval_step.lower(run.abstract["params"], specs)
        rows[name] = _Row(config, run)

    def compile_one(name):
        t0 = time.time()
        return name, {k: low.compile() for k, low in lowered[name].items()}, time.time() - t0

    workers = max(1, min(len(configs), os.cpu_count() or 1))
    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            compiled = list(pool.map(compile_one, list(configs)))
    except Exception as e:  # a compiler that will not share its process: one at a time
        _log(f"rung: compiling in threads failed ({type(e).__name__}: {str(e)[:200]}); "
             "compiling one row at a time")  # fmt: skip
        compiled = [compile_one(name) for name in configs]
    for name, programs, seconds in compiled:
        rows[name].train = programs.pop("train")
        rows[name].evals, rows[name].compile_s = programs, seconds
    return rows


def _step_time(row: _Row, train, *, steps: int) -> float:
    """Median seconds of one compiled step of `row` (a throw-away state)."""
    import jax
    import numpy as np

    from rope_jax import harness, sharding

    run, b, t = row.run, row.config.data.global_batch_size, row.config.data.seq_len
    rng = np.random.default_rng(1)
    with sharding.use_mesh(run.mesh, run.rules):
        state = jax.jit(run.init_fn, out_shardings=run.shardings)()
        times = []
        for i in range(steps + 1):
            batch = harness.put_batch(_random_windows(train, rng, b, t), run.batch_sharding)
            start = time.perf_counter()
            state, m = row.train(state, batch)
            jax.block_until_ready(m)
            if i:  # the first call also allocates
                times.append(time.perf_counter() - start)
    del state
    return statistics.median(times)


def _held_out(row: _Row, params, val, *, windows: int) -> dict:
    """{length: (loss, bits per byte)} on validation windows spread evenly over the
    carried validation tokens: `windows` of T tokens, and at 2T and 4T as many tokens in
    windows of that length."""
    import numpy as np

    from rope_jax import harness

    val_tokens, val_bytes = val
    b, t = row.config.data.global_batch_size, row.config.data.seq_len
    out = {}
    for length, program in row.evals.items():
        n, per = windows * t // length, b * t // length
        starts = np.linspace(0, len(val_tokens) - length - 1, n).astype(np.int64)
        sums = np.zeros(3)
        for j in range(0, n, per):
            batch = _windows(val_tokens, starts[j : j + per], length, val_bytes)
            m = program(params, harness.put_batch(batch, row.run.batch_sharding))
            sums += [float(m["loss_sum"]), float(m["weight_sum"]), float(m["byte_sum"])]
        out[str(length)] = (sums[0] / sums[1], sums[0] / sums[2] / math.log(2))
    return out


def _train_windows_loss(row: _Row, params, train, *, windows: int) -> float:
    """Loss of `params` on `windows` training windows of T tokens spread evenly over the
    carried training tokens, through the same compiled evaluation program as the held-out
    windows at T: against the held-out loss it separates poor generalisation from a fault
    of the evaluation path (bytes are not carried for the training tokens: loss only)."""
    import numpy as np

    from rope_jax import harness

    b, t = row.config.data.global_batch_size, row.config.data.seq_len
    n = max(b, windows // b * b)  # whole batches of the compiled program's B rows
    starts = np.linspace(0, len(train) - t - 1, n).astype(np.int64)
    total = weight = 0.0
    for j in range(0, n, b):
        batch = _windows(train, starts[j : j + b], t)
        batch["target_bytes"] = np.ones_like(batch["targets"])  # the program's field, unused
        m = row.evals[t](params, harness.put_batch(batch, row.run.batch_sharding))
        total, weight = total + float(m["loss_sum"]), weight + float(m["weight_sum"])
    return total / weight


def _train_row(row: _Row, train, val, *, seed: int, eval_windows: int) -> dict:
    """Trains one row from scratch on random windows (data order fixed by `seed`, the
    same for every row), then its held-out loss at T, 2T and 4T, and its loss on
    training windows through the same evaluation program; every step's loss and
    gradient norm are kept (fetched once at the end: no step waits on the host), and
    each layer's largest attention logit (`nn.probe`) on the step's batch before the
    step, LOGIT_SAMPLES times in a run: [[step, [per layer]], ...]."""
    import jax
    import numpy as np
    from flax import nnx

    from rope_jax import harness, sharding
    from rope_jax.nn import probe

    run, config = row.run, row.config
    b, t, steps = config.data.global_batch_size, config.data.seq_len, config.train.num_steps
    rng = np.random.default_rng(seed)
    probe_every = max(steps // LOGIT_SAMPLES, 1)
    logits_of = jax.jit(lambda params, tokens: probe.max_attention_logits(
        nnx.merge(run.graphdef, params), tokens))  # fmt: skip
    with sharding.use_mesh(run.mesh, run.rules):
        state = jax.jit(run.init_fn, out_shardings=run.shardings)()
        metrics, logits = [], []
        t1 = time.time()
        for i in range(steps):
            batch = _random_windows(train, rng, b, t)
            if i % probe_every == 0:  # before the step donates the state
                logits.append(logits_of(state["params"], batch["inputs"]))
            state, m = row.train(state, harness.put_batch(batch, run.batch_sharding))
            metrics.append((m["loss"], m["grad_norm"]))
        jax.block_until_ready(state)
        train_s = time.time() - t1
        every = np.asarray(jax.device_get(metrics), np.float64).reshape(-1, 2)  # [steps, 2]
        held = _held_out(row, state["params"], val, windows=eval_windows)
        on_train = _train_windows_loss(row, state["params"], train, windows=eval_windows)
    loss, bpb = held[str(t)]
    curve = [[i, float(every[i, 0])] for i in range(steps) if i % 200 == 0 or i == steps - 1]
    return dict(loss=loss, bits_per_byte=bpb, loss_at={k: v[0] for k, v in held.items()},
                bits_per_byte_at={k: v[1] for k, v in held.items()}, train_curve=curve,
                step_loss=[float(x) for x in every[:, 0]],
                step_grad_norm=[float(x) for x in every[:, 1]],
                max_logit=[[i * probe_every, [float(x) for x in layers]]
                           for i, layers in enumerate(jax.device_get(logits))],
                train_windows_loss=on_train, compile_s=row.compile_s, train_s=train_s,
                tokens=steps * b * t)  # fmt: skip


def rung_steps(tokens: int, shape: dict, smoke: bool) -> int:
    """Steps of each row: `tokens` per row (RUNG_TOKENS by default) in whole batches."""
    b, t = shape["batch"], shape["seq_len"]
    return max(int(tokens or (SMOKE_RUNG_TOKENS if smoke else RUNG_TOKENS)) // (b * t), 1)


def rung_problem(result: dict, out: str, data: str, tokens: int, smoke: bool) -> str | None:
    """Why the rung cannot run as asked (one line), or None: no corpus at `data`, or rows
    already in OUT/rung.json at another length, on another corpus or of another model
    shape (a rung's rows compare only when these are the same)."""
    if not os.path.isfile(os.path.join(data, "meta.json")):
        return (f"gpu_suite: --data={data} holds no travelling corpus (meta.json): make it "
                "with `python benchmarks/gpu_data.py --dataset=DIR/NAME` and carry it, or leave "
                "rung out of --stage")  # fmt: skip
    if not result.get("rows"):
        return None
    shape = SMOKE_RUNG_SHAPE if smoke else RUNG_SHAPE
    steps = rung_steps(tokens, shape, smoke)
    if result.get("steps") != steps:
        return (f"gpu_suite: {out}/rung.json has rows of {result['steps']} steps "
                f"({result['tokens_per_run']:,} tokens); this run asks {steps}: use the same "
                "--rung_tokens or another --out")  # fmt: skip
    with open(os.path.join(data, "meta.json")) as f:
        meta = json.load(f)
    old = result.get("data") or {}
    if any(old.get(k) != meta.get(k) for k in ("dataset", "vocab_size", "train_tokens", "slices")):
        return (f"gpu_suite: {out}/rung.json has rows trained on {old.get('dataset')} "
                f"({_count(old.get('train_tokens'))} tokens carried); --data={data} holds "
                f"{meta.get('dataset')} ({_count(meta.get('train_tokens'))}): carry the same "
                "corpus or use another --out")  # fmt: skip
    if result.get("shape", shape) != shape:
        return (f"gpu_suite: {out}/rung.json has rows of another model shape "
                f"({result['shape']}); use another --out")  # fmt: skip
    return None


def rung_rows(smoke: bool, spec: tuple = ()) -> tuple:
    """The rows a rung call runs: `spec` (--rung_rows), or every row of the site ablation
    (two in smoke mode)."""
    from configs import lm

    return tuple(spec) or (("nope", "qkvo") if smoke else tuple(lm.ROWS))


def seed_rows(result: dict, seed: int, *, add: bool = False, variant: str = "") -> dict:
    """{row: metrics} of `seed` in rung.json: seed 0's under "rows" (the rung's table),
    another seed's under "more_seeds" (its measure of the seed noise), a variant's
    (`rung_variant`'s label) under "variants" -> label -> seed; with `add`, the dict kept
    in `result` (made if absent)."""
    path = ("more_seeds", str(seed)) if seed else ("rows",)
    for key in ("variants", variant, str(seed)) if variant else path:
        result = result.setdefault(key, {}) if add else result.get(key, {})
    return result


def rung_todo(result: dict, smoke: bool, seed: int = 0, spec: tuple = (),
              variant: str = "") -> list[str]:  # fmt: skip
    """The rows of this call not yet finished in rung.json."""
    done = seed_rows(result, seed, variant=variant)
    return [row for row in rung_rows(smoke, spec) if row not in done]


def _count(n) -> str:
    return "?" if n is None else f"{n:,}"


def rung(ctx: Context) -> None:
    import jax

    from configs import lm
    from rope_jax.harness import flops

    r = ctx.result
    r.update(_jax_facts())
    meta, train, val = _rung_data(ctx.data)
    shape = SMOKE_RUNG_SHAPE if ctx.smoke else RUNG_SHAPE
    impl = "dot_product" if jax.default_backend() == "gpu" else "xla"
    b, t = shape["batch"], shape["seq_len"]
    eval_windows = 2 * b if ctx.smoke else 8 * b
    steps = rung_steps(ctx.rung_tokens, shape, ctx.smoke)
    problem = rung_problem(r, ctx.out, ctx.data, ctx.rung_tokens, ctx.smoke)
    if problem:  # the parent checks first; this is for a child started by hand
        raise SystemExit(problem)
    config = _rung_config(shape, "qk", meta["vocab_size"], steps, impl)
    r.update(data=meta, shape=shape, impl=impl, eval_windows=eval_windows, steps=steps,
             tokens_per_run=steps * b * t, params=flops.num_params(config.model),
             block_params=flops.block_matmul_params(config.model))  # fmt: skip
    seed, (variant, changes) = ctx.rung_seed, rung_variant(ctx.rung_variant)
    todo = rung_todo(r, ctx.smoke, seed, ctx.rung_rows, variant)
    if not todo:
        r["done"] = not rung_todo(r, ctx.smoke)  # seed 0's table is whole
        return
    done = seed_rows(r, seed, add=True, variant=variant)
    if not ctx.fits(60 if not ctx.smoke else 5):  # the compiles alone need about this
        return
    also = (f", seed {seed}" if seed else "") + (f", variant {variant}" if variant else "")
    _log(f"rung: compiling {len(todo)} rows, {steps} steps each ({steps * b * t:,} tokens){also}")
    t0 = time.time()
    programs = _compile_rows({row: _rung_config(shape, lm.ROWS[row], meta["vocab_size"], steps,
                                                impl, seed, changes) for row in todo})  # fmt: skip
    step_s = _step_time(programs[todo[0]], train, steps=3 if ctx.smoke else 10)
    r["timing"] = dict(compile_wall_s=time.time() - t0, step_s=step_s, device=r["device"])
    ctx.save()
    _log(f"rung: compiled in {time.time() - t0:.1f} s; a step {step_s * 1e3:.1f} ms")
    eval_s = len(eval_lengths(t)) * eval_windows / b * step_s
    row_s = 1.05 * steps * step_s + eval_s + 5  # what a row is allowed (`fits` below)
    fit = min(len(todo), max(int(ctx.left() // row_s), 0))
    _log(f"rung: a row about {row_s:.0f} s; {len(todo)} rows to go, {fit} fit in this call"
         + ("" if fit == len(todo) else "; the rest go on in the next (the same --out, or "
            "--resume_from the folder this call's files are kept in)"))  # fmt: skip
    for row in todo:
        if not ctx.fits(row_s):
            return
        done[row] = _train_row(programs[row], train, val, seed=seed, eval_windows=eval_windows)
        m = done[row]
        m["device"] = r["device"]  # a rung may span calls (and machines of one kind)
        if variant:
            m["variant_changes"] = changes
        _log(f"rung: {row}{f' seed {seed}' if seed else ''}{f' ({variant})' if variant else ''}"
             f": held-out loss {m['loss']:.4f}, "
             f"{m['bits_per_byte']:.4f} bits/byte, {m['train_s']:.0f} s")  # fmt: skip
        ctx.save()
    r["done"] = not rung_todo(r, ctx.smoke)


# ------------------------------------------------------------------ peer


def peer(ctx: Context) -> None:
    """Ours at `small` in bf16 here (JAX), then the peer (torch) at small and at the 1b
    body with step1b's batch; both sides on the same synthetic batches."""
    import jax
    from bench_child import torch_available
    from train_ours import measure_ours
    from train_peer import measure_peer

    r = ctx.result
    r.update(_jax_facts())
    if not torch_available():
        r["skipped"] = "torch or transformers is not installed"
        r["done"] = True
        return
    warm, steps = (1, 2) if ctx.smoke else (3, 8)
    size = "tiny" if ctx.smoke else "small"
    if "ours_small" not in r and ctx.fits(10 if ctx.smoke else 40):
        r["ours_small"] = measure_ours(size, ["bf16"], warmup=warm, steps=steps)["variants"]["bf16"]
        ctx.save()
    jax.clear_caches()
    if "peer_small" not in r and ctx.fits(10 if ctx.smoke else 30):
        r["peer_small"] = measure_peer(size, warmup=warm, steps=steps, dtype="bfloat16")
        ctx.save()
    best = best_step1b(ctx.load("step1b"))
    if best is None:
        r["peer_1b"] = None
        r["note_1b"] = "step1b has no setting that ran: no batch to compare at"
    elif "peer_1b" not in r and ctx.fits(10 if ctx.smoke else 60):
        s = best["setting"]
        r["ours_1b"] = dict(tokens_per_s=best["tokens_per_s"], setting=s, batch=best["batch"])
        try:
            r["peer_1b"] = measure_peer("tiny" if ctx.smoke else "1b", warmup=warm, steps=4,
                                        dtype="bfloat16", batch=best["batch"],
                                        remat=s["remat"] == "block")  # fmt: skip
        except Exception as e:
            if not _oom(e):
                raise
            r["peer_1b"] = dict(oom=True, error=str(e).splitlines()[0][:300])
        ctx.save()
    r["done"] = all(k in r for k in ("ours_small", "peer_small", "peer_1b"))


STAGES = {"check": check, "kernels": kernels, "step1b": step1b, "rung": rung, "peer": peer}
