"""RULER-style long-context tasks: generators of exact token length, and RULER's scorers.

RULER (Hsieh et al., 2024) reads what a model finds and uses at each context length:
retrieval (eight needle-in-a-haystack tasks), multi-hop tracking (`vt`) and aggregation
(`cwe`, `fwe`). Each task here is generated offline from (task, length, example index,
seed) in any of the project's tokenizers, with the prompt exactly `length -
max_new_tokens` of that tokenizer's tokens, and scored as RULER scores it:

    ex = ruler.make_example("niah_single_2", length=4096, index=3, seed=0,
                            tokenizer=tok, haystack=held_out_ids)
    ex.prompt_ids        # int32 [4096 - 128]
    ruler.score_one("niah_single_2", prediction, ex.answers)

  task              haystack  needles (keys x values, asked)       answer
  niah_single_1     noise     1 (word key -> 7-digit number)        the number
  niah_single_2     corpus    1 (word -> number)                    the number
  niah_single_3     corpus    1 (word -> uuid)                      the uuid
  niah_multikey_1   corpus    4 keys, 1 asked                       its number
  niah_multikey_2   needles   1, among needles of other keys        its number
  niah_multikey_3   needles   1 (uuid -> uuid), among needles       its uuid
  niah_multivalue   corpus    1 key with 4 values                   all 4
  niah_multiquery   corpus    4 keys, all asked                     all 4 numbers
  vt                noise     1 chain of 4 hops                     its 5 variables
  cwe               word list 10 words x 30 among words x 3         the 10 words
  fwe               coded     Zipf counts, alpha 2                  ranks 2-4

`noise` is RULER's five repeated sentences; `corpus` is held-out corpus text (the caller
passes it as token ids: RULER's Paul Graham essays are replaced by the project's own
prose, e.g. the held-out Shakespeare plays). RULER's two QA tasks (SQuAD, HotpotQA) are
left out: they need dataset downloads. `passkey` stays in `rope_jax.data.passkey`.

The counts are RULER's (`scripts/synthetic.yaml`), with RULER's wording under
`template="ruler"`. `template="short"` keeps the structure with a few words of wording
and, where RULER's counts cannot fit T = 256-512 byte windows, smaller ones: cwe asks
for 3 common words repeated 4 times among words seen once, fwe codes words in 4 letters
(see `templates.TEMPLATES`). Answer budgets: RULER's (niah 128, vt 30, cwe 120, fwe 50
tokens) under `ruler`, 24-40 under `short`.

Everything is host NumPy over token ids; nothing here needs JAX.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import string
import zlib
from collections.abc import Callable, Sequence

import numpy as np

from rope_jax.ruler import aggregation, niah, prompt, scoring, templates, variables, words
from rope_jax.ruler.prompt import DEPTHS
from rope_jax.ruler.scoring import postprocess, string_match_all, string_match_part

__all__ = ["DEPTHS", "TASKS", "Example", "Spec", "check", "make_example", "postprocess",
           "score_one", "string_match_all", "string_match_part", "training_window"]  # fmt: skip


@dataclasses.dataclass(frozen=True, eq=False)
class Example:
    """One task example. `prompt_ids` int32 [length - max_new_tokens] are exactly that many
    tokens of the tokenizer (no special ids); `answers` the references the scorer looks
    for; `depths` where each needle sits, a share 0..1 of the haystack (() without
    needles); `target` what a perfect model writes after the prompt; `text` the decoded
    prompt."""

    task: str
    prompt_ids: np.ndarray
    answers: tuple[str, ...]
    depths: tuple[float, ...]
    max_new_tokens: int
    target: str
    text: str

    def __eq__(self, other) -> bool:
        if not isinstance(other, Example):
            return NotImplemented
        same = dataclasses.astuple(self)[2:] == dataclasses.astuple(other)[2:]
        return (
            same and self.task == other.task and np.array_equal(self.prompt_ids, other.prompt_ids)
        )

    __hash__ = None


@dataclasses.dataclass(frozen=True)
class Spec:
    """A task: its RULER name, its template family, RULER's answer budget in tokens, its
    scorer ("all" | "part"), whether it hides needles and takes a depth, whether its
    haystack is corpus text, its generator `generate(counts, request) -> prompt.Built` and
    its counts (RULER's) and a note of where they are chosen here."""

    name: str
    family: str
    max_new_tokens: int
    scorer: str
    needles: bool
    depth: bool
    corpus: bool
    generate: Callable
    counts: dict
    note: str = ""


def _niah(name: str, haystack: str, key: str, value: str, k=1, v=1, q=1) -> Spec:
    counts = {"haystack": haystack, "key": key, "value": value, "k": k, "v": v, "q": q}
    return Spec(name, "niah", 128, "all", True, True, haystack == "corpus", niah.generate,
                counts)  # fmt: skip


_CWE = {"num_cw": 10, "freq_cw": 30, "freq_ucw": 3, "long_from": 4096, "short_freq": (6, 1),
        "shot": (40, 10, 3), "short_shot": (20, 3, 1)}  # fmt: skip

TASKS: dict[str, Spec] = {
    s.name: s
    for s in (
        _niah("niah_single_1", "noise", "words", "numbers"),
        _niah("niah_single_2", "corpus", "words", "numbers"),
        _niah("niah_single_3", "corpus", "words", "uuids"),
        _niah("niah_multikey_1", "corpus", "words", "numbers", k=4),
        _niah("niah_multikey_2", "needle", "words", "numbers"),
        _niah("niah_multikey_3", "needle", "uuids", "uuids"),
        _niah("niah_multivalue", "corpus", "words", "numbers", v=4),
        _niah("niah_multiquery", "corpus", "words", "numbers", q=4),
        Spec("vt", "vt", 30, "all", True, False, False, variables.generate,
             {"num_chains": 1, "num_hops": 4},
             "RULER's 1 chain of 4 hops; num_chains > 1 adds distractor chains"),
        Spec("cwe", "cwe", 120, "all", False, False, False, aggregation.generate_cwe, _CWE,
             "RULER's counts; the short template asks for 3 words x 4 among words x 1"),
        Spec("fwe", "fwe", 50, "all", False, False, False, aggregation.generate_fwe,
             {"alpha": 2.0, "coded_wordlen": 6},
             "RULER's counts; the short template codes words in 4 letters"),
    )
}  # fmt: skip


# --------------------------------------------------------------------------- checks


def spec(task: str) -> Spec:
    """The task's Spec; ValueError naming the nearest registered task."""
    if task in TASKS:
        return TASKS[task]
    near = difflib.get_close_matches(str(task), list(TASKS), n=1, cutoff=0.0)
    raise ValueError(f"unknown task {task!r}: did you mean {near[0]!r}? (tasks: "
                     f"{', '.join(TASKS)})")  # fmt: skip


def answer_budget(s: Spec, template: str, max_new_tokens: int | None) -> int:
    """The answer budget in tokens: `max_new_tokens`, else the template's (RULER's)."""
    if max_new_tokens is None:
        return int(templates.template(template, s.family).get("max_new_tokens", s.max_new_tokens))
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer) \
            or max_new_tokens < 1:  # fmt: skip
        raise ValueError(f"{s.name}: max_new_tokens={max_new_tokens!r} must be an int >= 1")
    return int(max_new_tokens)


