"""The corpus that travels to a GPU machine for `gpu_suite`'s rung: training and
validation tokens of a prepared dataset as compressed arrays, within the size limit.

  python benchmarks/gpu_data.py --dataset=~/rope_data/linux8k --out=gpu_corpus \
      --train_tokens=150000000 --wheels=.whl

On the GPU machine (no network): `pip install --no-index --no-deps --target /tmp/site
.whl/*.whl`, `PYTHONPATH=/tmp/site:.`, then `python -m benchmarks.gpu_suite ... --data
gpu_corpus`, carrying `gpu_corpus` and `.whl`.

The tokens are taken as `--slices` equal slices spread evenly over the whole split
(`--validation_slices` for the validation split; one slice: its start), so a corpus
stored in file order (a source tree: all of one directory, then the next) travels as a
sample of all of it; an EOS joins the slices. Writes OUT/train.npy.xz (uint16 tokens),
OUT/validation.npy.xz and OUT/validation_bytes.npy.xz (the UTF-8 bytes of each
validation token, for bits per byte), each an .npy file in xz (LZMA) compression (the
8k-BPE stream of `linux8k` packs to a sixth or less of its two bytes a token), and
OUT/meta.json (the dataset, its preparing command, the vocabulary, the counts, the
sizes): the format of `rope_jax.data.carried`, which reads it as any run's data
(`data.name=OUT`). Everything a GPU call carries (this folder, the
repository's tracked files and any wheels folder named by --also) must stay under
LIMIT_MIB: over it, nothing is written and the one-line error says by how much.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

LIMIT_MIB = 64
# requirements.txt's packages that a GPU image with JAX, flax, optax, orbax and torch lacks
# (read off the H200 image of 2026-11): `--wheels=DIR` downloads them for Python 3.12
WHEELS = ("array_record==0.8.6", "dm-tree==0.1.10", "docstring_parser==0.18.0",
          "googleapis-common-protos==1.76.0", "grain==0.2.18", "immutabledict==4.3.1",
          "importlib_resources==7.1.0", "ml_collections==1.1.0", "portpicker==1.6.0",
          "promise==2.3", "simple-parsing==0.1.9", "tensorboardX==2.6.5",
          "tensorflow-datasets==4.9.10", "tensorflow-metadata==1.21.0", "termcolor==3.3.0",
          "toml==0.10.2")  # fmt: skip
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64")  # fmt: skip
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 1 << 20  # tokens read per call


def tracked_bytes(root: str = _ROOT) -> int:
    """Bytes of the repository's tracked files (what a call sends besides carried paths)."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True,
                           check=True).stdout.split(b"\0")  # fmt: skip
    paths = (os.path.join(root, n.decode()) for n in names if n)
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


def folder_bytes(path: str) -> int:
    total = 0
    for base, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(base, f)) for f in files)
    return total


def read_split(path: str, split: str, limit: int | None = None,
               slices: int = 1) -> tuple[np.ndarray, np.ndarray, int]:  # fmt: skip
    """(tokens uint16, bytes per token uint16, slices taken) of `limit` tokens of the
    split's stream (all of it without a limit), as `slices` equal slices spread evenly over
    the stream and joined by EOS."""
    from rope_jax.data import shards

    source = shards.TokenSplit(path, split)
    total = len(source)
    n = total if limit is None else min(limit, total)
    slices = max(1, min(slices, n)) if n < total else 1  # all of it: one slice, no seams
    size = n // slices
    starts = np.linspace(0, total - size, slices).astype(np.int64) if slices > 1 else [0]
    tokens, nbytes = [], []
    for i, first in enumerate(starts):
        if i:  # the slices are not contiguous: an end of document between them
            tokens.append(np.array([source.eos_id], np.uint16))
            nbytes.append(np.zeros(1, np.uint16))
        for start in range(first, first + size, CHUNK):
            part = source.read(start, min(first + size, start + CHUNK))
            tokens.append(part["tokens"].astype(np.uint16))
            nbytes.append(part["bytes"].astype(np.uint16))
    return np.concatenate(tokens), np.concatenate(nbytes), slices


