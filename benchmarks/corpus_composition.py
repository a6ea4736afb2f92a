r"""What a prepared archive corpus is made of: bytes and tokens per part of the tree, per split.

  python benchmarks/corpus_composition.py --dataset=~/rope_data/linux8k \
      --out results/research/corpus_composition.md

Reads the archive the dataset was prepared from (its metadata names the source) through
the same reader and held-out rule as `python -m rope_jax.data.prepare`, puts every
document in the first group of GROUPS whose path prefix it has, and counts documents and
UTF-8 bytes per group and split. Tokens per group are estimated from a sample: every
document whose path hash falls in the first --sample_permille of a thousand buckets is
encoded with the dataset's own tokenizer, giving the group's bytes per token; the sum of
the estimates is printed beside the dataset's exact token counts as a check. Groups of
generated text (hardware register tables) are named, so a reader of a training curve
knows which share of the windows holds them.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_child  # noqa: E402

from rope_jax import provenance  # noqa: E402
from rope_jax.data import archives, sources, splits, tokenizers  # noqa: E402

GROUPS = (  # (name, path prefix inside the tree); first match wins, "" matches all
    ("AMD GPU register tables (generated headers)", "drivers/gpu/drm/amd/include/asic_reg/"),
    ("Documentation/ (prose, reStructuredText)", "Documentation/"),
    ("drivers/ (the rest)", "drivers/"),
    ("arch/", "arch/"),
    ("everything else (kernel/, fs/, net/, include/, tools/, ...)", ""),
)


def group_of(path: str) -> str:
    return next(name for name, prefix in GROUPS if path.startswith(prefix))


def sampled(path: str, permille: int) -> bool:
    """Whether the document at `path` is in the token sample (a stable hash of the path,
    independent of the held-out rule's)."""
    return int(hashlib.sha1(path.encode()).hexdigest()[:8], 16) % 1000 < permille


def count(source: str, tokenizer, permille: int) -> dict:
    """{group: {split: {documents, bytes}, sample_bytes, sample_tokens}} over `source`."""
    table = {name: {"sample_bytes": 0, "sample_tokens": 0, **{s: {"documents": 0, "bytes": 0}
                                                             for s in splits.SPLITS}}
             for name, _ in GROUPS}  # fmt: skip
    for doc in sources.read(source):
        text = doc.read()
        size = len(text.encode("utf-8"))
        row = table[group_of(doc.key)]
        row[doc.split]["documents"] += 1
        row[doc.split]["bytes"] += size
        if sampled(doc.key, permille):
            row["sample_bytes"] += size
            row["sample_tokens"] += len(tokenizer.encode(text))
    return table


def bytes_per_token(row: dict) -> float | None:
    """A group's sampled bytes per token (None when no document of it was sampled)."""
    return row["sample_bytes"] / row["sample_tokens"] if row["sample_tokens"] else None


def estimate(table: dict) -> dict:
    """{group: {split: estimated tokens}}: bytes over the group's sampled bytes per token
    (None for a group with no sampled document)."""
    out = defaultdict(dict)
    for name, row in table.items():
        rate = bytes_per_token(row)
        for s in splits.SPLITS:
            out[name][s] = row[s]["bytes"] / rate if rate else None
    return dict(out)


def render(table: dict, tokens: dict, exact: dict, head: str) -> str:
    lines = [head, "", "| part of the tree | split | documents | bytes | share of bytes | "
             "bytes/token (sample) | tokens (est.) | share of tokens |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in splits.SPLITS:
        total_bytes = sum(row[s]["bytes"] for row in table.values())
        total_tokens = sum(t[s] or 0 for t in tokens.values())
        for name, row in table.items():
            rate, est = bytes_per_token(row), tokens[name][s]
            lines.append(
                f"| {name} | {s} | {row[s]['documents']:,} | {row[s]['bytes'] / 1e6:,.1f} MB | "
                f"{100 * row[s]['bytes'] / max(total_bytes, 1):.1f}% | "
                + (f"{rate:.2f} | " if rate else "— | ")
                + (f"{est / 1e6:,.1f} M | {100 * est / max(total_tokens, 1):.1f}% |" if est
                   else "— | — |"))  # fmt: skip
    lines += ["", "| split | tokens, sum of estimates | tokens, prepared (exact) | ratio |",
              "|---|---|---|---|"]  # fmt: skip
    for s in splits.SPLITS:
        est = sum(t[s] or 0 for t in tokens.values())
        ex = exact.get(s)
        lines.append(f"| {s} | {est / 1e6:,.1f} M | "
                     + (f"{ex / 1e6:,.1f} M | {est / ex:.3f} |" if ex else "— | — |"))  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True, help="a prepared dataset dir (metadata.json)")
    p.add_argument("--sample_permille", type=int, default=20, help="documents tokenized, per 1000")
    p.add_argument("--out", default="", type=bench_child.page_path,
                   help="write the table here too (markdown)")  # fmt: skip
    args = p.parse_args(argv)
    dataset = os.path.expanduser(args.dataset)
    meta_path = os.path.join(dataset, "metadata.json")
    if not os.path.isfile(meta_path):
        sys.exit(f"error: --dataset={args.dataset}: no metadata.json (not a prepared dataset)")
    with open(meta_path) as f:
        meta = json.load(f)
    source = meta.get("settings", {}).get("source")
    if not isinstance(source, str) or archives.selection(source) is None:
        sys.exit(f"error: --dataset={args.dataset} was prepared from {source!r}, not from "
                 f"an archive ({', '.join(archives.ARCHIVES)})")  # fmt: skip
    if not 0 < args.sample_permille <= 1000:
        sys.exit(f"error: --sample_permille={args.sample_permille} is not in 1..1000")
    tokenizer = tokenizers.load(os.path.join(dataset, "tokenizer"))
    start = time.time()
    print(f"reading {source} (every document; {args.sample_permille} per 1000 tokenized)...",
          flush=True)  # fmt: skip
    table = count(source, tokenizer, args.sample_permille)
    exact = {s: v.get("tokens") for s, v in meta.get("splits", {}).items()}
    cmd = provenance.portable(
        "python benchmarks/corpus_composition.py " + " ".join(argv or sys.argv[1:])
    )
    head = (f"# What `{os.path.basename(dataset.rstrip('/'))}` is made of\n\nCommand: `{cmd}`\n\n"
            f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
            f"{time.time() - start:.0f} s. Source `{source}`, prepared with "
            f"`{provenance.portable(meta.get('command', '?'))}`. Bytes are exact (every "
            "document, split by the same held-out rule as the preparation); tokens are "
            "estimated per part from "
            f"the bytes per token of a {args.sample_permille}-per-1000 sample of its "
            "documents, encoded with the dataset's tokenizer.")  # fmt: skip
    page = render(table, estimate(table), exact, head)
    bench_child.publish(page, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
