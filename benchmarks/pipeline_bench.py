"""Input pipeline and multimodal position layouts, timed against the training step.

  python benchmarks/pipeline_bench.py [--size tiny] [--steps 100]   # one JSON line

Used by benchmarks/train_bench.py (its `--only=pipeline` and `--only=layouts`
children); no torch needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # `configs` is not installed: import it from the checkout
    sys.path.insert(0, _ROOT)
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # bench_child
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_child  # noqa: E402


def measure_pipeline(config, *, steps: int, rounds: int = 2) -> dict:
    """train.py's loop on real batches vs the same loop on one pre-placed batch.

    Loop body as in train.py `_loop`: batch = next(batches), with `batches` the
    iterator wrapped in `harness.Prefetch` (next() + put_batch in a background
    thread, two batches ahead); state, m = train_step(state, batch); the losses are
    fetched every log_every_steps. Reports the host time the loop spends in next() per
    step and the wall-clock cost of real data over the pre-placed batch, both as
    shares of the step time.
    """
    import jax
    import jax.numpy as jnp

    from rope_jax import data, harness, sharding

    run = harness.build(config)
    data.ensure_built(config.data)
    it = data.make_train_iterator(config.data, seed=0, batch_size=config.data.global_batch_size)
    log_every = config.train.log_every_steps
    with sharding.use_mesh(run.mesh, run.rules):
        state = jax.jit(run.init_fn, out_shardings=run.shardings)()
        placed = [harness.put_batch(next(it), run.batch_sharding)]  # the pre-placed batch
    batches = harness.Prefetch(it, run.batch_sharding)

    def loop(state, real: bool, steps: int = steps):
        pending, wait = [], 0.0
        start = time.perf_counter()
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            batch = next(batches) if real else placed[0]
            wait += time.perf_counter() - t0
            state, m = run.train_step(state, batch)
            pending.append(m["loss"])
            if step % log_every == 0 or step == steps:
                np.asarray(jax.device_get(jnp.stack(pending)))
                pending.clear()
        return state, time.perf_counter() - start, wait

    with sharding.use_mesh(run.mesh, run.rules):
        state, _, _ = loop(state, True, 3)  # warm-up: compile, fill the prefetch buffer
        walls = {True: [], False: []}
        waits = []
        for _ in range(rounds):
            for real in (True, False):
                state, wall, wait = loop(state, real)
                walls[real].append(wall)
                if real:
                    waits.append(wait)
    batches.close()
    real, fixed, wait = min(walls[True]), min(walls[False]), min(waits)
    return {
        "side": "pipeline",
        "steps": steps,
        "step_s_fixed": fixed / steps,
        "step_s_real": real / steps,
        "wait_s": wait / steps,
        "wait_share": wait / real,
        "wall_share": max(real - fixed, 0.0) / real,
    }


def mixed_sequences(num: int, seq_len: int, seed: int = 0) -> list:
    """`num` segment lists of exactly `seq_len` tokens: text, images and videos mixed."""
    from rope_jax import layouts

    rng = np.random.default_rng(seed)
    batch = []
    for _ in range(num):
        segments, left = [], seq_len
        while left > 0:
            kind = rng.integers(3)
            if kind == 1:
                seg = layouts.Image(h=int(rng.integers(4, 17)), w=int(rng.integers(4, 17)))
            elif kind == 2:
                seg = layouts.Video(
                    t=int(rng.integers(2, 5)), h=int(rng.integers(4, 9)), w=int(rng.integers(4, 9))
                )
            else:
                seg = layouts.Text(int(rng.integers(8, 129)))
            if seg.num_tokens > left:
                seg = layouts.Text(left)
            segments.append(seg)
            left -= seg.num_tokens
        batch.append(segments)
    return batch


def measure_layouts(num: int = 256, seq_len: int = 2048, repeats: int = 3) -> dict:
    """Seconds for positions() of each sequence and for batch_positions() of the batch."""
    from rope_jax import layouts

    batch = mixed_sequences(num, seq_len)
    out = {"side": "layouts", "num": num, "seq_len": seq_len, "segments": sum(map(len, batch))}
    for scheme in ("rope_tv", "mrope"):
        per_seq, batched = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            for segments in batch:
                layouts.positions(segments, scheme, 3)
            per_seq.append(time.perf_counter() - start)
            start = time.perf_counter()
            pos, mask = layouts.batch_positions(batch, scheme, 3, seq_len)
            batched.append(time.perf_counter() - start)
        assert pos.shape == (num, seq_len, 3) and mask.all()
        out[scheme] = {"positions_s": min(per_seq), "batch_positions_s": min(batched)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", type=bench_child.preset)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    from configs import lm

    result = measure_pipeline(lm.get_config(f"size={args.size}"), steps=args.steps)
    print(json.dumps({**result, "size": args.size, "layouts": measure_layouts()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
