"""Corpora read straight from an archive that a system package installs.

  apt-get install linux-source-6.12
  python -m rope_jax.data.prepare --source=linux_source --tokenizer=train:8000 \
      --name=linux8k --data_dir=~/rope_data --workers=2 --tokenizer_train_bytes=100000000

`linux_source`: the Linux 6.12 kernel tree with Debian's patches, the tarball of Debian's
`linux-source-6.12` package (about 150 MB of .tar.xz, 1.4 GB unpacked). One document per
text file: the C sources and headers, assembly, the reStructuredText and plain-text
documentation (`Documentation/` is about 32 MB of English prose), Kconfig and Makefiles,
scripts; files holding a NUL byte are skipped. About 30% of the training tokens are
AMD GPU register tables (generated headers; `benchmarks/corpus_composition.py`). Held
out by a hash of the path (1% validation, 1% test, `splits.by_name`), so the split does
not depend on the tokenizer or on the order the archive stores files in. The archive is
streamed (nothing is unpacked to disk); each pass of `prepare` reads it again. Licence:
the kernel is GPL-2.0 with the Linux syscall note; parts of `Documentation/` are under other free
licences (each file's SPDX line names its own); see the tarball's COPYING and
LICENSES/.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from collections.abc import Iterator

from rope_jax.data.readers import PrepareError


@dataclasses.dataclass(frozen=True)
class Archive:
    path: str  # the tarball the package installs
    package: str  # the Debian package that installs it
    suffixes: tuple[str, ...]  # text files kept, by suffix ...
    names: tuple[str, ...]  # ... or by file name
    held_out_percent: int = 1  # validation and test each


ARCHIVES = {
    "linux_source": Archive(
        path="/usr/src/linux-source-6.12.tar.xz",
        package="linux-source-6.12",
        suffixes=(".c", ".h", ".S", ".rst", ".txt", ".py", ".sh", ".pl", ".awk", ".y", ".l"),
        names=("Kconfig", "Makefile", "Kbuild", "README", "MAINTAINERS", "CREDITS"),
    ),
}


def check(name: str) -> Archive:
    archive = ARCHIVES[name]
    if not os.path.isfile(archive.path):
        raise PrepareError(
            f"--source={name} reads {archive.path}, which is not there: install it with "
            f"`apt-get install {archive.package}`"
        )
    return archive


def _kept(archive: Archive, name: str) -> bool:
    base = posixpath.basename(name)
    return base.endswith(archive.suffixes) or base.split(".")[0] in archive.names


def members(name: str) -> Iterator[tuple[str, bytes]]:
    """(path inside the tree, bytes) of every kept text file, in the archive's order."""
    import tarfile

    archive = check(name)
    with tarfile.open(archive.path, "r|*") as tar:
        for member in tar:
            if not (member.isfile() and _kept(archive, member.name)):
                continue
            data = tar.extractfile(member).read()
            if b"\0" in data:  # binary (firmware blobs, images with a text suffix)
                continue
            rel = member.name.split("/", 1)[-1]  # without the top folder
            yield rel, data
