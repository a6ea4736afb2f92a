"""RULER-style tasks (rope_jax.ruler): exact token lengths, needles where asked, answers
present and distinct, determinism, disjoint haystack slices, training windows, one-line
errors, and RULER's scorers against hand-computed scores.

Two tokenizers throughout: bytes, and a byte-level BPE of 400 ids trained on 100 KB of
Hamlet; the haystack text is Macbeth (a held-out play), ~100 KB.
"""

import dataclasses
import re

import numpy as np
import pytest

from rope_jax import ruler
from rope_jax.data import corpora, tokenizers
from rope_jax.ruler import aggregation, prompt, scoring, templates, variables, words

NIAH = [t for t in ruler.TASKS if t.startswith("niah")]
CORPUS = [t for t, s in ruler.TASKS.items() if s.corpus]


@pytest.fixture(scope="module")
def plays():
    files = corpora.play_files()
    train = corpora.markdown_to_text(files["hamlet"].read_text())[:100_000]
    held_out = corpora.markdown_to_text(files["macbeth"].read_text())
    return train, held_out


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def setting(request, plays):
    """(tokenizer, held-out haystack ids, lengths that fit both templates)."""
    train, held_out = plays
    if request.param == "bytes":
        tok = tokenizers.from_spec("bytes")
        lengths = {"short": (512, 700), "ruler": (2400, 3001)}
    else:
        tok = tokenizers.train_bpe([train], 400)
        lengths = {"short": (300, 451), "ruler": (1800, 2301)}
    return tok, np.asarray(tok.encode(held_out), np.int32), lengths


def _make(task, tok, hay, length, **kw):
    kw = {"index": 0, "seed": 0, **kw}
    return ruler.make_example(task, length=length, tokenizer=tok, haystack=hay, **kw)


def _specials(tok):
    return [tok.pad_id, tok.bos_id, tok.eos_id]


# ------------------------------------------------------------------ length and answers


def test_every_task_fills_its_prompt_exactly_and_its_target_holds_every_answer(setting):
    tok, hay, lengths = setting
    for template, sizes in lengths.items():
        for task in ruler.TASKS:
            for length in sizes:
                ex = _make(task, tok, hay, length, index=1, template=template)
                assert ex.prompt_ids.dtype == np.int32
                assert len(ex.prompt_ids) == length - ex.max_new_tokens, (task, template, length)
                assert not np.isin(ex.prompt_ids, _specials(tok)).any()
                assert ex.answers and all(a in ex.target for a in ex.answers)
                assert ruler.score_one(task, ex.target, ex.answers) == 1.0
                assert ex.text == tok.decode(ex.prompt_ids.tolist())
                counts = ruler.TASKS[task].counts
                needles = {"vt": 5, "cwe": 0, "fwe": 0}.get(task)
                if needles is None:
                    needles = max(counts["k"], counts["q"]) * counts["v"]
                assert len(ex.depths) == needles
                assert all(0 <= d <= 1 for d in ex.depths)


def test_answer_budgets_are_rulers_under_the_ruler_template(setting):
    tok, hay, lengths = setting
    budgets = {"niah_single_1": 128, "niah_multiquery": 128, "vt": 30, "cwe": 120, "fwe": 50}
    for task, budget in budgets.items():
        assert ruler.TASKS[task].max_new_tokens == budget
        assert _make(task, tok, hay, 8200).max_new_tokens == budget
    ex = _make("vt", tok, hay, 2000, max_new_tokens=7)
    assert ex.max_new_tokens == 7 and len(ex.prompt_ids) == 1993


def _needles(text):
    """(key, value) of every RULER needle sentence in `text`."""
    return re.findall(r"One of the special magic \w+ for (.+?) is: ([\w-]+)\.", text)


