"""benchmarks/gpu_suite.py in --smoke mode on a CPU: every stage runs, writes its JSON and
the page, resumes without redoing finished work, and bad input is one line."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_data  # noqa: E402
import gpu_kernels  # noqa: E402
import gpu_report  # noqa: E402
import gpu_rung  # noqa: E402
import gpu_suite  # noqa: E402

from rope_jax import data as data_lib  # noqa: E402
from rope_jax.data import carried  # noqa: E402
from rope_jax.harness import evals  # noqa: E402
from rope_jax.harness.evals import common  # noqa: E402


def _suite(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_suite", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A prepared byte-level corpus packed the way a GPU call carries it."""
    base = tmp_path_factory.mktemp("corpus")
    lines = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)]
    src = base / "src"
    src.mkdir()
    for i in range(40):
        (src / f"doc{i}.txt").write_text("".join(lines[i * 10 : (i + 1) * 10]))
    prepare = [sys.executable, "-m", "rope_jax.data.prepare", f"--source={src}/*.txt",
               "--tokenizer=bytes", "--name=tiny", f"--data_dir={base}", "--quiet",
               "--held_out_percent=10"]  # fmt: skip
    subprocess.run(prepare, cwd=ROOT, check=True, capture_output=True)
    out = base / "packed"
    info = gpu_data.pack(str(base / "tiny"), str(out), train_tokens=5000, also=[])
    return out, info


def test_pack_writes_the_splits_and_counts_bytes(corpus):
    out, info = corpus
    train = carried.load(str(out / "train"))
    val, val_bytes = (carried.load(str(out / n)) for n in ("validation", "validation_bytes"))
    assert train.dtype == np.uint16 and train.size == info["train_tokens"] == 5000
    assert val.size == val_bytes.size == info["validation_tokens"] > 0
    assert info["validation_bytes"] == int(np.sum(val < 256))  # bytes: all but EOS are 1 byte
    assert json.loads((out / "meta.json").read_text())["vocab_size"] == 259
    assert (out / "train.npy.xz").stat().st_size < train.nbytes / 2  # it travels compressed


def test_pack_takes_slices_spread_over_the_whole_split(corpus, tmp_path):
    """Four slices of 500 tokens: the first from the stream's start, the last ending at its
    end, joined by EOS."""
    from rope_jax.data import shards

    out, _ = corpus
    dataset = str(out.parent / "tiny")
    whole = shards.TokenSplit(dataset, "train")
    stream = whole.read(0, len(whole))["tokens"]
    info = gpu_data.pack(dataset, str(tmp_path / "p"), train_tokens=2000, also=[], slices=4)
    train = carried.load(str(tmp_path / "p" / "train"))
    assert info["train_tokens"] == train.size == 2000 + 3 and info["slices"] == 4
    parts = np.split(train, [500, 501, 1001, 1002, 1502, 1503])[::2]
    assert all(train[i] == whole.eos_id for i in (500, 1001, 1502))
    np.testing.assert_array_equal(parts[0], stream[:500])
    np.testing.assert_array_equal(parts[-1], stream[-500:])
    starts = [int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(stream, 500)
                                        == p, axis=1))[0]) for p in parts]  # fmt: skip
    assert starts == sorted(starts) and starts[1] > 500 and starts[2] < len(stream) - 1000


@pytest.mark.slow
def test_pack_refuses_what_would_not_travel(corpus, tmp_path, monkeypatch):
    out, _ = corpus
    monkeypatch.setattr(gpu_data, "LIMIT_MIB", 1)
    with pytest.raises(SystemExit, match=r"MiB over the 1 MiB a call carries"):
        gpu_data.pack(str(out.parent / "tiny"), str(tmp_path / "x"), train_tokens=5000, also=[])
    assert not (tmp_path / "x").exists()


