"""Needle in a haystack: RULER's eight niah tasks (`scripts/data/synthetic/niah.py`).

Needles are sentences "One of the special magic numbers for {key} is: {value}." hidden in
a haystack; the prompt ends by asking the values of one or more keys, and the answer is
every value asked. The tasks differ in their counts and kinds (see `rope_jax.ruler`):

  haystack  noise   RULER's five noise sentences, repeated, one per line
            corpus  held-out corpus prose (RULER's Paul Graham essays), needles joined
                    with a space at sentence ends
            needle  the haystack is all needles, with other keys and values
  keys      words (`adjective-noun`) or uuids; values numbers (7 digits) or uuids
  k, v, q   needles' keys, values per key, keys asked (k is at least q)

Keys are distinct within an example (distractor needles' keys too), and so are values.
The asked key's first needle goes at the asked depth (a grid depth drawn from the rng
when none is asked); the others at other grid depths, as RULER draws them.
"""

from __future__ import annotations

import functools

import numpy as np

from rope_jax.ruler import prompt, templates, words


def query_text(keys: list[str]) -> str:
    """RULER's list of asked keys: `a`, or `a, b, and c`."""
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def content(counts: dict, rng: np.random.Generator) -> dict:
    """The keys, values and asked keys of one example: {keys, values [k][v], asked, taken}
    with `taken` every key and value used (distractors are drawn outside it)."""
    num_k, num_v, num_q = max(counts["k"], counts["q"]), counts["v"], counts["q"]
    taken: set[str] = set()
    keys = words.distinct(words.RANDOM[counts["key"]], rng, num_k, taken)
    values = [words.distinct(words.RANDOM[counts["value"]], rng, num_v, taken) for _ in keys]
    asked = [int(i) for i in rng.choice(num_k, size=num_q, replace=False)]
    return {"keys": keys, "values": values, "asked": asked, "taken": taken}


def wording(template: dict, counts: dict, keys: list[str]) -> tuple[str, str, str]:
    """(before, after, type_needle_v) of the template, singular when one value is asked."""
    type_v = counts["value"]
    before, after = template["before"], template["after"]
    if counts["q"] * counts["v"] == 1:
        before, after = templates.singular(before, template), templates.singular(after, template)
        type_v = type_v[:-1]
    fields = {"type_needle_v": type_v, "type_needle": counts["value"], "query": query_text(keys)}
    return before.format(**fields), after.format(**fields), type_v


def needle_text(template: dict, counts: dict, key: str, value: str) -> str:
    return template["needle"].format(type_needle_v=counts["value"], type_needle=counts["value"],
                                     key=key, value=value)  # fmt: skip


def generate(counts: dict, request: prompt.Request) -> prompt.Built:
    """One niah example of exactly `request.budget` prompt tokens."""
    t, rng = request.template, request.rng
    c = content(counts, rng)
    asked_keys = [c["keys"][i] for i in c["asked"]]
    before, after, _ = wording(t, counts, asked_keys)
    order = c["asked"] + [i for i in range(len(c["keys"])) if i not in c["asked"]]
    sep = " " if counts["haystack"] == "corpus" else "\n"
    needles = [request.encode(sep + needle_text(t, counts, c["keys"][i], v))
               for i in order for v in c["values"][i]]  # fmt: skip
    answers = [v for i in c["asked"] for v in c["values"][i]]
    lead = request.encode("\n") if counts["haystack"] == "corpus" else np.zeros(0, np.int32)
    head, tail = request.encode(before), request.encode(after)
    noise = request.encode("\n" + t["noise"])
    size = prompt.available(request.budget, [head, lead, tail, *needles], prompt.MIN_HAYSTACK)
    haystack, boundaries = build_haystack(counts, request, c, size, noise)
    depths = prompt.pick_depths(rng, len(needles), request.depth)
    context, actual = prompt.insert(haystack, boundaries, needles, depths)
    opening, separator = t.get("answer", (" ", ", "))
    target = opening + separator.join(answers) + "."
    return prompt.finish(request.budget, [head, lead, context, tail],
                         answers=answers, depths=actual, target=target)  # fmt: skip


def build_haystack(counts, request, c, size, noise) -> tuple[np.ndarray, np.ndarray]:
    """(haystack ids [size], insertion boundaries) of the task's haystack kind."""
    if counts["haystack"] == "corpus":
        ids = request.corpus(size)
        return ids, prompt.sentence_boundaries(ids, request.tokenizer)
    if counts["haystack"] == "noise":
        unit = lambda k: noise
    else:
        unit = functools.partial(_distractor, counts, request, c["taken"])
    pieces, whole = prompt.fill_units(unit, size)
    return prompt.concat(pieces), prompt.unit_boundaries(pieces, whole)


def _distractor(counts, request, taken, k) -> np.ndarray:
    """A haystack needle with a key and value of its own (RULER's `needle` haystack)."""
    key = words.distinct(words.RANDOM[counts["key"]], request.rng, 1, taken)[0]
    value = words.distinct(words.RANDOM[counts["value"]], request.rng, 1, taken)[0]
    return request.encode("\n" + needle_text(request.template, counts, key, value))