def _check_depth(s: Spec, depth) -> None:
    if depth is None:
        return
    if not s.depth:
        raise ValueError(f"{s.name} takes no depth (depth={depth!r}); the niah tasks do")
    if isinstance(depth, bool) or not isinstance(depth, int | float) or not 0 <= depth <= 1:
        raise ValueError(f"{s.name}: depth={depth!r} must be a share in [0, 1]")


@functools.cache
def _word_characters() -> str:
    text = "".join(words.word_list("adjectives") + words.word_list("nouns") + words.common_words())
    return "".join(sorted(set(text)))


def _task_strings(s: Spec, template: str) -> list[str]:
    """The strings a task's prompts are made of (placeholders filled with sample values)."""
    t = templates.template(template, s.family)
    fields = {"type_needle_v": "numbers", "type_needle": "numbers", "query": "x", "num_v": 5,
              "num_cw": 10, "key": "x", "value": "1"}  # fmt: skip
    texts = [str(t[f]).format(**fields) for f in ("before", "after", "needle", "noise") if f in t]
    alphabet = {"niah": string.digits + "abcdef-" + _word_characters(),
                "vt": string.ascii_uppercase + string.digits + "=",
                "cwe": string.digits + "." + _word_characters(),
                "fwe": string.ascii_lowercase + "."}[s.family]  # fmt: skip
    return [*texts, "\n", " " + alphabet]


def check_tokenizer(s: Spec, tokenizer, template: str) -> None:
    """ValueError unless decode(encode(x)) == x for the task's strings, naming the first
    character that does not come back."""
    name = getattr(tokenizer, "name", type(tokenizer).__name__)
    for text in _task_strings(s, template):
        if _round_trip(tokenizer, "x" + text):
            continue
        bad = next((c for c in text if not _round_trip(tokenizer, "x" + c)), text)
        back = tokenizer.decode(tokenizer.encode("x" + bad))[1:]
        raise ValueError(f"{s.name}: tokenizer {name} cannot encode the task's text: {bad!r} "
                         f"comes back as {back!r}")  # fmt: skip


