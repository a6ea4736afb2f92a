"""RULER's two aggregation tasks: common words (`cwe`) and frequent words (`fwe`)
(`scripts/data/synthetic/common_words_extraction.py`, `freq_words_extraction.py`).

  cwe  a numbered list "1. word 2. word ..." of English words in random order: `num_cw`
       common words `freq_cw` times each, every other word `freq_ucw` times; the answer
       is the common words. RULER's counts: 30 and 3 from a window of 4096 tokens, 6 and
       1 below it; its prompt starts with one solved list (40 words, 10 and 3 times; 20
       words, 3 and 1 times below 4096).
  fwe  coded words (random lower-case letters) with Zipf (zeta, alpha = 2) counts over a
       vocabulary of (length - 50) / 50 words (5 at least): rank k appears
       int(n k^-alpha / zeta(alpha)) times, rank 1 is the dots `...`; the answer is ranks
       2-4.

Both grow the list by whole words while the prompt fits (the token count is exact and
rises with the number of words, so a binary search finds the largest), then fill the
last tokens: cwe with items of words that appear once, fwe with more dots.
"""

from __future__ import annotations

import numpy as np

from rope_jax.ruler import prompt, words


class _Lengths:
    """Token counts of the pieces of a list, cached: numbers (`1.`, ` 2.`) and words."""

    def __init__(self, request: prompt.Request):
        self.request = request
        self.numbers: list[int] = []
        self.words: dict[str, int] = {}

    def word(self, word: str) -> int:
        if word not in self.words:
            self.words[word] = len(self.request.encode(" " + word))
        return self.words[word]

    def number_total(self, count: int) -> int:
        while len(self.numbers) < count:
            k = len(self.numbers) + 1
            text = f"{k}." if k == 1 else f" {k}."
            self.numbers.append(len(self.request.encode(text)))
        return sum(self.numbers[:count])


def largest(total, lo: int, hi: int, room: int) -> int:
    """The largest n in [lo, hi] with total(n) <= room (total rises with n; total(lo) fits)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if total(mid) <= room else (lo, mid - 1)
    return lo


# ------------------------------------------------------------------------------- cwe


def cwe_counts(counts: dict, length: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """((freq_cw, freq_ucw), (shot words, shot freq_cw, shot freq_ucw)) at window `length`."""
    if length < counts["long_from"]:
        return tuple(counts["short_freq"]), tuple(counts["short_shot"])
    return (counts["freq_cw"], counts["freq_ucw"]), tuple(counts["shot"])


def cwe_list(pool: list[str], n: int, num_cw: int, freq: tuple[int, int], seed: int):
    """(shuffled words, common words): the first `num_cw` of pool[:n] freq[0] times each,
    the rest freq[1] times."""
    common, rare = pool[:num_cw], pool[num_cw:n]
    listed = common * freq[0] + rare * freq[1]
    order = np.random.default_rng([seed, n]).permutation(len(listed))
    return [listed[i] for i in order], common


def numbered(request: prompt.Request, listed: list[str], start: int = 1) -> list[np.ndarray]:
    """Ids of "1. w1 2. w2 ..." as pieces (a number, then a word)."""
    out = []
    for k, word in enumerate(listed, start):
        out += [request.encode(f"{k}." if k == 1 else f" {k}."), request.encode(" " + word)]
    return out


def cwe_shot(request: prompt.Request, num_cw: int, shot: tuple[int, int, int]) -> np.ndarray:
    """RULER's solved example: the template around a small list, the answer, a newline."""
    pool = [words.common_words()[i] for i in request.rng.permutation(len(words.common_words()))]
    listed, common = cwe_list(pool, shot[0], num_cw, shot[1:], int(request.rng.integers(2**62)))
    before, after = cwe_wording(request, num_cw)
    answer = " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(common)) + "\n"
    return prompt.concat([before, *numbered(request, listed), after, request.encode(answer)])


def cwe_wording(request: prompt.Request, num_cw: int) -> tuple[np.ndarray, np.ndarray]:
    t = request.template
    return request.encode(t["before"]), request.encode(t["after"].format(num_cw=num_cw))