# The tests that train the rung share an xdist group ("gpu_suite_rung"): one worker runs
# them in order, so `smoked` is made once and the later ones find the programs it compiled
# in the worker's compilation cache.
@pytest.fixture(scope="module")
def smoked(corpus, tmp_path_factory):
    """OUT of one `--smoke` call of every stage on the packed corpus, and the call: made
    once for the tests that read it (they copy OUT before adding to it)."""
    data, _ = corpus
    out = tmp_path_factory.mktemp("smoked") / "gpu"
    proc = _suite("--out", str(out), "--smoke", "--budget_s=400", "--data", str(data))
    return out, proc


@pytest.mark.slow
@pytest.mark.xdist_group("gpu_suite_rung")
def test_every_stage_runs_in_smoke_mode_and_resumes(corpus, smoked, tmp_path):
    data, _ = corpus
    out, proc = smoked
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = shutil.copytree(out, tmp_path / "gpu")  # the rerun below must change nothing
    results = {s: json.loads((out / f"{s}.json").read_text()) for s in gpu_suite.ORDER}
    assert all(r["done"] for r in results.values()), {s: r.get("errors") for s, r in
                                                      results.items()}  # fmt: skip
    kernels = results["kernels"]
    assert kernels["impls"] == ["dot_product", "chunked"]
    assert all(row["ok"] for case in kernels["cases"].values() for row in case["rows"])
    assert all(d["ok"] for d in kernels["decode"].values())
    ran = [m for m in results["step1b"]["settings"].values() if not m.get("oom")]
    assert ran and all(m["tokens_per_s"] > 0 and m["last_loss"] > 0 for m in ran)
    rung = results["rung"]
    assert set(rung["rows"]) == {"nope", "qkvo"}
    for row in rung["rows"].values():  # every step's loss and gradient norm, finite
        assert len(row["step_loss"]) == len(row["step_grad_norm"]) == rung["steps"]
        assert all(np.isfinite(row["step_loss"])) and all(x > 0 for x in row["step_grad_norm"])
        assert row["step_loss"][0] == row["train_curve"][0][1]
        # the final parameters on training windows, through the held-out windows' program
        assert 0 < row["train_windows_loss"] < row["step_loss"][0]
        # each layer's largest attention logit, sampled at steps 0, k, 2k, ...
        steps = [s for s, _ in row["max_logit"]]
        assert steps[0] == 0 and steps == sorted(set(steps)) and steps[-1] < rung["steps"]
        assert all(len(layers) == rung["shape"]["num_layers"] and np.all(np.isfinite(layers))
                   for _, layers in row["max_logit"])  # fmt: skip
    assert "| training windows @" in (out / "gpu_suite.md").read_text()
    for row in rung["rows"].values():  # trained: below the uniform guess over 259 ids
        assert row["loss"] < np.log(259) and row["bits_per_byte"] > 0
        assert set(row["loss_at"]) == {"32", "64", "128"} and row["loss_at"]["32"] == row["loss"]
    sweep = json.loads((out / "rung_sweep.json").read_text())
    assert sweep["seq_lens"] == ["32", "64", "128"]
    assert sweep["rows"]["nope"]["runs"][0]["loss"]["128"] == rung["rows"]["nope"]["loss_at"]["128"]
    page = (out / "gpu_suite.md").read_text()
    for stage in gpu_suite.ORDER:
        assert f"## {stage} (done" in page

    # a rerun finds every stage done and changes nothing
    before = {s: (out / f"{s}.json").read_text() for s in gpu_suite.ORDER}
    again = _suite("--out", str(out), "--smoke", "--budget_s=100", "--data", str(data))
    assert again.returncode == 0 and again.stdout.count("already done") == len(gpu_suite.ORDER)
    assert before == {s: (out / f"{s}.json").read_text() for s in gpu_suite.ORDER}


