"""Tests for rope_jax.sharding.

The mesh tests need 8 devices, and XLA_FLAGS must be set before jax starts, so they run
one script in a subprocess with 8 forced CPU devices; it prints its measurements as
JSON and the tests below check them. Rule and spec logic is tested in-process.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap
from subprocess import PIPE

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from rope_jax import sharding
from rope_jax.nn import model as model_lib
from tests.slurm_helpers import xla_flags

# One test worker runs the module (its tests share module-scoped models on 8 devices, built once).
pytestmark = pytest.mark.xdist_group("sharding")

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A tiny 3-axis VO-RoPE decoder; vocab 19 is not divisible by tensor=2 (stays replicated).
CFG = dict(
    vocab_size=19,
    num_layers=2,
    embed_dim=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    dtype="float32",
    param_dtype="float32",
    patch_dim=0,
    rope=dict(
        sites="vo",
        base=10000.0,
        ladder="standard",
        layout="half",
        allocation="sections",
        sections=(1, 1, 2),
    ),
)

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, ml_collections, numpy as np, optax
    from flax import nnx
    from rope_jax import harness, sharding
    from rope_jax.nn import model as model_lib

    out = {"devices": jax.device_count()}
    cfg = ml_collections.ConfigDict(json.loads(sys.argv[1]))
    make = lambda: model_lib.Decoder(cfg, num_axes=3, rngs=nnx.Rngs(0))

    mesh = sharding.make_mesh((-1, 2, 2))
    out["mesh_shape"] = dict(mesh.shape)
    out["axis_types"] = [t.name for t in mesh.axis_types]
    for bad in [(3, 1, 1), (-1, 3, 1), (2, 2)]:
        try:
            sharding.make_mesh(bad)
            out[f"bad_{bad}"] = None
        except ValueError as e:
            out[f"bad_{bad}"] = str(e)

    rules = sharding.axis_rules()

    def spec_str(spec):  # jit outputs drop trailing Nones; compare in that form
        spec = list(spec)
        while spec and spec[-1] is None:
            spec.pop()
        return str(tuple(spec))

    flat_specs = lambda state: {
        "/".join(map(str, path)): spec_str(v.get_value().sharding.spec)
        for path, v in nnx.to_flat_state(state)}

    model = sharding.create_sharded(make, mesh, rules)
    params = nnx.state(model, nnx.Param)
    out["specs"] = flat_specs(params)
    out["param_stats"] = {"/".join(map(str, path)): [float(jnp.sum(v)), float(jnp.sum(v * v))]
                          for path, v in nnx.to_flat_state(params)}
    graphdef, state = nnx.split(model)
    host_copy = lambda: nnx.merge(graphdef, jax.device_get(state))  # unsharded numpy values
    out["shard_model_specs"] = flat_specs(nnx.state(sharding.shard_model(host_copy(), mesh)))
    out["override_specs"] = flat_specs(sharding.shard_state(
        nnx.state(host_copy(), nnx.Param), mesh, sharding.axis_rules([("embed", None)])))

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 19, (4, 10)), jnp.int32)
    pos = jnp.asarray(np.random.default_rng(1).uniform(0, 9, (4, 10, 3)), jnp.float32)
    with sharding.use_mesh(mesh, rules):
        logits = nnx.jit(lambda m, t, p: m(t, p))(model, tokens, pos)
    out["logits"] = np.asarray(logits).tolist()
    out["logits_spec"] = spec_str(logits.sharding.spec)

    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    opt_shardings = sharding.state_shardings(nnx.state(optimizer), mesh, rules)
    out["adam_mu_spec"] = spec_str(
        opt_shardings["opt_state"][0]["mu"]["blocks"][0]["attn"]["q_proj"].get_value().spec)

    @nnx.jit
    def step(model, optimizer, tokens):
        loss_fn = lambda m: optax.softmax_cross_entropy_with_integer_labels(
            m(tokens[:, :-1]), tokens[:, 1:]).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    with sharding.use_mesh(mesh, rules):
        out["loss"] = float(step(model, optimizer, tokens))
    out["specs_after_step"] = flat_specs(nnx.state(model, nnx.Param))

    # a plain {"params", "opt", "step"} pytree (optax state mirrors the param Variables)
    tx = optax.adam(1e-3)
    def init_fn():
        p = nnx.state(make(), nnx.Param)
        return {"params": p, "opt": tx.init(p), "step": jnp.zeros((), jnp.int32)}
    abstract = jax.eval_shape(init_fn)
    tree_shardings = sharding.state_shardings(abstract, mesh, rules)
    out["pytree_mu_spec"] = spec_str(
        tree_shardings["opt"][0].mu["blocks"][0]["attn"]["q_proj"].get_value().spec)
    out["pytree_step_spec"] = spec_str(tree_shardings["step"].spec)

    batch_sharding = sharding.batch_sharding(mesh, rules)
    batch = {"inputs": np.zeros((8, 5), np.int32), "weights": np.ones((8, 5), np.float32)}
    placed = harness.put_batch(batch, batch_sharding)
    out["batch_spec"] = spec_str(placed["inputs"].sharding.spec)
    out["batch_shard_shape"] = list(placed["weights"].addressable_shards[0].data.shape)
    out["abstract_batch"] = {k: [list(v.shape), str(v.dtype), spec_str(v.sharding.spec)]
                             for k, v in harness.abstract_batch(8, 5, batch_sharding).items()}
    out["bytes_per_device"] = harness.bytes_per_device(params)
    out["num_elements"] = harness.num_elements(params)
    print("RESULT " + json.dumps(out))
    """
)


