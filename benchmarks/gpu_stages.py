"""The stages of `benchmarks/gpu_suite.py`, by name; each runs in its own child process
and lives in its own module (`gpu_common` holds what they share: the stage protocol).

  check    gpu_check.check       devices, versions, cuDNN, the matmul ceiling
  kernels  gpu_kernels.kernels   every attention impl against `xla`
  step1b   gpu_step1b.step1b     the `1b` preset's speed, MFU and memory
  rung     gpu_rung.rung         the site ablation, trained through the harness
  peer     gpu_peer.peer         HF Llama against ours
"""

from __future__ import annotations

from gpu_check import check
from gpu_kernels import kernels
from gpu_peer import peer
from gpu_rung import rung
from gpu_step1b import step1b

STAGES = {"check": check, "kernels": kernels, "step1b": step1b, "rung": rung, "peer": peer}
