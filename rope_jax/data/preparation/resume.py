"""What a killed preparation left behind: staged shards kept after their sha256 check, the
rest redone; the settings record that tells a resume from a new preparation.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil

from rope_jax.data import shards, tokenizers
from rope_jax.data.preparation.plan import HELD_OUT_PERCENT, Settings, source_fingerprint
from rope_jax.data.readers import PrepareError

STAGING = ".staging"  # DIR/NAME/.staging: shards and their entries while preparing


SETTINGS_FILE = "settings.json"


def entry_path(staging: str, split: str, k: int) -> str:
    return os.path.join(staging, shards.shard_stem(split, k) + ".json")


def _final_match(out: str, split: str, k: int, suffix: str) -> str | None:
    found = sorted(glob.glob(os.path.join(glob.escape(out), f"{split}-{k:05d}-of-*{suffix}")))
    return found[0] if found else None


def resume_split(out: str, staging: str, split: str, say) -> tuple[list[dict], int]:
    """Complete shards of `split` from an earlier run, checked by sha256 (a shard that
    finalizing already moved to its final name is moved back), and the documents they
    hold. Everything of the split from the first bad shard on is deleted."""
    entries, k = [], 0
    while os.path.isfile(entry_path(staging, split, k)):
        with open(entry_path(staging, split, k), encoding="utf-8") as f:
            entry = json.load(f)
        names = (entry["file"], entry["index"])
        for name, suffix in zip(names, (".array_record", ".index.npy"), strict=True):
            moved = _final_match(out, split, k, suffix)
            if not os.path.exists(os.path.join(staging, name)) and moved:
                os.replace(moved, os.path.join(staging, name))
        problem = shards.check_shard(staging, entry)
        if problem:
            say(f"prepare: redoing {split} shard {k} and later ({problem})")
            break
        entries.append(entry)
        k += 1
    _remove_from(out, staging, split, k)
    if entries:
        say(f"prepare: resuming {split}: {len(entries)} complete shard(s) kept")
    return entries, sum(e["documents"] for e in entries)


def _remove_from(out: str, staging: str, split: str, k: int) -> None:
    """Deletes the split's staging files of shards >= k and all its final-named files."""
    for path in glob.glob(os.path.join(glob.escape(staging), f"{split}-*")):
        number = os.path.basename(path)[len(split) + 1 :][:5]
        if not number.isdigit() or int(number) >= k:
            os.remove(path)
    for path in glob.glob(os.path.join(glob.escape(out), f"{split}-*-of-*")):
        os.remove(path)


def _demote(out: str, meta: dict, staging: str) -> None:
    """A complete dataset that fails its check goes back to the staging state."""
    os.makedirs(staging, exist_ok=True)
    write_json(os.path.join(staging, SETTINGS_FILE), meta["settings"])
    for split, info in meta["splits"].items():
        for k, entry in enumerate(info["shards"]):
            stem = shards.shard_stem(split, k)
            staged = dict(entry, file=shards.data_file(stem), index=shards.index_file(stem))
            write_json(entry_path(staging, split, k), staged)
    os.remove(os.path.join(out, shards.METADATA))


def _start_fresh(out: str) -> None:
    for name in os.listdir(out):
        path = os.path.join(out, name)
        if name in (STAGING, shards.TOKENIZER_DIR, shards.TOKENIZER_DIR + ".tmp"):
            shutil.rmtree(path)
        elif name.endswith((".array_record", ".index.npy", ".tmp")) or name in (
            shards.TOKEN_BYTES,
            shards.METADATA,
        ):
            os.remove(path)


def settings_record(settings: Settings) -> dict:
    record = dataclasses.asdict(settings)
    record["source_fingerprint"] = source_fingerprint(settings)
    record["format"] = shards.FORMAT
    record["held_out_percent"] = dict.fromkeys(HELD_OUT_PERCENT, settings.held_out_percent)
    kind, value = tokenizers.parse_spec(settings.tokenizer)
    if kind == "path":
        record["tokenizer_files"] = _tree_hash(value)
    return record


def check_existing(out: str, record: dict, say) -> dict | None:
    """The metadata if DIR/NAME is already complete with these settings and intact;
    None to (re)prepare; PrepareError if it holds a dataset of other settings."""
    path = os.path.join(out, shards.METADATA)
    staging = os.path.join(out, STAGING)
    if os.path.isfile(path):
        meta = shards.read_metadata(out)
        if meta.get("settings") != record:
            differ = sorted(k for k in record if meta.get("settings", {}).get(k) != record[k])
            raise PrepareError(
                f"{out} holds a dataset prepared with other settings (differs in "
                f"{', '.join(differ)}); choose another --name or delete it"
            )
        problems = [
            shards.check_shard(out, e) for i in meta["splits"].values() for e in i["shards"]
        ]
        problems = [p for p in problems if p]
        if not problems:
            return meta
        say(f"prepare: {out} is damaged ({problems[0]}); repairing")
        _demote(out, meta, staging)
        return None
    settings_path = os.path.join(staging, SETTINGS_FILE)
    if os.path.isfile(settings_path):
        with open(settings_path, encoding="utf-8") as f:
            if json.load(f) == record:
                return None
        say(f"prepare: {out} holds an unfinished preparation with other settings; starting over")
    _start_fresh(out)
    return None


def _tree_hash(path: str) -> str:
    """sha256 over a tokenizer file, or over the files of a tokenizer dir."""
    if not os.path.exists(path):
        raise PrepareError(f"tokenizer file {path} does not exist")
    files = (
        [path]
        if os.path.isfile(path)
        else sorted(
            os.path.join(path, n) for n in os.listdir(path) if os.path.isfile(os.path.join(path, n))
        )
    )
    h = hashlib.sha256()
    for file in files:
        h.update(shards.file_sha256(file).encode())
    return h.hexdigest()


def write_json(path: str, value) -> None:
    """Atomic JSON write (temporary file, then rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
