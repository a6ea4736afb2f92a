"""Hugging Face checkpoints in and out (`rope_jax.hf`), against fixtures made by transformers.

The fixtures in tests/data/hf/ were written once by `scripts/make_hf_fixtures.py`
(`save_pretrained` of tiny random models, with the logits transformers computed); these
tests need neither torch nor transformers. The live check (transformers loads our
export) is tests/hf_live_test.py, skipped without torch.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import ml_collections
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from configs import common, lm
from rope_jax import harness, hf
from rope_jax import pairs as pairs_lib
from rope_jax.harness import checksums, metrics, runfiles, transfer
from rope_jax.hf import config as hf_config
from rope_jax.hf import convert, weights
from rope_jax.hf import run as hf_run
from rope_jax.nn import generate
from rope_jax.nn import model as model_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "data", "hf")
NAMES = ("llama", "llama_tied", "qwen2", "qwen3", "llama_sharded", "mistral", "granite_swa")
SLIDING = ("mistral", "granite_swa")  # fixtures with greedy.npy: P = 6 prompt tokens
GREEDY_PROMPT = 6


def fixture(name: str) -> str:
    return os.path.join(FIXTURES, name)


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def tensors(directory: str) -> dict:
    """{HF name: array} of every safetensors file in `directory`."""
    out = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            handle = safe_open(os.path.join(directory, file), "numpy")
            out.update({k: handle.get_tensor(k) for k in handle.keys()})
    return out


_jitted_forward = nnx.jit(lambda model, tokens: model(tokens))


def forward(model, tokens) -> np.ndarray:
    """The model's logits of `tokens`, through one jitted program per model and shape (the
    same numbers as calling the model, without compiling each operation eagerly)."""
    return np.asarray(_jitted_forward(model, tokens))


def copy_fixture(name: str, tmp_path, **config_changes) -> str:
    """A writable copy of fixture `name` with config.json keys replaced."""
    out = str(tmp_path / name)
    shutil.copytree(fixture(name), out)
    if config_changes:
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
        cfg.update(config_changes)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f)
    return out


# ------------------------------------------------------------------------ requirements


def _pins(path: str) -> dict[str, str]:
    pins = {}
    for line in open(os.path.join(ROOT, path)):
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_requirement_files_pin_shared_packages_alike():
    """`pip install -r requirements.txt -r requirements-bench.txt` (the bench venv's
    command) resolves only if every package both files pin has one version."""
    main, bench = _pins("requirements.txt"), _pins("requirements-bench.txt")
    shared = sorted(set(main) & set(bench))
    assert len(shared) > 5  # the bench file repeats the peers' dependencies it shares
    assert {p: (main[p], bench[p]) for p in shared if main[p] != bench[p]} == {}
    assert "safetensors" in main and "torch" not in main and "transformers" not in main


# ------------------------------------------------------------------------------ import


@pytest.mark.parametrize("name", NAMES)
def test_imported_logits_equal_transformers(name):
    model, cfg, _ = hf.load(fixture(name))
    tokens = np.load(os.path.join(fixture(name), "tokens.npy"))
    want = np.load(os.path.join(fixture(name), "logits.npy"))
    got = forward(model, tokens)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_import_reads_every_feature_of_the_config():
    fields = hf_config.model_fields(hf_config.read(fixture("llama")))
    assert fields["head_dim"] == 16 and fields["embed_dim"] == 48  # H != D / N
    assert (fields["num_heads"], fields["num_kv_heads"]) == (4, 2)
    assert fields["norm_eps"] == 1e-5 and fields["tie_embeddings"] is False
    assert fields["rope.scaling"]["rope_type"] == "llama3" and fields["rope.layout"] == "half"
    assert fields["rope.max_position_embeddings"] == 64
    qwen2 = hf_config.model_fields(hf_config.read(fixture("qwen2")))
    assert qwen2["attention.qkv_bias"] and qwen2["tie_embeddings"] and qwen2["rope.base"] == 1e6
    assert hf_config.model_fields(hf_config.read(fixture("qwen3")))["attention.qk_norm"]


VARIANTS = json.load(open(os.path.join(FIXTURES, "llama", "variants.json")))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_rope_rule_equals_transformers(variant, tmp_path):
    directory = copy_fixture("llama", tmp_path, **VARIANTS[variant])
    model, cfg, _ = hf.load(directory)
    given = VARIANTS[variant]["rope_parameters"]
    pairs, rule = pairs_lib.from_hf({k: v for k, v in given.items() if k != "rope_theta"})
    assert cfg.rope.scaling.rope_type == rule["rope_type"]  # proportional: linear at its factor
    assert pairs_lib.PairSpec.of(cfg.rope.pairs) == pairs
    assert (pairs.rule == "proportional") == (given["rope_type"] == "proportional")
    tokens = np.load(os.path.join(directory, "tokens.npy"))[:1]
    want = np.load(os.path.join(directory, f"logits.{variant}.npy"))
    got = forward(model, tokens)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    if variant != "default":  # the rule changes the logits: the test can tell rules apart
        assert max_diff(want, np.load(os.path.join(directory, "logits.default.npy"))) > 1e-2


def test_bfloat16_weights_stay_bfloat16_unless_asked():
    model, cfg, _ = hf.load(fixture("llama_tied"))
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert cfg.param_dtype == "bfloat16" and dtypes == {np.dtype(ml_dtypes.bfloat16)}
    assert model.head is None  # tied: the logits use the embedding table
    wide, cfg, _ = hf.load(fixture("llama_tied"), param_dtype="float32")
    assert {x.dtype for x in jax.tree.leaves(nnx.state(wide, nnx.Param))} == {np.dtype("float32")}


@pytest.mark.slow
def test_imported_model_decodes_with_its_cache():
    """Greedy decoding with the key/value cache equals argmax of full forward passes."""
    model, _, tok = hf.load(fixture("qwen3"))
    prompt = np.load(os.path.join(fixture("qwen3"), "tokens.npy"))[:, :5]
    new = np.asarray(generate.generate(model, prompt, max_new_tokens=3))
    seq = prompt
    for _ in range(3):
        seq = np.concatenate([seq, np.argmax(forward(model, seq)[:, -1:], -1)], axis=1)
    np.testing.assert_array_equal(new, seq[:, 5:])


def test_sliding_windows_sinks_and_layer_types_are_read():
    mistral = hf_config.model_fields(hf_config.read(fixture("mistral")))
    assert (mistral["attention.window"], mistral["attention.layer_types"]) == (8, ())
    assert mistral["attention.sinks"] is False
    granite = hf_config.model_fields(hf_config.read(fixture("granite_swa")))
    assert granite["attention.sinks"] is True and granite["attention.window"] == 6
    assert granite["attention.layer_types"] == ("sliding", "full")
    assert granite["rope.scaling"]["rope_type"] == "yarn"
    assert granite["rope.scaling"]["truncate"] is False  # gpt-oss's yarn
    no_window = hf_config.model_fields({**hf_config.read(fixture("mistral")),
                                        "sliding_window": None})  # fmt: skip
    assert (no_window["attention.window"], no_window["attention.layer_types"]) == (0, ())


@pytest.mark.parametrize("name", SLIDING)
def test_the_window_and_the_sinks_change_the_logits(name):
    """The fixtures' T = 24 tokens run past the window and the sinks are not zero: a
    model without either would not equal transformers (the test can tell)."""
    model, cfg, _ = hf.load(fixture(name))
    tokens = np.load(os.path.join(fixture(name), "tokens.npy"))
    want = np.load(os.path.join(fixture(name), "logits.npy"))
    assert tokens.shape[1] > cfg.attention.window
    params = nnx.state(model, nnx.Param)
    full = cfg.copy_and_resolve_references()
    full.attention.window, full.attention.layer_types = 0, ()
    without = nnx.merge(nnx.graphdef(convert.abstract_model(full)), params)
    assert max_diff(forward(without, tokens), want) > 1e-2
    if cfg.attention.sinks:
        for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            if var.shape == (cfg.num_heads,):
                var.set_value(np.full(var.shape, -1e9, var.dtype))  # exp(sink) = 0
        assert max_diff(forward(model, tokens), want) > 1e-2


@pytest.mark.parametrize("name", ["mistral", pytest.param("granite_swa", marks=pytest.mark.slow)])
def test_greedy_decoding_past_the_window_equals_transformers(name):
    """`generate` through the key/value cache (ring caches on the sliding layers) gives
    transformers' greedy tokens (`greedy.npy`, its own cache), 26 tokens past W = 8 / 6."""
    model, cfg, _ = hf.load(fixture(name))
    want = np.load(os.path.join(fixture(name), "greedy.npy"))
    assert want.shape[1] > cfg.attention.window + GREEDY_PROMPT
    new = generate.generate(model, want[:, :GREEDY_PROMPT], max_new_tokens=want.shape[1] - 6)
    np.testing.assert_array_equal(np.asarray(new), want[:, GREEDY_PROMPT:])


