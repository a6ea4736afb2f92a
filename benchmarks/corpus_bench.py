r"""Prepared corpora read without loading: peak RSS and input speed at two corpus sizes.

  python benchmarks/corpus_bench.py --out results/performance/corpus_bench.md
  python benchmarks/corpus_bench.py --copies 1,10 --steps 5      # quick

The Python standard library corpus (the `python_stdlib` documents, ~12 MB) written K
times over as .jsonl files, for each K in --copies, prepared with the byte tokenizer
(`python -m rope_jax.data.prepare`, reused when already there) under --work. Then, per
size, one child process (its own peak RSS) trains the `small` preset on it through
train.py's input path (`data.make_train_iterator` behind `harness.Prefetch`):

* input batches/s of the iterator alone (B = 32 windows of T = 256 read from the shards);
* the host time the training loop waits in next() per step, as a share of the step,
  and the wall-clock cost of real batches over one pre-placed batch
  (`pipeline_bench.measure_pipeline`);
* the child's peak RSS, and how much of it the iterator added over the model alone.

Memory that does not grow with the corpus shows as equal peak RSS at both sizes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

import bench_child  # noqa: E402

from rope_jax import provenance  # noqa: E402


def write_source(directory: str, copies: int) -> str:
    """`copies` x the stdlib corpus as .jsonl files (one per copy); returns their glob."""
    from rope_jax.data import corpora

    os.makedirs(directory, exist_ok=True)
    texts = None
    for k in range(copies):
        path = os.path.join(directory, f"copy{k:04d}.jsonl")
        if os.path.exists(path):
            continue
        if texts is None:
            texts = [corpora.read_source(p) for p in corpora.stdlib_files().values()]
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts if t)
        os.replace(path + ".tmp", path)
    return os.path.join(directory, "*.jsonl")


def prepare(work: str, copies: int, workers: int) -> dict:
    """Prepares (or finds) the corpus of `copies` copies; its metadata and wall seconds."""
    name = f"stdlib_x{copies}"
    source = write_source(os.path.join(work, f"source_x{copies}"), copies)
    cmd = [sys.executable, "-m", "rope_jax.data.prepare", f"--source={source}",
           "--tokenizer=bytes", f"--name={name}", f"--data_dir={work}",
           f"--workers={workers}", "--quiet"]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    seconds = time.perf_counter() - start
    with open(os.path.join(work, name, "metadata.json")) as f:
        meta = json.load(f)
    return {"name": name, "copies": copies, "prepare_s": seconds,
            "train_tokens": meta["splits"]["train"]["tokens"],
            "disk_bytes": _du(os.path.join(work, name))}  # fmt: skip


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def measure(work: str, name: str, steps: int, batches: int) -> dict:
    """In this (child) process: the small preset's input path on dataset `name`."""
    import pipeline_bench

    from configs import lm
    from rope_jax import data

    config = lm.get_config("size=small")
    config.data.name, config.data.data_dir = name, work
    config.train.log_every_steps = steps
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    it = data.make_train_iterator(config.data, seed=0, batch_size=config.data.global_batch_size)
    next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    rate = batches / (time.perf_counter() - start)
    rss_iterator = rss()
    del it
    result = pipeline_bench.measure_pipeline(config, steps=steps)
    return {**result, "batches_per_s": rate, "peak_rss_iterator_mib": rss_iterator,
            "peak_rss_mib": rss()}  # fmt: skip


def render(rows: list[dict], args, argv) -> str:
    small, large = rows[0], rows[-1]
    lines = [
        "# Prepared corpora: memory and input speed against corpus size",
        "",
        f"Command: `python benchmarks/corpus_bench.py {' '.join(argv)}`",
        "",
        f"Date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; "
        f"CPU: {provenance.cpu_name()} x{os.cpu_count()}.",
        "",
        "The stdlib corpus written K times as .jsonl, prepared with the byte tokenizer "
        "(ArrayRecord shards, zstd), read by the `small` preset's training input (B = 32 "
        f"windows of T = 256 per step, {args.batches} batches for the rate, "
        f"{args.steps} steps x 2 rounds for the loop). One child process per size.",
        "",
        "| copies | train tokens | on disk | prepare (s) | input batches/s | wait per step "
        "(ms) | wait / step | real vs pre-placed batch | peak RSS, iterator only (MiB) | "
        "peak RSS with the model (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['copies']} | {r['train_tokens']:,} | {r['disk_bytes'] / 2**20:,.0f} MiB | "
            f"{r['prepare_s']:.0f} | {r['batches_per_s']:.0f} | {r['wait_s'] * 1e3:.2f} | "
            f"{r['wait_share']:.2%} | {r['wall_share']:+.2%} | "
            f"{r['peak_rss_iterator_mib']:.0f} | {r['peak_rss_mib']:.0f} |"
        )
    ratio = large["train_tokens"] / small["train_tokens"]
    lines += [
        "",
        f"The large corpus holds {ratio:.0f}x the tokens of the small one; peak RSS of the "
        f"iterator alone: {large['peak_rss_iterator_mib']:.0f} vs "
        f"{small['peak_rss_iterator_mib']:.0f} MiB "
        f"({large['peak_rss_iterator_mib'] / small['peak_rss_iterator_mib']:.2f}x). "
        f"The loop waits {large['wait_share']:.2%} of a `small` step for input at the "
        f"large size (step {large['step_s_real'] * 1e3:.0f} ms on this CPU).",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copies", default="1,100", help="corpus sizes, in copies of the stdlib")
    p.add_argument("--work", default="/tmp/rope_jax_corpus_bench", help="sources and datasets")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--out", default="", type=bench_child.page_path)
    p.add_argument("--clean", action="store_true", help="delete --work at the end")
    p.add_argument("--only", default="", help=argparse.SUPPRESS)  # child: dataset name
    args = p.parse_args(argv)
    if args.only:
        print(json.dumps(measure(args.work, args.only, args.steps, args.batches)))
        return 0
    rows = []
    for copies in sorted(int(c) for c in args.copies.split(",")):
        info = prepare(args.work, copies, args.workers)
        child = [f"--only={info['name']}", f"--work={args.work}", f"--steps={args.steps}",
                 f"--batches={args.batches}"]  # fmt: skip
        result = bench_child.run_child(child, script=__file__)
        if result is None:
            return 1
        rows.append({**info, **result})
        print(json.dumps(rows[-1]), flush=True)
    text = render(rows, args, argv)
    bench_child.publish(text, args.out)
    if args.clean:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
