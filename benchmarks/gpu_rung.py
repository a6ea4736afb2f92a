"""The `rung` stage: the nine-row rotation-site ablation on a travelling corpus
(`benchmarks/gpu_data.py` packs it; `rope_jax.data.carried` reads it as a run's data),
trained and scored through train.py's own path: each row is a config that
`harness.build` builds (its train and eval steps), its batches come from the harness's
training iterator (`harness.train_iterator`: shuffled windows of the carried training
tokens, seeded by the row's seed, so every row sees the same data order) and its
scores from the harness's evaluation (`harness.evals`' `loss` task on the validation
split at T, 2T and 4T, and on the training split at T).

What a GPU call adds around that path: every row's programs lowered from the harness's
steps and compiled ahead of time in parallel threads (`compile_rows`), a time budget
(`ctx.fits`), each row saved as it finishes, resume (`rung_todo`), other seeds and
variants beside the table (`seed_rows`), and diagnostics: every step's loss and
gradient norm, each layer's largest attention logit (`nn.probe`) sampled through the
run, and the loss on training windows.

Rows made here carry `"path": "harness"`. Rows without it were made by the stage's
earlier code, which drew its own random windows and scored its own held-out loop; a
rung.json holding such rows takes no row of this code (`rung_problem`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import statistics
import time

from gpu_common import Context, jax_facts, log

PATH = "harness"  # the `path` of every row this module makes
# the rung's model (about 25M weights in the blocks) and its batch
RUNG_SHAPE = dict(num_layers=8, embed_dim=512, num_heads=8, num_kv_heads=4, head_dim=64,
                  mlp_dim=1536, seq_len=512, batch=64, lr=1e-3, warmup=100)  # fmt: skip
# tokens each row of the rung trains on (whole batches of the carried training tokens)
RUNG_TOKENS, SMOKE_RUNG_TOKENS = 100_000_000, 20 * 4 * 32
LOGIT_SAMPLES = 100  # largest-attention-logit probes in a rung row (a forward each)
SMOKE_RUNG_SHAPE = dict(num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16,
                        mlp_dim=64, seq_len=32, batch=4, lr=3e-3, warmup=2)  # fmt: skip
# evaluation batches of B windows at each length (`eval.num_batches` of the loss task)
EVAL_BATCHES, SMOKE_EVAL_BATCHES = 8, 2


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


def rung_config(shape: dict, sites: str, vocab: int, steps: int, impl: str, *, data: str = "",
                seed: int = 0, changes: dict | None = None,
                eval_batches: int = EVAL_BATCHES):  # fmt: skip
    """The config of one row: the `small` preset at `shape`, rotation `sites`, trained
    `steps` steps on the carried corpus at `data` ("" keeps the preset's data: enough to
    compile), init and data order from `seed`, evaluated on `eval_batches` batches of B
    windows spread over the split; a variant's `changes` last."""
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
        "optim.warmup_steps": min(shape["warmup"], max(steps // 10, 1)),
        "eval.batch_size": shape["batch"], "eval.num_batches": eval_batches,
        "eval.sample": "spread"})  # fmt: skip
    if data:
        config.data.name, config.data.data_dir = os.path.abspath(data), ""
    config.update_from_flattened_dict(changes or {})  # a variant's (`rung_variant`)
    return config


@dataclasses.dataclass
class Row:
    """One row: its resolved config and its built harness `Setup`, whose train and eval
    steps are, once `compile_rows` ran, the programs it compiled from them."""

    config: object
    run: object
    compile_s: float = 0.0


def eval_lengths(t: int) -> tuple[int, ...]:
    """The held-out lengths of the rung: T, 2T and 4T (extrapolation past training's T)."""
    return (t, 2 * t, 4 * t)


def _abstract_batches(run, config) -> dict:
    """{"train": a training batch, length: an evaluation batch at each `eval_lengths`}, as
    the harness's iterators make them (`harness.abstract_batch`; evaluation adds
    `target_bytes`)."""
    import numpy as np

    from rope_jax import data, harness

    b, t, e = config.data.global_batch_size, config.data.seq_len, config.eval.batch_size
    out = {"train": harness.abstract_batch(b, t, run.batch_sharding,
                                           data.kind(config.data).batch_fields())}  # fmt: skip
    for n in eval_lengths(t):
        out[n] = harness.abstract_batch(e, n, run.batch_sharding,
                                        {"target_bytes": ((n,), np.int32)})  # fmt: skip
    return out


