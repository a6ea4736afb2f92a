"""Makes the Hugging Face test fixtures in tests/data/hf/ (run once; the files are committed).

  . .venv-bench/bin/activate && HF_HUB_OFFLINE=1 python scripts/make_hf_fixtures.py [NAME ...]

(NAMEs: only those fixtures, e.g. `mistral granite_swa`; default all.)

Needs torch and transformers (`requirements-bench.txt`: the committed fixtures were made
with torch 2.13.0 and transformers 5.18.0, which has every class used here, GraniteSWA's
sinks and sliding layers included); the tests that read the fixtures need neither. Each
fixture is a tiny random model written by `transformers`' `save_pretrained` (weights
drawn large enough that logits are O(1-10), norms and biases away from their init, so a
wrong mapping shows), with `tokens.npy` [B, T] and the
logits `transformers` computes for them in float32 (`logits.npy` [B, T, V]):

  llama          LlamaForCausalLM, untied, GQA (N=4, K=2, H=16 != D/N), eps 1e-5, llama3
                 scaling, with a byte-level BPE tokenizer.json of V=288 ids; plus
                 `variants.json` {name: config.json changes} and `logits.<name>.npy` for
                 every rope rule (default, linear, dynamic past L, yarn, longrope past L0,
                 proportional with partial_rotary_factor 0.5)
  llama_tied     LlamaForCausalLM, tied embeddings, N=K, bfloat16 weights (logits of the
                 weights upcast to float32)
  qwen2          Qwen2ForCausalLM (q/k/v biases), tied, linear scaling
  qwen3          Qwen3ForCausalLM (q/k RMSNorm per head), untied, GQA, yarn
  llama_sharded  LlamaForCausalLM saved with a small max_shard_size: three shards and
                 model.safetensors.index.json
  mistral        MistralForCausalLM, every layer sliding over W=8 keys (< T = 24), GQA,
                 with rope_jax's byte-level tokenizer.json (V=259; row 0 starts "ROMEO:")
  granite_swa    GraniteSWAForCausalLM: gpt-oss's attention (random per-head sinks,
                 sliding/full alternation with W=6, gpt-oss's yarn rule with truncate=false)
                 around a dense SwiGLU MLP, its multipliers Llama's; `variants.json` adds
                 the class's default layer_types (every 4th layer full)

The sliding-window fixtures also hold `greedy.npy` [B, P + N]: `generate`'s greedy tokens
(no end-of-text stop) continuing the first P = 6 tokens of each row by N = 20, past the
window.

One fixture is a single attention block, not a model:

  llama4_attention  Llama4TextAttention (iRoPE) of a 2-layer Llama4TextConfig with
                 no_rope_layers [1, 0]: layer 0 rotates (complex pairs), L2-normalises q
                 and k and attends in chunks of C = 4 (HF's chunked causal mask), layer 1
                 is NoPE with the query temperature (attn_scale 0.5, floor_scale 4) and a
                 full causal mask; GQA (N=4, K=2, H=8), T = 12. `config.json` holds the
                 config's fields; `<layer>.npz` (rope, nope) the random weights (HF's
                 [out, in] Linear layout), the input x [B, T, D], the cotangent dy of the
                 output, the output y, and dx and d<weight> of sum(y * dy), in float32.
  deepseek_v4_attention  DeepseekV4Attention of a DeepseekV4Config whose one layer is
                 "sliding_attention" (no compressor: the compressed-KV layers and their
                 indexer are not made): low-rank queries (q_a, RMSNorm, q_b, each head to
                 unit RMS), one shared key/value head with its RMSNorm, the trailing 8 of
                 H = 16 dims rotated in interleaved pairs, the output's rope slice rotated
                 back, random per-head sinks, the grouped low-rank output (2 groups of
                 rank 6); N = 4, D = 32, T = 12. `sliding.npz` under HF's sliding-window
                 mask of W = 4, `full.npz` under the plain causal mask (a sequence within
                 V4's window); the arrays as llama4_attention's.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "hf")
B, T = 2, 24
GREEDY_PROMPT, GREEDY_NEW = 6, 20  # greedy.npy: P prompt tokens, N new ones (P + N > W)

COMMON = dict(num_hidden_layers=2, hidden_act="silu", attn_implementation="eager")

# Rope rules of the llama fixture's variants (config.json changes; T = 24 tokens).
VARIANTS = {
    "default": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "linear": {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}},
    "dynamic": {  # T = 24 > max_position_embeddings = 16: the base grows
        "max_position_embeddings": 16,
        "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    },
    "yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 8.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        },
    },  # fmt: skip
    "longrope": {  # T = 24 > L0 = 16: long_factor, attention factor from L / L0 = 4
        "max_position_embeddings": 64,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 16,
            "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
            "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
        },
    },  # fmt: skip
    "proportional": {  # Gemma-style partial rotation: the first 4 of 8 pairs turn
        "rope_parameters": {
            "rope_type": "proportional",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "partial_rotary_factor": 0.5,
        },
    },  # fmt: skip
}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights ~ N(0, 1/fan_in) (embeddings N(0, 0.5)), norms 1 + N(0, 0.1), biases N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("sinks"):  # one logit per head, some above the scores
                p.copy_(noise)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / p.shape[1] ** 0.5)


def logits(model, tokens: np.ndarray) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE of `vocab_size` ids trained on Shakespeare (rope_jax's trainer)."""
    sys.path.insert(0, ROOT)
    from rope_jax.data import corpora, tokenizers

    plays = [p for name, p in corpora.play_files().items() if corpora.play_split(name) == "train"]
    texts = [corpora.markdown_to_text(p.read_text(encoding="utf-8"))[:20000] for p in plays[:3]]
    tok = tokenizers.train_bpe(texts, vocab_size)
    if tok.vocab_size != vocab_size:
        raise SystemExit(f"the BPE has {tok.vocab_size} ids, wanted {vocab_size}")
    return tok.to_str()


