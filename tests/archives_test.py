"""Corpora read from a system package's archive (`rope_jax.data.archives`), on a small
tarball of the same layout: text files kept by suffix or name, binaries skipped, the
split a hash of the path, and prepare's one line when the package is missing."""

import io
import subprocess
import sys
import tarfile

import pytest

from rope_jax.data import archives, readers, sources, splits


@pytest.fixture
def tree(tmp_path, monkeypatch):
    files = {
        "linux-6.12/kernel/fork.c": b"int fork(void) { return 0; }\n" * 20,
        "linux-6.12/Documentation/admin.rst": b"Admin guide\n===========\n\nText.\n" * 20,
        "linux-6.12/arch/x86/Kconfig": b"config X86\n\tbool\n" * 20,
        "linux-6.12/firmware/blob.txt": b"\x00\x01binary",
        "linux-6.12/tools/logo.png": b"\x89PNG not text",
    }
    for i in range(60):
        files[f"linux-6.12/drivers/d{i}.c"] = f"static int d{i};\n".encode() * 10
    path = tmp_path / "linux.tar.xz"
    with tarfile.open(path, "w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    archive = archives.ARCHIVES["linux_source"]
    monkeypatch.setitem(archives.ARCHIVES, "linux_source",
                        archives.Archive(str(path), archive.package, archive.suffixes,
                                         archive.names, archive.held_out_percent))  # fmt: skip
    return path


def test_text_files_are_documents_and_binaries_are_not(tree):
    docs = list(sources.read("linux_source"))
    keys = [d.key for d in docs]
    assert "kernel/fork.c" in keys and "Documentation/admin.rst" in keys
    assert "arch/x86/Kconfig" in keys
    assert "firmware/blob.txt" not in keys and "tools/logo.png" not in keys
    assert len(docs) == 63
    fork = next(d for d in docs if d.key == "kernel/fork.c")
    assert fork.read() == "int fork(void) { return 0; }\n" * 20
    for d in docs:  # the split is the path's, whatever the tokenizer or the order
        assert d.split == splits.by_name(d.key, validation_percent=1, test_percent=1)
    assert sources.fingerprint("linux_source") == sources.fingerprint("linux_source")


def test_a_selection_keeps_or_leaves_out_paths_and_keeps_their_splits(tree):
    full = {d.key: d.split for d in sources.read("linux_source")}
    kept = {d.key: d.split for d in sources.read("linux_source:kernel/,arch/")}
    assert kept == {
        "kernel/fork.c": full["kernel/fork.c"],
        "arch/x86/Kconfig": full["arch/x86/Kconfig"],
    }
    rest = {d.key: d.split for d in sources.read("linux_source:-drivers/,-kernel/")}
    assert rest == {k: v for k, v in full.items() if not k.startswith(("drivers/", "kernel/"))}
    mixed = {d.key for d in sources.read("linux_source:drivers/,-drivers/d1")}
    assert mixed == {k for k in full if k.startswith("drivers/") and not k.startswith("drivers/d1")}
    assert sources.fingerprint("linux_source:kernel/") == sources.fingerprint("linux_source")
    for bad in ("linux_source:", "linux_source:kernel/,", "linux_source:-"):
        with pytest.raises(readers.PrepareError, match="comma-separated path prefixes"):
            list(sources.read(bad))


def test_a_missing_package_is_one_line(tmp_path, monkeypatch):
    archive = archives.ARCHIVES["linux_source"]
    monkeypatch.setitem(archives.ARCHIVES, "linux_source",
                        archives.Archive(str(tmp_path / "none.tar.xz"), archive.package,
                                         archive.suffixes, archive.names))  # fmt: skip
    with pytest.raises(readers.PrepareError, match=r"apt-get install linux-source-6.12"):
        list(sources.read("linux_source"))


def test_prepare_says_so_in_one_line_without_the_package():
    if archives.os.path.isfile(archives.ARCHIVES["linux_source"].path):
        pytest.skip("the package is installed here")
    proc = subprocess.run([sys.executable, "-m", "rope_jax.data.prepare",
                           "--source=linux_source", "--tokenizer=bytes", "--name=x",
                           "--data_dir=/tmp/unused_rope_data"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode != 0
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "apt-get install linux-source-6.12" in proc.stderr


def test_composition_counts_every_byte_once_and_estimates_tokens(tree, tmp_path):
    """benchmarks/corpus_composition.py on the small tree: each document lands in the
    first group whose prefix it has, bytes per split add up to the documents' sizes, and
    the token estimate of a fully sampled group is its exact token count."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks/corpus_composition.py"
    spec = importlib.util.spec_from_file_location("corpus_composition", path)
    comp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(comp)
    assert comp.group_of("drivers/gpu/drm/amd/include/asic_reg/x.h").startswith("AMD")
    assert comp.group_of("drivers/d1.c") == "drivers/ (the rest)"
    assert comp.group_of("kernel/fork.c").startswith("everything else")

    from rope_jax.data import tokenizers

    byte_tok = tokenizers.ByteTokenizer()
    table = comp.count("linux_source", byte_tok, permille=1000)  # every document sampled
    docs = list(sources.read("linux_source"))
    for s in splits.SPLITS:
        want = sum(len(d.read().encode()) for d in docs if d.split == s)
        assert sum(row[s]["bytes"] for row in table.values()) == want
    assert (
        table["drivers/ (the rest)"]["train"]["documents"]
        + sum(table["drivers/ (the rest)"][s]["documents"] for s in ("validation", "test"))
        == 60
    )
    tokens = comp.estimate(table)  # bytes: one token per byte, so estimates are exact
    assert tokens["drivers/ (the rest)"]["train"] == table["drivers/ (the rest)"]["train"]["bytes"]
    assert tokens[comp.GROUPS[0][0]]["train"] is None  # no AMD tables in this tree

    dataset = tmp_path / "ds"
    (dataset / "tokenizer").mkdir(parents=True)
    byte_tok.save(str(dataset / "tokenizer"))
    (dataset / "metadata.json").write_text(
        json.dumps({"settings": {"source": "linux_source"}, "splits": {"train": {"tokens": 1}}})
    )
    out = tmp_path / "comp.md"
    assert comp.main([f"--dataset={dataset}", "--sample_permille=1000", f"--out={out}"]) == 0
    assert "| drivers/ (the rest) | train |" in out.read_text()
    (dataset / "metadata.json").write_text(json.dumps({"settings": {"source": "shakespeare"}}))
    with pytest.raises(SystemExit, match="not from an archive"):
        comp.main([f"--dataset={dataset}"])
