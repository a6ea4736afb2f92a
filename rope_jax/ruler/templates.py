"""The wording of the tasks, as data: one dict per template, one entry per task family.

A prompt is `before + context + after`, where `after` ends with the answer prefix the
model continues (RULER appends its `answer_prefix` to the question the same way), and the
context is the haystack with the needles in it. Repeated units (noise sentences, needles,
assignments, list items, coded words) each carry their separator in front (`unit`), so
the text is exactly RULER's `"\\n".join(...)` / `" ".join(...)` while every piece is
tokenized on its own.

  ruler  RULER's wording, character for character (`scripts/data/synthetic/constants.py`
         with its base model template): an imported model is asked as RULER asks it.
         Its worked examples too: vt and cwe start with one solved example of the task.
  short  the same structure with a few words of instruction, no worked example and
         smaller answer budgets and word counts: for byte-level models trained at
         T = 256-512, where RULER's ~300 characters of instructions leave no haystack.
         Its niah question repeats the needle's own words up to the value ("Magic
         numbers for KEY: #"), so finding the key is the whole task, and every value
         follows a `#` that nothing else in the prompt uses: a copy can start from one
         token (as the pass key's `#` does), not from a `: ` that the haystack's prose
         also holds.

Fields: `before`/`after` the text around the context ({type_needle_v}, {query}, {num_v},
{num_cw} filled in), `needle` the needle sentence, `noise` the repeated filler sentence,
`singular` the replacements RULER makes when one value is asked (`Some` -> `A`, `are` ->
`is`, ...), `shots` the number of worked examples (`shot_tokens` the most tokens of vt's),
`answer` the niah target's (lead, separator) around the values (RULER's `(" ", ", ")`
when absent), `max_new_tokens` the answer budgets (tokens) by family, and `counts`
overrides of the task counts (see `rope_jax.ruler.TASKS`).
"""

from __future__ import annotations

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
SINGULAR = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))

TEMPLATES: dict[str, dict[str, dict]] = {
    "ruler": {
        "niah": {
            "before": "Some special magic {type_needle_v} are hidden within the following text. "
            "Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.",
            "after": "\nWhat are all the special magic {type_needle_v} for {query} mentioned in "
            "the provided text? The special magic {type_needle_v} for {query} mentioned in the "
            "provided text are",
            "needle": NEEDLE,
            "noise": NOISE,
            "singular": SINGULAR,
            "max_new_tokens": 128,
        },
        "vt": {
            "before": "Memorize and track the chain(s) of variable assignment hidden in the "
            "following text.\n",
            "after": "\nQuestion: Find all variables that are assigned the value {query} in the "
            "text above. Answer: According to the chain(s) of variable assignment in the text "
            "above, {num_v} variables are assigned the value {query}, they are: ",
            "noise": NOISE,
            "shots": 1,
            "shot_tokens": 500,
            "max_new_tokens": 30,
        },
        "cwe": {
            "before": "Below is a numbered list of words. In these words, some appear more often "
            "than others. Memorize the ones that appear most often.\n",
            "after": "\nQuestion: What are the {num_cw} most common words in the above list? "
            "Answer: The top {num_cw} words that appear most often in the list are:",
            "shots": 1,
            "max_new_tokens": 120,
        },
        "fwe": {
            "before": "Read the following coded text and track the frequency of each coded "
            "word. Find the three most frequently appeared coded words.",
            "after": "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
            "What are the three most frequently appeared words in the above coded text? "
            "Answer: According to the coded text above, the three most frequently appeared "
            "words are:",
            "max_new_tokens": 50,
        },
    },
    "short": {
        "niah": {
            "before": "Some magic {type_needle_v} are hidden here.",
            "after": "\nMagic {type_needle} for {query}: #",
            "needle": "Magic {type_needle} for {key}: #{value}.",
            "answer": ("", ", #"),
            "noise": NOISE,
            "singular": SINGULAR,
            "max_new_tokens": 40,
        },
        "vt": {
            "before": "Track the variables.",
            "after": "\nThe {num_v} variables equal to {query}: ",
            "noise": NOISE,
            "shots": 0,
            "max_new_tokens": 30,
        },
        "cwe": {
            "before": "Find the most common words.\n",
            "after": "\nThe top {num_cw} words:",
            "shots": 0,
            "counts": {"num_cw": 3, "freq_cw": 4, "freq_ucw": 1, "long_from": 0},
            "max_new_tokens": 32,
        },
        "fwe": {
            "before": "Find the three most frequent coded words.",
            "after": "\nIgnoring the dots, the three most frequent words are:",
            "counts": {"coded_wordlen": 4},
            "max_new_tokens": 24,
        },
    },
}


def template(name: str, family: str) -> dict:
    """The template dict of one task family; ValueError for an unknown template name."""
    if name not in TEMPLATES:
        raise ValueError(f"template={name!r}: must be one of {sorted(TEMPLATES)}")
    return TEMPLATES[name][family]


def singular(text: str, template_fields: dict) -> str:
    """RULER's rewording of a niah template when one value is asked: `Some` -> `A`, ..."""
    for old, new in template_fields.get("singular", ()):
        text = text.replace(old, new)
    return text