GRANITE_VARIANTS = json.load(open(os.path.join(FIXTURES, "granite_swa", "variants.json")))


@pytest.mark.parametrize("variant", sorted(GRANITE_VARIANTS))
def test_granite_swa_variants_equal_transformers(variant, tmp_path):
    """No layer_types in config.json: GraniteSWA's own default (layer i full when
    i % 4 == 0), not the fixture's order."""
    directory = copy_fixture("granite_swa", tmp_path, **GRANITE_VARIANTS[variant])
    model, cfg, _ = hf.load(directory)
    assert cfg.attention.layer_types == ("full", "sliding")
    tokens = np.load(os.path.join(directory, "tokens.npy"))[:1]
    want = np.load(os.path.join(directory, f"logits.{variant}.npy"))
    np.testing.assert_allclose(forward(model, tokens), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())  # fmt: skip
    assert max_diff(want, np.load(os.path.join(directory, "logits.npy"))[:1]) > 1e-2


def test_a_byte_level_tokenizer_json_gives_the_byte_ids():
    """What a byte-level run exports: `tokenizers` loads it and encodes text to the
    ByteTokenizer's ids (the 256 bytes, PAD/BOS/EOS at 256/257/258) and back."""
    import tokenizers as hf_tokenizers

    from rope_jax.data import tokenizers

    ours = tokenizers.ByteTokenizer()
    tok = hf_tokenizers.Tokenizer.from_str(ours.to_hf().to_str())
    text = "ROMEO: O, sé thou\tpa\u0300tient,\r\n  日本 \x00\x7f end ~"
    assert tok.encode(text).ids == ours.encode(text) and tok.decode(tok.encode(text).ids) == text
    assert tok.get_vocab_size() == ours.vocab_size == 259
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>")] == [256, 257, 258]
    assert tok.decode([72, 105, 258, 0xE6]) == ours.decode([72, 105, 258, 0xE6])  # bad UTF-8
    assert sorted(tok.get_vocab().values()) == list(range(259))


