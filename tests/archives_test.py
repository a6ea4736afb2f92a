"""Corpora read from a system package's archive (`rope_jax.data.archives`), on a small
tarball of the same layout: text files kept by suffix or name, binaries skipped, the
split a hash of the path, and prepare's one line when the package is missing."""

import io
import subprocess
import sys
import tarfile

import pytest

from rope_jax.data import archives, readers, splits


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
    docs = list(readers.documents("linux_source"))
    keys = [d.key for d in docs]
    assert "kernel/fork.c" in keys and "Documentation/admin.rst" in keys
    assert "arch/x86/Kconfig" in keys
    assert "firmware/blob.txt" not in keys and "tools/logo.png" not in keys
    assert len(docs) == 63
    fork = next(d for d in docs if d.key == "kernel/fork.c")
    assert fork.read() == "int fork(void) { return 0; }\n" * 20
    for d in docs:  # the split is the path's, whatever the tokenizer or the order
        assert d.split == splits.by_name(d.key, validation_percent=1, test_percent=1)
    assert readers.fingerprint("linux_source") == readers.fingerprint("linux_source")


def test_a_missing_package_is_one_line(tmp_path, monkeypatch):
    archive = archives.ARCHIVES["linux_source"]
    monkeypatch.setitem(archives.ARCHIVES, "linux_source",
                        archives.Archive(str(tmp_path / "none.tar.xz"), archive.package,
                                         archive.suffixes, archive.names))  # fmt: skip
    with pytest.raises(readers.PrepareError, match=r"apt-get install linux-source-6.12"):
        list(readers.documents("linux_source"))


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
