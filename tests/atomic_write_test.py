"""Files written whole or not at all, without replacing what is not a regular file."""

import os
import stat
import threading

import matplotlib
import pytest

from rope_jax.experiments import report
from rope_jax.harness import workdir

matplotlib.use("Agg")


def _read_fifo(path, out: list):
    """Reads `path` (a FIFO) to its end in a thread; the bytes land in `out`."""

    def read():
        with open(path, "rb") as f:
            out.append(f.read())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_a_file_is_replaced_whole_and_a_failed_write_keeps_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "table.md"
    path.write_text("old\n")
    workdir.write_atomic(str(path), "new\n")
    assert path.read_text() == "new\n" and os.listdir(tmp_path) == ["table.md"]
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        workdir.write_atomic(str(path), "newer\n")
    assert path.read_text() == "new\n" and os.listdir(tmp_path) == ["table.md"]  # no temp left


def test_a_symlink_stays_a_link_and_its_file_gets_the_text(tmp_path):
    (tmp_path / "kept").mkdir()
    real = tmp_path / "kept" / "table.md"
    real.write_text("old\n")
    link = tmp_path / "table.md"
    link.symlink_to(real)
    workdir.write_atomic(str(link), "new\n")
    assert link.is_symlink() and real.read_text() == "new\n"


def test_a_fifo_or_device_is_written_in_place_not_replaced(tmp_path):
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    got = []
    reader = _read_fifo(fifo, got)
    workdir.write_atomic(fifo, "through the pipe\n")
    reader.join(10)
    assert got == [b"through the pipe\n"] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert workdir.rename_target(os.devnull) is None  # /dev/null is never renamed over
    assert workdir.rename_target(fifo) is None
    assert workdir.rename_target(str(tmp_path / "new.md")) == str(tmp_path / "new.md")


def test_a_figure_is_a_whole_png_and_a_fifo_stays_a_fifo(tmp_path):
    import matplotlib.pyplot as plt

    path = tmp_path / "plot.png"
    report.save_figure(plt.figure(), str(path), 50)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.listdir(tmp_path) == ["plot.png"]
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    got = []
    reader = _read_fifo(fifo, got)
    report.save_figure(plt.figure(), fifo, 50)
    reader.join(10)
    assert got[0][:8] == b"\x89PNG\r\n\x1a\n" and stat.S_ISFIFO(os.stat(fifo).st_mode)
