"""Preparing a corpus once (`python -m rope_jax.data.prepare`, whose help says what it does):

plan      Settings, the documents, the split of each (`rope_jax.data.splits`), warnings
encode    the tokenizer and the worker processes that encode with it
space     free-space checks before each shard
progress  the progress line
resume    what a killed run left: kept, checked, or redone
run       `prepare(settings, name, data_dir)`: the whole preparation
"""

from rope_jax.data.preparation.plan import SPLITS, Settings, assigned, documents, plan_splits
from rope_jax.data.preparation.resume import STAGING
from rope_jax.data.preparation.run import prepare
from rope_jax.data.preparation.space import OutOfSpace
from rope_jax.data.readers import PrepareError

__all__ = ["SPLITS", "STAGING", "OutOfSpace", "PrepareError", "Settings", "assigned", "documents",
           "plan_splits", "prepare"]  # fmt: skip