def pack(dataset: str, out: str, *, train_tokens: int, also: list[str], slices: int = 1,
         validation_tokens: int | None = None, validation_slices: int = 1) -> dict:  # fmt: skip
    from rope_jax.data.carried import dump

    dataset = os.path.abspath(os.path.expanduser(dataset))
    with open(os.path.join(dataset, "metadata.json")) as f:
        meta = json.load(f)
    if int(meta["vocab_size"]) > 65536:
        raise SystemExit(f"gpu_data: {dataset} has {meta['vocab_size']} ids; uint16 holds 65,536")
    train, _, slices = read_split(dataset, "train", train_tokens, slices)
    val, val_bytes, validation_slices = read_split(dataset, "validation", validation_tokens,
                                                   validation_slices)  # fmt: skip
    files = {"train": dump(train), "validation": dump(val), "validation_bytes": dump(val_bytes)}
    payload = sum(len(b) for b in files.values()) + 4096
    others = tracked_bytes() + sum(folder_bytes(p) for p in also)
    total = payload + others
    if total > LIMIT_MIB * 2**20:
        over = (total - LIMIT_MIB * 2**20) / 2**20
        raise SystemExit(f"gpu_data: {payload / 2**20:.1f} MiB of data + {others / 2**20:.1f} "
                         f"MiB of tree and wheels is {over:.1f} MiB over the {LIMIT_MIB} MiB a "
                         "call carries; lower --train_tokens")  # fmt: skip
    os.makedirs(out, exist_ok=True)
    for name, blob in files.items():
        with open(os.path.join(out, f"{name}.npy.xz.tmp"), "wb") as f:
            f.write(blob)
        os.replace(os.path.join(out, f"{name}.npy.xz.tmp"), os.path.join(out, f"{name}.npy.xz"))
        if os.path.isfile(os.path.join(out, f"{name}.npy")):  # an older, uncompressed pack
            os.remove(os.path.join(out, f"{name}.npy"))
    info = dict(
        dataset=os.path.basename(dataset),
        prepared_by=meta.get("command"),
        tokenizer=meta["settings"].get("tokenizer"),
        vocab_size=int(meta["vocab_size"]),
        train_tokens=int(train.size),
        train_tokens_in_dataset=int(meta["splits"]["train"]["stream_tokens"]),
        slices=slices,
        validation_tokens=int(val.size),
        validation_slices=validation_slices,
        validation_bytes=int(val_bytes.sum()),
        validation_bytes_per_token=float(val_bytes.sum() / val.size),
        data_mib=round(payload / 2**20, 1),
        carried_mib=round(total / 2**20, 1),
        command=" ".join(["python benchmarks/gpu_data.py", *sys.argv[1:]]),
    )
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def download_wheels(folder: str) -> None:
    """WHEELS for CPython 3.12 on x86-64 Linux into `folder` (a source-only package is
    built into a wheel here: it is pure Python)."""
    pip = [sys.executable, "-m", "pip", "-q"]
    for spec in WHEELS:
        plat = [x for p in PLATFORMS for x in ("--platform", p)]
        got = subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:",
                              "--python-version", "3.12", "--implementation", "cp", *plat,
                              "-d", folder, spec], capture_output=True)  # fmt: skip
        if got.returncode:
            subprocess.run([*pip, "wheel", "--no-deps", "-w", folder, spec], check=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, help="a prepared dataset directory")
    p.add_argument("--out", default=os.path.join(_ROOT, "gpu_corpus"))
    p.add_argument("--train_tokens", type=int, default=150_000_000)
    p.add_argument("--slices", type=int, default=100, help="evenly spread training slices")
    p.add_argument("--validation_tokens", type=int, default=1_000_000)
    p.add_argument("--validation_slices", type=int, default=10)
    p.add_argument("--also", default="", help="comma list of other carried folders (wheels)")
    p.add_argument("--wheels", default="", help="first download WHEELS into this folder")
    args = p.parse_args(argv)
    if args.wheels:
        download_wheels(args.wheels)
        args.also = ",".join(filter(None, [args.also, args.wheels]))
    if not os.path.isfile(os.path.join(os.path.expanduser(args.dataset), "metadata.json")):
        raise SystemExit(f"gpu_data: {args.dataset} is not a prepared dataset (no metadata.json)")
    info = pack(args.dataset, args.out, train_tokens=args.train_tokens, slices=args.slices,
                validation_tokens=args.validation_tokens,
                validation_slices=args.validation_slices,
                also=[a for a in args.also.split(",") if a])  # fmt: skip
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, _ROOT)
    main()
