"""Learned rotations (`config.model.rope.learned`): trainable frequencies and basis.

`KINDS` names each kind and the parameters it trains:

  none       the fixed rotation of `rope_jax.rotary` (nothing trained).
  freqs      RoPE-Mixed (Heo et al. 2024): a frequency per kv head, pair and axis,
             theta [K, P, A]; pair i of kv head k turns by phi = sum_a p_a theta[k, i, a].
  commuting  freqs in a trained orthonormal basis Q [H, H] shared by the layer's heads:
             R(p) = Q blockdiag_i(rot2(phi_i(p))) Q^T = expm(sum_a p_a B_a) with the
             commuting skew-symmetric generators B_a = Q blockdiag_i(theta[., i, a] J) Q^T
             (J = [[0, -1], [1, 0]]), in the ComRoPE / LieRE family. Q = cayley(S) of a
             trained S [H, H], so Q is orthogonal for every S.

Both start where `none` is: theta[k, i, a] is the fixed frequency of pair i on its axis
a(i) and 0 on the others, and S = 0 (Q = I), so at initialisation the rotation equals
the fixed one (bit-exact for `freqs`). Since every generator shares the pair blocks
(in the basis Q), R(m)^T R(n) = R(n - m) holds for any trained values: attention stays
relative. The maths is in docs/maths.md#learned-rotations.

Query head n uses kv head n // G's frequencies, as it uses that kv head's key: a key is
rotated once per kv head (and cached so), and relativity needs the query rotated by the
same R. With N = K every head has its own frequencies.

Pure functions of arrays (jit/vmap/grad-able); the phases are float32 whatever the
input dtype, as in `rotary`. The `Attention` module holds the parameters as
`nnx.Param`s named `PARAM_NAMES` and passes a `LearnedRotation` to `attend`.

Shape legend:
  T positions, N query heads, K kv heads, G = N / K, H head dim (even), P = H/2 pairs,
  A position axes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rope_jax import rotary
from rope_jax.rotary import RopeSpec

# kind -> the parameters it trains (attribute names on the `Attention` module).
KINDS = {"none": (), "freqs": ("rope_freqs",), "commuting": ("rope_freqs", "rope_basis")}
# Every learned-rotation parameter: frequencies [K, P, A] and the basis generator S [H, H].
PARAM_NAMES = ("rope_freqs", "rope_basis")
_HIGHEST = jax.lax.Precision.HIGHEST  # the basis products in full float32 on any backend


def check_kind(kind: Any, field: str = "learned") -> str:
    """Returns `kind` if it is one of `KINDS`, else raises naming `field`."""
    if kind not in KINDS:
        raise ValueError(f"{field}={kind!r} is not one of {', '.join(map(repr, KINDS))}")
    return kind


def refusal(spec: RopeSpec) -> str | None:
    """Why learned frequencies cannot start from `spec` (one line), or None: they start
    from the fixed ladder over the whole head, so a context rule (which rescales fixed
    frequencies by the length) or a pair selection other than all has no meaning here."""
    if spec.scaling is not None:
        return (f"learned frequencies start from the fixed ladder; rope_type="
                f"{spec.rope_type!r} rescales it")  # fmt: skip
    if spec.pairs.rule != "all":
        return (f"learned frequencies turn every pair of the head; pairs.rule="
                f"{spec.pairs.rule!r} freezes or drops some")  # fmt: skip
    return None


def initial_freqs(
    head_dim: int, num_kv_heads: int, rope: RopeSpec | None = None, *, num_axes: int = 1
) -> np.ndarray:
    """The fixed rotation as learned frequencies: theta[k, i, a] = theta_i if a = a(i), else 0.

    The same for every kv head. Only for specs that rotate the whole head with fixed
    frequencies (no scaling rule, no partial rotation).

    Returns:
      float32 [K, P, A].
    """
    spec = RopeSpec.of(rope)
    refused = refusal(spec)
    if refused:
        raise ValueError(refused)
    freqs, axes = rotary.pair_table(head_dim, spec, num_axes=num_axes)
    theta = np.zeros((num_kv_heads, freqs.size, num_axes), np.float32)
    theta[:, np.arange(freqs.size), axes] = freqs
    return theta


def cayley(generator) -> jax.Array:
    """The orthogonal Q = (I + W)(I - W)^{-1} of the skew-symmetric W = S - S^T.

    I - W is invertible for every real skew W (its eigenvalues are 1 - i lambda), and
    Q^T Q = I; S = 0 gives Q = I exactly.

    Args:
      generator: S, float [H, H] (any real matrix; only its skew part matters).

    Returns:
      float32 [H, H].
    """
    s = jnp.asarray(generator, jnp.float32)
    skew = s - s.T
    eye = jnp.eye(s.shape[-1], dtype=jnp.float32)
    # Q = (I - W)^{-1} (I + W): the two factors commute, so this is the same Q.
    return jnp.linalg.solve(eye - skew, eye + skew)


def learned_angles(positions, freqs) -> jax.Array:
    """Phase of every pair of every kv head: phi[..., k, i] = sum_a p_a theta[k, i, a].

    Computed as float32 products and sums (no matrix unit, whose default precision may
    round the operands): with one non-zero theta per pair it is p_{a(i)} theta_i exactly.

    Args:
      positions: [..., A] float or int.
      freqs: theta, float [K, P, A].

    Returns:
      float32 [..., K, P].
    """
    positions = jnp.asarray(positions).astype(jnp.float32)
    theta = jnp.asarray(freqs, jnp.float32)
    if positions.shape[-1] != theta.shape[-1]:
        raise ValueError(
            f"positions have {positions.shape[-1]} axes but the learned frequencies "
            f"{tuple(theta.shape)} [K, P, A] have {theta.shape[-1]}"
        )
    per_axis = positions[..., None, None, :] * theta  # [..., K, P, A]
    phase = per_axis[..., 0]
    for a in range(1, theta.shape[-1]):
        phase = phase + per_axis[..., a]
    return phase


def rotate(x, positions, freqs, basis=None, *, layout: str = "half", inverse: bool = False):
    """x -> R(p) x (R(p)^T x with inverse=True), R(p) = Q D(p) Q^T at each token's position.

    D(p) turns pair i of kv head k by phi[k, i] (`learned_angles`), pairs formed as
    `layout` says; query head n takes kv head n // G's angles. Without a basis Q = I.

    Args:
      x: [..., T, N, H] with N a multiple of K.
      positions: [..., T] (1-D) or [..., T, A].
      freqs: theta, float [K, P, A] with 2P = H.
      basis: Q, float32 orthogonal [H, H] (`cayley`), or None.
      layout: "half" or "interleaved" (`rotary.LAYOUTS`).

    Returns:
      [..., T, N, H] in x's dtype.
    """
    heads, head_dim = x.shape[-2:]
    kv_heads, pairs, _ = jnp.shape(freqs)
    if 2 * pairs != head_dim or heads % kv_heads:
        raise ValueError(
            f"x {tuple(x.shape)} [..., T, N, H] does not fit the learned frequencies "
            f"{tuple(jnp.shape(freqs))} [K, P, A]: need H = 2P and N a multiple of K"
        )
    positions = jnp.asarray(positions)
    if positions.ndim == x.ndim - 2:
        positions = positions[..., None]  # [..., T, 1]
    phase = learned_angles(positions, freqs)  # [..., T, K, P]
    y = x if basis is None else _in_basis(x, basis, transpose=True)  # Q^T x, float32
    grouped = y.reshape(*x.shape[:-2], kv_heads, heads // kv_heads, head_dim)  # [..., T, K, G, H]
    # `rotary.turn` reads [..., T', N', H] with phases [..., T', P]: here T' = K, N' = G.
    y = rotary.turn(grouped, phase, layout=layout, inverse=inverse).reshape(x.shape)
    return y if basis is None else _in_basis(y, basis).astype(x.dtype)  # Q D Q^T x


def _in_basis(x, basis, *, transpose: bool = False) -> jax.Array:
    """Q x (or Q^T x) of every head vector x [..., H], float32."""
    spec = "...h,hg->...g" if transpose else "...g,hg->...h"
    xf, q = x.astype(jnp.float32), jnp.asarray(basis, jnp.float32)
    return jnp.einsum(spec, xf, q, precision=_HIGHEST)


def rotation_matrix(position, freqs, basis=None, *, layout: str = "half") -> jax.Array:
    """The explicit R(p) = Q D(p) Q^T of every kv head, so rotate(x, p) == R(p) @ x.

    Args:
      position: [..., A].
      freqs: theta, float [K, P, A].
      basis: Q [H, H] or None.

    Returns:
      float32 [..., K, H, H].
    """
    phase = learned_angles(position, freqs)  # [..., K, P]
    cos, sin = jnp.cos(phase), jnp.sin(phase)
    pairs = phase.shape[-1]
    u, v = rotary._pair_indices(2 * pairs, layout)
    eye = jnp.eye(2 * pairs, dtype=jnp.float32)
    mat = jnp.broadcast_to(eye, (*phase.shape[:-1], 2 * pairs, 2 * pairs))
    mat = mat.at[..., u, u].set(cos).at[..., v, v].set(cos)
    mat = mat.at[..., v, u].set(sin).at[..., u, v].set(-sin)
    if basis is None:
        return mat
    q = jnp.asarray(basis, jnp.float32)
    return jnp.einsum("hg,...gf,ef->...he", q, mat, q, precision=_HIGHEST)


@dataclasses.dataclass(frozen=True)
class LearnedRotation:
    """A layer's learned rotation, as `attention.attend` takes it in place of a spec.

    `spec` gives the pair layout (and says there is no scaling rule: its attention
    factor is 1); `freqs` theta [K, P, A] and `basis` Q [H, H] (None for "freqs") are
    the arrays read from the layer's parameters (Q already through `cayley`).
    """

    spec: RopeSpec
    freqs: Any
    basis: Any = None

    def rotate(self, x, positions, inverse: bool = False) -> jax.Array:
        """x [..., T, N, H] -> R(p) x (or R(p)^T x) at positions [..., T] or [..., T, A]."""
        return rotate(
            x, positions, self.freqs, self.basis, layout=self.spec.layout, inverse=inverse
        )
