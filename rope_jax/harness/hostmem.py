"""Host memory: what a step needs at least, against what this machine has free.

On the CPU backend every device's arrays live in the host's RAM, and a step that needs
more than there is ends in the kernel's OOM killer (a bare `Killed`, maybe of another
process), not in an error. `check_train` and `check_eval` refuse such a run with one line
before anything is allocated, from a lower bound of what it must hold at once:

  state       parameters and optimiser state, every local device's copy
  gradients   one per parameter, while training
  residuals   while training, each block's input [B, T, D] kept for the backward pass
              (with `model.remat` none or block alike), per microbatch
  logits      [B, T, vocab] in the compute dtype, the head's output, per microbatch
  scores      [B, heads, T, T] float32 of one layer, where attention materialises them
              (`model.attention.impl` xla, or dot_product, which is XLA's on a CPU)
  batch       inputs, targets (int32) and weights (float32) on the host
  cache       when decoding, every layer's keys and values of prompt + new tokens (a
              sliding or chunked layer's ring of W or C slots)

Everything else a step holds only adds to it, so a refusal is certain; a run that passes
can still need more (`train.py --dry_run` gives XLA's figure). Free memory is
/proc/meminfo's MemAvailable plus free swap; where there is no /proc/meminfo, or on a
GPU or TPU (which report RESOURCE_EXHAUSTED themselves), nothing is checked.
"""

from __future__ import annotations

import jax
import numpy as np

from rope_jax import defaults
from rope_jax.harness import checks, console, setup
from rope_jax.harness.workdir import format_bytes
from rope_jax.nn import model as model_lib  # the decoding cache's owner

MEMINFO = "/proc/meminfo"


def available_bytes(path: str = MEMINFO) -> int | None:
    """MemAvailable + SwapFree in bytes; None where the file or the fields are missing."""
    try:
        with open(path) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("MemAvailable", "SwapFree"))
    except (OSError, KeyError, ValueError):
        return None


def train_needs(run, config) -> dict[str, int]:
    """The lower bound of a train step's host bytes, by part (module docstring)."""
    rows = config.data.global_batch_size // jax.process_count()
    micro = rows // config.train.microbatches
    tokens, item = config.data.seq_len, np.dtype(config.model.dtype).itemsize
    return {
        "state": _state(run),
        "gradients": setup.bytes_per_device(run.abstract["params"]) * jax.local_device_count(),
        "residuals": config.model.num_layers * micro * tokens * config.model.embed_dim * item,
        "logits": micro * tokens * config.model.vocab_size * item,
        "scores": _scores(config, micro, tokens),
        "batch": rows * tokens * 12,
    }


def eval_needs(run, config, seq_len: int, *, decoding: bool = False) -> dict[str, int]:
    """The lower bound of an evaluation's host bytes at context `seq_len`; `decoding`: a
    greedy answer after a prefill (the suite's generated tasks), which projects one
    position onto the vocabulary and holds the cache instead of every position's logits."""
    rows = config.eval.batch_size // jax.process_count()
    item = np.dtype(config.model.dtype).itemsize
    needs = {
        "state": _state(run),
        "logits": rows * (1 if decoding else seq_len) * config.model.vocab_size * item,
        "scores": _scores(config, rows, seq_len),
        "batch": rows * seq_len * 12,
    }
    if decoding:
        needs["cache"] = rows * model_lib.kv_cache_bytes(config.model, seq_len)
        needs["activations"] = 2 * rows * seq_len * config.model.mlp_dim * item  # one MLP's
    return needs