def greedy(model, prompt: np.ndarray) -> np.ndarray:
    """transformers' greedy continuation [B, P + N] of `prompt` [B, P] through its cache."""
    model.generation_config.eos_token_id = None  # N new tokens whatever they are
    with torch.no_grad():
        out = model.generate(torch.as_tensor(prompt, dtype=torch.long), do_sample=False,
                             max_new_tokens=GREEDY_NEW, min_new_tokens=GREEDY_NEW,
                             pad_token_id=0)  # fmt: skip
    return out.numpy().astype(np.int32)


def byte_tokenizer_json() -> str:
    """rope_jax's byte tokenizer (ids 0..255 bytes, PAD/BOS/EOS 256..258) as tokenizer.json."""
    sys.path.insert(0, ROOT)
    from rope_jax.data import tokenizers

    return tokenizers.ByteTokenizer().to_hf().to_str()


def make(name, config_cls, model_cls, *, seed, dtype=torch.float32, shard=None, tokenizer=None,
         variants=None, prefix=b"", decode=False, **config):  # fmt: skip
    if sys.argv[1:] and name not in sys.argv[1:]:
        return
    out = os.path.join(OUT, name)
    shutil.rmtree(out, ignore_errors=True)
    cfg = config_cls(**COMMON, **config)
    model = model_cls(cfg)
    randomize(model, seed)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    tokens[0, : len(prefix)] = list(prefix)  # byte ids of a prompt the tests type
    model.to(dtype).save_pretrained(out, max_shard_size=shard or "50GB")
    # what transformers computes from the directory, in float32 (bfloat16 weights upcast;
    # the rotary frequencies recomputed in float32, not the bfloat16 buffers of `model`)
    reference = model_cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    np.save(os.path.join(out, "tokens.npy"), tokens)
    np.save(os.path.join(out, "logits.npy"), logits(reference, tokens).astype(np.float32))
    if decode:
        np.save(os.path.join(out, "greedy.npy"), greedy(reference, tokens[:, :GREEDY_PROMPT]))
    if tokenizer:
        with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(tokenizer)
    for variant, changes in (variants or {}).items():
        other = model_cls(config_cls(**{**COMMON, **config, **changes}))
        other.load_state_dict(reference.state_dict())
        np.save(os.path.join(out, f"logits.{variant}.npy"), logits(other, tokens[:1]))
    if variants:
        with open(os.path.join(out, "variants.json"), "w") as f:
            json.dump(variants, f, indent=1, sort_keys=True)
            f.write("\n")
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"{name}: {sorted(os.listdir(out))} {size / 1e3:.0f} KB")