def test_niah_answers_are_in_the_prompt_once_with_distinct_keys_and_values(setting):
    tok, hay, lengths = setting
    adjectives, nouns = set(words.word_list("adjectives")), set(words.word_list("nouns"))
    for task in NIAH:
        for index in range(3):
            ex = _make(task, tok, hay, lengths["ruler"][1], index=index)
            found = _needles(ex.text)
            keys, values = [k for k, _ in found], [v for _, v in found]
            counts = ruler.TASKS[task].counts
            want = max(counts["k"], counts["q"]) * counts["v"]
            assert len(found) >= want and len(set(values)) == len(values), task
            assert len(set(keys)) == len(keys) or counts["v"] > 1
            assert len(ex.answers) == counts["q"] * counts["v"]
            for answer in ex.answers:
                assert ex.text.count(f"is: {answer}.") == 1
                key = keys[values.index(answer)]
                assert key in ex.text[ex.text.rindex("\nWhat ") :]  # the question asks it
                if counts["key"] == "words":
                    assert any(key.startswith(a + "-") and key[len(a) + 1 :] in nouns
                               for a in adjectives)  # fmt: skip
                else:
                    assert re.fullmatch(r"[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}", key)
                if counts["value"] == "numbers":
                    assert re.fullmatch(r"[1-9]\d{6}", answer)


def test_ruler_wording_and_rulers_singular_form():
    tok = tokenizers.from_spec("bytes")
    one = _make("niah_single_1", tok, None, 2000, depth=0.5).text
    assert one.startswith(
        "A special magic number is hidden within the following text. Make sure to memorize "
        "it. I will quiz you about the number afterwards.\n" + templates.NOISE + "\n"
    )
    key = _needles(one)[0][0]
    assert one.endswith(
        f"\nWhat is the special magic number for {key} mentioned in the provided text? The "
        f"special magic number for {key} mentioned in the provided text is"
    )
    hay = np.asarray(tok.encode("It was so. " * 2000))
    many = _make("niah_multivalue", tok, hay, 2000).text
    assert many.startswith("Some special magic numbers are hidden within the following text.")
    assert many.endswith("mentioned in the provided text are")
    assert "\nWhat are all the special magic numbers for " in many
    query = _make("niah_multiquery", tok, hay, 2000).text
    assert re.search(r"for .+?, .+?, .+?, and .+? mentioned in the provided text\?", query)


def test_vt_chain_is_in_the_prompt_in_order_with_distinct_names(setting):
    tok, hay, lengths = setting
    for template, sizes in lengths.items():
        ex = _make("vt", tok, hay, sizes[1], template=template, index=2)
        names = ex.answers
        assert len(names) == 5 and len(set(names)) == 5
        assert all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
        value = re.search(r"VAR " + names[0] + r" = (\d{5})\n", ex.text).group(1)
        lines = [f"VAR {names[0]} = {value}\n"] + [
            f"VAR {names[j + 1]} = VAR {names[j]} \n" for j in range(4)
        ]
        where = [ex.text.index(line) for line in lines]
        assert where == sorted(where)
        assert ex.text.endswith(f" {value}, they are: " if template == "ruler" else f"{value}: ")
        assert ex.target == " ".join(names)
        if template == "ruler":  # RULER's solved example comes first, 3-letter names
            shot = ex.text[: ex.text.index("\n\nMemorize", 10)]
            assert shot.startswith("Memorize and track the chain(s)")
            assert re.search(r"they are:  [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3}$", shot)


def test_vt_distractor_chains_have_their_own_names_and_values(monkeypatch):
    tok = tokenizers.from_spec("bytes")
    three = dataclasses.replace(ruler.TASKS["vt"], counts={"num_chains": 3, "num_hops": 2})
    monkeypatch.setitem(ruler.TASKS, "vt", three)
    ex = _make("vt", tok, None, 1200, template="short")
    assigned = re.findall(r"VAR ([A-Z]{5}) = (\d{5})\n", ex.text)
    renamed = re.findall(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5}) \n", ex.text)
    assert len(assigned) == 3 and len(renamed) == 6
    every = [a for a, _ in assigned] + [a for a, _ in renamed]
    assert len(set(every)) == 9 and len({v for _, v in assigned}) == 3
    assert len(ex.answers) == 3 and len(ex.depths) == 9
    names, _ = variables.chains(np.random.default_rng(0), num_chains=40, num_hops=4, letters=3,
                                taken=set())  # fmt: skip
    assert len({n for chain in names for n in chain}) == 200


def _cwe_list(text):
    """The numbered items of the last list in `text` (the question's, after any shot)."""
    body = text[text.rindex("\n1. ") + 1 : text.rindex("\n")]
    return re.findall(r"(\d+)\. (\S+)", body)


