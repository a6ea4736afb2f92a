"""Host memory: the lower bound a run is refused by, against XLA's own figure."""

import os

import jax
import pytest
from flax import nnx

from rope_jax.harness import checks, hostmem, setup
from rope_jax.nn import model
from tests.train_test import tiny

GIB = 1 << 30


def _run(data_dir, **overrides):
    config = checks.settle_vocab(checks.resolve(tiny(data_dir, **overrides)))
    return setup.build(config), config


def test_free_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:    2048 kB\nSwapFree: 1024 kB\n")
    assert hostmem.available_bytes(str(meminfo)) == 3072 * 1024
    meminfo.write_text("MemTotal: 100 kB\n")  # an old kernel's: no MemAvailable
    assert hostmem.available_bytes(str(meminfo)) is None
    assert hostmem.available_bytes(str(tmp_path / "none")) is None
    if os.path.exists(hostmem.MEMINFO):
        assert hostmem.available_bytes() > 0  # this machine's


@pytest.mark.slow
def test_the_bound_stays_under_what_xla_allocates(data_dir):
    """'At least' must hold: the train step's bound (less the host batch) is no more than
    XLA's state + temporaries for it, the evaluation's no more than its step's."""
    for impl in ("xla", "chunked"):
        run, config = _run(data_dir, **{"model.attention.impl": impl, "data.seq_len": 128})
        needs = hostmem.train_needs(run, config)
        report = setup.dry_run(config)
        xla = sum(report[f"{k}_bytes_per_device"] for k in ("params", "opt", "temp"))
        assert sum(needs.values()) - needs["batch"] <= xla, (impl, needs, report)
        assert (needs["scores"] > 0) == (impl == "xla")
        needs = hostmem.eval_needs(run, config, 256)
        batch = {"inputs": jax.ShapeDtypeStruct((8, 256), "int32"),
                 "targets": jax.ShapeDtypeStruct((8, 256), "int32"),
                 "weights": jax.ShapeDtypeStruct((8, 256), "float32")}  # fmt: skip
        lowered = run.eval_step.lower(run.abstract["params"], batch)
        analysis = lowered.compile().memory_analysis()
        assert needs["logits"] + needs["scores"] <= analysis.temp_size_in_bytes, impl


def test_microbatches_divide_what_a_step_holds_at_once(data_dir):
    one = hostmem.train_needs(*_run(data_dir))
    two = hostmem.train_needs(*_run(data_dir, **{"train.microbatches": 2}))
    for part in ("residuals", "logits", "scores"):
        assert two[part] * 2 == one[part] > 0
    assert two["state"] == one["state"] and two["batch"] == one["batch"]


def test_a_run_that_cannot_fit_is_one_line_naming_its_parts(data_dir):
    run, config = _run(data_dir, **{"data.seq_len": 4096})
    hostmem.check_train(run, config, free=64 * GIB)  # fits
    with pytest.raises(ValueError) as info:
        hostmem.check_train(run, config, free=1 << 20)
    line = str(info.value)
    assert "\n" not in line and line.startswith("training needs at least ")
    assert "scores " in line and "model.attention.impl=chunked" in line
    with pytest.raises(ValueError, match=r"^evaluation at seq_len=65536 needs at least .* "
                                         r"--seq_lens"):  # fmt: skip
        hostmem.check_eval(run, config, [256, 65536], free=4 * GIB)


def test_xla_running_out_of_memory_is_one_line():
    """Past the bound, XLA's own RESOURCE_EXHAUSTED is what train.py and eval.py print, as
    one line (here a 256 TiB buffer: more than x86-64's 128 TiB of user address space, so
    refused at once whatever the kernel's overcommit setting)."""
    import jax.numpy as jnp

    from rope_jax.harness import cli

    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.jit(lambda x: jnp.zeros((1 << 46,), jnp.float32) + x)(1.0).block_until_ready()
    line = cli.out_of_memory(info.value)
    assert line.startswith("out of memory: RESOURCE_EXHAUSTED: ") and "\n" not in line
    assert cli.out_of_memory(ValueError("model.head_dim=15 is invalid")) is None


