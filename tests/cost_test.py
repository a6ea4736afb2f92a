"""The cost plan (harness.cost): FLOPs against hand counts, wall-time arithmetic, the CLI."""

import math
import os
import shlex

import jax
import pytest
from flax import nnx

from configs import lm
from rope_jax import learned
from rope_jax.harness import cost, flops
from rope_jax.nn import model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_flops_match_a_hand_count():
    config = lm.get_config("size=tiny")  # L 2, D 128, N 4, K 2, H 32, F 384, V 259, T 128
    # per layer: q 128*4*32 = 16,384, o 16,384, k + v 2*128*2*32 = 16,384,
    # SwiGLU 3*128*384 = 147,456 -> 196,608; 2 layers 393,216; head 128*259 = 33,152.
    assert flops.matmul_params(config.model) == 393_216 + 33_152 == 426_368
    # + embedding 259*128 = 33,152 + norm scales (2*2 + 1)*128 = 640
    assert flops.num_params(config.model) == 426_368 + 33_152 + 640 == 460_160
    # 6 * 426,368 + 12 * 2 * 128 * 4 * 32
    assert flops.flops_per_token(config) == 2_558_208 + 393_216 == 2_951_424
    assert flops.remat_flops_per_token(config) == 0  # remat=none
    assert flops.token_budget(config) == 500 * 16 * 128  # num_steps x B x T
    assert flops.total_flops(config) == 2_951_424 * 1_024_000