def with_programs(run, programs: dict):
    """The harness `Setup` `run` with its jitted steps replaced by compiled ones: the train
    program, and an eval step running the program compiled for the batch's length."""
    evals = {n: p for n, p in programs.items() if n != "train"}
    return run._replace(train_step=programs["train"],
                        eval_step=lambda params, batch: evals[batch["inputs"].shape[1]](
                            params, batch))  # fmt: skip


def compile_rows(configs: dict) -> dict:
    """{row: Row}: every row built by `harness.build`, its train step and its eval step at
    each of `eval_lengths` lowered here one after another and compiled in parallel
    threads (XLA compiles outside Python's lock; on 2 CPU cores that makes no reliable
    difference, `benchmarks/compile_threads.py`; the rung records the wall time of its
    compiles on the GPU host)."""
    from rope_jax import harness, sharding

    rows, lowered = {}, {}
    for name, config in configs.items():
        config = harness.resolve(config)
        run = harness.build(config, vocab_from_data=False)
        with sharding.use_mesh(run.mesh, run.rules):
            lowered[name] = {
                k: run.train_step.lower(run.abstract, spec) if k == "train"
                else run.eval_step.lower(run.abstract["params"], spec)
                for k, spec in _abstract_batches(run, config).items()
            }  # fmt: skip
        rows[name] = Row(config, run)

    def compile_one(name):
        t0 = time.time()
        return name, {k: low.compile() for k, low in lowered[name].items()}, time.time() - t0

    workers = max(1, min(len(configs), os.cpu_count() or 1))
    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            compiled = list(pool.map(compile_one, list(configs)))
    except Exception as e:  # a compiler that will not share its process: one at a time
        log(f"rung: compiling in threads failed ({type(e).__name__}: {str(e)[:200]}); "
            "compiling one row at a time")  # fmt: skip
        compiled = [compile_one(name) for name in configs]
    for name, programs, seconds in compiled:
        rows[name].run = with_programs(rows[name].run, programs)
        rows[name].compile_s = seconds
    return rows


def _step_time(row: Row, *, steps: int) -> float:
    """Median seconds of one compiled step of `row` (a throw-away state, the row's own
    first batches)."""
    import jax

    from rope_jax import harness, sharding

    run = row.run
    batches = harness.Prefetch(harness.train_iterator(row.config), run.batch_sharding)
    try:
        with sharding.use_mesh(run.mesh, run.rules):
            state = jax.jit(run.init_fn, out_shardings=run.shardings)()
            times = []
            for i in range(steps + 1):
                batch = next(batches)
                start = time.perf_counter()
                state, m = run.train_step(state, batch)
                jax.block_until_ready(m)
                if i:  # the first call also allocates
                    times.append(time.perf_counter() - start)
    finally:
        batches.close()
    del state
    return statistics.median(times)


def scores(row: Row, params) -> dict:
    """The harness's `loss` task on `params` (`evals.score`, as train.py's evaluation and
    eval.py call it): {str(length): metrics} on the validation split at each of
    `eval_lengths`, and {"train": metrics} on the training split at T (no bytes are
    carried for it: no bits per byte), `eval.num_batches` batches each."""
    from rope_jax.harness import evals

    config = row.config
    ctx = evals.Context(row.run, params, config, split=config.data.eval_split,
                        num_batches=config.eval.num_batches)  # fmt: skip
    out = {str(n): evals.score(ctx, ("loss",), n) for n in eval_lengths(config.data.seq_len)}
    on_train = dataclasses.replace(ctx, split=config.data.train_split)
    out["train"] = evals.score(on_train, ("loss",), config.data.seq_len)
    return out


def _train(row: Row, probe_every: int):
    """Trains `row` from its initial state on the harness's training batches (placed
    ahead by `harness.Prefetch`, as train.py's loop does): (final parameters, every
    step's [loss, gradient norm] fetched once at the end, each layer's largest attention
    logit on the step's batch before every `probe_every`-th step, training seconds)."""
    import jax
    import numpy as np
    from flax import nnx

    from rope_jax import harness, sharding
    from rope_jax.nn import probe

    run, steps = row.run, row.config.train.num_steps
    logits_of = jax.jit(lambda params, tokens: probe.max_attention_logits(
        nnx.merge(run.graphdef, params), tokens))  # fmt: skip
    batches = harness.Prefetch(harness.train_iterator(row.config), run.batch_sharding)
    try:
        with sharding.use_mesh(run.mesh, run.rules):
            state = jax.jit(run.init_fn, out_shardings=run.shardings)()
            metrics, logits = [], []
            t1 = time.time()
            for i in range(steps):
                batch = next(batches)
                if i % probe_every == 0:  # before the step donates the state
                    logits.append(logits_of(state["params"], batch["inputs"]))
                state, m = run.train_step(state, batch)
                metrics.append((m["loss"], m["grad_norm"]))
            jax.block_until_ready(state)
            train_s = time.time() - t1
    finally:
        batches.close()
    every = np.asarray(jax.device_get(metrics), np.float64).reshape(-1, 2)  # [steps, 2]
    return state["params"], every, jax.device_get(logits), train_s


