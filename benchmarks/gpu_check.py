"""The `check` stage: devices, versions, cuDNN, the dense matmul ceiling measured."""

from __future__ import annotations

import subprocess

from gpu_common import Context, jax_facts


def _cudnn_version():
    try:
        from jax._src.lib import cuda_versions

        return cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception:  # not a CUDA build
        return None


def _nvidia_smi() -> str | None:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30,
        ).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "torch",
                 "transformers"):  # fmt: skip
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def check(ctx: Context) -> None:
    import jax
    from train_ours import measure_ceiling

    r = ctx.result
    r.update(jax_facts())
    r["versions"] = _versions()
    r["cudnn"] = _cudnn_version()
    r["nvidia_smi"] = _nvidia_smi()
    r["memory_bytes"] = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    ctx.save()
    r["ceiling"] = measure_ceiling(n=256 if ctx.smoke else None)
    r["done"] = True