def test_cwe_common_words_repeat_as_ruler_counts(setting):
    tok, hay, lengths = setting
    for template, sizes in lengths.items():
        ex = _make("cwe", tok, hay, sizes[1], template=template)
        items = _cwe_list(ex.text)
        assert [int(n) for n, _ in items] == list(range(1, len(items) + 1))
        counts = {}
        for _, word in items:
            counts[word] = counts.get(word, 0) + 1
        freq_cw = 6 if template == "ruler" else 4  # RULER's below a 4096 window; short's
        num_cw = 10 if template == "ruler" else 3
        assert len(ex.answers) == num_cw and len(set(ex.answers)) == num_cw
        assert all(counts[w] == freq_cw for w in ex.answers)
        assert max(c for w, c in counts.items() if w not in ex.answers) == 1
        assert ex.target == " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex.answers))
    long = _make("cwe", tokenizers.from_spec("bytes"), None, 4200 * 4)
    counts = {}
    for _, word in _cwe_list(long.text):
        counts[word] = counts.get(word, 0) + 1
    assert all(counts[w] == 30 for w in long.answers)  # RULER's 30 and 3 from 4096 on
    assert max(c for w, c in counts.items() if w not in long.answers) == 3


def test_fwe_answers_are_the_three_most_frequent_words_after_the_dots(setting):
    tok, hay, lengths = setting
    for template, sizes in lengths.items():
        ex = _make("fwe", tok, hay, sizes[1], template=template)
        body = ex.text[: ex.text.rindex("\n")]
        coded = re.findall(r"(?<= )([a-z]+)(?= |$)", body[body.index("words.") + 6 :])
        counts = {}
        for word in coded:
            counts[word] = counts.get(word, 0) + 1
        dots = body.count(" ...")
        top = sorted(counts.values(), reverse=True)
        assert dots > top[0] and len(ex.answers) == 3
        assert sorted(counts[a] for a in ex.answers) == sorted(top[:3]) and top[2] > top[3]
    assert aggregation.fewest_words(5, 2.0) > 10  # rank 4 must beat rank 5


# -------------------------------------------------------------------------- depths


def _layout(ex, tok, sep):
    """(needle start in the haystack, haystack bytes) of a one-needle bytes example."""
    raw = bytes(ex.prompt_ids.astype(np.uint8))
    head = raw.index(b"afterwards.") + len(b"afterwards.") + (1 if sep == b" " else 0)
    tail = raw.rindex(b"\nWhat is")
    value = raw.index(f"is: {ex.answers[0]}.".encode())
    start = raw.rindex(sep + b"One of the special", 0, value)
    end = value + len(f"is: {ex.answers[0]}.")
    return start - head, raw[head:start] + raw[end:tail]


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 0.77, 1.0])
def test_the_needle_sits_at_the_unit_boundary_nearest_the_asked_depth(depth):
    """Noise haystack, bytes: the needle starts a line, or follows the haystack's last
    (cut) line; slack half a noise line."""
    tok = tokenizers.from_spec("bytes")
    unit = len("\n" + templates.NOISE)
    for length in (1000, 2345):
        ex = _make("niah_single_1", tok, None, length, depth=depth)
        offset, haystack = _layout(ex, tok, b"\n")
        assert ex.depths[0] == pytest.approx(offset / len(haystack))
        assert offset % unit == 0 or offset == len(haystack)
        assert abs(offset - depth * len(haystack)) <= 0.5 * unit
        assert (offset == len(haystack)) == (depth == 1.0)  # depth 1: after the last line


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_in_corpus_text_the_needle_sits_at_the_nearest_sentence_end(depth, plays):
    """Corpus haystack, bytes: the needle follows a sentence end (`.`, `!` or `?` then
    whitespace), and no sentence end is nearer the asked depth."""
    tok = tokenizers.from_spec("bytes")
    hay = np.asarray(tok.encode(plays[1]))
    for task in ("niah_single_2", "niah_single_3"):
        ex = _make(task, tok, hay, 3000, depth=depth, index=4)
        offset, haystack = _layout(ex, tok, b" ")
        assert ex.depths[0] == pytest.approx(offset / len(haystack))
        ends = [0] + [p for p in range(1, len(haystack) + 1) if haystack[p - 1 : p] in b".!?"
                      and (haystack + b" ")[p : p + 1].isspace()]  # fmt: skip
        assert offset in ends
        best = min(abs(e - depth * len(haystack)) for e in ends)
        assert abs(offset - depth * len(haystack)) == best