def test_local_layers_count_the_keys_their_masks_keep():
    config = lm.get_config("size=tiny")  # N 4, H 32, T 128
    a = config.model.attention
    config.model.num_layers = 4
    a.layer_types, a.window, a.chunk = ("sliding", "full", "chunked", "full"), 32, 48
    # full square: 2 * 32 - 32^2 / 128 = 56, 128, (2 * 48^2 + 32^2) / 128 = 44, 128 -> 356
    assert flops.attention_flops_per_token(config.model, 128) == 12 * 4 * 32 * 356
    # causal: 32 - 32^2 / 256 = 28, 64, 44 / 2 = 22, 64 -> 178
    assert flops.attention_flops_per_token(config.model, 128, causal=True) == 12 * 4 * 32 * 178
    # the causal area is the count of the kept (query, key) pairs to within half the
    # diagonal (a triangle's area, T^2 / 2, against its T (T + 1) / 2 cells)
    for kind, size in (("sliding", 32), ("chunked", 48), ("full", 128)):
        t = 128
        q, k = [i for i in range(t) for _ in range(t)], [j for _ in range(t) for j in range(t)]
        kept = sum(1 for i, j in zip(q, k, strict=True) if j <= i and (
            kind == "full" or (kind == "sliding" and i - j < size)
            or (kind == "chunked" and i // size == j // size)))  # fmt: skip
        got = flops.keys_per_query(kind, size, t, causal=True) * t
        assert kept - t / 2 <= got <= kept
        assert flops.keys_per_query(kind, size, t) == 2 * got / t  # the full-square count


def test_1b_flops_match_a_hand_count():
    config = lm.get_config("size=1b")  # L 16, D 2048, N 32, K 8, H 64, F 8192, T 2048
    # per layer: q 2048*32*64 = 4,194,304, o 4,194,304, k + v 2*2048*8*64 = 2,097,152,
    # SwiGLU 3*2048*8192 = 50,331,648 -> 60,817,408; 16 layers 973,078,528;
    # head 2048*259 = 530,432.
    assert flops.block_matmul_params(config.model) == 973_078_528
    assert flops.matmul_params(config.model) == 973_608_960
    assert flops.num_params(config.model) == 974_206_976  # the README's dry-run count
    attention = 12 * 16 * 2048 * 32 * 64
    assert attention == 805_306_368
    assert flops.flops_per_token(config) == 6 * 973_608_960 + attention == 6_646_960_128
    # remat=block recomputes the blocks' forward: 2 * 973,078,528 + 4 * 16 * 2048 * 2048
    assert flops.remat_flops_per_token(config) == 1_946_157_056 + 268_435_456
    ratio = 1 + flops.remat_flops_per_token(config) / flops.flops_per_token(config)
    assert ratio == pytest.approx(1.333, abs=1e-3)


def test_causal_count_halves_the_attention_term_only():
    config = lm.get_config("size=1b")  # L 16, N 32, H 64, T 2048
    # causal attention: half the T x T square, 6 * 16 * 2048 * 32 * 64 = 402,653,184
    causal = 6 * 973_608_960 + 402_653_184
    assert flops.attention_flops_per_token(config.model, 2048, causal=True) == 402_653_184
    assert flops.flops_per_token(config, causal=True) == causal == 6_244_306_944
    assert flops.total_flops(config, causal=True) == causal * 500 * 256 * 2048
    # the H100's 1b step: 79,711.47 tokens/s on one 989 TFLOP/s device
    both = flops.mfu_both(79_711.4693906479, config, 1, 989e12)
    assert both["full"] == pytest.approx(0.53573, abs=1e-5)
    assert both["causal"] == pytest.approx(79_711.4693906479 * causal / 989e12)
    assert both["causal"] == pytest.approx(0.50327, abs=1e-5)
    assert flops.causal_mfu(both["full"], config) == pytest.approx(both["causal"])
    tiny = lm.get_config("size=tiny")  # 12 * 2 * 128 * 4 * 32 = 393,216, half 196,608
    assert flops.flops_per_token(tiny, causal=True) == 2_558_208 + 196_608


def test_num_tokens_overrides_steps_times_batch_times_seq_len():
    config = lm.get_config("size=1b")
    assert flops.token_budget(config) == 500 * 256 * 2048
    config.train.num_tokens = 20_000_000_000
    assert flops.token_budget(config) == 20_000_000_000
    assert flops.total_flops(config) == 6_646_960_128 * 20_000_000_000
    assert flops.steps_for_budget(config) == math.ceil(20e9 / (256 * 2048)) == 38_147


TIED = {"model.attention.kv": "tied", "model.rope.sites": "qkvo"}


LEARNED = {"model.rope.learned": "commuting", "model.rope.nope_every": 2}


@pytest.mark.parametrize("overrides, num_axes", [
    ({}, 1), (TIED, 1), ({"model.patch_dim": 64}, 1), ({"model.rope.learned": "freqs"}, 3),
    (LEARNED, 1), (lm.row_overrides("v4"), 1),
])  # fmt: skip
def test_matmul_params_are_the_models_matrices_but_the_embedding(overrides, num_axes):
    config = lm.get_config("size=tiny")
    config.update_from_flattened_dict(overrides)
    decoder = lambda: model.Decoder(config.model, num_axes=num_axes, rngs=nnx.Rngs(0))
    net = nnx.eval_shape(decoder)
    params = nnx.to_flat_state(nnx.state(net, nnx.Param))
    shapes = {path: v.get_value().shape for path, v in params}
    rotation = {path for path in shapes if path[-1] in learned.PARAM_NAMES}
    matrices = sum(math.prod(s) for path, s in shapes.items()
                   if len(s) >= 2 and path != ("embed",) and path not in rotation)  # fmt: skip
    assert bool(rotation) == (config.model.rope.learned != "none")
    assert flops.matmul_params(config.model) == matrices
    assert flops.num_params(config.model, num_axes) == sum(math.prod(s) for s in shapes.values())


def test_wall_time_arithmetic():
    # 1e18 FLOPs on 8 devices of 1e15 FLOP/s at 50% MFU: 1e18 / 4e15 = 250 s
    assert flops.wall_seconds(1e18, 8, 1e15, 0.5) == pytest.approx(250.0)
    assert flops.measured_mfu(1e4, 1e10, 2, 1e15) == pytest.approx(0.05)
    assert [cost.format_duration(s) for s in (9.5, 250, 7199, 7200, 48 * 3600)] == [
        "9.5 s", "4 min", "120 min", "2.0 h", "48 h (2.0 d)"]  # fmt: skip
    assert [cost.format_count(n) for n in (20e9, 5.5e9, 2e6, 1500, 12)] == [
        "20B", "5.5B", "2M", "1.5k", "12"]  # fmt: skip
    assert cost.sci(1.3293920256e20) == "1.329e20" and cost.sci(2e10) == "2e10"


def test_the_plan_of_the_1b_preset_at_20b_tokens():
    config = lm.get_config("size=1b")
    config.train.num_tokens = 20_000_000_000
    lines = cost.format_plan(config, rows=9, seeds=(1, 3), measured=0.2)
    text = "\n".join(lines)
    assert "6.647e9" in text and "38,147 steps" in text and "x1.333" in text
    # both conventions, each named: FLOPs per token and MFU
    assert "full T x T attention, PaLM" in text and "= 6.244e9" in text
    assert "planning 40% (full T x T attention, PaLM) = 37.6% (causal" in text
    assert "measured 20.0% (full) = 18.8% (causal)" in text
    assert "9 runs: 1.196e21" in text and "27 runs: 3.589e21" in text
    # 1.3294e20 / (8 x 989e12 x 0.4) = 42,006 s = 11.7 h, 93 GPU-hours; at 20%: 23.3 h;
    # 9 runs 105 h (840 GPU-hours), 27 runs 315 h (2,520).
    cells = ["H100 SXM", "989", "8", "11.7 h", "93", "23.3 h", "105 h (4.4 d)", "840",
             "315 h (13.1 d)", "2,520"]  # fmt: skip
    assert "| " + " | ".join(cells) + " |" in lines
    assert sum(line.startswith("| TPU v5p |") for line in lines) == len(cost.DEVICE_COUNTS)
    assert cost.format_plan(config)[-1].count("|") == 6  # one run: no totals columns


def test_the_committed_plan_is_what_its_command_writes(monkeypatch):
    """results/performance/cost_plan.md = the output of the command it names + its
    hand-written notes."""
    monkeypatch.chdir(ROOT)
    with open("results/performance/cost_plan.md") as f:
        text = f.read()
    made_by = next(line for line in text.splitlines() if line.startswith("Made by `python -m"))
    argv = shlex.split(made_by.split("`")[1])[3:]  # after python -m rope_jax.harness.cost
    assert "--out=results/performance/cost_plan.md" in argv
    notes = cost.kept_notes("results/performance/cost_plan.md")
    assert notes.startswith(cost.NOTES_MARKER)
    assert text == "\n".join(cost.render(argv)) + "\n\n" + notes


def test_main_writes_markdown_and_keeps_the_notes(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "plan.md"
    argv = ["--config=configs/lm.py:size=tiny", "--num_tokens=1e9,2e6", "--rows=9", f"--out={out}"]
    cost.main(argv)
    text = out.read_text()
    assert text.startswith("# Cost plan: `configs/lm.py:size=tiny`")
    assert "## 1B tokens per run" in text and "## 2M tokens per run" in text
    out.write_text("stale numbers\n" + cost.NOTES_MARKER + "\nmy notes\n")
    cost.main(argv)
    assert out.read_text() == text + "\n" + cost.NOTES_MARKER + "\nmy notes\n"
    with pytest.raises(SystemExit, match="no config file 'configs/none.py'"):
        cost.main(["--config=configs/none.py"])
    kept = out.read_text()

    def cut_short(*args):  # a crash or Ctrl-C before the new plan is in place
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", cut_short)
    with pytest.raises(KeyboardInterrupt):
        cost.main(argv)
    assert out.read_text() == kept  # the notes were never at risk: the file is whole
    assert os.listdir(tmp_path) == ["plan.md"]  # no temporary file left


@pytest.mark.parametrize("flag, message", [
    ("--num_tokens=abc", "--num_tokens=abc must be comma-separated positive numbers"),
    ("--num_tokens=-5", "--num_tokens=-5 must be comma-separated positive numbers"),
    ("--seeds=0", "--seeds=0 must be comma-separated positive numbers"),
    ("--rows=0", "--rows=0 must be >= 1"),
    ("--mfu=2", "--mfu=2 must be a fraction in (0, 1]"),
    ("--measured_mfu=0", "--measured_mfu=0 must be a fraction in (0, 1]"),
    ("--out=/dev/null/plan.md", "--out=/dev/null/plan.md is not writable: Not a directory"),
])  # fmt: skip
def test_a_value_the_plan_cannot_use_is_one_line(flag, message, monkeypatch):
    """Each was a traceback or a plan of negative hours."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as info:
        cost.main(["--config=configs/lm.py:size=tiny", flag])
    assert str(info.value.code) == f"error: {message}"


@pytest.mark.slow  # compiles the tiny step (~5-10 s on 2 busy cores)
def test_dry_run_reports_the_flops():
    from rope_jax.harness import setup

    config = lm.get_config("size=tiny")
    config.train.num_tokens = 10**9
    report = setup.dry_run(config)
    assert report["flops_per_token"] == 2_951_424
    assert report["total_flops"] == 2_951_424 * 10**9
    assert jax.device_count() == report["devices"]