def start_block(name: str, cfg, seed: int):
    """(out, x, dy, positions, mask kwargs) of an attention block's fixture: its folder
    made empty, an input [B, 12, D] and a cotangent drawn from `seed`, text positions,
    and the keyword arguments of transformers' mask builders."""
    out = os.path.join(OUT, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 12, cfg.hidden_size, generator=gen)
    dy = torch.randn(B, 12, cfg.hidden_size, generator=gen)
    positions = torch.arange(x.shape[1])[None].expand(B, -1)
    masks = dict(config=cfg, inputs_embeds=x, attention_mask=None, past_key_values=None,
                 position_ids=positions)  # fmt: skip
    return out, x, dy, positions, masks


def save_block(path: str, block, x, dy, *inputs) -> None:
    """One attention block's fixture: input x, output y = block(x, *inputs)[0], the
    cotangent dy, dx, every weight and its gradient (of sum(y * dy)), float32, one .npz."""
    xi = x.clone().requires_grad_(True)
    y = block(xi, *inputs)[0]
    (y * dy).sum().backward()
    arrays = {"x": x, "dy": dy, "y": y, "dx": xi.grad}
    for weight, p in block.named_parameters():
        arrays[weight] = p
        arrays["d" + weight] = p.grad
    np.savez(path, **{k: v.detach().float().numpy() for k, v in arrays.items()})


def finish_block(out: str, name: str, config: dict) -> None:
    """The block's config.json beside its .npz files, and a line of what was written."""
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1, sort_keys=True)
        f.write("\n")
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"{name}: {sorted(os.listdir(out))} {size / 1e3:.0f} KB")


LLAMA4 = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              num_hidden_layers=2, no_rope_layers=[1, 0], attention_chunk_size=4,
              use_qk_norm=True, attn_temperature_tuning=True, attn_scale=0.5, floor_scale=4,
              rms_norm_eps=1e-5, max_position_embeddings=64, vocab_size=64,
              rope_parameters={"rope_type": "default", "rope_theta": 500.0})  # fmt: skip


def llama4_attention(seed: int = 8, name: str = "llama4_attention") -> None:
    """Forward and backward of Llama 4's attention block, one rope and one NoPE layer."""
    if sys.argv[1:] and name not in sys.argv[1:]:
        return
    from transformers.masking_utils import create_causal_mask, create_chunked_causal_mask
    from transformers.models.llama4 import modeling_llama4 as m

    cfg = transformers.Llama4TextConfig(**LLAMA4, attn_implementation="eager")
    out, x, dy, positions, masks = start_block(name, cfg, seed)
    freqs = m.Llama4TextRotaryEmbedding(cfg)(x, positions)
    mask = {"rope": create_chunked_causal_mask(**masks), "nope": create_causal_mask(**masks)}
    for layer, kind in enumerate(("rope", "nope")):
        attn = m.Llama4TextAttention(cfg, layer)
        randomize(attn, seed + layer)
        save_block(os.path.join(out, f"{kind}.npz"), attn, x, dy, freqs, mask[kind])
    finish_block(out, name, LLAMA4)


