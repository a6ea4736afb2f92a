"""Which code made a number: the commit a checkout is at, and whether its code changed."""

import os
import subprocess

import pytest

from rope_jax import __version__, provenance
from rope_jax.experiments import report


def _git(root, *args):
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A git repository with a committed module and a committed results file, standing
    in for this package's checkout."""
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("x = 1\n")
    (root / "table.json").write_text("{}\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    monkeypatch.setattr(provenance, "_ROOT", str(root))
    return root


def _version():
    return provenance.code_version.__wrapped__()  # not the cached answer for this checkout


def test_the_commit_and_whether_python_files_changed(checkout):
    head = _git(checkout, "rev-parse", "HEAD")
    assert _version() == {"commit": head, "changed": False, "rope_jax": __version__}
    assert provenance.describe(_version()) == head[:7]
    (checkout / "table.json").write_text('{"rows": 1}\n')  # results are not code
    (checkout / "pkg" / "new.py").write_text("y = 2\n")  # nor is a file git does not track
    assert _version()["changed"] is False
    (checkout / "pkg" / "a.py").write_text("x = 2\n")
    assert _version()["changed"] is True
    assert provenance.describe(_version()) == f"{head[:7]} + uncommitted changes"


def test_outside_a_checkout_the_package_version_stands_in(tmp_path, checkout, monkeypatch):
    plain = tmp_path / "copied_tree"
    plain.mkdir()
    monkeypatch.setattr(provenance, "_ROOT", str(plain))
    assert _version() == {"commit": None, "changed": None, "rope_jax": __version__}
    assert provenance.describe(_version()) == f"rope_jax {__version__} (no git commit)"
    # installed inside some other repository: that repository's commit is not ours
    monkeypatch.setattr(provenance, "_ROOT", str(checkout / "pkg"))
    assert _version()["commit"] is None
    assert provenance.describe(None) == "unknown"


def test_this_checkout_names_its_own_head():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isdir(os.path.join(root, ".git")) and not os.path.isfile(
        os.path.join(root, ".git")
    ):
        pytest.skip("the tests run from a tree that is not a git checkout")
    assert provenance.code_version()["commit"] == _git(root, "rev-parse", "HEAD")


def test_starts_are_appended_and_a_line_cut_short_is_skipped(tmp_path):
    provenance.record_start(str(tmp_path), 0)
    provenance.record_start(str(tmp_path), 500)
    with open(tmp_path / provenance.FILE, "a") as f:
        f.write('{"step": 900, "co')  # killed mid-line
    starts = provenance.read_starts(str(tmp_path))
    assert [r["step"] for r in starts] == [0, 500]
    assert provenance.seen(str(tmp_path)) == [provenance.describe(provenance.code_version())]
    assert provenance.seen(str(tmp_path), "devices") == [provenance.devices()]
    assert provenance.read_starts(str(tmp_path / "none")) == []


def test_a_page_names_the_code_and_devices_its_runs_recorded(tmp_path):
    here = provenance.describe(provenance.code_version())
    a, b, old = (str(tmp_path / n) for n in ("a", "b", "old"))
    for w in (a, b, old):
        os.makedirs(w)
    provenance.record_start(a, 0)
    with open(os.path.join(b, provenance.FILE), "w") as f:  # b resumed under other code
        f.write('{"step": 0, "code": "abc1234", "devices": "gpu (NVIDIA H200) x1"}\n')
    provenance.record_start(b, 10)
    got = report.provenance_of([a, b, old])  # old: a run from before runs recorded it
    assert got == {"code": [here, "abc1234", "not recorded"],
                   "device": f"{provenance.devices()}, gpu (NVIDIA H200) x1"}  # fmt: skip
    assert report.provenance_of([old]) == {"code": ["not recorded"],
                                           "device": provenance.devices()}  # fmt: skip
    assert report.provenance_of([a], "slurm jobs of 2 node(s)")["device"] == (
        f"slurm jobs of 2 node(s); {provenance.devices()}"
    )
    page = dict(config="c", title="", command="x", date="d", jax="j", device="cpu",
                settings={}, seeds=[0])  # fmt: skip
    assert report.header(page)[4] == "Date: d; jax j; device: cpu."  # a page from before
    line = report.header(dict(page, code=["abc1234"]))[4]
    assert line == "Date: d; jax j; device: cpu; code: abc1234."
    line = report.header(dict(page, code=["abc1234", "def5678"]))[4]
    assert "code: abc1234, def5678 (the runs span these" in line


def test_a_copied_tree_without_git_reports_the_commit_it_was_stamped_with(tmp_path, checkout,
                                                                          monkeypatch):  # fmt: skip
    head = _git(checkout, "rev-parse", "HEAD")
    assert provenance.stamp() == str(checkout / provenance.STAMP)
    copied = tmp_path / "copied"
    subprocess.run(["cp", "-r", str(checkout), str(copied)], check=True)
    subprocess.run(["rm", "-rf", str(copied / ".git")], check=True)  # as a copy travels
    monkeypatch.setattr(provenance, "_ROOT", str(copied))
    version = _version()
    assert version == {"commit": head, "changed": False, "rope_jax": __version__,
                       "stamped": True}  # fmt: skip
    assert provenance.describe(version) == f"{head[:7]} (stamped)"
    (copied / "table.json").write_text('{"rows": 2}\n')  # not code
    assert _version()["changed"] is False
    (copied / "pkg" / "a.py").write_text("x = 3\n")  # edited after the stamp
    assert provenance.describe(_version()) == f"{head[:7]} (stamped) + uncommitted changes"
    with pytest.raises(ValueError, match="is not a git checkout: nothing to stamp"):
        provenance.stamp()  # a stamp is made from git, not from another stamp


def test_a_copy_whose_git_is_older_than_its_files_reports_the_stamp(tmp_path, checkout,
                                                                    monkeypatch):  # fmt: skip
    """A copied tree can carry a .git from an older state (a GPU host's copy): its HEAD
    with "uncommitted changes" would name the wrong code; the matching stamp names it."""
    old = _git(checkout, "rev-parse", "HEAD")
    copied = tmp_path / "copied"
    subprocess.run(["cp", "-r", str(checkout), str(copied)], check=True)  # .git at `old`
    (checkout / "pkg" / "a.py").write_text("x = 4\n")
    _git(checkout, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "second")
    new = _git(checkout, "rev-parse", "HEAD")
    provenance.stamp()
    for name in ("pkg/a.py", provenance.STAMP):  # the files travel, the .git stays old
        (copied / name).write_bytes((checkout / name).read_bytes())
    monkeypatch.setattr(provenance, "_ROOT", str(copied))
    assert provenance.describe(_version()) == f"{new[:7]} (stamped)"
    (copied / "pkg" / "a.py").write_text("x = 5\n")  # matches neither: git's view stands
    assert provenance.describe(_version()) == f"{old[:7]} + uncommitted changes"
    monkeypatch.setattr(provenance, "_ROOT", str(checkout))
    assert provenance.describe(_version()) == new[:7]  # a clean checkout: git, stamp or not


def test_a_recorded_command_is_written_with_a_readers_paths(monkeypatch, tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "home" / "repo"
    cwd.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    command = f"train.py --workdir={cwd}/runs/x --data_dir={home}/rope_data --out=/data/y"
    assert provenance.portable(command) == (
        "train.py --workdir=runs/x --data_dir=~/rope_data --out=/data/y"
    )
