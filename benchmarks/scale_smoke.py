"""The `1b` preset end to end on this machine, with where its memory goes.

  python benchmarks/scale_smoke.py --out results/performance/scale_smoke.md
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python benchmarks/scale_smoke.py --mesh=1,8,1 --only=plan \
      --out results/performance/scale_smoke_fsdp8.md

Builds `size=1b` (bf16 compute, `chunked` attention, remat as the preset says) with a small
batch (B sequences of T tokens, synthetic), then, each phase timed and its peak resident
memory sampled every 5 ms by a thread:

  init     the train state (float32 parameters, AdamW moments) allocated on the devices
  compile  the train step lowered and compiled (XLA's own byte counts of the program)
  train    --steps steps
  save     an Orbax checkpoint through the harness (`checkpoint.Manager`, checksums)
  restore  the checkpoint into a fresh state, compared bit for bit with the trained one
  eval     one evaluation batch (loss)
  decode   greedy decoding of a few tokens from the restored parameters

and the breakdown of each phase's peak apart (`breakdown`): training's (parameters,
optimiser state, the compiled step's temporaries, which hold the gradients and the
activations: XLA reports them together, and the rest: the runtime, the compiled program,
host copies) and decoding's (the state, the weights cast to bfloat16, and the rest).
`--only=plan` compiles the step and reports the per-device bytes of each part without
running it (for the 8-device mesh).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import tempfile
import threading
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import bench_child  # noqa: E402

from rope_jax.provenance import cpu_name  # noqa: E402

GIB = 2**30


class RssSampler:
    """The process's resident set size sampled every `interval` s in a thread; `phase`
    marks where the samples belong, `peaks` holds each phase's maximum."""

    def __init__(self, interval: float = 0.005):
        import psutil

        self._proc = psutil.Process()
        self.interval, self.peaks, self._phase = interval, {}, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = self._proc.memory_info().rss
            if self._phase is not None:
                self.peaks[self._phase] = max(self.peaks.get(self._phase, 0), rss)
            time.sleep(self.interval)

    def phase(self, name: str) -> None:
        if self._phase is not None:  # the last phase's peak, said as it ends
            print(f"scale_smoke: {self._phase} peak RSS {self.peaks[self._phase] / GIB:.2f} GiB",
                  file=sys.stderr, flush=True)  # fmt: skip
        print(f"scale_smoke: {name} ...", file=sys.stderr, flush=True)
        self._phase = name
        self.peaks[name] = max(self.peaks.get(name, 0), self._proc.memory_info().rss)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def tree_bytes(tree) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def config_for(args):
    from configs import lm

    config = lm.get_config(f"size={args.size}")
    config.update_from_flattened_dict({
        "model.dtype": "bfloat16", "model.attention.impl": "chunked",
        "data.seq_len": args.seq_len, "data.global_batch_size": args.batch,
        "eval.batch_size": args.batch, "mesh.shape": tuple(args.mesh)})  # fmt: skip
    return config


def plan(args) -> dict:
    """Per-device bytes of each part, from shapes and the compiled step (nothing runs):
    `harness.dry_run`'s figures; the gradients have the parameters' shapes and sharding."""
    from rope_jax import harness

    d = harness.dry_run(config_for(args))
    params = d["params_bytes_per_device"]
    return dict(devices=d["devices"], mesh=list(args.mesh), params=params, grads=params,
                opt=d["opt_bytes_per_device"], temp=d["temp_bytes_per_device"])  # fmt: skip


def measure(args) -> dict:
    import jax
    import numpy as np
    from bench_shapes import synthetic_batch

    from rope_jax import harness, sharding
    from rope_jax.nn import generate

    sampler = RssSampler()
    out, times = {}, {}
    config = config_for(args)
    b, t = args.batch, args.seq_len

    def timed(name, fn):
        sampler.phase(name)
        start = time.perf_counter()
        result = fn()
        if any(isinstance(x, jax.Array) for x in jax.tree.leaves(result)):
            jax.block_until_ready(result)
        times[name] = time.perf_counter() - start
        return result

    run = harness.build(config, vocab_from_data=False)
    with sharding.use_mesh(run.mesh, run.rules):
        state = timed("init", lambda: jax.jit(run.init_fn, out_shardings=run.shardings)())
        gc.collect()  # as the training loop does after init or restore
        batches = [harness.put_batch(synthetic_batch(b, t, s), run.batch_sharding)
                   for s in range(2)]  # fmt: skip
        lower = run.train_step.lower
        compiled = timed("compile", lambda st=state: lower(st, batches[0]).compile())
        mem = compiled.memory_analysis()
        losses = []
        sampler.phase("train")
        start = time.perf_counter()
        for i in range(args.steps):
            state, m = compiled(state, batches[i % 2])
            losses.append(float(m["loss"]))
        times["train"] = time.perf_counter() - start
        restored, same = _save_and_restore(args, run, state, timed)
        del state
        gc.collect()
        sums = timed("eval", lambda: run.eval_step(restored["params"], batches[0]))
        from flax import nnx

        net = nnx.merge(run.graphdef, restored["params"])
        prompt = np.asarray(batches[0]["inputs"])[:1, :16]
        new = timed("decode", lambda: generate.generate(net, prompt, max_new_tokens=8))
    sampler.stop()
    params = tree_bytes(restored["params"])
    opt = tree_bytes(restored["opt"])
    out.update(
        times=times,
        step_s=times["train"] / args.steps,
        losses=losses,
        eval_loss=float(sums["loss_sum"] / sums["weight_sum"]),
        decoded=np.asarray(new).tolist(),
        restored_equal=same,
        peaks=sampler.peaks,
        params=params,
        grads=params,
        opt=opt,
        temp=mem.temp_size_in_bytes,
        arguments=mem.argument_size_in_bytes,
        aliased=mem.alias_size_in_bytes,
    )
    return out