def _round_trip(tokenizer, text: str) -> bool:
    return tokenizer.decode(tokenizer.encode(text)) == text


def _check_int(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
        raise ValueError(f"{name}={value!r} must be an int >= {least}")


def _check_length(length, index=0, seed=0) -> None:
    _check_int("length", length, 1)
    _check_int("index", index, 0)
    _check_int("seed", seed, 0)


# --------------------------------------------------------------------------- corpus


def _clean(haystack, tokenizer) -> np.ndarray:
    """The haystack stream int32 [n] without special ids (document separators)."""
    ids = np.asarray(haystack).reshape(-1).astype(np.int32)
    specials = [getattr(tokenizer, f, None) for f in ("pad_id", "bos_id", "eos_id")]
    return ids[~np.isin(ids, [x for x in specials if x is not None])]


def capacity(haystack, tokenizer, budget: int) -> int:
    """How many evaluation examples with `budget` prompt tokens the haystack text fills
    without repeating (each takes its own slice of `budget` tokens)."""
    return len(_clean(haystack, tokenizer)) // max(budget, 1)


def _eval_corpus(s: Spec, stream: np.ndarray, tokenizer, *, length, budget, index, seed):
    """corpus(size) for evaluation example `index`: `size` ids from its own slice of
    `budget` tokens of the stream (slices rotated by the seed), from a line start when one
    is near the slice's start."""
    room = len(stream) // budget
    if index >= room:
        raise ValueError(f"{s.name}: the haystack text ({len(stream)} tokens) holds {room} "
                         f"examples of {budget} prompt tokens at length {length}; example "
                         f"{index} would repeat text")  # fmt: skip
    shift = int(np.random.default_rng([int(seed) % 2**63, _code(s.name), length, 1]).integers(room))
    slot = (index + shift) % room
    window = stream[slot * budget : (slot + 1) * budget]

    def take(size: int) -> np.ndarray:
        texts = prompt.token_texts(window[: budget - size], tokenizer)
        start = next((p + 1 for p, t in enumerate(texts) if t.endswith("\n")), 0)
        return window[start : start + size]

    return take


def _train_corpus(s: Spec, stream: np.ndarray, rng: np.random.Generator):
    """corpus(size) for training: `size` ids from a random place of the stream."""

    def take(size: int) -> np.ndarray:
        if len(stream) < size:
            raise ValueError(f"{s.name}: the haystack text has {len(stream)} tokens; a "
                             f"training window needs {size}")  # fmt: skip
        start = int(rng.integers(0, len(stream) - size + 1))
        return stream[start : start + size]

    return take


# ------------------------------------------------------------------------- examples


def _code(task: str) -> int:
    return zlib.crc32(task.encode())


def _rng(task: str, *, index: int, seed: int, purpose: int) -> np.random.Generator:
    """The example's generator, fixed by (task, index, seed) and the purpose (0 evaluation,
    1 training: training examples never equal evaluation ones). Not by the length: niah and
    vt example k asks the same keys and values, at the same depth, at every length."""
    key = [int(seed) % 2**63, int(index) % 2**63, _code(task), purpose]
    return np.random.default_rng(key)


def _build(s: Spec, *, length, budget, index, seed, tokenizer, haystack, depth, template,
           train) -> prompt.Built:  # fmt: skip
    """The generator's example with a prompt of exactly `budget` tokens; a too-short
    length is one ValueError line naming the shortest that fits."""
    t = templates.template(template, s.family)
    rng = _rng(s.name, index=index, seed=seed, purpose=int(train))
    corpus = None
    if s.corpus:
        if haystack is None:
            raise ValueError(f"{s.name}: its haystack is corpus text; pass haystack= (token "
                             "ids of held-out text in this tokenizer)")  # fmt: skip
        stream = _clean(haystack, tokenizer)
        corpus = (_train_corpus(s, stream, rng) if train else
                  _eval_corpus(s, stream, tokenizer, length=length, budget=budget, index=index,
                               seed=seed))  # fmt: skip
    counts = {**s.counts, **t.get("counts", {})}
    request = prompt.Request(tokenizer, budget, length, rng, t, counts, depth, corpus)
    try:
        if budget < 1:
            raise prompt.TooShort(1)
        return s.generate(counts, request)
    except prompt.TooShort as short:
        name = getattr(tokenizer, "name", type(tokenizer).__name__)
        raise ValueError(
            f"{s.name}: length {length} is too short for its {template!r} "
            f"template, needles and {length - budget} answer tokens in tokenizer "
            f"{name}: it needs at least {short.need + length - budget}"
        ) from None


def make_example(task: str, *, length: int, index: int, seed: int, tokenizer,
                 haystack: np.ndarray | None = None, depth: float | None = None,
                 max_new_tokens: int | None = None,
                 template: str = "ruler") -> Example:  # fmt: skip
    """Example `index` of `task` at window `length` (prompt + answer budget, in the
    tokenizer's tokens): deterministic in (task, length, index, seed), the haystack and
    the tokenizer. `haystack` (token ids of held-out text) is needed by the corpus tasks;
    each index uses its own slice of it. `depth` in [0, 1] puts the (first asked) needle
    there, None draws it from DEPTHS."""
    s = spec(task)
    _check_length(length, index, seed)
    _check_depth(s, depth)
    new = answer_budget(s, template, max_new_tokens)
    built = _build(s, length=length, budget=length - new, index=index, seed=seed,
                   tokenizer=tokenizer, haystack=haystack, depth=depth, template=template,
                   train=False)  # fmt: skip
    text = tokenizer.decode(built.prompt_ids.tolist())
    return Example(s.name, built.prompt_ids, built.answers, built.depths, new, built.target, text)


def training_window(task: str, *, length: int, index: int, seed: int, tokenizer, haystack=None,
                    template: str = "ruler") -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(ids int32 [length + 1], answer bool [length + 1]): a training example of `task`, its
    prompt followed by the tokens of its target, True on the target's tokens. Corpus tasks
    take their haystack from `haystack` (the training split's ids), at a random place;
    deterministic in (task, length, index, seed), never equal to an evaluation example."""
    s = spec(task)
    _check_length(length, index, seed)
    kwargs = dict(length=length, index=index, seed=seed, tokenizer=tokenizer,
                  haystack=haystack, depth=None, template=template, train=True)  # fmt: skip
    first = _build(s, budget=length, **kwargs)  # the content, and so the target, is drawn first
    target = prompt.encode(tokenizer, first.target)
    built = _build(s, budget=length + 1 - len(target), **kwargs)
    if built.target != first.target:  # the target does not depend on the budget
        raise AssertionError(f"{task}: target changed with the budget")
    ids = np.concatenate([built.prompt_ids, target]).astype(np.int32)
    answer = np.zeros(length + 1, bool)
    answer[len(built.prompt_ids) :] = True
    return ids, answer


def check(task: str, *, length: int, tokenizer, num_examples: int = 1, haystack=None,
          max_new_tokens: int | None = None, template: str = "ruler") -> None:  # fmt: skip
    """One ValueError line for settings `make_example` cannot serve: an unknown task or
    template, a length too short for the template, needles and answer budget, a tokenizer
    that cannot encode the task's characters, more examples than the haystack text fills
    without repeating."""
    s = spec(task)
    _check_length(length)
    _check_int("num_examples", num_examples, 1)
    templates.template(template, s.family)
    new = answer_budget(s, template, max_new_tokens)
    check_tokenizer(s, tokenizer, template)
    if s.corpus and haystack is not None and length > new:
        room = capacity(haystack, tokenizer, length - new)
        if num_examples > room:
            raise ValueError(f"{task}: the haystack text holds {room} examples at length "
                             f"{length} ({length - new} prompt tokens each), not "
                             f"{num_examples}")  # fmt: skip
    for index in range(min(num_examples, 2)):
        example = make_example(
            task,
            length=length,
            index=index,
            seed=0,
            tokenizer=tokenizer,
            haystack=haystack,
            max_new_tokens=max_new_tokens,
            template=template,
        )
        _check_budget(example, tokenizer, max_new_tokens)


def _check_budget(example: Example, tokenizer, max_new_tokens: int | None) -> None:
    """One ValueError line when the references alone, one space apart (the shortest answer
    the scorer takes whole, for any model), cannot fit the answer budget: every score
    would be capped below 1 (vt's five names in bytes take 29 tokens, not 16)."""
    shortest = " ".join(example.answers)
    need = len(prompt.encode(tokenizer, shortest))
    if need <= example.max_new_tokens:
        return
    name = getattr(tokenizer, "name", type(tokenizer).__name__)
    given = "its own" if max_new_tokens is None else "the asked (eval.answer_tokens)"
    raise ValueError(
        f"{example.task}: its answers alone ({shortest!r}) take {need} tokens in tokenizer "
        f"{name}, more than {given} answer budget of {example.max_new_tokens}: every score "
        f"would be capped below 1; give an answer budget of at least {need}"
    )


def score_one(task: str, prediction: str, answers: Sequence[str]) -> float:
    """The example's score under the task's scorer, after RULER's `postprocess`."""
    return scoring.SCORERS[spec(task).scorer][1](postprocess(prediction), answers)