def test_a_stage_resumes_after_its_finished_items(tmp_path):
    """A rung cut off after one row keeps it and runs only the others."""
    row = {"loss": 1.0, "bits_per_byte": 0.5, "train_s": 1.0, "compile_s": 1.0}
    r = {"steps": 3, "rows": {"nope": row}}
    gpu_suite.save(str(tmp_path), "rung", r)
    assert gpu_suite.load(str(tmp_path), "rung") == r
    assert gpu_suite.load(str(tmp_path), "kernels") == {}
    page = gpu_report.render({"rung": {**r, "stopped_for_time": True}})
    assert "## rung (partial, stopped for time)" in page
    assert "Rows finished: 1 of 9" in page and "more than one device" not in page
    two = {"nope": dict(row, device="H100"), "qk": dict(row, loss=0.9, device="H200")}
    page = gpu_report.render({"rung": {**r, "rows": two}})
    assert "Rows ran on more than one device: qk H200, nope H100." in page
    # a later call that finished the stage: done, whatever an earlier call recorded
    page = gpu_report.render({"rung": {**r, "stopped_for_time": True, "done": True}})
    assert "## rung (done)" in page


@pytest.mark.slow
@pytest.mark.xdist_group("gpu_suite_rung")
def test_a_rung_trains_rows_again_at_another_seed_beside_its_table(corpus, smoked, tmp_path):
    """--rung_seed/--rung_rows add seed 1 of a row to a finished rung (the smoke call's,
    `smoked`): its own init and data order, seed 0's table untouched, both seeds in the
    page and the sweep file."""
    data, _ = corpus
    first = smoked[1]
    assert first.returncode == 0, first.stderr[-3000:]
    out = shutil.copytree(smoked[0], tmp_path / "gpu")
    table = gpu_suite.load(str(out), "rung")["rows"]
    assert set(table) == {"nope", "qkvo"}
    again = ("--out", str(out), "--smoke", "--stage=rung", "--data", str(data), "--rung_seed=1",
             "--rung_rows=nope")  # fmt: skip
    proc = _suite(*again)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rung: nope seed 1: held-out loss" in proc.stdout and "qkvo" not in proc.stdout
    rung = gpu_suite.load(str(out), "rung")
    assert rung["rows"] == table and rung["done"]
    assert set(rung["more_seeds"]) == {"1"} and set(rung["more_seeds"]["1"]) == {"nope"}
    one = rung["more_seeds"]["1"]["nope"]
    assert one["loss"] < np.log(259) and abs(one["loss"] - table["nope"]["loss"]) > 1e-4
    sweep = json.loads((out / "rung_sweep.json").read_text())
    assert sweep["seeds"] == [0, 1]
    assert [r["seed"] for r in sweep["rows"]["nope"]["runs"]] == [0, 1]
    assert [r["seed"] for r in sweep["rows"]["qkvo"]["runs"]] == [0]
    assert sweep["rows"]["nope"]["runs"][1]["loss"]["32"] == one["loss"]
    page = (out / "gpu_suite.md").read_text()
    spread = abs(one["loss"] - table["nope"]["loss"])
    assert f"The largest spread between the seeds of a row is {spread:.4f}" in page
    assert "its seed noise is unmeasured" not in page
    rerun = _suite(*again)  # that row of that seed is done: nothing runs
    assert rerun.returncode == 0 and "rung already done" in rerun.stdout
    assert gpu_suite.load(str(out), "rung") == rung
    # float32 compute at a tenth of the peak learning rate: kept beside, not in, the table
    variant = _suite("--out", str(out), "--smoke", "--stage=rung", "--data", str(data),
                     "--rung_rows=nope", "--rung_variant=lr=3e-4,float32")  # fmt: skip
    assert variant.returncode == 0, variant.stderr[-3000:]
    assert "rung: nope (float32,lr=3e-4): held-out loss" in variant.stdout
    after = gpu_suite.load(str(out), "rung")
    assert after["rows"] == table and after["more_seeds"] == rung["more_seeds"]
    slow = after["variants"]["float32,lr=3e-4"]["0"]["nope"]
    assert slow["variant_changes"] == {"model.dtype": "float32", "optim.lr": 3e-4}
    assert slow["loss"] > table["nope"]["loss"]  # a tenth of the step size, as many steps
    page = (out / "gpu_suite.md").read_text()
    assert f"| nope | float32,lr=3e-4 | 0 | {slow['loss']:.4f} |" in page
    new = tmp_path / "new"  # refused before --resume_from copies anything into it
    bad = _suite("--out", str(new), "--smoke", "--stage=rung", "--rung_rows=nope,vk",
                 "--resume_from", str(out))  # fmt: skip
    assert bad.returncode != 0 and bad.stdout == "" and not new.exists()
    assert bad.stderr.strip().splitlines() == [
        "gpu_suite: --rung_rows='nope,vk': vk is not a row; the rows are "
        "nope, q, k, v, o, qk, vo, qkv, qkvo"
    ]