def digests(tree) -> list[str]:
    """sha256 of every array's bytes, one array on the host at a time."""
    import hashlib

    import jax
    import numpy as np

    return [hashlib.sha256(np.ascontiguousarray(jax.device_get(x)).tobytes()).hexdigest()
            for x in jax.tree.leaves(tree)]  # fmt: skip


def _save_and_restore(args, run, state, timed):
    """Saves `state` through the harness, drops it, restores the checkpoint, as a resumed
    run does: (restored, whether every array is bit-identical, by sha256)."""
    from rope_jax.harness import checkpoint

    before = digests(state)
    with tempfile.TemporaryDirectory(dir=args.tmp) as workdir:
        manager = checkpoint.Manager(workdir, keep=1)
        timed("save", lambda: manager.save(args.steps, state, {"step": args.steps}))
        state.clear()  # the caller's dict: its arrays go
        gc.collect()
        restored, _ = timed("restore", lambda: manager.restore(args.steps, run.abstract))
        manager.close()
    return restored, digests(restored) == before


def breakdown(m: dict) -> list[str]:
    """Each phase's peak apart: training (state + XLA's step temporaries + the rest of
    the train phase's peak) and decoding (the restored state + the decode phase's peak
    over it: the bfloat16 copy of the weights that decoding casts, and what this run's
    numbers do not explain). A temporary of one phase is never taken from another's peak."""
    state = m["params"] + m["opt"]
    train, decode = m["peaks"].get("train"), m["peaks"].get("decode")
    lines = ["| part | GiB |", "|---|---|",
             f"| parameters (float32) | {m['params'] / GIB:.2f} |",
             f"| optimiser state (AdamW moments) | {m['opt'] / GIB:.2f} |"]  # fmt: skip
    if train:
        lines += [f"| training: step temporaries (gradients, activations; XLA) | "
                  f"{m['temp'] / GIB:.2f} |",
                  f"| training: the rest of its peak (runtime, program, host copies) | "
                  f"{(train - state - m['temp']) / GIB:.2f} |",
                  f"| **training peak RSS** | **{train / GIB:.2f}** |"]  # fmt: skip
    if decode:
        weights = m["params"] // 2  # the float32 parameters cast to bfloat16
        lines += [f"| decoding: the weights in bfloat16 | {weights / GIB:.2f} |",
                  f"| decoding: the rest of its peak over the state (not broken down by "
                  f"this run: runtime, decoding program, cache, copies) | "
                  f"{(decode - state - weights) / GIB:.2f} |",
                  f"| **decoding peak RSS** | **{decode / GIB:.2f}** |"]  # fmt: skip
    return lines


def render(args, m: dict | None, p: dict | None) -> str:
    lines = [f"# The {args.size} preset on a CPU", "",
             f"Command: `python benchmarks/scale_smoke.py {' '.join(sys.argv[1:])}`", "",
             f"Date: {datetime.date.today()}. Machine: {cpu_name()}, "
             f"{os.cpu_count()} cores. `size={args.size}`, bf16 compute, float32 parameters "
             f"and AdamW state, `chunked` attention, B = {args.batch}, T = {args.seq_len}, "
             "synthetic tokens.", ""]  # fmt: skip
    if m:
        lines += ["| phase | seconds | peak RSS GiB |", "|---|---|---|"]
        for name, peak in m["peaks"].items():
            lines.append(f"| {name} | {m['times'].get(name, 0):.1f} | {peak / GIB:.2f} |")
        losses = ", ".join(f"{x:.3f}" for x in m["losses"])
        lines += ["", f"Step {m['step_s']:.1f} s; losses {losses}; "
                  f"restored state bit-identical: {m['restored_equal']}; eval loss "
                  f"{m['eval_loss']:.3f}; decoded {len(m['decoded'][0])} tokens.", ""]  # fmt: skip
        lines += breakdown(m)
    if p:
        lines += ["", f"Per device on {p['devices']} devices, mesh {tuple(p['mesh'])} "
                  "(compiled, not run):", "", "| part | GiB per device |", "|---|---|",
                  f"| parameters | {p['params'] / GIB:.3f} |",
                  f"| gradients | {p['grads'] / GIB:.3f} |",
                  f"| optimiser state | {p['opt'] / GIB:.3f} |",
                  f"| step temporaries (XLA) | {p['temp'] / GIB:.3f} |"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="", type=bench_child.page_path)
    p.add_argument("--size", default="1b", type=bench_child.preset,
                   help="the preset (tiny for a quick check)")  # fmt: skip
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mesh", default="-1,1,1", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--only", choices=["all", "plan"], default="all")
    p.add_argument("--tmp", default=None, help="where the checkpoint is written (then removed)")
    args = p.parse_args(argv)
    m = measure(args) if args.only == "all" else None
    pl = plan(args) if args.only == "plan" else None
    page = render(args, m, pl)
    bench_child.publish(page, args.out)


if __name__ == "__main__":
    main()