def test_an_exported_byte_level_run_carries_its_tokenizer(tmp_path):
    """A byte-level run (runfiles gives it a ByteTokenizer) exports a tokenizer.json that
    `tokenizers` reads with the run's ids, and re-imports with it."""
    import tokenizers as hf_tokenizers

    from rope_jax.data import tokenizers

    ours = tokenizers.ByteTokenizer()
    assert runfiles.load_tokenizer(str(tmp_path)).kind == "bytes"  # a run without a tokenizer/
    model, cfg = random_model(vocab_size=259)
    files = hf.save(str(tmp_path / "out"), model, cfg, max_position_embeddings=64, tokenizer=ours)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(map(os.path.basename, files))
    assert json.load(open(tmp_path / "out" / "tokenizer_config.json")) == {
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}  # fmt: skip
    cfg_json = json.load(open(tmp_path / "out" / "config.json"))
    assert [cfg_json[f"{k}_token_id"] for k in ("pad", "bos", "eos")] == [256, 257, 258]
    tok = hf_tokenizers.Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    _, _, again = hf.load(str(tmp_path / "out"))
    text = "KING: Now is the winter of our discontent\n"
    assert tok.encode(text).ids == again.encode(text) == ours.encode(text)
    assert (again.pad_id, again.bos_id, again.eos_id, again.vocab_size) == (256, 257, 258, 259)
    assert again.encode("a<eos>") == ours.encode("a<eos>")  # text, as in the run


# ------------------------------------------------------------------------------ export


@pytest.mark.parametrize("name", NAMES)
def test_import_export_import_is_bit_exact(name, tmp_path):
    model, cfg, tok = hf.load(fixture(name))
    out = str(tmp_path / "out")
    hf.save(out, model, cfg, max_position_embeddings=cfg.rope.max_position_embeddings,
            tokenizer=tok)  # fmt: skip
    original, written = tensors(fixture(name)), tensors(out)
    assert sorted(written) == sorted(original)  # HF's own names, lm_head only if untied
    for key, value in original.items():
        assert written[key].dtype == value.dtype and written[key].shape == value.shape, key
        assert np.array_equal(written[key].view(np.uint8), value.view(np.uint8)), key
    again, cfg2, _ = hf.load(out)
    first, second = convert.flat_params(model), convert.flat_params(again)
    assert first.keys() == second.keys()
    assert all(np.array_equal(first[k].view(np.uint8), second[k].view(np.uint8)) for k in first)
    assert cfg2.to_dict() == cfg.to_dict()
    assert os.path.isfile(os.path.join(out, "tokenizer.json")) == (tok is not None)
    if tok is not None:  # transformers' tokenizer learns the specials' names from it
        specials = json.load(open(os.path.join(out, "tokenizer_config.json")))
        assert {k: tok.tok.token_to_id(v) for k, v in specials.items()} == {
            "bos_token": tok.bos_id, "eos_token": tok.eos_id, "pad_token": tok.pad_id}  # fmt: skip
    for file in os.listdir(out):  # readable by other users (safetensors alone writes 0600)
        assert os.stat(os.path.join(out, file)).st_mode & 0o777 == 0o644, file


def test_an_export_stopped_part_way_is_never_a_model_and_a_replaced_one_keeps_no_stale_file(
    tmp_path, monkeypatch
):
    """config.json is written last (it marks a complete model): an export cut short while
    it writes the weights (Ctrl-C, a full disk) over an earlier one leaves none, so
    neither transformers nor `export_run` ("holds a model already") takes the half-written
    directory for a model; a replacement without a tokenizer drops the old tokenizer.json."""
    llama, cfg, tok = hf.load(fixture("llama"))
    out = str(tmp_path / "out")
    hf.save(out, llama, cfg, max_position_embeddings=cfg.rope.max_position_embeddings,
            tokenizer=tok)  # fmt: skip
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))

    def cut_short(directory, arrays):
        with open(os.path.join(directory, weights.SINGLE_FILE), "wb") as f:
            f.write(b"half a file")
        raise KeyboardInterrupt

    model, small = random_model()
    with monkeypatch.context() as patch:
        patch.setattr(weights, "write", cut_short)
        with pytest.raises(KeyboardInterrupt):
            hf.save(out, model, small, max_position_embeddings=64)
    assert sorted(os.listdir(out)) == [weights.SINGLE_FILE]  # no config.json: not a model
    with pytest.raises(hf_config.HFError):
        hf.load(out)
    files = hf.save(out, model, small, max_position_embeddings=64)
    assert sorted(map(os.path.basename, files)) == sorted(os.listdir(out)) == [
        "config.json", weights.SINGLE_FILE]  # fmt: skip
    again, _, no_tok = hf.load(out)
    assert no_tok is None
    first, second = convert.flat_params(model), convert.flat_params(again)
    assert all(np.array_equal(first[k], second[k]) for k in first)


LLAMA_TENSORS = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
    f"model.layers.{i}.{t}"
    for i in range(2)
    for t in (
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    )  # fmt: skip
]


