"""Hugging Face checkpoints in and out (docs/hf.md).

  config    config.json <-> config.model; ARCHITECTURES (Llama, Qwen2, Qwen3); what
            export refuses (`check_exportable`)
  weights   safetensors <-> parameters: names, layouts, shards, dtypes
  convert   load(dir) -> (Decoder, config.model, tokenizer); save(dir, params, config.model)
  run       the harness side: train.init_from=hf:DIR, eval.py --hf=DIR, export of a workdir
  __main__  python -m rope_jax.hf export --workdir=W [--step=S] --out=DIR | import ...

Nothing here imports torch or transformers.
"""

from rope_jax.hf.config import ARCHITECTURES, HFError
from rope_jax.hf.convert import load, save

__all__ = ["ARCHITECTURES", "HFError", "load", "save"]