def generate_cwe(counts: dict, request: prompt.Request) -> prompt.Built:
    """One cwe example of exactly `request.budget` prompt tokens."""
    if request.depth is not None:
        raise ValueError("cwe has no needles; depth= is for the niah tasks")
    num_cw = counts["num_cw"]
    freq, shot = cwe_counts(counts, request.length)
    shots = [cwe_shot(request, num_cw, shot) for _ in range(request.template.get("shots", 0))]
    before, after = cwe_wording(request, num_cw)
    pool_all = words.common_words()
    pool = [pool_all[i] for i in request.rng.permutation(len(pool_all))]
    seed, lengths = int(request.rng.integers(2**62)), _Lengths(request)

    def total(n: int) -> int:
        items = num_cw * freq[0] + (n - num_cw) * freq[1]
        listed = sum(lengths.word(w) for w in pool[:num_cw]) * freq[0]
        listed += sum(lengths.word(w) for w in pool[num_cw:n]) * freq[1]
        return lengths.number_total(items) + listed

    lo, spare = 2 * num_cw, 64  # RULER's smallest list has 2 x num_cw words
    room = request.budget - sum(len(p) for p in [*shots, before, after])
    if total(lo) > room:
        raise prompt.TooShort(request.budget - room + total(lo))
    n = largest(total, lo, len(pool) - spare, room)
    listed, common = cwe_list(pool, n, num_cw, freq, seed)
    pieces = numbered(request, listed)
    pieces += cwe_pad(request, pool[n:], len(listed) + 1, room - total(n))
    target = " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(common))
    return prompt.finish(request.budget, [*shots, before, *pieces, after], answers=common,
                         depths=(), target=target)  # fmt: skip


def cwe_pad(request, fresh: list[str], start: int, size: int) -> list[np.ndarray]:
    """`size` tokens of further list items, each a word not in the list (seen once)."""
    pieces, used = [], 0
    for k, word in enumerate(fresh, start):
        if used >= size:
            return pieces
        for ids in numbered(request, [word], k)[-2:]:
            pieces.append(ids[: size - used])
            used += len(pieces[-1])
    if used < size:
        raise ValueError(f"cwe at this length needs more than the {len(words.common_words())} "
                         "words of the word lists")  # fmt: skip
    return pieces


# ------------------------------------------------------------------------------- fwe


def zipf_counts(n: int, vocab_size: int, alpha: float) -> np.ndarray:
    """RULER's word counts int [vocab_size]: int(n k^-alpha / zeta(alpha)), k = 1, 2, ...
    (scipy is imported here, not with the module: it costs every train.py and eval.py
    start a third of a second, and only fwe needs it)."""
    from scipy import special

    k = np.arange(1, vocab_size + 1, dtype=np.float64)
    return (n * k**-alpha / special.zeta(alpha)).astype(np.int64)


def fewest_words(vocab_size: int, alpha: float) -> int:
    """The smallest n from which rank 4 always appears more often than rank 5 (so the
    three most frequent words after the dots are one set)."""
    share = zipf_counts(10**9, 5, alpha) / 1e9
    n = int(np.ceil(1 / (share[3] - share[4])))  # from here on, counts differ by >= 1
    while n > 1 and (lambda c: c[3] > c[4])(zipf_counts(n - 1, 5, alpha)):
        n -= 1
    return n


def generate_fwe(counts: dict, request: prompt.Request) -> prompt.Built:
    """One fwe example of exactly `request.budget` prompt tokens."""
    if request.depth is not None:
        raise ValueError("fwe has no needles; depth= is for the niah tasks")
    rng, alpha = request.rng, counts["alpha"]
    vocab_size = max(request.length // 50 - 1, 5)  # RULER: (length - 50) // 50
    vocab = words.distinct(lambda r: words.random_coded_word(r, counts["coded_wordlen"]), rng,
                           vocab_size, set())  # fmt: skip
    vocab = [vocab[i] for i in rng.permutation(len(vocab))]
    vocab[0] = "..."  # rank 1 is noise, as RULER's
    t = request.template
    before, after = request.encode(t["before"]), request.encode(t["after"])
    sizes = np.array([len(request.encode(" " + w)) for w in vocab])
    total = lambda n: int(zipf_counts(n, vocab_size, alpha) @ sizes)
    room = request.budget - len(before) - len(after)
    lo = fewest_words(vocab_size, alpha)
    if total(lo) > room:
        raise prompt.TooShort(request.budget - room + total(lo))
    n = largest(total, lo, 4 * room + lo, room)
    listed = [w for w, c in zip(vocab, zipf_counts(n, vocab_size, alpha), strict=True)
              for _ in range(c)]  # fmt: skip
    listed = [listed[i] for i in np.random.default_rng([int(rng.integers(2**62)), n])
              .permutation(len(listed))]  # fmt: skip
    dots = request.encode(" ...")
    pad, _ = prompt.fill_units(lambda k: dots, room - total(n))
    pieces = [request.encode(" " + w) for w in listed] + pad
    answers = vocab[1:4]
    return prompt.finish(request.budget, [before, *pieces, after], answers=answers, depths=(),
                         target=" " + " ".join(answers))  # fmt: skip