def random_model(seed=0, **overrides):
    """A tiny rope_jax Decoder with every parameter random (norms, biases included)."""
    cfg = common.base_config("tiny").model
    cfg.update_from_flattened_dict({"vocab_size": 64, "embed_dim": 32, "num_heads": 4,
                                    "num_kv_heads": 2, "head_dim": 16, "mlp_dim": 48,
                                    "rope.max_position_embeddings": 64, **overrides})  # fmt: skip
    model = model_lib.Decoder(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        noise = rng.normal(size=var.shape) * 0.3
        var.set_value((np.asarray(var.get_value()) + noise).astype(var.dtype))
    return model, cfg


@pytest.mark.slow
def test_exported_run_is_what_llamaforcausallm_expects(tmp_path):
    """The names, shapes and config keys transformers' Llama reads (checked without torch;
    tests/hf_live_test.py loads it in transformers)."""
    model, cfg = random_model(**{"norm_eps": 1e-5, "rope.base": 500000.0,
                                 "rope.scaling.rope_type": "llama3", "rope.scaling.factor": 8.0,
                                 "rope.scaling.low_freq_factor": 1.0,
                                 "rope.scaling.high_freq_factor": 4.0})  # fmt: skip
    hf.save(str(tmp_path), model, cfg, max_position_embeddings=64)
    written = tensors(str(tmp_path))
    assert sorted(written) == sorted(LLAMA_TENSORS)
    assert written["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 32)  # [N*H, D]
    assert written["model.layers.0.self_attn.o_proj.weight"].shape == (32, 4 * 16)  # [D, N*H]
    assert written["model.layers.1.mlp.down_proj.weight"].shape == (32, 48)  # [D, F]
    meta = safe_open(os.path.join(tmp_path, "model.safetensors"), "numpy").metadata()
    assert meta == {"format": "pt"}  # transformers refuses other formats
    cfg_json = json.load(open(os.path.join(tmp_path, "config.json")))
    assert cfg_json["architectures"] == ["LlamaForCausalLM"] and cfg_json["model_type"] == "llama"
    assert cfg_json["rope_parameters"] == {
        "rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    assert (cfg_json["rms_norm_eps"], cfg_json["head_dim"], cfg_json["num_key_value_heads"]) == (
        1e-5, 16, 2)  # fmt: skip
    assert cfg_json["tie_word_embeddings"] is False and cfg_json["dtype"] == "float32"
    again, _, _ = hf.load(str(tmp_path))
    tokens = np.arange(24).reshape(2, 12) % 64
    np.testing.assert_array_equal(forward(again, tokens), forward(model, tokens))


EXPORTS = {  # overrides -> HF class; every one reloads with the same logits
    "interleaved": ({"rope.layout": "interleaved"}, "LlamaForCausalLM"),
    "interleaved_partial": ({"rope.layout": "interleaved", "rope.pairs.rule": "proportional",
                             "rope.pairs.fraction": 0.5}, "LlamaForCausalLM"),
    "proportional_linear": ({"rope.pairs.rule": "proportional", "rope.pairs.fraction": 0.25,
                             "rope.scaling.rope_type": "linear", "rope.scaling.factor": 2.0},
                            "LlamaForCausalLM"),
    "qk_norm_tied_yarn": ({"attention.qk_norm": True, "tie_embeddings": True,
                           "rope.layout": "interleaved", "rope.scaling.rope_type": "yarn",
                           "rope.scaling.factor": 4.0}, "Qwen3ForCausalLM"),
    "sliding_every_layer": ({"attention.window": 6}, "MistralForCausalLM"),
    "sinks_alternating_yarn": ({"attention.sinks": True, "attention.window": 5,
                                "attention.layer_types": ("full", "sliding"),
                                "rope.scaling.rope_type": "yarn", "rope.scaling.factor": 4.0,
                                "rope.scaling.truncate": False}, "GraniteSWAForCausalLM"),
    "sinks_only": ({"attention.sinks": True}, "GraniteSWAForCausalLM"),
    "qkv_bias_longrope": ({"attention.qkv_bias": True, "rope.layout": "interleaved",
                           "rope.scaling.rope_type": "longrope",
                           "rope.scaling.original_max_position_embeddings": 8,
                           "rope.scaling.short_factor": (1.0, 1.5, 2.0, 3.0, 1.0, 1.0, 2.0, 4.0),
                           "rope.scaling.long_factor": (2.0, 1.5, 2.0, 3.0, 5.0, 1.0, 2.0, 4.0)},
                          "Qwen2ForCausalLM"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(EXPORTS))
def test_export_maps_every_layout_and_feature(case, tmp_path):
    """An interleaved-pair model is written with HF's half pairs (q/k rows, biases and
    norm scales permuted): it reloads as layout half with the same logits."""
    overrides, arch = EXPORTS[case]
    model, cfg = random_model(seed=3, **overrides)
    hf.save(str(tmp_path), model, cfg, max_position_embeddings=64)
    assert json.load(open(os.path.join(tmp_path, "config.json")))["architectures"] == [arch]
    again, cfg2, _ = hf.load(str(tmp_path))
    assert cfg2.rope.layout == "half"
    assert cfg2.attention.to_dict() == {
        **cfg.attention.to_dict(),
        "layer_types": tuple(cfg.attention.layer_types),
    }
    tokens = np.random.default_rng(0).integers(0, 64, (2, 20))  # 20 > L0 = 8 for longrope
    want = forward(model, tokens)
    np.testing.assert_allclose(forward(again, tokens), want, atol=1e-5 * np.abs(want).max())
    if cfg.rope.layout == "interleaved":  # without the permutation it would not be equal
        q = "blocks.0.attn.q_proj"
        plain = np.asarray(convert.flat_params(model)[q])
        assert not np.array_equal(convert.flat_params(again)[q], plain)


REFUSED = {
    "model.rope.sites='vo'": {"model.rope.sites": "vo"},
    "model.rope.sites=''": {"model.rope.sites": ""},
    "model.attention.kv='tied'": {"model.attention.kv": "tied", "model.rope.sites": "qkvo"},
    "model.rope.learned='freqs'": {"model.rope.learned": "freqs"},
    "model.rope.nope_every=2": {"model.rope.nope_every": 2},
    "model.rope.global_every=2": {"model.rope.global_every": 2, "model.rope.local_base": 100.0},
    "data (position axes)=3": {"num_axes": 3},
    "model.attention.sinks=True": {"model.attention.sinks": True,
                                   "model.attention.qkv_bias": True},
    "model.attention.window=16": {"model.attention.window": 16,
                                  "model.attention.qk_norm": True},
    "model.attention.chunk=8": {"model.attention.chunk": 8},
    "model.attention.qk_l2_norm=True": {"model.attention.qk_l2_norm": True},
    "model.attention.q_lora_rank=32": {"model.attention.q_lora_rank": 32},
    "model.attention.q_l2_norm=True": {"model.attention.q_l2_norm": True},
    "model.attention.kv_norm=True": {"model.attention.kv": "tied", "model.rope.sites": "qkvo",
                                     "model.attention.kv_norm": True},
    "model.attention.o_groups=2": {"model.attention.o_groups": 2,
                                   "model.attention.o_lora_rank": 32},
    "model.rope.pairs.rule='first'": {"model.rope.pairs.rule": "first",
                                      "model.rope.pairs.fraction": 0.5},
    "model.rope.pairs.rule='index'": {"model.rope.pairs.rule": "index",
                                      "model.rope.pairs.index": (0, 2)},
    "model.rope.pairs.rule='proportional'": {"model.rope.pairs.rule": "proportional",
                                             "model.rope.pairs.fraction": 0.5,
                                             "model.rope.scaling.rope_type": "yarn",
                                             "model.rope.scaling.factor": 4.0},
}  # fmt: skip


@pytest.mark.parametrize("setting", sorted(REFUSED))
def test_export_refuses_what_hf_cannot_express(setting):
    config = lm.get_config()
    overrides = dict(REFUSED[setting])
    num_axes = overrides.pop("num_axes", 1)
    config.update_from_flattened_dict(overrides)
    with pytest.raises(hf.HFError, match=re.escape(setting)):
        hf_config.check_exportable(config.model, num_axes=num_axes)
    hf_config.check_exportable(lm.get_config().model)  # the plain qk model is fine


# ---------------------------------------------------------------- one line per mistake


def run_cli(*args, timeout=240):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, JAX_PLATFORMS="cpu"))  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-2000:]
    assert "Traceback" not in stderr
    return lines[0]


