"""rope_jax: rotary position encodings in JAX.

Public modules: `rotary` (the rotation ops), `layouts` (position ids for
interleaved text / image / video sequences), `recurrence` (VO-RoPE with decaying
weights as a linear RNN) and `generate` (decoding with a key/value cache).
"""

__version__ = "0.1.0"

from rope_jax import signals as _signals

# `python -m rope_jax.<module>`: a Ctrl-C while the parent packages import JAX is held
# until the module's `main` starts (standard library only; nothing otherwise)
_signals.hold_for_module()
