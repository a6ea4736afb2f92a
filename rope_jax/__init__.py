"""rope_jax: rotary position encodings in JAX.

Public modules: `rotary` (the rotation ops) and `layouts` (position ids for
interleaved text / image / video sequences).
"""

__version__ = "0.1.0"
