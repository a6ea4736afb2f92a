"""Variable tracking (RULER's `vt`, `scripts/data/synthetic/variable_tracking.py`).

Chains of assignments hidden one per line among RULER's noise sentences:

    VAR QWERT = 48213
    VAR ASDFG = VAR QWERT
    ...                                  (num_hops assignments after the first)

each chain with its own 5-digit value and its own variable names (distinct across
chains); the question gives the first chain's value and the answer is every variable of
that chain. Further chains (`num_chains` > 1) are distractors. Each chain's lines keep
their order at depths drawn at random (RULER inserts them at random sentence positions);
the example records the depths of every line, the asked chain first.

With the `ruler` template the prompt starts, as RULER's does, with one solved example
(3-letter names, its own value) padded with noise to at most `shot_tokens` tokens (at
least 5 noise sentences), followed by the question.
"""

from __future__ import annotations

import numpy as np

from rope_jax.ruler import prompt, words


def chains(rng: np.random.Generator, *, num_chains: int, num_hops: int, letters: int,
           taken: set[str]) -> tuple[list[list[str]], list[list[str]]]:  # fmt: skip
    """(names [chains][hops + 1], lines [chains][hops + 1]): RULER's assignment chains;
    names and values are new to `taken` (which grows)."""
    names, lines = [], []
    for _ in range(num_chains):
        chain = words.distinct(lambda r: words.random_variable(r, letters), rng, num_hops + 1,
                               taken)  # fmt: skip
        value = words.distinct(lambda r: str(int(r.integers(10000, 99999))), rng, 1, taken)[0]
        names.append(chain)
        hops = [f"VAR {chain[j + 1]} = VAR {chain[j]} " for j in range(num_hops)]
        lines.append([f"VAR {chain[0]} = {value}", *hops])
    return names, lines


def value_of(lines: list[list[str]]) -> str:
    return lines[0][0].split("=")[-1].strip()


def chain_depths(rng: np.random.Generator, lines: list[list[str]]) -> list[float]:
    """Random depths, sorted within each chain (so each chain reads in order)."""
    return [float(d) for chain in lines for d in np.sort(rng.random(len(chain)))]


def body(request: prompt.Request, lines, size: int, depths=None) -> tuple[np.ndarray, tuple]:
    """(context ids [size + statement tokens], actual depths): noise lines filling `size`
    tokens with the chains' lines inserted."""
    noise = request.encode("\n" + request.template["noise"])
    pieces, whole = prompt.fill_units(lambda k: noise, size)
    statements = [request.encode("\n" + line) for chain in lines for line in chain]
    depths = chain_depths(request.rng, lines) if depths is None else depths
    return prompt.insert(prompt.concat(pieces), prompt.unit_boundaries(pieces, whole),
                         statements, depths)  # fmt: skip


def fixed_pieces(request: prompt.Request, lines) -> tuple[np.ndarray, np.ndarray, list]:
    """(head, tail, statements) of the question about chain 0's value."""
    t = request.template
    after = t["after"].format(query=value_of(lines), num_v=len(lines[0]))
    statements = [request.encode("\n" + line) for chain in lines for line in chain]
    return request.encode(t["before"]), request.encode(after), statements


def shot(request: prompt.Request, counts: dict, taken: set[str]) -> np.ndarray:
    """RULER's worked example: a vt prompt with 3-letter names, its answer and a blank
    line; the prompt part at most `shot_tokens` tokens when 5 noise lines or more fit
    in it, else with 5 lines."""
    names, lines = chains(request.rng, num_chains=counts["num_chains"],
                          num_hops=counts["num_hops"], letters=3, taken=taken)  # fmt: skip
    head, tail, statements = fixed_pieces(request, lines)
    answer = request.encode(" " + " ".join(names[0]) + "\n\n")  # RULER: shot + "\n" + "\n"
    noise = len(request.encode("\n" + request.template["noise"]))
    fixed = len(head) + len(tail) + sum(len(s) for s in statements)  # the input, as RULER
    count = max(5, (request.template["shot_tokens"] - fixed) // noise)
    context, _ = body(request, lines, count * noise)
    return prompt.concat([head, context, tail, answer])


def generate(counts: dict, request: prompt.Request) -> prompt.Built:
    """One vt example of exactly `request.budget` prompt tokens."""
    if request.depth is not None:
        raise ValueError("vt puts its assignments at random depths; depth= is for the niah tasks")
    taken: set[str] = set()
    names, lines = chains(request.rng, num_chains=counts["num_chains"],
                          num_hops=counts["num_hops"], letters=5, taken=taken)  # fmt: skip
    shots = [shot(request, counts, taken) for _ in range(request.template.get("shots", 0))]
    head, tail, statements = fixed_pieces(request, lines)
    size = prompt.available(request.budget, [*shots, head, tail, *statements], prompt.MIN_HAYSTACK)
    context, depths = body(request, lines, size)
    return prompt.finish(request.budget, [*shots, head, context, tail], answers=names[0],
                         depths=depths, target=" ".join(names[0]))  # fmt: skip