DEEPSEEK_V4 = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                   q_lora_rank=12, partial_rotary_factor=0.5, o_groups=2, o_lora_rank=6,
                   sliding_window=4, num_hidden_layers=1, layer_types=["sliding_attention"],
                   rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
                   vocab_size=64)  # fmt: skip


def deepseek_v4_attention(seed: int = 9, name: str = "deepseek_v4_attention") -> None:
    """Forward and backward of DeepSeek-V4's attention block (no compressor) under a
    sliding-window mask and under a full causal one."""
    if sys.argv[1:] and name not in sys.argv[1:]:
        return
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    cfg = transformers.DeepseekV4Config(**DEEPSEEK_V4, attn_implementation="eager")
    out, x, dy, positions, masks = start_block(name, cfg, seed)
    rotary = m.DeepseekV4RotaryEmbedding(cfg)
    freqs = {kind: rotary(x, positions, layer_type=kind) for kind in ("main", "compress")}
    mask = {"sliding": create_sliding_window_causal_mask(**masks),
            "full": create_causal_mask(**masks)}  # fmt: skip
    for offset, kind in enumerate(("sliding", "full")):
        attn = m.DeepseekV4Attention(cfg, 0)
        assert attn.compressor is None
        randomize(attn, seed + offset)
        save_block(os.path.join(out, f"{kind}.npz"), attn, x, dy, freqs, positions, mask[kind])
    finish_block(out, name, DEEPSEEK_V4)


def main():
    os.makedirs(OUT, exist_ok=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    t = transformers
    llama = dict(hidden_size=48, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64)  # fmt: skip
    make("llama", t.LlamaConfig, t.LlamaForCausalLM, seed=1, vocab_size=288, rms_norm_eps=1e-5,
         tie_word_embeddings=False, rope_parameters=LLAMA3, tokenizer=tokenizer_json(288),
         variants=VARIANTS, **llama)  # fmt: skip
    make("llama_tied", t.LlamaConfig, t.LlamaForCausalLM, seed=2, dtype=torch.bfloat16,
         vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
         num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6,
         tie_word_embeddings=True,
         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    make("qwen2", t.Qwen2Config, t.Qwen2ForCausalLM, seed=3, vocab_size=128, hidden_size=32,
         intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
         max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
         rope_parameters={"rope_type": "linear", "factor": 2.0,
                          "rope_theta": 1000000.0})  # fmt: skip
    make("qwen3", t.Qwen3Config, t.Qwen3ForCausalLM, seed=4, vocab_size=128, hidden_size=32,
         intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
         max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
         rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0,
                          "original_max_position_embeddings": 16})  # fmt: skip
    make("llama_sharded", t.LlamaConfig, t.LlamaForCausalLM, seed=5, shard="100KB",
         vocab_size=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **llama)  # fmt: skip
    make("mistral", t.MistralConfig, t.MistralForCausalLM, seed=6, vocab_size=259,
         hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
         head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
         sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
         pad_token_id=256, bos_token_id=257, eos_token_id=258,
         tokenizer=byte_tokenizer_json(), prefix=b"ROMEO:", decode=True)  # fmt: skip
    # gpt-oss's attention: sinks, sliding layers first then full ones, its yarn rule
    # (factor 32, beta 32/1, truncate false over L0 4096, here over L0 = 8)
    make("granite_swa", t.GraniteSWAConfig, t.GraniteSWAForCausalLM, seed=7, vocab_size=128,
         hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
         head_dim=16, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
         pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=6,
         layer_types=["sliding_attention", "full_attention"],
         attention_multiplier=16**-0.5, embedding_multiplier=1.0, residual_multiplier=1.0,
         logits_scaling=1.0, decode=True,
         rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 150000.0,
                          "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                          "original_max_position_embeddings": 8},
         variants={"default_layer_types": {"layer_types": None}})  # fmt: skip
    llama4_attention()
    deepseek_v4_attention()


if __name__ == "__main__":
    main()
