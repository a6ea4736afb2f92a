"""The `kernels` stage: every attention impl equal to `xla` in loss and gradients (bf16
and float32) over the rotation-site subsets, the tied key/value cache, packed documents
and decoding through the cache; whether cuDNN's fused attention is in the program."""

from __future__ import annotations

import functools
import itertools
import time

from gpu_common import Context, jax_facts, log

ALL_SITES = ["".join(c) for r in range(5) for c in itertools.combinations("qkvo", r)]
# tolerances of `kernels`: (loss, gradients), relative to the reference's size
TOL = {"float32": (1e-5, 1e-3), "bfloat16": (2e-2, 5e-2)}
# `kernels` compiles: no GEMM autotuning (it checks results, not speed; on the H200 a case
# spent 14-98 s compiling, and the stage reached 7 of 19 cases in its call)
CHECK_COMPILE = {"xla_gpu_autotune_level": 0}


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
    r.update(jax_facts())
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
            log(f"kernels: {key} {time.time() - t0:.1f} s, cuDNN calls {cudnn_calls}, ok {ok}")
        else:
            kv, sites, impl, dtype = args
            err = _decode_error(kv, sites, impl, dtype, ctx.smoke)
            decode[key] = dict(rel_err=err, ok=err <= (1e-4 if dtype == "float32" else 5e-2))
        ctx.save()
    r["done"] = True
