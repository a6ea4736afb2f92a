"""`train.init_from`: a fresh run starts from another run's matching parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import lm, multimodal
from rope_jax import harness, sharding
from rope_jax.harness import checksums, metrics, transfer

SMALL = {"model.num_layers": 1, "model.embed_dim": 32, "model.num_heads": 2,
         "model.num_kv_heads": 1, "model.head_dim": 16, "model.mlp_dim": 64,
         "data.global_batch_size": 4, "data.seq_len": 32, "train.num_steps": 2,
         "train.log_every_steps": 1, "train.eval_every_steps": 0, "eval.num_batches": 1,
         "eval.batch_size": 4}  # fmt: skip


def test_merge_takes_same_name_and_shape_and_keeps_the_rest():
    fresh = {"a": jnp.zeros((2, 3)), "b": jnp.zeros((4,)), "c": jnp.ones((1,), jnp.bfloat16)}
    source = {"a": jnp.full((2, 3), 7.0), "b": jnp.ones((5,)), "c": jnp.full((1,), 2.0)}
    params, loaded, kept = transfer.merge(fresh, source)
    assert loaded == ["a", "c"] and kept == ["b"]
    np.testing.assert_array_equal(params["a"], 7.0)
    np.testing.assert_array_equal(params["b"], 0.0)  # shape differs: fresh
    assert params["c"].dtype == jnp.bfloat16 and float(params["c"][0]) == 2.0


def test_parse_and_a_workdir_without_a_run_is_one_line(tmp_path):
    assert transfer.parse("runs/x:200") == ("runs/x", 200)
    assert transfer.parse("runs/x") == ("runs/x", None)
    with pytest.raises(transfer.TransferError, match=r"holds no run \(config.json missing\)"):
        transfer.check(str(tmp_path))


def test_an_hf_source_without_its_reader_is_one_line():
    """The harness imports nothing of `rope_jax.hf`: hf:DIR is read through the sources its
    caller passes (train.py: `hf.run.SOURCES`); without them, one line says so."""
    config = lm.get_config()
    config.train.init_from = "hf:some/model"
    with pytest.raises(transfer.TransferError, match="no reader of hf: sources was given"):
        transfer.prepare(config)


@pytest.mark.slow
def test_a_digit_grid_run_starts_from_a_text_model(data_dir, tmp_path):
    text = lm.get_config("size=tiny")
    text.update_from_flattened_dict(SMALL)
    text.data.data_dir = data_dir
    harness.train_and_evaluate(text, str(tmp_path / "text"))

    grids = multimodal.get_config("row=rope_tv")
    grids.update_from_flattened_dict(SMALL)
    grids.data.data_dir, grids.data.seq_len = data_dir, multimodal.get_config().data.seq_len
    run = harness.build(grids)
    with sharding.use_mesh(run.mesh, run.rules):
        fresh = jax.jit(run.init_fn, out_shardings=run.shardings)()
        state, line = transfer.apply(fresh, str(tmp_path / "text"))
    assert line.startswith(f"init_from {tmp_path / 'text'} (step 2): loaded ")
    assert "fresh: " in line and "patch" in line  # the patch embedding is new
    source = transfer.source_params(str(tmp_path / "text"))[1]
    names = lambda tree: {checksums.leaf_name(p): x
                          for p, x in jax.tree_util.tree_leaves_with_path(tree)}  # fmt: skip
    src, got, new = names(source), names(state["params"]), names(fresh["params"])
    assert set(src) < set(got)
    for name, value in got.items():
        want = src[name] if name in src else new[name]
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want))
    # a multimodal run trains from there
    grids.train.init_from = str(tmp_path / "text")
    harness.train_and_evaluate(grids, str(tmp_path / "grids"))
    assert metrics.read_jsonl(str(tmp_path / "grids"))[-1]["step"] == 2