def single_device_run():
    """The same model and inputs in this one-device process: (flat params, logits)."""
    model = model_lib.Decoder(ml_collections.ConfigDict(CFG), num_axes=3, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 19, (4, 10)), jnp.int32)
    pos = jnp.asarray(np.random.default_rng(1).uniform(0, 9, (4, 10, 3)), jnp.float32)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    params = {"/".join(map(str, path)): np.asarray(v.get_value()) for path, v in flat}
    return params, np.asarray(model(tokens, pos))


@pytest.fixture(scope="module")
def runs():
    """(8-device script results, single-device reference), computed concurrently."""
    env = dict(os.environ)
    env.update(XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-c", SCRIPT, json.dumps(CFG)]
    with subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=PIPE, stderr=PIPE, text=True) as proc:
        reference = single_device_run()
        stdout, stderr = proc.communicate(timeout=300)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :]), reference


@pytest.fixture(scope="module")
def mesh_run(runs):
    return runs[0]


EXPECTED_SPECS = {
    # vocab 19 is not divisible by tensor=2, so it stays replicated
    "embed": "(None, 'fsdp')",
    "head": "('fsdp',)",
    "norm/scale": "('fsdp',)",
    "blocks/0/attn/q_proj": "('fsdp', 'tensor')",
    "blocks/0/attn/k_proj": "('fsdp', 'tensor')",
    "blocks/1/attn/o_proj": "('tensor', None, 'fsdp')",
    "blocks/1/mlp/gate": "('fsdp', 'tensor')",
    "blocks/1/mlp/down": "('tensor', 'fsdp')",
}


