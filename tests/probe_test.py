"""nn/probe: the largest attention logit of each layer equals the largest score the
attention kernel itself is given (captured from inside a real forward pass), for every
kind of layer the decoder has."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import lm
from rope_jax.nn import attention, kernels, probe
from rope_jax.nn import model as model_lib

# One worker runs the module: the ops its tests run eagerly (building decoders of one size)
# compile once.
pytestmark = pytest.mark.xdist_group("probe")

T = 64


def decoder(row: str):
    config = lm.get_config(f"row={row}")
    config.model.vocab_size = 259
    config.data.seq_len = T
    if row in ("irope", "v4"):  # chunk / window of T/4 at this T
        key = "chunk" if row == "irope" else "window"
        config.model.attention[key] = T // 4
        config.model.rope.nope_floor_scale = float(T // 4)
    return model_lib.Decoder(config.model, train_seq_len=T, rngs=nnx.Rngs(3))


@pytest.mark.parametrize("row", ["qk", "vo", "nope", "tied_qkvo", "irope", "v4"])
def test_the_largest_logit_is_the_largest_score_the_kernel_sees(row, monkeypatch):
    model = decoder(row)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 259, (2, T)))
    seen, mix = [], kernels.mix

    def spy(q, k, v, terms=None, **kw):
        terms = kernels.Terms.of(terms)
        assert terms.causal and not terms.q_offset
        scale = kw["scale"] or q.shape[-1] ** -0.5
        k_all = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
        logits = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k_all.astype(jnp.float32))
        ok = probe.allowed(q.shape[1], terms.window, terms.chunk)
        seen.append(jnp.max(jnp.where(ok, logits * scale, -jnp.inf)))
        return mix(q, k, v, terms, **kw)

    monkeypatch.setattr(attention.kernels, "mix", spy)

    @nnx.jit  # one compiled program (an eager pass compiles each op on its own)
    def forward_and_probe(model, tokens):
        model(tokens)
        forward = list(seen)  # one score per layer (the probe's own blocks add more)
        return forward, probe.max_attention_logits(model, tokens)

    forward, got = forward_and_probe(model, tokens)
    forward, got = [float(x) for x in forward], np.asarray(got)
    assert got.shape == (len(model.blocks),) and len(forward) == len(got)
    np.testing.assert_allclose(got, forward, rtol=1e-5, atol=1e-5)


def test_allowed_pairs_are_causal_inside_the_window_or_the_chunk():
    assert probe.allowed(4, None, None).tolist() == np.tril(np.ones((4, 4), bool)).tolist()
    window = probe.allowed(4, 2, None)
    assert window[3].tolist() == [False, False, True, True]
    chunk = probe.allowed(4, None, 2)
    assert chunk[3].tolist() == [False, False, True, True] and chunk[1].tolist() == [
        True, True, False, False]  # fmt: skip