def test_a_rung_keeps_its_length_across_calls(corpus, tmp_path):
    """Rows of different lengths are not one rung: another --rung_tokens is one line."""
    data, _ = corpus
    row = {"loss": 1.0, "bits_per_byte": 0.5, "train_s": 1.0, "compile_s": 1.0, "path": "harness"}
    rung = {"steps": 20, "tokens_per_run": 2560, "rows": {"nope": row}}
    gpu_suite.save(str(tmp_path), "rung", rung)
    proc = _suite("--out", str(tmp_path), "--smoke", "--stage=rung", "--rung_tokens=5120",
                  "--data", str(data), "--budget_s=60")  # fmt: skip
    assert proc.returncode != 0 and proc.stdout == ""  # before any stage started
    assert proc.stderr.strip().splitlines() == [
        f"gpu_suite: {tmp_path}/rung.json has rows of 20 steps (2,560 tokens); this run asks "
        "40: use the same --rung_tokens or another --out"
    ]
    assert gpu_suite.load(str(tmp_path), "rung")["rows"] == {"nope": row}
    # the same length on another corpus: not one rung either
    other = {"dataset": "other", "train_tokens": 7}
    gpu_suite.save(str(tmp_path), "rung", dict(rung, steps=40, tokens_per_run=5120, data=other))
    proc = _suite("--out", str(tmp_path), "--smoke", "--stage=rung", "--rung_tokens=5120",
                  "--data", str(data), "--budget_s=60")  # fmt: skip
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"gpu_suite: {tmp_path}/rung.json has rows trained on other (7 tokens carried); "
        f"--data={data} holds tiny (5,000): carry the same corpus or use another --out"
    ]
    proc = _suite("--out", str(tmp_path / "new"), "--stage=all", "--data", str(tmp_path / "no"))
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"gpu_suite: --data={tmp_path}/no holds no travelling corpus (meta.json): make it with "
        "`python benchmarks/gpu_data.py --dataset=DIR/NAME` and carry it, or leave rung out "
        "of --stage"
    ]
    assert not (tmp_path / "new").exists()


def test_rows_of_the_earlier_rung_code_take_no_new_rows(corpus, tmp_path):
    """A rung.json whose rows have no "path" (made before the rung trained through the
    harness) stays as it is: a call that would add rows to it is one line; one that asks
    only for rows it has runs nothing."""
    data, info = corpus
    row = {"loss": 1.0, "bits_per_byte": 0.5, "train_s": 1.0, "compile_s": 1.0}
    rung = {"steps": 20, "tokens_per_run": 2560, "rows": {"nope": row, "qkvo": row},
            "data": info, "shape": gpu_rung.SMOKE_RUNG_SHAPE}  # fmt: skip
    gpu_suite.save(str(tmp_path), "rung", rung)
    proc = _suite("--out", str(tmp_path), "--smoke", "--stage=rung", "--rung_seed=1",
                  "--rung_rows=qk", "--data", str(data), "--budget_s=60")  # fmt: skip
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"gpu_suite: {tmp_path}/rung.json holds rows made by the rung's earlier code (2 "
        'without "path": its own windows and held-out loop); rows trained through the '
        "harness do not join them: use another --out"
    ]
    done = _suite("--out", str(tmp_path), "--smoke", "--stage=rung", "--data", str(data),
                  "--budget_s=60")  # fmt: skip
    assert done.returncode == 0 and "rung already done" in done.stdout
    assert gpu_suite.load(str(tmp_path), "rung") == rung
    assert gpu_rung.rung_problem(dict(rung, rows={"nope": dict(row, path="harness")}),
                                 str(tmp_path), str(data), 2560, True) is None  # fmt: skip