@pytest.mark.slow
def test_mesh_is_auto_and_fills_minus_one(mesh_run):
    assert mesh_run["devices"] == 8
    assert mesh_run["mesh_shape"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert mesh_run["axis_types"] == ["Auto"] * 3


@pytest.mark.slow
def test_bad_mesh_shapes_raise(mesh_run):
    assert "needs 3 devices but 8 are present" in mesh_run["bad_(3, 1, 1)"]
    assert "not divisible by 3" in mesh_run["bad_(-1, 3, 1)"]
    assert "mesh.axes" in mesh_run["bad_(2, 2)"]


@pytest.mark.slow
@pytest.mark.parametrize("key", ["specs", "shard_model_specs", "specs_after_step"])
def test_params_get_expected_shardings(mesh_run, key):
    specs = mesh_run[key]
    for path, spec in EXPECTED_SPECS.items():
        assert specs[path] == spec, (key, path, specs[path])


@pytest.mark.slow
def test_rule_override(mesh_run):
    specs = mesh_run["override_specs"]
    assert specs["blocks/0/attn/q_proj"] == "(None, 'tensor')"
    assert specs["embed"] == "()"


@pytest.mark.slow
def test_sharded_init_and_forward_match_single_device(runs):
    mesh_run, (params, logits) = runs
    assert set(mesh_run["param_stats"]) == set(params)
    for path, (total, squares) in mesh_run["param_stats"].items():
        value = np.asarray(params[path], np.float64)
        np.testing.assert_allclose([total, squares], [value.sum(), (value**2).sum()], rtol=1e-4)
    np.testing.assert_allclose(np.asarray(mesh_run["logits"]), np.asarray(logits), atol=1e-5)
    assert mesh_run["logits_spec"] == "(('data', 'fsdp'),)"


@pytest.mark.slow
def test_optimizer_state_follows_params(mesh_run):
    assert mesh_run["adam_mu_spec"] == "('fsdp', 'tensor')"  # nnx.Optimizer
    assert mesh_run["pytree_mu_spec"] == "('fsdp', 'tensor')"  # plain optax state
    assert mesh_run["pytree_step_spec"] == "()"
    assert np.isfinite(mesh_run["loss"])


@pytest.mark.slow
def test_batches(mesh_run):
    assert mesh_run["batch_spec"] == "(('data', 'fsdp'),)"
    assert mesh_run["batch_shard_shape"] == [2, 5]  # 8 rows over data x fsdp = 4
    assert mesh_run["abstract_batch"] == {
        "inputs": [[8, 5], "int32", "(('data', 'fsdp'),)"],
        "targets": [[8, 5], "int32", "(('data', 'fsdp'),)"],
        "weights": [[8, 5], "float32", "(('data', 'fsdp'),)"],
    }


@pytest.mark.slow
def test_sizes(mesh_run, runs):
    params = runs[1][0]
    assert mesh_run["num_elements"] == sum(v.size for v in params.values())
    # mostly split 4 ways (fsdp x tensor) but never less than a quarter, never all
    total = 4 * mesh_run["num_elements"]
    assert total / 4 <= mesh_run["bytes_per_device"] < total / 2


# ------------------------------------------------------------------------ in-process

MESH = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)


def test_logical_to_spec():
    rules = sharding.DEFAULT_RULES
    assert sharding.logical_to_spec(("embed", "mlp"), rules) == P("fsdp", "tensor")
    spec = sharding.logical_to_spec(("batch", "seq", "embed"), rules, shape=(8, 4, 6), mesh=MESH)
    assert spec == P(("data", "fsdp"), None, None)  # fsdp used by batch first
    spec = sharding.logical_to_spec(("batch", "embed"), rules, shape=(2, 6), mesh=MESH)
    assert spec == P("data", "fsdp")  # batch 2 fits data only, leaving fsdp for embed
    spec = sharding.logical_to_spec(("heads", "kv_heads"), rules, shape=(4, 4), mesh=MESH)
    assert spec == P("tensor", None)  # a mesh axis is used once per array
    assert sharding.logical_to_spec(("unknown", None), rules) == P(None, None)
    assert sharding.logical_to_spec(None) == P()


def test_axis_rules_override():
    rules = sharding.axis_rules([("embed", None), ("seq", ["tensor"])])
    assert dict(rules)["embed"] is None and dict(rules)["seq"] == ("tensor",)
    assert dict(rules)["mlp"] == "tensor"
    assert len(rules) == len(sharding.DEFAULT_RULES)
    assert sharding.axis_rules() == sharding.DEFAULT_RULES


def test_constrain_is_noop_without_mesh():
    x = jnp.ones((2, 3, 4))
    assert sharding.constrain(x, ("batch", "seq", "embed")) is x
    y = jax.jit(lambda x: sharding.constrain(x, ("batch", "seq", "embed")) * 2)(x)
    np.testing.assert_array_equal(np.asarray(y), 2 * np.ones((2, 3, 4)))
    with pytest.raises(ValueError, match="do not fit"):
        sharding.constrain(x, ("batch", "embed"))
