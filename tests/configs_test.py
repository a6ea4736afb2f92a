"""Tests for configs/lm.py: every ablation row builds a valid config; matched tied rows;
the irope row (Llama 4) at every size."""

import pytest
from flax import nnx

from configs import attention, common, lm
from rope_jax import harness
from rope_jax.nn import model as model_lib

ORIGINAL = ["nope", "q", "k", "v", "o", "qk", "vo", "qkv", "qkvo"]
TIED = ["tied_qkvo", "separate_qk_params", "separate_qk_cache"]
EXTRA = TIED + ["irope", "v4"]


def num_params(config) -> int:
    abstract = nnx.eval_shape(lambda: model_lib.Decoder(config.model, rngs=nnx.Rngs(0)))
    return model_lib.count_params(abstract)


@pytest.mark.parametrize("row", ORIGINAL + EXTRA)
def test_every_row_is_a_valid_config(row):
    config = lm.get_config(f"size=tiny,row={row}")
    harness.check_config(config)
    expected_kv = "tied" if row in ("tied_qkvo", "v4") else "separate"
    assert config.model.attention.kv == expected_kv
    if row in ORIGINAL:
        assert config.model.rope.sites == lm.ROWS[row]
        assert config.model.to_dict() == _with_sites(lm.ROWS[row])


def _with_sites(sites):
    model = common.base_config("tiny").model
    model.rope.sites = sites
    return model.to_dict()


def test_unknown_row_names_the_choices():
    with pytest.raises(ValueError, match="row='qq'.*tied_qkvo"):
        lm.get_config("row=qq")


def test_sweep_emits_original_rows_first_then_tied_rows():
    rows = []
    lm.sweep(lambda name, **overrides: rows.append((name, overrides)), arg="size=tiny")
    assert [name for name, _ in rows] == ORIGINAL + EXTRA
    for name, overrides in rows[:9]:
        assert overrides == {"model.rope.sites": lm.ROWS[name]}  # unchanged rows
    assert rows[9][1] == {"model.attention.kv": "tied", "model.rope.sites": "qkvo"}


@pytest.mark.parametrize("size", list(common.SIZES))
def test_matched_rows_match_parameters_and_cache(size):
    tied = lm.get_config(f"size={size},row=tied_qkvo")
    params = lm.get_config(f"size={size},row=separate_qk_params")
    cache = lm.get_config(f"size={size},row=separate_qk_cache")
    base = lm.get_config(f"size={size},row=qk")
    n_tied, n_params, n_base = num_params(tied), num_params(params), num_params(base)
    assert n_tied < n_base
    assert abs(n_params - n_tied) / n_tied < 0.01, (n_params, n_tied)
    assert params.model.num_kv_heads == tied.model.num_kv_heads  # only the MLP changed
    bytes_tied = model_lib.kv_cache_bytes_per_token(tied.model)
    assert model_lib.kv_cache_bytes_per_token(cache.model) == bytes_tied
    assert model_lib.kv_cache_bytes_per_token(base.model) == 2 * bytes_tied
    for config in (tied, params, cache):
        model_lib.check_config(config.model)


@pytest.mark.parametrize("size", ["small", "tiny"])
def test_sweep_sizes_matched_rows_from_its_arg(size):
    """The sweep tool passes its config arg to sweep(add, arg=...): rows follow its size."""
    rows = {}
    lm.sweep(lambda name, **overrides: rows.update({name: overrides}), arg=f"size={size}")
    expected = lm.get_config(f"size={size},row=separate_qk_params").model.mlp_dim
    assert rows["separate_qk_params"]["model.mlp_dim"] == expected
    assert (
        rows["separate_qk_cache"]["model.num_kv_heads"] == common.SIZES[size]["num_kv_heads"] // 2
    )