def test_kernel_items_put_the_common_cases_first():
    items = gpu_kernels.kernel_items(["dot_product", "chunked"], ("float32", "bfloat16"), False)
    keys = [key for _, key, _ in items]
    assert keys[:2] == ["separate/qk", "separate/qkvo"]
    loss = [k for kind, k, _ in items if kind == "loss" and not k.startswith("segments")]
    assert len(loss) == 17 and len(set(keys)) == len(keys)  # 16 site subsets + tied


def test_bad_stage_budget_or_out_is_one_line(tmp_path):
    """A device's minutes are few: what would waste them is refused before anything runs."""
    (tmp_path / "file").write_text("")
    for args, line in [
        (["--stage=kernel"],
         "gpu_suite: --stage='kernel': stages are all or check, kernels, step1b, rung, peer"),
        (["--budget_s=0"], "gpu_suite: --budget_s=0 must be > 0"),
        (["--rung_variant=fp16"], "gpu_suite: --rung_variant='fp16': 'fp16' is neither "
         "'float32' nor 'lr=X' with X > 0"),
        (["--rung_variant=lr=0"], "gpu_suite: --rung_variant='lr=0': 'lr=0' is neither "
         "'float32' nor 'lr=X' with X > 0"),
        ([f"--out={tmp_path}/file/out"],
         f"gpu_suite: --out={tmp_path}/file/out: Not a directory ({tmp_path}/file)"),
    ]:  # fmt: skip
        proc = _suite("--out", str(tmp_path / "unused"), *args)
        assert proc.returncode != 0
        assert proc.stderr.strip().splitlines() == [line]
    assert not (tmp_path / "unused").exists()


def _rung_rows(data, seed: int, rows=("nope", "qkvo")) -> dict:
    """The smoke rung's rows compiled, two steps each, on the packed corpus at `data`."""
    from configs import lm

    shape = gpu_rung.SMOKE_RUNG_SHAPE
    configs = {r: gpu_rung.rung_config(shape, lm.ROWS[r], 259, 2, "xla", data=str(data),
                                       seed=seed) for r in rows}  # fmt: skip
    return gpu_rung.compile_rows(configs)


@pytest.mark.slow
@pytest.mark.xdist_group("gpu_suite_rung")
def test_a_rung_row_trains_on_the_harness_iterators_batches(corpus):
    """Every rung row's train step sees the batches of the harness's training iterator
    for the row's seed (train.py's): `pipeline.Windows` over the carried training tokens,
    in the order of `pipeline.shuffled_batches`; the same for every row."""
    import jax

    from rope_jax import harness
    from rope_jax.data import pipeline

    data, _ = corpus
    rows = _rung_rows(data, seed=3)
    seen = {}
    for name, row in rows.items():
        step = row.run.train_step

        def spy(state, batch, name=name, step=step):
            seen.setdefault(name, []).append(jax.device_get(batch))
            return step(state, batch)

        row.run = row.run._replace(train_step=spy)
        gpu_rung.train_row(row)
    shape = gpu_rung.SMOKE_RUNG_SHAPE
    b, t = shape["batch"], shape["seq_len"]
    tokens = np.asarray(carried.load(str(data / "train")))
    own = pipeline.shuffled_batches((len(tokens) - 1) // t, pipeline.Windows(tokens, t),
                                    seed=3, batch_size=b, shard=(0, 1))  # fmt: skip
    trains = harness.train_iterator(rows["nope"].config)
    for i in range(2):
        want, also = next(own), next(trains)
        for name in rows:
            assert set(seen[name][i]) == set(want)
            for key in want:
                np.testing.assert_array_equal(seen[name][i][key], want[key])
                np.testing.assert_array_equal(also[key], want[key])
    other = pipeline.shuffled_batches((len(tokens) - 1) // t, pipeline.Windows(tokens, t),
                                      seed=4, batch_size=b, shard=(0, 1))  # fmt: skip
    assert not np.array_equal(next(other)["inputs"], seen["nope"][0]["inputs"])


