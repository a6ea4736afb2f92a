r"""Evaluation throughput: prefill and greedy decoding through the key/value cache, the two
halves of every generated-answer task (RULER's, eval.py --tasks), by length and batch.

  python benchmarks/eval_bench.py --out results/performance/eval_bench.md
  python benchmarks/eval_bench.py --size=tiny --lengths=128,256 --batches=1,2 --new=8   # quick

A model of --size (random weights: speed does not depend on them) with
`model.attention.impl` --impl answers B prompts of T - M tokens with M new tokens
through `nn.generate`'s two compiled programs (the prefill of the prompt into the key/value
cache, then calls of CHUNK greedy steps), the way an evaluation cell does. Each (T, B) is
timed after a warm-up that compiles both, each program waited for: the median of
--repeats runs. The table gives tokens/s of the prefill (B (T - M) / prefill), of
decoding (B x decoding steps / decode) and overall, and the share of the time the
prefill takes, all measured in this one run; the CPU is named at the top.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rope_jax import provenance  # noqa: E402


def model(size: str, impl: str):
    from flax import nnx

    from configs import lm
    from rope_jax.harness import checks
    from rope_jax.nn import model as model_lib

    config = lm.get_config(f"size={size}")
    config.model.attention.impl = impl
    config = checks.settle_vocab(checks.resolve(config))
    return model_lib.Decoder(config.model, rngs=nnx.Rngs(0))


def measure(net, length: int, batch: int, new: int, repeats: int) -> dict:
    """Median seconds of the prefill and of the decoding calls (`nn.generate`'s two
    compiled programs, each waited for), after a warm-up that compiles them."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rope_jax import layouts
    from rope_jax.nn import generate

    graphdef, state = nnx.split(net)
    t, c, n = length - new, generate.CHUNK, generate.chunks(new)
    prompt = jnp.asarray(np.random.default_rng(length).integers(0, 256, (batch, t)), jnp.int32)
    positions = layouts.text_positions(jnp.zeros((batch,)), t, net.num_axes, xp=jnp)
    keys = jax.random.split(jax.random.key(0), c + 1)
    zero = jnp.asarray(0.0, jnp.float32)

    def once() -> tuple[float, float]:
        start = time.perf_counter()
        cache, token = jax.block_until_ready(generate._prefill(
            graphdef, state, prompt, positions, None, None, zero, keys[0], slots=t + 1 + n * c,
            seq_len=length, greedy=True))  # fmt: skip
        middle = time.perf_counter()
        for i in range(n):
            starts = (
                t + jnp.arange(i * c, (i + 1) * c, dtype=jnp.float32)[:, None] + jnp.zeros(batch)
            )
            cache, token, _ = generate._decode(graphdef, state, cache, token, starts, keys[1:],
                                               zero, seq_len=length, greedy=True)  # fmt: skip
        jax.block_until_ready(token)
        return middle - start, time.perf_counter() - middle

    once()  # compiles both programs
    runs = [once() for _ in range(repeats)]
    prefill, decode = (statistics.median(r[k] for r in runs) for k in (0, 1))
    steps = n * c  # decoding steps run (the last call's beyond `new` included)
    return {"T": length, "B": batch, "prefill_s": prefill, "decode_s": decode,
            "prefill_tok_s": batch * t / prefill, "decode_tok_s": batch * steps / decode,
            "total_tok_s": batch * (t + steps) / (prefill + decode),
            "prefill_share": prefill / (prefill + decode)}  # fmt: skip


def render(rows: list[dict], args, cpu: str) -> str:
    lines = [
        "# Evaluation throughput: prefill and decoding",
        "",
        f"`python benchmarks/eval_bench.py --size={args.size} --impl={args.impl} "
        f"--lengths={args.lengths} --batches={args.batches} --new={args.new} "
        f"--repeats={args.repeats}` ({datetime.date.today()}, {cpu}). Random weights; "
        f"B prompts of T - {args.new} tokens answered with {args.new} greedy tokens through "
        "the key/value cache; medians after a warm-up.",
        "",
        "| T | B | prefill tok/s | decode tok/s | overall tok/s | prefill share |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['T']} | {r['B']} | {r['prefill_tok_s']:,.0f} | "
                     f"{r['decode_tok_s']:,.0f} | {r['total_tok_s']:,.0f} | "
                     f"{r['prefill_share']:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", help="size preset of configs/lm.py")
    p.add_argument("--impl", default="chunked", help="model.attention.impl")
    p.add_argument("--lengths", default="256,512,1024,2048")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new", type=int, default=32, help="new tokens per answer (M)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the markdown page here")
    args = p.parse_args(argv)
    net = model(args.size, args.impl)
    rows = []
    for length in map(int, args.lengths.split(",")):
        for batch in map(int, args.batches.split(",")):
            rows.append(measure(net, length, batch, args.new, args.repeats))
            r = rows[-1]
            print(f"T={length} B={batch}: {r['total_tok_s']:,.0f} tok/s, prefill share "
                  f"{r['prefill_share']:.2f}", file=sys.stderr, flush=True)  # fmt: skip
    page = render(rows, args, provenance.cpu_name())
    if args.out:
        with open(args.out, "w") as f:
            f.write(page)
    print(page)
    return page


if __name__ == "__main__":
    main()
