"""The English word lists behind the keys and the word lists of the tasks.

RULER draws its keys as `adjective-noun` pairs and its common-words lists from the noun,
adjective and verb lists of the `wonderwords` package; so does this module, from the
same files (`wonderwords` is pinned in requirements.txt and ships the lists in its wheel,
nothing is downloaded). The lists are read once and kept sorted and de-duplicated, so a
seed gives the same words on every host.
"""

from __future__ import annotations

import functools
import importlib.resources
import string

import numpy as np

LISTS = {"nouns": "nounlist.txt", "adjectives": "adjectivelist.txt", "verbs": "verblist.txt"}


@functools.cache
def word_list(kind: str) -> tuple[str, ...]:
    """The sorted, de-duplicated words of one `wonderwords` list ("nouns" | "adjectives" |
    "verbs")."""
    if kind not in LISTS:
        raise ValueError(f"word list {kind!r}: must be one of {sorted(LISTS)}")
    try:
        assets = importlib.resources.files("wonderwords") / "assets"
        text = (assets / LISTS[kind]).read_text(encoding="utf-8")
    except ModuleNotFoundError:
        raise ValueError("the RULER tasks need the `wonderwords` package: pip install "
                         "wonderwords") from None  # fmt: skip
    return tuple(sorted({w.strip() for w in text.splitlines() if w.strip()}))


@functools.cache
def common_words() -> tuple[str, ...]:
    """Nouns, adjectives and verbs together, sorted and de-duplicated (RULER's cwe pool)."""
    return tuple(sorted(set().union(*(word_list(k) for k in LISTS))))


def random_key(rng: np.random.Generator) -> str:
    """An `adjective-noun` key, uniform over the pairs (RULER's `words` needle keys)."""
    adjectives, nouns = word_list("adjectives"), word_list("nouns")
    return f"{adjectives[rng.integers(len(adjectives))]}-{nouns[rng.integers(len(nouns))]}"


def random_number(rng: np.random.Generator, digits: int = 7) -> str:
    """A number of exactly `digits` digits (RULER's needle values have 7)."""
    return str(int(rng.integers(10 ** (digits - 1), 10**digits)))


def random_uuid(rng: np.random.Generator) -> str:
    """A version-4 UUID string from 128 random bits (RULER's `uuids` keys and values)."""
    import uuid

    bits = int.from_bytes(rng.bytes(16), "big")
    return str(uuid.UUID(int=bits, version=4))


def random_letters(rng: np.random.Generator, count: int, alphabet: str) -> str:
    return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), count))


def random_variable(rng: np.random.Generator, count: int = 5) -> str:
    """An upper-case variable name (RULER's vt uses 5 letters, 3 in its worked example)."""
    return random_letters(rng, count, string.ascii_uppercase)


def random_coded_word(rng: np.random.Generator, count: int = 6) -> str:
    """A lower-case coded word (RULER's fwe uses 6 letters)."""
    return random_letters(rng, count, string.ascii_lowercase)


RANDOM = {"words": random_key, "numbers": random_number, "uuids": random_uuid}


def distinct(draw, rng: np.random.Generator, count: int, taken: set[str]) -> list[str]:
    """`count` new strings from `draw(rng)`, none in `taken` nor repeated; `taken` grows."""
    out = []
    while len(out) < count:
        value = draw(rng)
        if value not in taken:
            taken.add(value)
            out.append(value)
    return out