@pytest.mark.slow
@pytest.mark.xdist_group("gpu_suite_rung")
def test_a_rung_row_scores_as_the_harness_loss_task_does(corpus):
    """A rung row's held-out loss and bits per byte at T and 4T, and its loss on training
    windows, are the harness's `loss` task's (`evals.score`, with the jitted steps of
    `harness.build`) on the parameters of the same two training steps from the same
    init, on the same batches (`harness.train_iterator`)."""
    import dataclasses

    import jax

    from rope_jax import harness, sharding

    data, _ = corpus
    row = _rung_rows(data, seed=3, rows=("qkvo",))["qkvo"]
    got = gpu_rung.train_row(row)
    assert got["path"] == "harness"

    config = row.config
    run = harness.build(config, vocab_from_data=False)
    batches = harness.train_iterator(config)
    with sharding.use_mesh(run.mesh, run.rules):
        state = jax.jit(run.init_fn, out_shardings=run.shardings)()
        for _ in range(2):
            state, m = run.train_step(state, harness.put_batch(next(batches), run.batch_sharding))
    np.testing.assert_allclose(got["step_loss"][-1], float(m["loss"]), rtol=1e-6)
    ctx = evals.Context(run, state["params"], config, split="validation",
                        num_batches=config.eval.num_batches)  # fmt: skip
    t = config.data.seq_len
    for length in (t, 4 * t):
        want = evals.score(ctx, ("loss",), length)
        np.testing.assert_allclose(got["loss_at"][str(length)], want["loss"], rtol=1e-5)
        np.testing.assert_allclose(got["bits_per_byte_at"][str(length)], want["bits_per_byte"],
                                   rtol=1e-5)  # fmt: skip
        assert got["eval_tokens_at"][str(length)] == want["tokens"] > 0
    on_train = evals.score(dataclasses.replace(ctx, split="train"), ("loss",), t)
    np.testing.assert_allclose(got["train_windows_loss"], on_train["loss"], rtol=1e-5)
    assert "bits_per_byte" not in on_train  # no bytes carried for the training tokens


def test_a_carried_corpus_is_a_runs_data(corpus):
    """`data.name` naming a packed folder is a carried corpus: its vocabulary, training
    windows from the training ids, evaluation windows with the carried bytes."""
    folder, info = corpus
    config = gpu_rung.rung_config(gpu_rung.SMOKE_RUNG_SHAPE, "qk", 259, 2, "xla",
                                  data=str(folder))  # fmt: skip
    kind = data_lib.kind(config.data)
    assert kind.name == "carried" and kind.vocab_size == info["vocab_size"] == 259
    val, val_bytes = (carried.load(str(folder / n)) for n in ("validation", "validation_bytes"))
    batch = next(iter(data_lib.make_eval_iterator(config.data, split="validation",
                                                  batch_size=2, seq_len=8)))  # fmt: skip
    np.testing.assert_array_equal(batch["targets"][0], val[1:9])
    np.testing.assert_array_equal(batch["target_bytes"][1], val_bytes[9:17])
    train = next(iter(data_lib.make_eval_iterator(config.data, split="train", batch_size=2,
                                                  seq_len=8)))  # fmt: skip
    assert not train["target_bytes"].any()  # not carried: no bits per byte
    with pytest.raises(ValueError, match="carried corpus"):
        kind.tokenizer()
    for task in ("passkey", "niah_single_1"):  # made from text: refused in one line
        with pytest.raises(ValueError, match=r"^[^\n]*(byte-level text|carried corpus)[^\n]*$"):
            evals.check(config, [task], lengths=[8], examples=1)
    with pytest.raises(ValueError, match=r"is carried data: token ids without their tokenizer"):
        common.text_stream(config.data, "validation")