def test_depths_in_bpe_tokens_and_multi_needle_tasks(setting):
    tok, hay, lengths = setting
    for task in ("niah_single_1", "niah_single_2", "niah_multikey_2", "niah_multikey_1"):
        for depth in (0.1, 0.6):
            ex = _make(task, tok, hay, lengths["ruler"][1], depth=depth)
            assert abs(ex.depths[0] - depth) < 0.12, (task, ex.depths)
    drawn = {_make("niah_single_1", tok, hay, 2000, index=i).depths[0] for i in range(12)}
    assert len(drawn) > 4  # no depth asked: RULER's grid, drawn by (seed, index)
    assert min(ruler.DEPTHS) == 0 and max(ruler.DEPTHS) == 1 and len(ruler.DEPTHS) == 40


# ------------------------------------------------------------ determinism and slices


def test_same_arguments_same_example_other_index_or_seed_another(setting):
    tok, hay, lengths = setting
    for task in ruler.TASKS:
        length = lengths["ruler"][0]
        ex = _make(task, tok, hay, length, index=5, seed=3)
        assert ex == _make(task, tok, hay, length, index=5, seed=3)
        assert not np.array_equal(ex.prompt_ids, _make(task, tok, hay, length, index=6,
                                                       seed=3).prompt_ids)  # fmt: skip
        assert not np.array_equal(ex.prompt_ids, _make(task, tok, hay, length, index=5,
                                                       seed=4).prompt_ids)  # fmt: skip


def test_each_index_takes_its_own_slice_of_the_haystack():
    tok = tokenizers.from_spec("bytes")
    text = "".join(f"Item {i:05d} is here. " for i in range(2000))  # 42 KB, every slice known
    hay = np.asarray(tok.encode(text))
    for task in CORPUS:
        room = ruler.capacity(hay, tok, 1000 - 128)
        seen = []
        for index in range(room):
            ex = _make(task, tok, hay, 1000, index=index, seed=7)
            seen.append(set(re.findall(r"Item (\d{5})", ex.text)))
            assert len(seen[-1]) >= 5
        every = set().union(*seen)
        assert len(every) == sum(len(s) for s in seen), task  # no item in two examples
        with pytest.raises(ValueError, match=rf"holds {room} examples"):
            _make(task, tok, hay, 1000, index=room, seed=7)
        with pytest.raises(ValueError, match=rf"^{task}: the haystack text holds {room} "):
            ruler.check(task, length=1000, tokenizer=tok, num_examples=room + 1, haystack=hay)
        ruler.check(task, length=1000, tokenizer=tok, num_examples=room, haystack=hay)


def test_special_ids_in_the_haystack_stream_never_reach_a_prompt(setting):
    tok, hay, lengths = setting
    stream = np.concatenate([hay[:3000], [tok.eos_id], hay[3000:6000], [tok.eos_id]])
    for task in CORPUS:
        ex = _make(task, tok, stream, lengths["ruler"][0])
        assert not np.isin(ex.prompt_ids, _specials(tok)).any()


# ------------------------------------------------------------------ training windows


def test_training_windows_are_length_plus_one_with_the_target_marked(setting, plays):
    tok, hay, lengths = setting
    train = np.asarray(tok.encode(plays[0]), np.int32)
    for template, sizes in lengths.items():
        for task in ruler.TASKS:
            length = sizes[0]
            ids, answer = ruler.training_window(task, length=length, index=9, seed=1,
                                                tokenizer=tok, haystack=train,
                                                template=template)  # fmt: skip
            assert ids.shape == answer.shape == (length + 1,) and ids.dtype == np.int32
            assert answer.dtype == bool and answer.any() and answer[-1]
            first = int(np.argmax(answer))
            assert answer[first:].all() and not answer[:first].any()
            target = tok.decode(ids[first:].tolist())
            kwargs = dict(tokenizer=tok, haystack=train, template=template)
            again, _ = ruler.training_window(task, length=length, index=9, seed=1, **kwargs)
            np.testing.assert_array_equal(again, ids)
            ex = _make(
                task,
                tok,
                hay,
                length + 1,
                index=9,
                seed=1,
                template=template,
                max_new_tokens=len(ids) - first,
            )  # the same prompt length
            assert not np.array_equal(ex.prompt_ids, ids[:first])  # evaluation differs
            assert np.array_equal(ids[first:], prompt.encode(tok, target))
            if task.startswith("niah_single_1"):  # short: the value follows the prompt's `#`
                opening = " " if template == "ruler" else ""
                assert re.fullmatch(opening + r"[1-9]\d{6}\.", target)
                assert template == "ruler" or tok.decode(ids[:first].tolist()).endswith(": #")


