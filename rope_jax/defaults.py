"""Every config field with its default: the one table the rest of the package reads.

  from rope_jax import defaults
  config = defaults.config()                 # every section, the tiny decoder's shape
  config = defaults.fill(partial)            # a partial config (dict or ConfigDict) over it
  raw = defaults.migrate(json.load(f))       # a config saved by an older version, as today's
  module = defaults.load_module("configs/lm.py")  # a config file, as absl's --config loads it

A run's config is resolved once, at its entry point (`harness.checks.resolve`: filled,
checked, frozen); modules read its fields and supply no defaults of their own.
Experiment configs (`configs/common.py`) start from `config()` and set a size preset.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
from collections.abc import Mapping

import ml_collections

from rope_jax import pairs, scaling

# The tiny decoder (LLaMA-like: RMSNorm, SwiGLU, grouped-query attention): the shape of
# `config()`; `configs/common.SIZES` holds the other presets.
SHAPE = dict(num_layers=2, embed_dim=128, num_heads=4, num_kv_heads=2, head_dim=32,
             mlp_dim=384, seq_len=128, global_batch_size=16)  # fmt: skip


def config(shape: dict = SHAPE) -> ml_collections.ConfigDict:
    """Every field of a run's config, with its default (`shape` sizes the decoder)."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # one seed for init and data order
    c.model = model(shape)
    c.data = data(shape)
    c.optim = optim()
    c.train = train()
    c.eval = eval()
    c.mesh = mesh()
    return c


def fill(partial) -> ml_collections.ConfigDict:
    """`partial` (a dict, ConfigDict or FrozenConfigDict, any subset of the fields) over
    `config()`, as a new ConfigDict. An unknown field, a value where a section belongs
    or a value of the wrong type is one ValueError line."""
    out = config()
    _overlay(out, _plain(partial), "")
    return out


def fill_model(partial) -> ml_collections.ConfigDict:
    """A partial `config.model` section over the defaults (`fill`)."""
    return fill({"model": partial}).model


def load_module(path: str):
    """The config file `path` as a module (`get_config(arg)`, and for a sweep `sweep(add)`),
    loaded as absl's `--config` loads it. Config files import `configs.common`, which is
    installed with the project (`pip install -e .`); ValueError (one line) for no file."""
    if not os.path.isfile(path):
        raise ValueError(f"no config file {path!r}")
    name = "config_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def migrate(raw) -> dict:
    """A config (dict or ConfigDict, left as it is) saved by an older version, as a dict of
    today's fields: the layout scheme moved from `model.rope.scheme` to `data.scheme`,
    `num_axes` dropped (the data's now), allocation "interleaved" renamed "alternating",
    and HF's `partial_rotary_factor` and rope_type
    "proportional" moved from `model.rope.scaling` to `model.rope.pairs` (which pairs
    turn; `pairs.from_hf`). Fields added since a run was saved need nothing: `fill` gives
    them their defaults, which are the values those runs used."""
    raw = copy.deepcopy(_plain(raw))
    rope = raw.get("model", {}).get("rope", {})
    scheme = rope.pop("scheme", None)
    rope.pop("num_axes", None)
    if scheme is not None and "data" in raw:
        raw["data"].setdefault("scheme", scheme)
    if rope.get("allocation") == "interleaved":  # renamed: "interleaved" is a pair layout
        rope["allocation"] = "alternating"
    rule = rope.get("scaling")
    if isinstance(rule, Mapping) and (
        "partial_rotary_factor" in rule or rule.get("rope_type") == "proportional"
    ):
        spec, rule = pairs.from_hf(rule)
        kept = {key: None for key in rope["scaling"] if key in _RULE_KEYS}  # today's keys
        rope["scaling"] = {**kept, **rule}
        if spec.rule != "all":
            rope.setdefault("pairs", spec.config())
    return raw


_RULE_KEYS = ("rope_type", *scaling.KEYS)


_placeholder = ml_collections.config_dict.placeholder  # a typed None (settable by flag)


def _plain(tree) -> dict:
    if isinstance(tree, ml_collections.FrozenConfigDict):
        tree = tree.as_configdict()
    if isinstance(tree, ml_collections.ConfigDict):
        return tree.to_dict()
    return dict(tree)


