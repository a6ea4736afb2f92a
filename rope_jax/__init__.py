"""rope_jax: rotary position encodings in JAX.

The rotary ops are one import, `from rope_jax import rotary` (`RopeSpec`, `rotate`,
`frequencies`, ...; pure NumPy/JAX, no model, no config). Beside it: `pairs` (which pairs
turn) and `scaling` (context-scaling rules), the stages its frequencies are made of;
`layouts` (position ids for interleaved text / image / video sequences); and in `nn/`,
`nn.recurrence` (VO-RoPE with decaying weights as a linear RNN) and `nn.generate`
(decoding with a key/value cache).
"""

__version__ = "0.1.0"

from rope_jax import signals as _signals

# `python -m rope_jax.<module>`: a Ctrl-C while the parent packages import JAX is held
# until the module's `main` starts (standard library only; nothing otherwise)
_signals.hold_for_module()