def _missing_shard(tmp_path):
    directory = copy_fixture("llama_sharded", tmp_path)
    os.remove(os.path.join(directory, "model-00002-of-00003.safetensors"))
    return directory


def _dtype_mismatch(tmp_path):
    directory = copy_fixture("qwen3", tmp_path)
    path = os.path.join(directory, "model.safetensors")
    arrays = tensors(directory)
    arrays["model.norm.weight"] = arrays["model.norm.weight"].astype(ml_dtypes.bfloat16)
    save_file(arrays, path, metadata={"format": "pt"})
    return directory


def _router_tensor(tmp_path):
    directory = copy_fixture("granite_swa", tmp_path)
    arrays = tensors(directory)
    arrays["model.layers.1.mlp.router.weight"] = np.zeros((4, 32), np.float32)
    save_file(arrays, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return directory


BAD_INPUT = {
    "missing shard": (_missing_shard, "shard model-00002-of-00003.safetensors listed in "
                      "model.safetensors.index.json is missing"),
    "shape mismatch": (lambda t: copy_fixture("qwen2", t, intermediate_size=80),
                       "tensor model.layers.0.mlp.down_proj.weight has shape [32, 64]; "
                       "config.json implies [32, 80]"),
    "dtype mismatch": (_dtype_mismatch, "tensor model.norm.weight has dtype BF16 but"),
    "unsupported architecture": (
        lambda t: copy_fixture("llama_tied", t, architectures=["GPT2LMHeadModel"]),
        "config.json architectures=['GPT2LMHeadModel'] is not supported; supported: "
        "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
    "unsupported rope type": (
        lambda t: copy_fixture("llama_tied", t, rope_parameters={"rope_type": "mrope",
                                                                 "rope_theta": 1e4}),
        "config.json rope_parameters['rope_type']='mrope' must be one of default, linear"),
    "unsupported legacy rope type": (  # the error names the key the file has
        lambda t: copy_fixture("llama_tied", t, rope_parameters=None, rope_theta=1e4,
                               rope_scaling={"type": "foo", "factor": 2.0}),
        "config.json rope_scaling['type']='foo' must be one of default, linear"),
    "no weights": (lambda t: os.path.dirname(copy_fixture("llama_tied", t)) + "/nothing",
                   "is not a directory"),
    "gpt-oss": (lambda t: copy_fixture("granite_swa", t, architectures=["GptOssForCausalLM"],
                                       model_type="gpt_oss", num_local_experts=32),
                "config.json architectures=['GptOssForCausalLM'] num_local_experts=32: a "
                "mixture-of-experts MLP (router and experts) is not supported"),
    "experts counted": (lambda t: copy_fixture("llama", t, num_experts=8),
                        "num_experts=8: a mixture-of-experts MLP"),
    "router weights": (_router_tensor, "tensor model.layers.1.mlp.router.weight belongs to "
                       "a mixture-of-experts MLP (router and experts), which is not supported"),
    "layer type": (lambda t: copy_fixture("granite_swa", t, layer_types=["sliding_attention",
                                                                          "chunked_attention"]),
                   "config.json layer_types[1]='chunked_attention' is not supported: rope_jax's "
                   "layers are full_attention or sliding_attention"),
    "sliding qwen": (lambda t: copy_fixture("qwen3", t, use_sliding_window=True,
                                            layer_types=["sliding_attention"] * 2),
                     "Qwen3ForCausalLM's sliding-window layers are not supported"),
    "mistral layer_types": (lambda t: copy_fixture("mistral", t, layer_types=[
        "sliding_attention", "full_attention"]), "MistralForCausalLM slides every layer"),
    "attention multiplier": (lambda t: copy_fixture("granite_swa", t, attention_multiplier=1.0),
                             "config.json attention_multiplier=1.0 is not supported: rope_jax's "
                             "decoder has attention_multiplier=0.25 (head_dim ** -0.5) fixed"),
    "per-layer bases": (lambda t: copy_fixture("granite_swa", t, layer_rope_theta=[1e4, 0]),
                        "config.json layer_rope_theta=[10000.0, 0]: per-layer bases and NoPE"),
    "bad window": (lambda t: copy_fixture("mistral", t, sliding_window=0),
                   "config.json sliding_window=0 must be a positive integer or null"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line(case, tmp_path):
    """Each mistake is one HFError line from `hf.load` and from the import that `python -m
    rope_jax.hf import` and `eval.py --hf` run (in-process here: the command prints that
    line, test_the_import_command_prints_a_mistake_as_its_one_line), and nothing is written."""
    make, message = BAD_INPUT[case]
    directory = make(tmp_path)
    with pytest.raises(hf.HFError, match=re.escape(message)) as error:
        hf.load(directory)
    assert "\n" not in str(error.value)
    with pytest.raises(hf.HFError, match=re.escape(message)) as error:
        hf_run.import_run(directory, str(tmp_path / "w"), hf_run.default_config())
    assert "\n" not in str(error.value)
    assert not os.path.exists(tmp_path / "w")  # nothing written


@pytest.mark.slow
def test_the_import_command_prints_a_mistake_as_its_one_line(tmp_path):
    """`python -m rope_jax.hf import` of a bad directory: the import's HFError is the one
    line on stderr, exit status 1, nothing written (every mistake: test_bad_input_is_one_line)."""
    make, message = BAD_INPUT["missing shard"]
    directory = make(tmp_path)
    code, _, err = run_cli("-m", "rope_jax.hf", "import", f"--hf={directory}",
                           f"--workdir={tmp_path / 'w'}")  # fmt: skip
    assert code == 1 and message in one_line_error(err)
    assert not os.path.exists(tmp_path / "w")  # nothing written


@pytest.mark.slow
def test_export_of_a_run_hf_cannot_express_is_one_line(tmp_path):
    config = lm.get_config("row=vo")
    os.makedirs(tmp_path / "run")
    runfiles.save_config(str(tmp_path / "run"), config)
    code, _, err = run_cli("-m", "rope_jax.hf", "export", f"--workdir={tmp_path / 'run'}",
                           f"--out={tmp_path / 'out'}")  # fmt: skip
    assert code == 1
    assert one_line_error(err) == (
        "error: cannot export to Hugging Face: model.rope.sites='vo': transformers rotates "
        "exactly q and k (sites v/o and NoPE have no HF class)"
    )
    assert not os.path.exists(tmp_path / "out")
    code, _, err = run_cli("eval.py", f"--hf={FIXTURES}/missing", f"--workdir={tmp_path / 'e'}")
    assert code == 1 and "is not a directory" in one_line_error(err)


def test_an_export_into_the_run_or_where_nothing_can_be_written_stops_before_restoring(tmp_path):
    """--out=the workdir would, with --overwrite, replace the run's config.json by HF's;
    an --out that cannot be written is named before the checkpoint is restored."""
    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    runfiles.save_config(workdir, lm.get_config())  # no checkpoint: neither restores
    before = open(os.path.join(workdir, "config.json")).read()
    with pytest.raises(hf_config.HFError, match=r"is the run's workdir .* e\.g\. --out=.*/hf$"):
        hf_run.export_run(workdir, workdir + "/.", overwrite=True)
    assert open(os.path.join(workdir, "config.json")).read() == before
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"^--out=.*/file/x is not writable: Not a directory$"):
        hf_run.export_run(workdir, str(tmp_path / "file" / "x"))


# ------------------------------------------------------------------- train, eval, decode


def small_run(data_dir, **overrides):
    config = lm.get_config()
    config.update_from_flattened_dict({"data.data_dir": data_dir, "data.seq_len": 32,
                                       "data.global_batch_size": 4, "train.num_steps": 2,
                                       "train.log_every_steps": 1, "train.eval_every_steps": 0,
                                       "eval.num_batches": 1, "eval.batch_size": 4,
                                       **overrides})  # fmt: skip
    return config


def test_a_second_import_into_a_workdir_being_imported_waits_and_reuses_it(tmp_path, capsys):
    """Two `eval.py --hf` into one new workdir at once once both wrote checkpoint step 0
    and both failed; now the second waits for the first (saying so) and reuses its import."""
    import threading

    from rope_jax.harness import workdir as workdir_lib

    workdir = str(tmp_path / "m")
    os.makedirs(workdir)
    held = workdir_lib.Lock(workdir, name=hf_run.IMPORT_LOCK)
    held.acquire()  # the first import, under way
    lines = []
    second = threading.Thread(target=lambda: lines.append(
        hf_run.import_run(fixture("llama"), workdir, lm.get_config())))  # fmt: skip
    second.start()
    second.join(timeout=3)
    assert second.is_alive() and not os.path.exists(os.path.join(workdir, "checkpoints"))
    assert "waiting for another import into" in capsys.readouterr().out
    held.release()
    second.join()
    assert lines and lines[0].startswith("imported ")
    again = hf_run.import_run(fixture("llama"), workdir, lm.get_config())
    assert "holds" in again and "already" in again


def test_the_harness_reads_hf_dir_through_the_sources_it_is_given():
    """`hf.run.SOURCES`, as train.py passes them: the run takes DIR's architecture and
    DIR's arrays by name."""
    config = lm.get_config()
    config.train.init_from = f"hf:{fixture('llama')}"
    adopted = transfer.prepare(config, hf_run.SOURCES)
    assert (adopted.model.embed_dim, adopted.model.head_dim) == (48, 16)
    step, arrays = transfer.source_params(config.train.init_from, hf_run.SOURCES)
    shapes = convert.param_shapes(adopted.model)
    assert step is None and {k: v.shape for k, v in arrays.items()} == shapes


def test_an_import_takes_the_defaults_that_configs_lm_gives_without_an_arg():
    """`python -m rope_jax.hf import` and `eval.py --hf` without --config: the library's
    defaults, never configs/ (which the library does not import)."""
    assert hf_run.default_config().to_dict() == lm.get_config().to_dict()


@pytest.fixture(scope="module")
def from_hf(data_dir, tmp_path_factory):
    """A run started with `init_from=hf:DIR` (the llama fixture) and trained 2 steps, made
    once for the two tests below (they only read it; they share one xdist group)."""
    workdir = str(tmp_path_factory.mktemp("from_hf") / "run")
    config = small_run(data_dir, **{"train.init_from": f"hf:{fixture('llama')}",
                                    "optim.warmup_steps": 1})  # fmt: skip
    harness.train_and_evaluate(config, workdir, sources=hf_run.SOURCES)
    return workdir


@pytest.mark.slow
@pytest.mark.xdist_group("hf_from_hf")
def test_an_imported_workdir_trains_on_as_a_run_started_from_the_model(data_dir, tmp_path, from_hf):
    """`eval.py --hf`'s import (step 0, no data position: nothing was read) trained on
    from its saved config (`configs/saved.py`) is the run `init_from=hf:DIR` trains
    (`from_hf`, the same small run); it used to stop with KeyError: 'data'."""
    directory = fixture("llama")
    config = small_run(data_dir, **{"optim.warmup_steps": 1})
    imported = str(tmp_path / "imported")
    hf_run.import_run(directory, imported, config)
    harness.train_and_evaluate(runfiles.load_config(imported), imported, sources=hf_run.SOURCES)
    losses = [
        [r["loss"] for r in metrics.read_jsonl(w) if "loss" in r] for w in (imported, from_hf)
    ]
    assert len(losses[0]) == 2 and losses[0] == losses[1]


@pytest.mark.slow
@pytest.mark.xdist_group("hf_from_hf")
def test_a_run_trains_from_an_hf_checkpoint_and_exports_back(tmp_path, from_hf):
    """init_from=hf:DIR: the run takes DIR's architecture, tokenizer and weights, trains
    2 steps (`from_hf`), and exports again (the export's logits are the trained run's)."""
    directory = fixture("llama")
    workdir = from_hf
    saved = runfiles.load_config(workdir)
    assert (saved.model.embed_dim, saved.model.head_dim, saved.model.vocab_size) == (48, 16, 288)
    assert saved.model.norm_eps == 1e-5 and saved.model.rope.scaling.rope_type == "llama3"
    assert saved.data.tokenizer == os.path.join(directory, "tokenizer.json")
    assert runfiles.load_tokenizer(workdir).vocab_size == 288
    losses = [r["loss"] for r in metrics.read_jsonl(workdir) if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))
    # the trained weights start at the HF ones
    _, source = transfer.source_params(f"hf:{directory}", hf_run.SOURCES)
    _, trained = transfer.source_params(workdir)
    moved = [max_diff(source[k], np.asarray(v)) for k, v in _named(trained).items()]
    assert 0 < max(moved) < 0.1  # two small steps away from the HF weights
    out = str(tmp_path / "hf")
    code, stdout, err = run_cli("-m", "rope_jax.hf", "export", f"--workdir={workdir}",
                                f"--out={out}")  # fmt: skip
    assert code == 0, err[-2000:]
    assert "exported step 2" in stdout
    again, _, tok = hf.load(out)
    assert tok.vocab_size == 288
    net = nnx.merge(harness.build(_no_corpus(saved), vocab_from_data=False).graphdef, trained)
    tokens = np.load(os.path.join(directory, "tokens.npy"))
    np.testing.assert_array_equal(forward(again, tokens), forward(net, tokens))


@pytest.mark.slow
def test_a_byte_level_run_exports_a_tokenizer_that_reimports(data_dir, tmp_path):
    """The default byte-level run (no tokenizer/ in its workdir; a 1-layer D = 32 decoder)
    trains 2 steps and exports: the directory's tokenizer.json gives the run's byte ids,
    and the import holds the run's logits."""
    from rope_jax.data import tokenizers

    workdir = str(tmp_path / "run")
    small = {"model.num_layers": 1, "model.embed_dim": 32, "model.num_heads": 2,
             "model.num_kv_heads": 1, "model.head_dim": 16, "model.mlp_dim": 64}  # fmt: skip
    harness.train_and_evaluate(small_run(data_dir, **{"optim.warmup_steps": 1, **small}), workdir)
    assert runfiles.load_tokenizer(workdir).kind == "bytes"
    out = str(tmp_path / "hf")
    hf_run.export_run(workdir, out)
    model, _, tok = hf.load(out)
    text = "ROMEO: O, she doth teach the torches to burn bright!\n"
    assert tok.encode(text) == tokenizers.ByteTokenizer().encode(text)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 256, 257, 258)
    saved = runfiles.load_config(workdir)
    _, trained = checkpoint_params(workdir)
    net = nnx.merge(harness.build(_no_corpus(saved), vocab_from_data=False).graphdef, trained)
    ids = np.asarray([tok.encode(text)])
    np.testing.assert_array_equal(forward(model, ids), forward(net, ids))


def checkpoint_params(workdir: str):
    return transfer.source_params(workdir)


def _named(tree) -> dict:
    return {checksums.leaf_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _no_corpus(config):
    from rope_jax.harness.evaluate import without_corpus

    return without_corpus(config)


@pytest.mark.slow
def test_eval_py_imports_evaluates_and_decodes_an_hf_model(data_dir, tmp_path, capsys):
    """`eval.py --hf` imports the model into a workdir and evaluates it; its --generate
    (what eval.py runs for it, in-process here: the command itself decodes in
    test_eval_py_decodes_a_sliding_window_model_as_transformers) finds the import there
    and continues the prompt as the imported model's own greedy decoding does."""
    from rope_jax.harness.evaluate import generate_text

    workdir = str(tmp_path / "m")
    overrides = [f"--config.data.data_dir={data_dir}", "--config.data.seq_len=32",
                 "--config.eval.batch_size=4", "--config.eval.num_batches=1"]  # fmt: skip
    args = ["eval.py", f"--hf={fixture('llama')}", f"--workdir={workdir}",
            "--config=configs/lm.py", *overrides]  # fmt: skip
    code, out, err = run_cli(*args)
    assert code == 0, err[-2000:]
    result = json.load(open(os.path.join(workdir, "eval_0.json")))
    # the import is trained at the model's context (max_position_embeddings 64), not the
    # evaluation window data.seq_len=32: that is its T and its default length
    assert result["step"] == 0 and result["train_seq_len"] == 64
    assert 0 < result["64"]["loss"] < 20
    config = runfiles.load_config(workdir)  # eval.py's --config and overrides, as imported
    assert "holds" in hf_run.import_run(fixture("llama"), workdir, config)
    capsys.readouterr()
    text = generate_text(workdir, prompt="ROMEO:", max_new_tokens=8)
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == text and text.startswith("ROMEO:")
    model, _, tok = hf.load(fixture("llama"))
    ids = np.asarray([tok.encode("ROMEO:")])
    new = generate.generate(model, ids, max_new_tokens=8)[0].tolist()
    new = new[: new.index(tok.eos_id)] if tok.eos_id in new else new
    assert text == "ROMEO:" + tok.decode(new)


@pytest.mark.slow
def test_eval_py_decodes_a_sliding_window_model_as_transformers(data_dir, tmp_path):
    """`eval.py --hf --generate` of the Mistral fixture (W = 8, its byte-level
    tokenizer.json) prints transformers' greedy continuation of "ROMEO:", 20 tokens on."""
    from rope_jax.data import tokenizers

    want = np.load(os.path.join(fixture("mistral"), "greedy.npy"))[0].tolist()
    assert bytes(want[:GREEDY_PROMPT]) == b"ROMEO:"
    new = want[GREEDY_PROMPT:]
    new = new[: new.index(258)] if 258 in new else new  # the run's EOS ends the text
    code, out, err = run_cli(
        "eval.py", f"--hf={fixture('mistral')}", f"--workdir={tmp_path / 'm'}",
        "--config=configs/lm.py", f"--config.data.data_dir={data_dir}",
        "--config.data.seq_len=32", "--generate", "--prompt=ROMEO:",
        f"--max_new_tokens={len(want) - GREEDY_PROMPT}",
    )  # fmt: skip
    assert code == 0, err[-2000:]
    text = "ROMEO:" + tokenizers.ByteTokenizer().decode(new)
    assert len(new) > 8 and text.replace("\r\n", "\n").replace("\r", "\n") in out


def test_a_window_not_below_the_runs_length_is_named_before_anything_is_written(tmp_path):
    """A run's window must be below data.seq_len (the decoder's rule): for an imported
    checkpoint the line says to raise the length, not to drop the window."""
    config = lm.get_config()
    config.data.seq_len = 8
    with pytest.raises(hf.HFError, match=r"sliding_window=8 is not below data\.seq_len=8, .* "
                       r"--config\.data\.seq_len above 8 "):  # fmt: skip
        hf_run.import_run(fixture("mistral"), str(tmp_path / "m"), config)
    assert not os.path.exists(tmp_path / "m")
    config.data.seq_len = 9
    assert convert.adopt(config, fixture("mistral")).model.attention.window == 8


def test_set_fields_replaces_the_whole_scaling_section():
    cfg = common.base_config("tiny").model
    cfg.rope.scaling.rope_type, cfg.rope.scaling.factor = "yarn", 4.0
    hf_config.set_fields(cfg, hf_config.model_fields(hf_config.read(fixture("llama_tied"))))
    assert cfg.rope.scaling.rope_type == "default" and cfg.rope.scaling.factor is None
    assert isinstance(cfg.rope.scaling, ml_collections.ConfigDict)
    model_lib.check_config(cfg)


def test_half_order_takes_interleaved_pairs_to_half_pairs():
    np.testing.assert_array_equal(weights.half_order(8), [0, 2, 4, 6, 1, 3, 5, 7])
    np.testing.assert_array_equal(weights.half_order(8, 4), [0, 2, 1, 3, 4, 5, 6, 7])
    bias = np.arange(16.0)  # [N*H] with N = 2, H = 8: each head reordered alone
    np.testing.assert_array_equal(
        weights.to_half("blocks.1.attn.k_bias", bias, 8), [0, 2, 4, 6, 1, 3, 5, 7,
                                                           8, 10, 12, 14, 9, 11, 13, 15]
    )  # fmt: skip
    assert weights.to_half("blocks.1.attn.v_bias", bias, 8) is bias  # values keep their order


def test_weights_are_read_one_tensor_at_a_time_when_placed():
    """read_params checks every tensor but reads none: each is read when it is placed."""
    from rope_jax.hf import convert, weights

    arrays, dtype = convert.read_params(fixture("llama"))
    assert all(isinstance(t, weights.Tensor) for t in arrays.values())
    reads = []
    for t in arrays.values():
        t._load = lambda o=t._load, n=t._name: reads.append(n) or o()
    first = next(iter(arrays.values()))
    assert reads == [] and first.shape == np.asarray(first).shape and len(reads) == 1
    assert np.asarray(first).dtype == first.dtype == np.dtype(dtype)