def train_row(row: Row) -> dict:
    """Trains one row from scratch (`_train`), then scores it (`scores`): held-out loss
    and bits per byte at T, 2T and 4T, the loss on training windows, every step's loss
    and gradient norm, each layer's largest attention logit LOGIT_SAMPLES times in a run
    ([[step, [per layer]], ...])."""
    config = row.config
    b, t, steps = config.data.global_batch_size, config.data.seq_len, config.train.num_steps
    probe_every = max(steps // LOGIT_SAMPLES, 1)
    params, every, logits, train_s = _train(row, probe_every)
    held = scores(row, params)
    on_train = held.pop("train")
    curve = [[i, float(every[i, 0])] for i in range(steps) if i % 200 == 0 or i == steps - 1]
    return dict(path=PATH, loss=held[str(t)]["loss"],
                bits_per_byte=held[str(t)]["bits_per_byte"],
                loss_at={k: v["loss"] for k, v in held.items()},
                bits_per_byte_at={k: v["bits_per_byte"] for k, v in held.items()},
                eval_tokens_at={k: v["tokens"] for k, v in held.items()}, train_curve=curve,
                step_loss=[float(x) for x in every[:, 0]],
                step_grad_norm=[float(x) for x in every[:, 1]],
                max_logit=[[i * probe_every, [float(x) for x in layers]]
                           for i, layers in enumerate(logits)],
                train_windows_loss=on_train["loss"], compile_s=row.compile_s, train_s=train_s,
                tokens=steps * b * t)  # fmt: skip


def rung_steps(tokens: int, shape: dict, smoke: bool) -> int:
    """Steps of each row: `tokens` per row (RUNG_TOKENS by default) in whole batches."""
    b, t = shape["batch"], shape["seq_len"]
    return max(int(tokens or (SMOKE_RUNG_TOKENS if smoke else RUNG_TOKENS)) // (b * t), 1)


def all_rows(result: dict) -> list[dict]:
    """Every row of rung.json: the table's, other seeds', the variants'."""
    variants = (result.get("variants") or {}).values()
    tables = [result.get("rows") or {}, *(result.get("more_seeds") or {}).values(),
              *(done for by_seed in variants for done in by_seed.values())]  # fmt: skip
    return [m for table in tables for m in table.values()]


def _corpus_meta(data: str) -> dict | None:
    """meta.json of the travelling corpus at `data`, or None (none there): read with the
    standard library alone, as the suite's parent checks it before any stage runs
    (`rope_jax.data.carried` reads the corpus itself)."""
    path = os.path.join(data, "meta.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def rung_problem(result: dict, out: str, data: str, tokens: int, smoke: bool) -> str | None:
    """Why the rung cannot run as asked (one line), or None: no corpus at `data`, rows in
    OUT/rung.json made by the stage's earlier code, or rows at another length, on another
    corpus or of another model shape (a rung's rows compare only when these are the
    same)."""
    meta = _corpus_meta(data)
    if meta is None:
        return (f"gpu_suite: --data={data} holds no travelling corpus (meta.json): make it "
                "with `python benchmarks/gpu_data.py --dataset=DIR/NAME` and carry it, or leave "
                "rung out of --stage")  # fmt: skip
    earlier = sum(m.get("path") != PATH for m in all_rows(result))
    if earlier:
        return (f"gpu_suite: {out}/rung.json holds rows made by the rung's earlier code "
                f"({earlier} without \"path\": its own windows and held-out loop); rows "
                "trained through the harness do not join them: use another --out")  # fmt: skip
    if not result.get("rows"):
        return None
    shape = SMOKE_RUNG_SHAPE if smoke else RUNG_SHAPE
    steps = rung_steps(tokens, shape, smoke)
    if result.get("steps") != steps:
        return (f"gpu_suite: {out}/rung.json has rows of {result['steps']} steps "
                f"({result['tokens_per_run']:,} tokens); this run asks {steps}: use the same "
                "--rung_tokens or another --out")  # fmt: skip
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


def _row_seconds(step_s: float, steps: int, eval_batches: int) -> float:
    """What a row is allowed (`ctx.fits`): its steps, and its evaluation batches (at T,
    2T, 4T and on training windows: as many tokens as 1 + 2 + 4 + 1 batches at T, each
    counted as a step), with margin."""
    return 1.05 * steps * step_s + 8 * eval_batches * step_s + 5


def _describe(r: dict, ctx: Context, shape: dict, steps: int, impl: str) -> None:
    """The rung's own fields of rung.json (the corpus, the shape, the evaluation)."""
    from rope_jax.data import carried
    from rope_jax.harness import flops

    meta, b, t = carried.metadata(ctx.data), shape["batch"], shape["seq_len"]
    model = rung_config(shape, "qk", meta["vocab_size"], steps, impl).model
    r.update(data=meta, shape=shape, impl=impl, steps=steps, tokens_per_run=steps * b * t,
             eval_batches=SMOKE_EVAL_BATCHES if ctx.smoke else EVAL_BATCHES,
             eval_batch_size=b, params=flops.num_params(model),
             block_params=flops.block_matmul_params(model))  # fmt: skip


def rung(ctx: Context) -> None:
    import jax

    from configs import lm

    r = ctx.result
    r.update(jax_facts())
    shape = SMOKE_RUNG_SHAPE if ctx.smoke else RUNG_SHAPE
    impl = "dot_product" if jax.default_backend() == "gpu" else "xla"
    steps = rung_steps(ctx.rung_tokens, shape, ctx.smoke)
    problem = rung_problem(r, ctx.out, ctx.data, ctx.rung_tokens, ctx.smoke)
    if problem:  # the parent checks first; this is for a child started by hand
        raise SystemExit(problem)
    _describe(r, ctx, shape, steps, impl)
    seed, (variant, changes) = ctx.rung_seed, rung_variant(ctx.rung_variant)
    todo = rung_todo(r, ctx.smoke, seed, ctx.rung_rows, variant)
    if not todo:
        r["done"] = not rung_todo(r, ctx.smoke)  # seed 0's table is whole
        return
    done = seed_rows(r, seed, add=True, variant=variant)
    if not ctx.fits(60 if not ctx.smoke else 5):  # the compiles alone need about this
        return
    b, t = shape["batch"], shape["seq_len"]
    also = (f", seed {seed}" if seed else "") + (f", variant {variant}" if variant else "")
    log(f"rung: compiling {len(todo)} rows, {steps} steps each ({steps * b * t:,} tokens){also}")
    t0 = time.time()
    rows = compile_rows({row: rung_config(shape, lm.ROWS[row], r["data"]["vocab_size"], steps,
                                          impl, data=ctx.data, seed=seed, changes=changes,
                                          eval_batches=r["eval_batches"])
                         for row in todo})  # fmt: skip
    step_s = _step_time(rows[todo[0]], steps=3 if ctx.smoke else 10)
    r["timing"] = dict(compile_wall_s=time.time() - t0, step_s=step_s, device=r["device"])
    ctx.save()
    log(f"rung: compiled in {time.time() - t0:.1f} s; a step {step_s * 1e3:.1f} ms")
    row_s = _row_seconds(step_s, steps, r["eval_batches"])
    fit = min(len(todo), max(int(ctx.left() // row_s), 0))
    log(f"rung: a row about {row_s:.0f} s; {len(todo)} rows to go, {fit} fit in this call"
        + ("" if fit == len(todo) else "; the rest go on in the next (the same --out, or "
           "--resume_from the folder this call's files are kept in)"))  # fmt: skip
    for row in todo:
        if not ctx.fits(row_s):
            return
        done[row] = m = train_row(rows[row])
        m["device"] = r["device"]  # a rung may span calls (and machines of one kind)
        if variant:
            m["variant_changes"] = changes
        log(f"rung: {row}{f' seed {seed}' if seed else ''}{f' ({variant})' if variant else ''}"
            f": held-out loss {m['loss']:.4f}, "
            f"{m['bits_per_byte']:.4f} bits/byte, {m['train_s']:.0f} s")  # fmt: skip
        ctx.save()
    r["done"] = not rung_todo(r, ctx.smoke)