def _tuples(value):
    """Lists (JSON's, or a caller's) as tuples, at any depth: configs hold tuples."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list | tuple) else value


def _overlay(node: ml_collections.ConfigDict, values: Mapping, prefix: str) -> None:
    for key, value in values.items():
        field = f"{prefix}{key}"
        if key not in node:
            known = ", ".join(f"{prefix}{k}" for k in node)
            raise ValueError(f"config field {field} is unknown (known here: {known})")
        if isinstance(node[key], ml_collections.ConfigDict):
            if not isinstance(value, Mapping | ml_collections.ConfigDict):
                raise ValueError(f"config field {field} is a section, got {value!r}")
            _overlay(node[key], _plain(value), f"{field}.")
            continue
        try:
            node[key] = _tuples(value)
        except TypeError as e:
            raise ValueError(f"config field {field}={value!r}: {e}") from None


def model(shape: dict = SHAPE) -> ml_collections.ConfigDict:
    """The decoder (`config.model`)."""
    model = ml_collections.ConfigDict()
    # V: the data's tokenizer decides it; 259 (256 bytes + PAD, BOS, EOS) follows a
    # subword tokenizer's size, any other value must equal it
    model.vocab_size = 259
    model.num_layers = shape["num_layers"]  # decoder blocks
    model.embed_dim = shape["embed_dim"]  # D, residual width
    model.num_heads = shape["num_heads"]  # N, query heads
    model.num_kv_heads = shape["num_kv_heads"]  # K, key/value heads (GQA); N % K == 0
    model.head_dim = shape["head_dim"]  # H, even (rotation pairs)
    model.mlp_dim = shape["mlp_dim"]  # F, SwiGLU hidden width
    model.dtype = "float32"  # compute dtype: float32 | bfloat16
    model.param_dtype = "float32"  # parameter (master weight) dtype
    model.patch_dim = 0  # input width of visual patch vectors; 0 = text only
    model.remat = "none"  # none | block (recompute in backward)
    model.norm_eps = 1e-6  # RMSNorm epsilon (Llama 2/3 checkpoints use 1e-5)
    model.tie_embeddings = False  # True: the LM head is the embedding table (transposed)

    model.attention = attention()

    model.rope = ml_collections.ConfigDict()
    model.rope.sites = "qk"  # rotated sites, a subset of "qkvo"; "" = NoPE
    model.rope.base = 10000.0  # frequency base
    model.rope.ladder = "standard"  # standard | per_axis
    model.rope.layout = "half"  # pair layout: half (LLaMA) | interleaved (RoFormer)
    model.rope.allocation = "alternating"  # pair -> axis: alternating (i mod A) | sections ...
    model.rope.sections = ()  # pairs per axis (one per position axis) for allocation=sections,
    # summing to H/2; the data decides the number of axes A (1 text, 2 image, 3 video)
    # Which pairs turn: a rule of rope_jax.pairs.SELECTIONS (each in the table of
    # docs/maths.md#which-pairs-turn), e.g. first (the leading int(H * fraction) numbers
    # rotate, the rest pass: HF's partial_rotary_factor), proportional (p-RoPE: the first
    # floor(fraction * H/2) pairs of the whole-head ladder turn), index (the listed pairs)
    model.rope.pairs = ml_collections.ConfigDict()
    model.rope.pairs.rule = "all"  # all = every pair turns
    model.rope.pairs.fraction = _placeholder(float)  # first, proportional: share in [0, 1]
    model.rope.pairs.index = ()  # index: the pair indices that turn; heads: [layer][kv head] lists
    # xPos (Sun et al. 2022): rotated q and k pair i scaled by zeta_i ** (+-(p - T/2) / gamma),
    # a decay of q . k with distance; gamma here (the reference's 512), 0 = off
    model.rope.xpos_scale_base = 0.0
    # modded-nanogpt's partial key offset: a key's stationary numbers (its frozen pairs,
    # e.g. pairs.rule=half_truncated) are the previous token's, in every rotating layer
    model.rope.key_offset = False
    # Context scaling (docs/maths.md#context-scaling), Hugging Face `rope_parameters` keys;
    # a key left None is absent, e.g. --config.model.rope.scaling.rope_type=yarn
    # --config.model.rope.scaling.factor=4. The rule applies to every rotating (global) layer.
    model.rope.scaling = ml_collections.ConfigDict()
    # rope_type: default | linear | dynamic | yarn | longrope | llama3
    model.rope.scaling.rope_type = "default"  # the rule; default = plain RoPE
    for key, spec in scaling.KEYS.items():  # one typed None per other key: f (factor),
        model.rope.scaling[key] = _placeholder(spec.kind)  # L0, yarn's betas ... (`scaling.KEYS`)
    model.rope.max_position_embeddings = _placeholder(int)  # L; None = the training seq_len
    model.rope.nope_every = 0  # k > 0: layers k-1, 2k-1, ... have no rotation (Llama 4)
    # NoPE layers' attention temperature (Llama 4's attn_temperature_tuning, nn.irope):
    # queries at position p times 1 + nope_attn_scale * log1p(floor((p + 1) / nope_floor_scale))
    model.rope.nope_attn_scale = 0.0  # 0 = off (Llama 4: 0.1)
    model.rope.nope_floor_scale = 8192.0  # positions per step of the temperature (Llama 4: 8192)
    model.rope.local_base = _placeholder(float)  # base of the non-global layers (Gemma 3)
    model.rope.global_every = 0  # g > 0: layers g-1, 2g-1, ... global (base), others local_base
    # learned: none (fixed) | freqs (trained per-kv-head, per-axis frequencies, RoPE-Mixed) |
    # commuting (freqs in a trained orthogonal basis per layer); both start equal to none
    model.rope.learned = "none"
    return model


def attention() -> ml_collections.ConfigDict:
    """The attention of every decoder layer (`config.model.attention`)."""
    attention = ml_collections.ConfigDict()
    # kv = "separate" (default): own key and value projections. "tied": one latent per kv
    # head is rotated once and serves as key and value (half the cache; needs sites qkvo).
    attention.kv = "separate"
    # impl: the softmax-attention kernel (rotations stay outside it): xla (reference,
    # [B, K, T, G, S] float32 scores) | dot_product (jax.nn.dot_product_attention: cuDNN
    # flash attention on GPU in bf16) | chunked (blockwise online softmax, O(T) memory,
    # any backend) | splash (TPU Pallas).
    attention.impl = "xla"
    # bias: a position bias added to every layer's logits, a scheme of
    # rope_jax.nn.biases.SCHEMES (the table in docs/maths.md#position-biases), e.g. alibi
    # (-m_n |p_t - p_s|, geometric slopes), fire (a learned MLP of the interpolated log
    # distance); none = no bias; combines with any rope.sites
    attention.bias = "none"
    attention.qkv_bias = False  # biases on the q, k, v projections (Qwen2 checkpoints)
    attention.qk_norm = False  # RMSNorm over H of each q and k head (Qwen3 checkpoints)
    # sinks: one learned logit per query head in every softmax denominator, no value
    # (gpt-oss, DeepSeek-V4); a parameter "sinks" [N] per layer, zeros at init
    attention.sinks = False
    # stick-breaking attention (Tan et al. 2024): each key takes sigmoid(z) of the stick
    # the nearer keys left, instead of a softmax share; the xla kernel computes it
    attention.stick_breaking = False
    # window: W > 0 = the sliding window of the "sliding" layers: query t sees keys
    # t - W < s <= t (HF's sliding_window; Mistral, Gemma 2/3, gpt-oss); must be below
    # data.seq_len (a window of the whole sequence changes nothing); 0 = none
    attention.window = 0
    # chunk: C > 0 = the chunk of the "chunked" layers: query t sees keys s <= t of its
    # own chunk, s // C == t // C, chunks starting at position 0 (HF's
    # attention_chunk_size; Llama 4's local layers); must be below data.seq_len; 0 = none
    attention.chunk = 0
    # layer_types: one of full | sliding | chunked per layer (HF's layer_types), e.g.
    # ("sliding", "full"); () = every layer sliding when window > 0 (Mistral), chunked
    # when chunk > 0, else full
    attention.layer_types = ()
    # qk_l2_norm: q and k of every rotating layer scaled to unit RMS over H, no weight,
    # epsilon norm_eps (Llama 4's use_qk_norm; rope_jax.nn.irope)
    attention.qk_l2_norm = False
    # DeepSeek-V4's attention (rope_jax.nn.v4; with kv="tied", num_kv_heads=1, sinks,
    # interleaved partial rotation): 0 / False = off
    attention.q_lora_rank = 0  # r > 0: q = W_qb RMSNorm(W_qa x), a rank-r query latent
    attention.q_l2_norm = False  # every query head scaled to unit RMS over H, no weight
    attention.kv_norm = False  # RMSNorm (scale [H]) of the tied latent; needs kv="tied"
    attention.o_groups = 0  # g > 0: heads in g groups, each projected to o_lora_rank ...
    attention.o_lora_rank = 0  # ... R numbers, the g * R then to D; set with o_groups
    return attention


def data(shape: dict = SHAPE) -> ml_collections.ConfigDict:
    """The data (`config.data`)."""
    data = ml_collections.ConfigDict()
    data.name = "shakespeare"  # corpus, archive, prepared dataset, family, TFDS (sources.resolve)
    data.files = ""  # glob of local text files; when set, replaces name
    data.data_dir = ""  # TFDS / prepared data dir; "" = the TFDS default (~/tensorflow_datasets)
    # tokenizer: "" = the data's own (bytes for raw text, the stored one of a prepared
    # dataset) | bytes | train:VOCAB (a BPE trained on the train split) | path to a
    # SentencePiece .model or HF tokenizer.json; not bytes on a shipped corpus or
    # data.files: prepared once into <data_dir>/prepared/ (python -m rope_jax.data.prepare)
    data.tokenizer = ""
    data.packing = "stream"  # stream | documents (positions restart, attention per document)
    data.passkey_rate = 0.0  # share of training windows made passkey-retrieval examples
    data.passkey_weight = 1.0  # loss weight of a passkey example's five answer targets
    # RULER's synthetic tasks in training (`ruler`), e.g. ("niah_single_1", "vt"): a share
    # synthetic_rate of training windows become examples of one of them (chosen evenly),
    # made from the window's own text; their answer targets weigh synthetic_weight
    data.synthetic_tasks = ()
    data.synthetic_rate = 0.0
    data.synthetic_weight = 1.0
    data.task_template = "ruler"  # RULER tasks' wording: ruler (RULER's own) | short (byte models)
    data.text_key = "text"  # feature holding the text in other TFDS datasets
    data.train_split = "train"  # split to train on
    data.eval_split = "validation"  # held-out split evaluated during training
    data.max_documents = 0  # documents read per split; 0 = all
    data.tasks = ()  # multimodal data only: task names; () = all of the dataset's
    data.scheme = "flat"  # multimodal data only: layout placing patches (layouts.SCHEMES)
    # Layout settings (rope_jax.layouts.SETTINGS; None = unset): seconds between the frames
    # of every video; mrope's temporal ids per second (Qwen2.5-VL time alignment, read with
    # seconds_per_frame); videorope's temporal id step between frames (None = 2).
    data.seconds_per_frame = _placeholder(float)
    data.tokens_per_second = _placeholder(float)
    data.delta = _placeholder(float)
    data.seq_len = shape["seq_len"]  # T, training context in tokens
    data.global_batch_size = shape["global_batch_size"]  # sequences per step, all devices
    return data


def optim() -> ml_collections.ConfigDict:
    """The optimiser (`config.optim`)."""
    optim = ml_collections.ConfigDict()
    optim.name = "adamw"  # adamw | adam | sgd
    optim.lr = 3e-3  # peak lr
    optim.warmup_steps = 50  # linear warm-up from 0
    optim.schedule = "cosine"  # cosine | linear | constant (after warm-up)
    optim.weight_decay = 0.1  # decoupled, on matrices only
    optim.b1 = 0.9  # Adam beta1
    optim.b2 = 0.95  # Adam beta2
    optim.grad_clip_norm = 1.0  # global-norm clip; 0 = off
    optim.z_loss = 0.0  # weight of the z-loss mean(logsumexp(logits)^2); 0 = off
    return optim


def train() -> ml_collections.ConfigDict:
    """The loop (`config.train`)."""
    train = ml_collections.ConfigDict()
    train.num_steps = 500  # optimiser steps
    train.num_tokens = 0  # token budget for the dry run's cost plan; 0 = steps x batch x T
    train.microbatches = 1  # k: each global batch is k sequential microbatches (accumulated)
    # WORKDIR[:STEP]: start from that run's matching parameters; hf:DIR: from a Hugging Face
    # model directory, whose architecture replaces the model section (docs/hf.md); "" = random
    train.init_from = ""
    train.log_every_steps = 25  # progress line + metrics.jsonl + TensorBoard
    train.eval_every_steps = 250  # held-out evaluation; 0 = only at the end
    train.ckpt_every_steps = 250  # Orbax checkpoint; the last step is always saved
    train.ckpt_keep = 3  # checkpoints kept (newest)
    return train


def eval() -> ml_collections.ConfigDict:
    """Evaluation (`config.eval`)."""
    eval = ml_collections.ConfigDict()
    eval.num_batches = 20  # batches per evaluation; 0 = the whole split
    eval.batch_size = 16  # sequences per evaluation batch
    # which windows num_batches takes from a text split: first (in order from the start) |
    # spread (evenly through the whole split: a large corpus ordered by source, as a
    # source tree is, is sampled everywhere, not only where it begins)
    eval.sample = "first"
    eval.seq_lens = ()  # extra context lengths for eval.py (extrapolation), e.g. (256, 512)
    eval.splits = ()  # extra held-out splits eval.py scores at data.seq_len, e.g. ("test",)
    # evaluation tasks (`harness.evals.TASKS`) of the in-training evaluation (at data.seq_len)
    # and of eval.py: loss | passkey | RULER's niah_single_1 ... vt, cwe, fwe ("ruler": all)
    eval.tasks = ("loss",)
    eval.examples = 100  # examples per length of the example-based tasks (passkey, RULER's)
    eval.answer_tokens = 0  # RULER tasks' answer budget in tokens; 0 = each task's own
    return eval


def mesh() -> ml_collections.ConfigDict:
    """The device mesh (`config.mesh`)."""
    mesh = ml_collections.ConfigDict()
    mesh.shape = (-1, 1, 1)  # devices per axis; -1 = all remaining devices
    mesh.axes = ("data", "fsdp", "tensor")  # mesh axis names
    mesh.logical_axis_rules = ()  # (logical, mesh axis) overrides; () = library defaults
    return mesh