@pytest.mark.parametrize("size", list(common.SIZES))
def test_irope_row_is_llama4s_pattern_at_every_size(size):
    """NoPE every 4th layer (the last of tiny's 2), full there, chunked elsewhere in chunks
    of T/4 that also step the NoPE layers' temperature; q/k L2 norm; interleaved pairs."""
    config = lm.get_config(f"size={size},row=irope")
    harness.check_config(config)
    m, layers = config.model, common.SIZES[size]["num_layers"]
    every = min(4, layers)
    assert m.rope.nope_every == every and m.attention.qk_l2_norm and m.rope.layout == "interleaved"
    ropes = model_lib.layer_rotations(m, train_seq_len=config.data.seq_len)
    types = m.attention.layer_types
    assert [t == "full" for t in types] == [r is None for r in ropes] == [
        (i + 1) % every == 0 for i in range(layers)]  # fmt: skip
    assert m.attention.chunk == m.rope.nope_floor_scale == config.data.seq_len // 4


@pytest.mark.parametrize("size", list(common.SIZES))
def test_v4_row_is_deepseek_v4s_attention_at_every_size(size):
    """One tied kv head (qkvo), interleaved pairs over H/8 dims, sinks, every layer sliding
    over T/4 keys, low-rank normed queries and the grouped output, at V4-Flash's ratios."""
    config = lm.get_config(f"size={size},row=v4")
    harness.check_config(config)
    m, p = config.model, common.SIZES[size]
    a = m.attention
    assert (m.num_kv_heads, a.kv, m.rope.sites, m.rope.layout) == (1, "tied", "qkvo", "interleaved")
    assert (m.rope.pairs.rule, m.rope.pairs.fraction) == ("first", 0.125)
    assert a.sinks and a.q_l2_norm and a.kv_norm
    assert a.window == config.data.seq_len // 4 and not a.layer_types  # every layer sliding
    assert a.q_lora_rank == a.o_lora_rank == p["embed_dim"] // 4
    assert p["num_heads"] % a.o_groups == 0 and a.o_groups == max(2, p["num_heads"] // 8)


def test_precision_rows_change_only_the_compute_dtype():
    from configs import precision

    base = lm.get_config("size=small").to_dict()
    for row, dtype in (("float32", "float32"), ("bfloat16", "bfloat16")):
        config = precision.get_config(f"size=small,row={row}")
        harness.check_config(config)
        got = config.to_dict()
        assert got["model"].pop("dtype") == dtype and got["model"]["param_dtype"] == "float32"
        base["model"].pop("dtype", None)
        assert got == base
    with pytest.raises(ValueError, match="row='fp8' is not one of float32, bfloat16"):
        precision.get_config("row=fp8")


def test_eval_sample_is_checked_once_at_resolve():
    from configs import multimodal
    from rope_jax.harness import checks

    config = lm.get_config("size=tiny")
    config.eval.sample = "middle"
    with pytest.raises(ValueError, match=r"eval\.sample='middle' is not one of first, spread"):
        checks.resolve(config)
    grid = multimodal.get_config("size=tiny")
    grid.eval.sample = "spread"
    with pytest.raises(ValueError, match="multimodal splits are scored on their first"):
        checks.resolve(grid)
    config.eval.sample = "spread"
    assert checks.resolve(config).eval.sample == "spread"


def test_resolve_fills_from_the_defaults_checks_once_and_freezes():
    import ml_collections

    from rope_jax import defaults
    from rope_jax.harness import checks

    partial = {"model": {"rope": {"sites": "vo"}}, "train": {"num_steps": 7}}
    config = checks.resolve(partial)
    assert isinstance(config, ml_collections.FrozenConfigDict)
    assert config.model.rope.sites == "vo" and config.train.num_steps == 7
    assert config.model.remat == defaults.config().model.remat  # filled, not supplied
    assert checks.resolve(config) is config  # resolved once: passed through
    with pytest.raises(AttributeError):
        config.model.rope.sites = "qk"
    with pytest.raises(ValueError, match=r"config field model\.rope\.sitez is unknown"):
        checks.resolve({"model": {"rope": {"sitez": "vo"}}})
    old = {"model": {"rope": {"scheme": "mrope", "num_axes": 3}}, "data": {}}  # an old run
    assert checks.resolve(old).data.scheme == "mrope"


def test_a_folder_of_runs_given_as_a_run_names_one_of_them(tmp_path):
    """eval.py --workdir=SWEEP (or its row folder) said only "not a training workdir"."""
    from rope_jax.harness import checkpoint, runfiles

    for row in ("qk", "vo"):
        (tmp_path / row / "seed_0").mkdir(parents=True)
        (tmp_path / row / "seed_0" / "config.json").write_text("{}")
    with pytest.raises(checkpoint.CheckpointError,
                       match=rf"not a training workdir; it holds 2 run\(s\), e.g. "
                             rf"{tmp_path}/qk/seed_0$"):  # fmt: skip
        runfiles.load_config(str(tmp_path))
    with pytest.raises(checkpoint.CheckpointError, match=r"holds 1 run\(s\), e.g. .*/vo/seed_0$"):
        runfiles.load_config(str(tmp_path / "vo"))
    with pytest.raises(checkpoint.CheckpointError, match=r"not a training workdir$"):
        runfiles.load_config(str(tmp_path / "qk" / "seed_0" / "none"))


def test_attention_rows_are_lms_rows_with_and_without_a_sink():
    """Every row of configs/attention.py is lm's row of its name, plus the sink where the
    name says so; each is a valid run; a sink on an open model's row is refused."""
    for row in attention.rows():
        config = attention.get_config(f"row={row}")
        harness.check_config(config)
        base, changes = attention.CHANGED_ROWS.get(row, (row.removesuffix("_sinks"), lambda p: {}))
        want = lm.get_config(f"row={base}")
        want.update_from_flattened_dict(changes(common.size_preset("tiny")))
        want.model.attention.sinks = row.endswith("_sinks") or want.model.attention.sinks
        assert config.to_dict() == want.to_dict(), row
    assert attention.get_config("row=v4_whole_head").model.rope.pairs.rule == "all"
    parts = {r: attention.get_config(f"row={r},size=l8").model for r in attention.CHANGED_ROWS}
    assert parts["irope_no_chunks"].attention.layer_types == ("full",) * 8
    assert not parts["irope_no_l2"].attention.qk_l2_norm and parts["qk_l2"].attention.qk_l2_norm
    assert parts["irope_no_nope"].rope.nope_every == 0 and parts["qk_l2"].rope.sites == "qk"
    h8 = attention.get_config("row=tied_qkvo_h8").model
    assert h8.rope.pairs.fraction == 0.125 and h8.attention.kv == "tied"
    with pytest.raises(ValueError, match="row='irope_sinks' is not one of"):
        attention.get_config("row=irope_sinks")


def test_position_rows_are_lms_site_rows_and_a_bias():
    """Every row of configs/positions.py is a valid run: lm's site row of its name, or the
    site row it starts from with a position bias or its rotation settings (xPos); the
    sweep emits every row once."""
    from configs import positions

    added = []
    positions.sweep(lambda name, **overrides: added.append((name, overrides)))
    assert [name for name, _ in added] == list(positions.ROWS)
    for row in positions.ROWS:
        config = positions.get_config(f"row={row}")
        harness.check_config(config)
        base, bias = positions.BIAS_ROWS.get(row, (positions.ROTATION_ROWS.get(row, (row,))[0],
                                                   "none"))  # fmt: skip
        assert config.model.rope.sites == lm.get_config(f"row={base}").model.rope.sites, row
        assert config.model.attention.bias == bias, row
    assert positions.get_config("row=xpos").model.rope.xpos_scale_base == 512.0
    with pytest.raises(ValueError, match="row='cope' is not one of qk, qkvo, vo, nope, alibi"):
        positions.get_config("row=cope")