def test_a_training_window_of_a_corpus_task_reads_the_given_stream():
    tok = tokenizers.from_spec("bytes")
    stream = np.asarray(tok.encode("Train text only. " * 300))
    kwargs = dict(tokenizer=tok, haystack=stream, template="short")
    ids, answer = ruler.training_window("niah_single_2", length=700, index=0, seed=0, **kwargs)
    assert "Train text only." in tok.decode(ids.tolist())
    with pytest.raises(ValueError, match="pass haystack="):
        ruler.training_window("niah_single_2", length=700, index=0, seed=0, tokenizer=tok)


# ------------------------------------------------------------------------ bad input


class _LettersOnly(tokenizers.ByteTokenizer):
    """A tokenizer that drops every character but ASCII letters and spaces."""

    name = "letters-only"

    def encode(self, text):
        return [b for b in text.encode() if chr(b).isalpha() or b == 32]


def _one_line(excinfo):
    return "\n" not in str(excinfo.value)


def test_bad_inputs_are_one_line_value_errors(setting):
    tok, hay, lengths = setting
    cases = [
        (dict(task="niah_singel_1"), "unknown task 'niah_singel_1': did you mean 'niah_single_1'"),
        (dict(task="niah_single_1", template="long"), r"template='long': must be one of"),
        (dict(task="vt", depth=0.5), "vt takes no depth"),
        (dict(task="niah_single_1", depth=1.5), r"depth=1.5 must be a share in \[0, 1\]"),
        (dict(task="niah_single_2", haystack=None), "pass haystack="),
        (dict(task="niah_single_1", max_new_tokens=0), "max_new_tokens=0 must be an int"),
        (dict(task="niah_single_1", length=0), "length=0 must be an int >= 1"),
        (dict(task="niah_single_1", index=-1), "index=-1 must be an int >= 0"),
    ]
    for kwargs, message in cases:
        kwargs = {"length": 3000, "haystack": hay, "index": 0, "seed": 0, **kwargs}
        with pytest.raises(ValueError, match=message) as excinfo:
            ruler.make_example(tokenizer=tok, **kwargs)
        assert _one_line(excinfo)
    with pytest.raises(ValueError, match="did you mean 'cwe'") as excinfo:
        ruler.check("cwf", length=3000, tokenizer=tok)
    assert _one_line(excinfo)


@pytest.mark.parametrize("task", ["niah_single_1", "vt"])
def test_too_short_names_the_shortest_length_that_fits(task):
    tok = tokenizers.from_spec("bytes")
    with pytest.raises(ValueError, match=rf"^{task}: length 300 is too short .* it needs at "
                       r"least (\d+)$") as excinfo:  # fmt: skip
        ruler.check(task, length=300, tokenizer=tok)
    assert _one_line(excinfo)
    need = int(re.search(r"at least (\d+)$", str(excinfo.value)).group(1))
    ruler.make_example(task, length=need, index=0, seed=0, tokenizer=tok)  # fits exactly
    with pytest.raises(ValueError, match=rf"needs at least {need}$"):
        ruler.make_example(task, length=need - 1, index=0, seed=0, tokenizer=tok)


def test_an_answer_budget_that_cannot_hold_the_answers_is_one_line():
    """vt's five names, one space apart, take 29 bytes: a budget of 16 caps every score at
    2 of 5 names (0.4), so it is refused; its own budget (30) and 29 hold them."""
    tok = tokenizers.from_spec("bytes")
    with pytest.raises(ValueError, match=r"^vt: its answers alone \('[A-Z]{5}( [A-Z]{5}){4}'\) "
                       r"take 29 tokens in tokenizer bytes, more than the asked "
                       r"\(eval.answer_tokens\) answer budget of 16: every score would be "
                       r"capped below 1; give an answer budget of at least 29$"):  # fmt: skip
        ruler.check("vt", length=400, tokenizer=tok, max_new_tokens=16, template="short")
    for budget in (None, 29):
        ruler.check("vt", length=400, tokenizer=tok, max_new_tokens=budget, template="short")
    ruler.check("niah_single_1", length=400, tokenizer=tok, max_new_tokens=16, template="short")