def fit_eval(run, config, seq_lens, *, decoding: bool = False, free: int | None = None):
    """`config`, or a copy whose evaluation at the longest of `seq_lens` fits host memory:
    attention that materialises the scores becomes `chunked` (blockwise, O(T) memory, the
    same numbers), then `eval.batch_size` halves, each change said in one line; one line
    refusing when a batch of one still does not fit (nothing has compiled yet)."""
    if (
        jax.default_backend() != "cpu"
        or (free := available_bytes() if free is None else free) is None
    ):
        return config
    longest = max(seq_lens)
    fits = lambda c: sum(eval_needs(run, c, longest, decoding=decoding).values()) <= free
    if fits(config):
        return config
    changed = defaults.fill(config)
    if changed.model.attention.impl in ("xla", "dot_product"):
        changed.model.attention.impl = "chunked"
        console.note(f"at length {longest} the attention scores would not fit in host memory: "
                     "model.attention.impl=chunked for this evaluation (blockwise, same "
                     "numbers)")  # fmt: skip
    size = changed.eval.batch_size
    while not fits(changed) and changed.eval.batch_size > 1:
        changed.eval.batch_size = max(1, changed.eval.batch_size // 2)
    if changed.eval.batch_size != size:
        console.note(f"at length {longest} eval.batch_size={size} would not fit in host memory: "
                     f"{changed.eval.batch_size} for this evaluation")  # fmt: skip
    changed = checks.resolve(changed)
    check_eval(run, changed, seq_lens, free, decoding=decoding)  # a batch of one: refused
    return changed


def generate_needs(run, config, prompt_len: int, max_new_tokens: int) -> dict[str, int]:
    """The lower bound of decoding one prompt: the state and the cache of every token."""
    length = prompt_len + max_new_tokens
    return {
        "state": _state(run),
        "cache": model_lib.kv_cache_bytes(config.model, length),  # init_cache's
    }


def _state(run) -> int:
    """Parameters and optimiser state over every local device (all in the host's RAM)."""
    return setup.bytes_per_device(run.abstract) * jax.local_device_count()


def _scores(config, rows: int, seq_len: int) -> int:
    """One layer's float32 attention scores, where the kernel materialises them (CPU)."""
    if config.model.attention.impl not in ("xla", "dot_product"):
        return 0
    return rows * config.model.num_heads * seq_len * seq_len * 4


def check_train(run, config, free: int | None = None) -> None:
    """Refuses a training run (and its periodic evaluation) that cannot fit; one line."""
    needs = train_needs(run, config)
    hint = "lower data.global_batch_size or data.seq_len, or raise train.microbatches"
    if needs["scores"]:
        hint += ", or set model.attention.impl=chunked (O(T) memory)"
    _check("training", needs, hint, free)
    _check(f"evaluation at seq_len={config.data.seq_len}",
           eval_needs(run, config, config.data.seq_len), "lower eval.batch_size", free)  # fmt: skip


def check_eval(run, config, seq_lens, free: int | None = None, *, decoding: bool = False) -> None:
    """Refuses an evaluation at the longest of `seq_lens` that cannot fit; one line."""
    longest = max(seq_lens)
    _check(f"evaluation at seq_len={longest}", eval_needs(run, config, longest, decoding=decoding),
           "use shorter --seq_lens or a smaller eval.batch_size", free)  # fmt: skip


def check_generate(run, config, prompt_len: int, max_new_tokens: int,
                   free: int | None = None) -> None:  # fmt: skip
    """Refuses a continuation whose decoding cache cannot fit; one line."""
    _check(f"generating {max_new_tokens} tokens",
           generate_needs(run, config, prompt_len, max_new_tokens),
           "ask for fewer --max_new_tokens", free)  # fmt: skip


def _check(what: str, needs: dict[str, int], hint: str, free: int | None) -> None:
    if jax.default_backend() != "cpu":
        return
    free = available_bytes() if free is None else free
    total = sum(needs.values())
    if free is None or total <= free:
        return
    parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in needs.items() if n)
    raise ValueError(
        f"{what} needs at least {format_bytes(total)} of host memory ({parts}), more than "
        f"the {format_bytes(free)} free (RAM and swap): {hint}"
    )


def dry_run_line(report: dict) -> str | None:
    """On a CPU, `--dry_run`'s line on this host: XLA's parameters + optimiser +
    temporaries over every local device, against the memory free now; None elsewhere."""
    free = available_bytes()
    if jax.default_backend() != "cpu" or free is None:
        return None
    per_device = sum(report[f"{k}_bytes_per_device"] for k in ("params", "opt", "temp"))
    total = per_device * jax.local_device_count()
    verdict = "fits" if total <= free else "does not fit"
    return (f"this host: {format_bytes(total)} (XLA's parameters + optimiser + temporaries) "
            f"of {format_bytes(free)} free (RAM and swap): {verdict}")  # fmt: skip
