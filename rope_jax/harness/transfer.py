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

Other sources are read by the packages that own their format, passed in by the caller
as `sources` (prefix -> `Source`): `hf:DIR` by `rope_jax.hf.run.SOURCES`, which train.py
passes, reading DIR's config.json and safetensors. The run first takes the source's
architecture (`prepare`), so every array loads, and DIR's tokenizer.json as its data's
tokenizer when `data.tokenizer` is "". The harness imports no such package: they import
the harness.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import ml_collections

from rope_jax import defaults
from rope_jax.harness import checkpoint, checksums, runfiles, setup
from rope_jax.harness.evaluate import restore, without_corpus

HF_PREFIX = "hf:"  # init_from=hf:DIR, a Hugging Face model directory (`rope_jax.hf.run`)


class TransferError(ValueError):
    """An `init_from` that cannot be used (one line)."""


class Source(NamedTuple):
    """A reader of `init_from=<prefix>PATH` values other than a run's workdir."""

    adopt: Callable  # (config, PATH) -> a copy of config holding PATH's architecture
    read_params: Callable  # PATH -> {parameter name: host array}


Sources = Mapping[str, Source]  # prefix ("hf:") -> its reader


def _source(spec: str, sources: Sources | None) -> tuple[Source | None, str]:
    """(the reader of `spec`, the path after its prefix), or (None, spec) for a workdir.
    A prefix known to need a reader that was not given is one line."""
    for prefix, source in (sources or {}).items():
        if spec.startswith(prefix):
            return source, spec[len(prefix) :]
    if spec.startswith(HF_PREFIX):
        raise TransferError(
            f"train.init_from={spec!r}: no reader of {HF_PREFIX} sources was given (train.py "
            "passes one; in Python, pass sources=rope_jax.hf.run.SOURCES)"
        )
    return None, spec


def prepare(config, sources: Sources | None = None):
    """The run config to train: with `train.init_from` naming a source of `sources`
    (hf:DIR), a copy holding its architecture; else `config` itself (a resolved config
    has been through here)."""
    if isinstance(config, ml_collections.FrozenConfigDict):
        return config
    spec = defaults.fill(config).train.init_from
    if not spec:
        return config
    source, path = _source(spec, sources)
    if source is None:
        return config
    try:
        return source.adopt(config, path)
    except ValueError as e:
        raise TransferError(f"train.init_from={spec!r}: {e}") from None


def check(spec: str, sources: Sources | None = None) -> None:
    """A cheap first check, before anything is built: the workdir holds a run (another
    source was read by `prepare`)."""
    if _source(spec, sources)[0] is not None:
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


def source_params(spec: str, sources: Sources | None = None):
    """(step, params) of the run named by `spec`, restored into its own model's shapes
    (step None and {name: host array} for a source of `sources`, hf:DIR)."""
    source, path = _source(spec, sources)
    if source is not None:
        try:
            return None, source.read_params(path)
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


def apply(state: dict, spec: str, sources: Sources | None = None) -> tuple[dict, str]:
    """The fresh `state` with `spec`'s matching parameters; (state, one report line)."""
    step, source = source_params(spec, sources)
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