def test_a_tokenizer_that_cannot_spell_the_task_is_named_with_the_character():
    tok = _LettersOnly()
    with pytest.raises(ValueError, match=r"^niah_single_1: tokenizer letters-only cannot encode "
                       r"the task's text: '\.' comes back as ''$"):  # fmt: skip
        ruler.check("niah_single_1", length=3000, tokenizer=tok)
    spells = tokenizers.from_spec("bytes")  # every task passes with one that spells all
    hay = np.asarray(spells.encode("So it is. " * 2000))
    for task in ruler.TASKS:
        ruler.check(task, length=8200, tokenizer=spells, haystack=hay)


# --------------------------------------------------------------------------- scorers


def _ruler_all(preds, refs):  # RULER's scripts/eval/synthetic/constants.py, verbatim
    score = sum([sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref)
                 for pred, ref in zip(preds, refs, strict=True)]) / len(preds) * 100  # fmt: skip
    return round(score, 2)


def _ruler_part(preds, refs):
    score = sum([max([1.0 if r.lower() in pred.lower() else 0.0 for r in ref])
                 for pred, ref in zip(preds, refs, strict=True)]) / len(preds) * 100  # fmt: skip
    return round(score, 2)


def test_scorers_against_hand_computed_ruler_scores():
    preds = ["The numbers are 1234567 and more", "7654321"]
    refs = [["1234567", "2345678"], ["7654321", "1111111"]]
    assert ruler.string_match_all(preds, refs) == 0.5  # (1/2 + 1/2) / 2
    assert ruler.string_match_part(preds, refs) == 1.0  # (1 + 1) / 2
    assert ruler.string_match_all(["APPLE and Pear"], [["apple", "pear"]]) == 1.0
    assert ruler.string_match_part(["nothing"], [["apple"]]) == 0.0
    assert ruler.string_match_all(["a b", "c", "d"], [["a", "b", "x"], ["c"], ["q"]]) == \
        pytest.approx((2 / 3 + 1 + 0) / 3)  # fmt: skip
    rng = np.random.default_rng(0)
    pool = ["alpha", "Beta", "GAMMA", "delta", "eps"]
    for _ in range(50):
        refs = [list(rng.choice(pool, rng.integers(1, 4), replace=False)) for _ in range(5)]
        preds = [" ".join(rng.choice(pool, rng.integers(0, 4))).upper() for _ in range(5)]
        assert round(ruler.string_match_all(preds, refs) * 100, 2) == _ruler_all(preds, refs)
        assert round(ruler.string_match_part(preds, refs) * 100, 2) == _ruler_part(preds, refs)
    with pytest.raises(ValueError, match="2 predictions for 1 reference"):
        ruler.string_match_all(["a", "b"], [["a"]])


def test_postprocess_and_score_one_as_ruler():
    assert ruler.postprocess("  1234567\x00.\t\n ") == "1234567\n."
    assert ruler.postprocess("\x01 a\nb \x1f") == "a\nb"
    three = ["1111111", "2222222", "3333333"]
    assert ruler.score_one("niah_multivalue", " 1111111, 2222222.", three) == 2 / 3
    assert ruler.score_one("cwe", "1. Apple 2. pear", ["apple", "pear"]) == 1.0
    assert all(s.scorer == "all" for s in ruler.TASKS.values())  # RULER: match_all for these
    assert sorted(ruler.TASKS) == sorted(
        ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
         "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt",
         "cwe", "fwe"]
    )  # fmt: skip


def test_chars_in_place_counts_the_perfect_answers_characters_at_their_place():
    assert scoring.chars_in_place("3904551.", "3904551.") == 1.0
    assert scoring.chars_in_place("394941. #", "3904551.") == 2 / 8  # 3, 9 then shifted
    assert scoring.chars_in_place("", " 12.") == 0.0
    with pytest.raises(ValueError, match="empty"):
        scoring.chars_in_place("x", "")