def test_the_dry_run_says_whether_the_run_fits_this_host(data_dir, capsys):
    from rope_jax.harness import loop

    if hostmem.available_bytes() is None:
        pytest.skip("no /proc/meminfo here: the dry run has no line on this host")

    report = loop.print_dry_run(tiny(data_dir))
    line = next(x for x in capsys.readouterr().out.splitlines() if "this host:" in x)
    assert line.strip().startswith("this host: ") and line.endswith(": fits"), line
    huge = dict(report, temp_bytes_per_device=1 << 60)  # an exbibyte of temporaries
    assert hostmem.dry_run_line(huge).endswith(": does not fit")


@pytest.mark.parametrize("layers", [None, ("sliding", "full"), ("chunked", "sliding")])
def test_the_cache_bound_is_what_decoding_allocates(data_dir, layers):
    """Sliding and chunked layers hold a ring of W or C slots, not the whole continuation:
    counted as full, a continuation that fits would be refused."""
    sets = {"model.num_layers": 2, "model.attention.layer_types": layers} if layers else {}
    if layers and "sliding" in layers:
        sets["model.attention.window"] = 8
    if layers and "chunked" in layers:
        sets["model.attention.chunk"] = 16
    run, config = _run(data_dir, **sets)
    needs = hostmem.generate_needs(run, config, 3, 10**8)
    net = model.Decoder(config.model, rngs=nnx.Rngs(0))
    cache = jax.eval_shape(lambda: net.init_cache(1, 3 + 10**8))  # what decoding allocates
    assert needs["cache"] == sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(cache) if x.ndim
    )


def test_a_continuation_whose_cache_cannot_fit_is_one_line(data_dir):
    run, config = _run(data_dir)
    hostmem.check_generate(run, config, 3, 200, free=GIB)
    with pytest.raises(ValueError, match=r"^generating 100000000 tokens needs at least .*"
                                         r"cache .*: ask for fewer --max_new_tokens$"):  # fmt: skip
        hostmem.check_generate(run, config, 3, 10**8, free=GIB)


def test_an_evaluation_that_would_not_fit_gets_a_kernel_and_batch_that_do(data_dir, capsys):
    """The suite at a long length: attention that materialises the scores becomes chunked,
    then the batch halves, each said in one line; a batch of one that cannot fit is
    refused before anything compiles."""
    run, config = _run(data_dir, **{"eval.batch_size": 16})
    length = 8192
    needs = hostmem.eval_needs(run, config, length, decoding=True)
    assert needs["scores"] > 0 and needs["cache"] > 0
    assert needs["logits"] == 16 * config.model.vocab_size * 4  # one position a row
    free = sum(needs.values()) - needs["scores"] // 2  # the scores alone do not fit
    same = hostmem.fit_eval(run, config, [length], decoding=True, free=10 * sum(needs.values()))
    assert same is config
    fitted = hostmem.fit_eval(run, config, [length], decoding=True, free=free)
    assert fitted.model.attention.impl == "chunked" and fitted.eval.batch_size == 16
    assert "model.attention.impl=chunked for this evaluation" in capsys.readouterr().err
    chunked = hostmem.eval_needs(run, fitted, length, decoding=True)
    smaller = hostmem.fit_eval(run, config, [length], decoding=True,
                               free=sum(chunked.values()) - chunked["cache"] // 2)  # fmt: skip
    assert smaller.model.attention.impl == "chunked" and smaller.eval.batch_size == 8
    assert "eval.batch_size=16 would not fit in host memory: 8" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^evaluation at seq_len=8192 needs at least"):
        hostmem.fit_eval(run, config, [length], decoding=True, free=needs["state"])
