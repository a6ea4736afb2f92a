"""Data: tokenizers, TFDS builders, prepared corpora and Grain pipelines (no TensorFlow).

  from rope_jax import data
  data.ensure_built(config.data)                 # build shipped corpora if needed
  kind = data.kind(config.data)                  # Text or Multimodal: axes, tasks, checks
  it = data.make_train_iterator(config.data, seed=0, batch_size=32)
  batch = next(it)                               # {"inputs", "targets", "weights"}
  state = it.get_state(); it.set_state(state)    # checkpointable, JSON-serialisable
  for batch in data.make_eval_iterator(config.data, split="validation",
                                       batch_size=32, seq_len=4 * 256):
      ...

`config.data` fields (an ml_collections ConfigDict; `default_config()` gives every one):
  name:          "shakespeare" | "python_stdlib" (built on first use from files that
                 ship with the installed packages) | "linux_source" (an archive, read
                 with a data.tokenizer) | a multimodal family | a dataset prepared by
                 `python -m rope_jax.data.prepare` under data_dir (read from its shards
                 by random access, never loaded) | a carried corpus, a folder of
                 token arrays packed to travel (`carried`) | any TFDS dataset name, which must
                 already be on disk as array_record under data_dir (never downloaded).
                 Which one, in what order: `sources.resolve`, the one place.
  files:         glob of local UTF-8 text files ("" = unused); when set it replaces
                 `name`. Documents (a .txt file, a .jsonl line, a .parquet row) are
                 held out by `splits` (1% validation, 1% test by a hash of the text,
                 at least one each; 1-2 documents each cut 90/5/5 at line ends), the
                 rule `prepare` follows: the same files, the same held-out text.
  seq_len:       T, training context in tokens (evaluation may use any length).
  data_dir:      TFDS data dir ("" = the TFDS default, ~/tensorflow_datasets).
  text_key:      feature holding the text in a TFDS dataset ("a/b" for nested).
  train_split:   split used for training ("train").
  eval_split:    split used for held-out evaluation ("validation").
  max_documents: read at most this many documents per split (0 = all); bounds memory
                 and start-up time for large TFDS datasets.
  tokenizer:     "" (the data's own: bytes, or a prepared dataset's) | "bytes" |
                 "train:VOCAB" | path to a SentencePiece .model / HF tokenizer.json.
                 Other than bytes on a shipped corpus or `files`, the corpus is prepared
                 once into <data_dir>/prepared/ and read from shards (`prepared`).
  packing:       "stream" | "documents" (positions restart and attention stays inside
                 each document; batches add `segments` and `positions`; `packing`).
  passkey_rate:  share of training windows (byte-level text) that become passkey-
                 retrieval examples (`passkey`); 0 = none.
  passkey_weight: loss weight of those examples' answer targets (1 = plain LM loss).
  scheme:        multimodal layout placing patches (`rope_jax.layouts.SCHEMES`); text
                 positions are the same in every scheme.

Splits of the shipped corpora: train / validation / test. Every document is
followed by EOS; the token streams of a raw split are held in memory (uint16), a
prepared corpus is read window by window from its shards (`prepared`).

Multimodal tasks (`multimodal.FAMILIES`: "digit_grids", "digit_videos") interleave
text with grids of scikit-learn's handwritten digits; their batches add `patches`,
`is_patch`, `positions` (placed by `data.scheme`) and `task`. Extra field: `tasks`
(names from the family; () = all).
"""

import ml_collections

from rope_jax import defaults
from rope_jax.data import multimodal
from rope_jax.data.byte_ids import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, decode, encode
from rope_jax.data.corpora import CORPORA, RopePythonStdlib, RopeShakespeare
from rope_jax.data.digits import RopeDigits
from rope_jax.data.kinds import (
    Carried,
    Multimodal,
    Prepared,
    Text,
    check_scheme,
    ensure_built,
    kind,
    make_eval_iterator,
    make_train_iterator,
)
from rope_jax.data.pipeline import Windows
from rope_jax.data.sources import DataSourceError, documents, token_stream


def default_config() -> ml_collections.ConfigDict:
    """`config.data` with every field this package reads, at its default
    (`rope_jax.defaults.data`, where each field is commented)."""
    return defaults.data()


__all__ = [
    "BOS_ID",
    "CORPORA",
    "Carried",
    "DataSourceError",
    "EOS_ID",
    "Multimodal",
    "PAD_ID",
    "Prepared",
    "RopeDigits",
    "RopePythonStdlib",
    "RopeShakespeare",
    "Text",
    "VOCAB_SIZE",
    "Windows",
    "check_scheme",
    "decode",
    "default_config",
    "documents",
    "encode",
    "kind",
    "make_eval_iterator",
    "make_train_iterator",
    "multimodal",
    "ensure_built",
    "token_stream",
]
