"""Every row of configs/positions.py that is not a site row trains: four steps at T = 32,
checkpointed and evaluated (a scheme whose layer state does not split into parameters and
static settings fails here, not in the sweep)."""

import numpy as np
import pytest

from configs import positions
from tests.rope_variants_test import _four_steps

SCHEME_ROWS = [r for r in positions.ROWS if r not in positions.SITE_ROWS]


@pytest.mark.slow
@pytest.mark.parametrize("row", SCHEME_ROWS)
def test_every_scheme_row_trains_and_evaluates(row, data_dir, tmp_path):
    import train

    config = positions.get_config(f"size=tiny,row={row}")
    _four_steps(config, data_dir)
    result = train.train_and_evaluate(config, str(tmp_path / row))
    assert np.isfinite(result["loss"]) and result["loss"] < 7.0, result  # bytes: ~5.5 at init