def test_resume_from_starts_out_from_an_earlier_calls_files(tmp_path, capsys):
    """Stage files OUT lacks come from the kept folder; OUT's own are kept; a folder not
    made yet (the first call) starts afresh."""
    kept, out = tmp_path / "kept", tmp_path / "out"
    gpu_suite.save(str(kept.mkdir() or kept), "rung", {"steps": 5, "rows": {"qk": {}}})
    gpu_suite.save(str(kept), "check", {"done": True, "from": "kept"})
    gpu_suite.save(str(out.mkdir() or out), "check", {"done": True, "from": "out"})
    gpu_suite.resume_from(str(kept), str(out))
    assert gpu_suite.load(str(out), "rung") == {"steps": 5, "rows": {"qk": {}}}
    assert gpu_suite.load(str(out), "check")["from"] == "out"
    gpu_suite.resume_from(str(tmp_path / "not_yet"), str(tmp_path / "fresh"))
    assert "nothing to resume in" in capsys.readouterr().out
    assert not (tmp_path / "fresh").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("gpu_suite_rung")
def test_rows_compile_one_by_one_when_threads_fail(corpus, monkeypatch, capsys):
    """The rows of the tests above (their programs in the worker's compilation cache),
    compiled one after the other when no thread pool can be had."""
    import concurrent.futures

    class Broken(concurrent.futures.ThreadPoolExecutor):
        def map(self, *args, **kwargs):
            raise RuntimeError("no threads here")

    monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", Broken)
    rows = _rung_rows(corpus[0], seed=3)
    assert "compiling one row at a time" in capsys.readouterr().out
    assert set(rows) == {"nope", "qkvo"} and all(r.compile_s > 0 for r in rows.values())
    assert all(hasattr(r.run.train_step, "cost_analysis") for r in rows.values())  # compiled


def test_step1b_table_is_in_run_order_with_both_mfus_and_each_settings_memory():
    """The H100's committed step1b JSON (sorted by name on disk): rows in the order the
    settings ran, MFU counted over the full T x T square and causally, and the second
    setting's peak marked as not its own (it did not raise the first one's)."""
    with open(os.path.join(ROOT, "results/device/gpu_suite_2026-11-26_h100/step1b.json")) as f:
        r = json.load(f)
    assert list(r["settings"])[0].startswith("dot_product remat=block")  # sorted keys
    rows = [x for x in gpu_report._step1b(r) if x.startswith("| dot_product")]
    assert [x.split(" | ")[0] for x in rows] == ["| dot_product remat=none B=8 k=1",
                                                 "| dot_product remat=block B=16 k=1"]  # fmt: skip
    cells = [x.split(" | ") for x in rows]
    assert cells[0][3:5] == ["53.6%", "50.3%"] and cells[1][3:5] == ["45.4%", "42.7%"]
    assert cells[0][7:9] == ["31.7", "31.7"]  # its own peak; XLA: 10.9 + 20.9 GiB
    assert cells[1][7:9] == ["<= 31.7", "16.5"]  # not its own; XLA: 10.9 + 5.6 GiB
    page = "\n".join(gpu_report._step1b(r))
    assert "in the order shown" not in page and "'causal' half of it" in page
    # recorded by a newer run: its own order, MFU and peak before it
    m = dict(r["settings"]["dot_product remat=block B=16 k=1"], order=0, mfu_causal=0.5,
             peak_bytes_before=0)  # fmt: skip
    rows = [x for x in gpu_report._step1b({"settings": {"b": m}}) if x.startswith("| b")]
    assert rows[0].split(" | ")[4] == "50.0%" and rows[0].split(" | ")[7] == "31.7"
