"""The loss-by-position study (`experiments.position_loss`) on an imported HF fixture."""

import json
import os

import numpy as np
import pytest

from configs import lm
from rope_jax.experiments import position_loss
from rope_jax.hf import run as hf_run
from tests.hf_test import fixture


@pytest.fixture(scope="module")
def imported(tmp_path_factory, data_dir):
    workdir = str(tmp_path_factory.mktemp("pl") / "m")
    config = lm.get_config()
    config.data.data_dir = data_dir
    config.data.seq_len = 32
    hf_run.import_run(fixture("llama"), workdir, config)
    return workdir


def test_rules_parse_and_bad_ones_are_one_line():
    assert position_loss.parse_rule("yarn:2") == ("yarn", 2.0)
    assert position_loss.parse_rule("none") == ("none", None)
    bad_specs = [("ntk:2", "is not one of"), ("yarn", "needs a factor > 1"),
                 ("linear:1", "needs a factor > 1"), ("none:2", "takes no factor")]  # fmt: skip
    for bad, said in bad_specs:
        with pytest.raises(ValueError, match=said):
            position_loss.parse_rule(bad)


def test_the_curve_is_the_models_own_loss_and_resumes(imported, tmp_path, capsys):
    out = str(tmp_path / "pl")
    args = [f"--workdir={imported}", f"--out={out}", "--rules=none,linear:2,yarn:2",
            "--length=512", "--windows=2", "--bucket=128"]  # fmt: skip
    position_loss.main(args)
    page = json.load(open(os.path.join(out, "position_loss.json")))
    cells = {position_loss.cell_name(c["rule"], c["factor"]): c for c in page["cells"]}
    assert set(cells) == {"none", "linear_2", "yarn_2"}
    assert cells["none"]["trained_length"] == 64  # the fixture's max_position_embeddings
    assert len(cells["none"]["buckets"]) == 4 and page["tokens"] > 1024
    # the rules change the numbers (the fixture's model is random: no order is claimed)
    assert abs(cells["none"]["mean"] - cells["linear_2"]["mean"]) > 1e-4
    # one pass's losses equal the model's own logits (imported through hf.load)
    from rope_jax import hf
    from rope_jax.data import tokenizers

    model, _, _ = hf.load(fixture("llama"))
    tok = tokenizers.load(os.path.join(imported, "tokenizer"))
    ids = np.asarray(tok.encode(position_loss.text()[0])[:1024]).reshape(2, 512)
    logits = np.asarray(model(ids), np.float64)  # the two windows
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = lse[:, :-1] - np.take_along_axis(logits[:, :-1], ids[:, 1:, None], -1)[..., 0]
    assert abs(cells["none"]["buckets"][0] - want[:, :128].mean()) < 1e-3
    assert os.path.isfile(os.path.join(out, "position_loss.png"))
    capsys.readouterr()
    position_loss.main(args)  # every cell is there: nothing is scored again
    assert "mean" not in capsys.readouterr().out.split("wrote")[0]
