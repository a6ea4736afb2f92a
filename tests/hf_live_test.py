"""The live check: `transformers` loads what `rope_jax.hf.save` writes, at logits parity.

Skipped where torch or transformers is missing (CI); run it in the benchmark venv:

  . .venv-bench/bin/activate && HF_HUB_OFFLINE=1 python -m pytest -q -n 0 -s tests/hf_live_test.py

Each case prints `live <case>: <HF class> max |logits diff| <d> (max |logit| <m>)`.
"""

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never the hub
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rope_jax import hf  # noqa: E402
from tests.hf_test import EXPORTS, FIXTURES, random_model  # noqa: E402

CASES = {
    "llama_plain": ({}, "LlamaForCausalLM"),
    "llama_bf16_llama3": ({"param_dtype": "bfloat16", "norm_eps": 1e-5,
                           "rope.scaling.rope_type": "llama3", "rope.scaling.factor": 8.0,
                           "rope.scaling.low_freq_factor": 1.0,
                           "rope.scaling.high_freq_factor": 4.0,
                           "rope.scaling.original_max_position_embeddings": 16},
                          "LlamaForCausalLM"),
    "llama_dynamic_tied": ({"tie_embeddings": True, "rope.scaling.rope_type": "dynamic",
                            "rope.scaling.factor": 2.0, "rope.max_position_embeddings": 12},
                           "LlamaForCausalLM"),
    **EXPORTS,
}  # fmt: skip


def hf_logits(directory: str, tokens: np.ndarray, arch: str) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    )
    assert type(model).__name__ == arch
    model.eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_loads_our_export_at_parity(case, tmp_path):
    overrides, arch = CASES[case]
    model, cfg = random_model(seed=5, **overrides)
    hf.save(str(tmp_path), model, cfg, max_position_embeddings=cfg.rope.max_position_embeddings)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 20))
    ours = np.asarray(model(tokens))
    theirs = hf_logits(str(tmp_path), tokens, arch)
    diff, scale = float(np.abs(ours - theirs).max()), float(np.abs(ours).max())
    print(f"\nlive {case}: {arch} max |logits diff| {diff:.2e} (max |logit| {scale:.1f})")
    assert diff <= 1e-5 * scale


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_an_imported_fixture_exported_again_loads_in_transformers(name, tmp_path):
    directory = os.path.join(FIXTURES, name)
    model, cfg, tok = hf.load(directory)
    hf.save(str(tmp_path), model, cfg, max_position_embeddings=cfg.rope.max_position_embeddings,
            tokenizer=tok)  # fmt: skip
    tokens = np.load(os.path.join(directory, "tokens.npy"))
    arch = hf.config.export_architecture(cfg)
    theirs = hf_logits(str(tmp_path), tokens, arch)
    want = np.load(os.path.join(directory, "logits.npy"))
    np.testing.assert_allclose(theirs, want, rtol=0, atol=1e-6 * np.abs(want).max())
    if tok is not None:  # the tokenizer.json reads in transformers as well
        fast = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{tmp_path}/tokenizer.json")
        assert fast.encode("ROMEO: hark") == tok.encode("ROMEO: hark")
