"""Starting a run from another run's parameters (`config.train.init_from`).

  --config.train.init_from=runs/text_lm          # its newest checkpoint
  --config.train.init_from=runs/text_lm:2000     # that step
  --config.train.init_from=hf:path/to/model      # a Hugging Face model directory

A fresh run (no checkpoint of its own yet) takes every parameter array of the other
run whose name and shape match, keeps the fresh initialisation of the others (a patch
embedding a text model lacks, a different vocabulary's embedding, ...), and starts at
step 0 with a fresh optimiser state. One line reports what was loaded. Rotations have
no parameters, so a text model's weights serve any position layout: this is how a
pretrained text LM is carried to interleaved image/video data. A run that resumes from
its own checkpoint ignores `init_from`.

`hf:DIR` reads DIR's config.json and safetensors (`rope_jax.hf`); the run first takes
DIR's architecture (`prepare`), so every array loads, and DIR's tokenizer.json as its
data's tokenizer when `data.tokenizer` is "".
"""

from __future__ import annotations

import jax
import ml_collections

from rope_jax import defaults
from rope_jax.harness import checkpoint, checksums, runfiles, setup

HF_PREFIX = "hf:"  # init_from=hf:DIR, a Hugging Face model directory


class TransferError(ValueError):
    """An `init_from` that cannot be used (one line)."""


def prepare(config):
    """The run config to train: with `train.init_from=hf:DIR`, a copy holding DIR's
    architecture (`rope_jax.hf.convert.adopt`); else `config` itself (a resolved config
    has been through here)."""
    if isinstance(config, ml_collections.FrozenConfigDict):
        return config
    spec = defaults.fill(config).train.init_from
    if not spec.startswith(HF_PREFIX):
        return config
    from rope_jax.hf import convert  # only for hf: sources

    try:
        return convert.adopt(config, spec[len(HF_PREFIX) :])
    except ValueError as e:
        raise TransferError(f"train.init_from={spec!r}: {e}") from None


def check(spec: str) -> None:
    """A cheap first check, before anything is built: the workdir holds a run (an hf:
    source was read by `prepare`)."""
    import os

    if spec.startswith(HF_PREFIX):
        return
    workdir, _ = parse(spec)
    if not os.path.isfile(os.path.join(workdir, runfiles.CONFIG_FILE)):
        raise TransferError(
            f"train.init_from={spec!r}: {workdir!r} holds no run ({runfiles.CONFIG_FILE} missing)"
        )


def parse(spec: str) -> tuple[str, int | None]:
    """`WORKDIR[:STEP]` -> (workdir, step or None for the newest)."""
    workdir, sep, step = spec.rpartition(":")
    if not sep or not step.isdigit():
        return spec, None
    return workdir, int(step)


def source_params(spec: str):
    """(step, params) of the run named by `spec`, restored into its own model's shapes
    (step None and {name: host array} for hf:DIR)."""
    from rope_jax.harness.evaluate import restore, without_corpus

    if spec.startswith(HF_PREFIX):
        from rope_jax.hf import convert

        try:
            return None, convert.read_params(spec[len(HF_PREFIX) :])[0]
        except ValueError as e:
            raise TransferError(f"train.init_from={spec!r}: {e}") from None
    workdir, step = parse(spec)
    try:
        config = runfiles.load_config(workdir)
        run = setup.build(without_corpus(config), vocab_from_data=False)
        step, state = restore(workdir, run, step, fallback=False)
    except (checkpoint.CheckpointError, ValueError) as e:
        raise TransferError(f"train.init_from={spec!r}: {e}") from None
    return step, state["params"]


def merge(fresh, source) -> tuple[object, list[str], list[str]]:
    """`fresh` with every leaf of `source` of the same path and shape put in (cast to the
    fresh dtype and placed with its sharding). Returns (params, loaded names, names kept
    fresh)."""
    found = {checksums.leaf_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(source)}
    loaded, kept = [], []

    def take(path, leaf):
        name = checksums.leaf_name(path)
        other = found.get(name)
        if other is None or other.shape != leaf.shape:
            kept.append(name)
            return leaf
        loaded.append(name)
        return jax.device_put(other.astype(leaf.dtype), leaf.sharding)

    params = jax.tree_util.tree_map_with_path(take, fresh)
    return params, loaded, kept


def apply(state: dict, spec: str) -> tuple[dict, str]:
    """The fresh `state` with `spec`'s matching parameters; (state, one report line)."""
    step, source = source_params(spec)
    params, loaded, kept = merge(state["params"], source)
    if not loaded:
        raise TransferError(
            f"train.init_from={spec!r}: no parameter of that run matches this model in name "
            "and shape"
        )
    size = lambda names, tree: sum(
        x.size for p, x in jax.tree_util.tree_leaves_with_path(tree)
        if checksums.leaf_name(p) in set(names)
    )  # fmt: skip
    line = (
        f"init_from {spec}{'' if step is None else f' (step {step})'}: loaded {len(loaded)} of "
        f"{len(loaded) + len(kept)} "
        f"parameter arrays ({size(loaded, params):,} of {size(loaded + kept, params):,} values)"
        + (f"; fresh: {', '.join(kept)}" if kept else "")
    )
    return {**state, "params": params}, line
