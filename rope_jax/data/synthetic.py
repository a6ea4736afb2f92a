"""RULER's synthetic tasks in training (`data.synthetic_tasks`): a share of training
windows become task examples, so a small model learns to retrieve and track at its
training length from the same generators the evaluation asks it with (`rope_jax.ruler`).

  data.synthetic_tasks = ("niah_single_1", "vt")  # which tasks (RULER's names)
  data.synthetic_rate = 0.5     # share of training windows that become an example
  data.synthetic_weight = 10.0  # loss weight of an example's answer targets
  data.task_template = "short"  # the wording, shared with the evaluation

Row b of a training batch becomes an example with probability `synthetic_rate`, of a
task chosen evenly, fixed by (seed, window index) like passkey windows (`data.passkey`),
so resumed runs and every process see the same batches. Its haystack is the training
split's own text (the window and the one after it, special ids removed); the evaluation
draws its haystacks from the held-out split. The example is the window's first
S + 1 tokens, S drawn evenly from [T/2, T] (T where the task does not fit in S): prompt,
then the answer (`ruler.training_window`), whose targets weigh `synthetic_weight` in
the loss (the prompt's weigh 1: plain language modelling); an EOS and the row's own
text fill the rest. So the answer lands at every place, the evaluation's among them (a
prompt of T minus the answer budget, then the answer): were every example the whole
window, every answer would sit on its last tokens, and a small model learns that
place. (The `tiny` preset trained so on niah_single_1 scored 0.00 from the evaluation's
prompt at T = 192 and 0.93 at length 201, whose prompt puts the answer at the window's
end: results/research/synthetic_mix.md.)

Everything here is host NumPy over token ids.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rope_jax import ruler

SALT = 0x5E7  # separates this choice's random stream from passkey's


def check(data_config) -> None:
    """The fields' shapes and names (one ValueError line); whether the tasks fit the
    window in the data's tokenizer is `Mix.check`'s, once the tokenizer is known."""
    tasks, rate = data_config.synthetic_tasks, data_config.synthetic_rate
    if isinstance(tasks, str) or not all(isinstance(t, str) for t in tasks):
        raise ValueError(f"data.synthetic_tasks={tasks!r} must be a tuple of task names, "
                         "e.g. ('niah_single_1', 'vt')")  # fmt: skip
    for name in tasks:
        if name not in ruler.TASKS:
            raise ValueError(
                f"data.synthetic_tasks: {name!r} is not one of {', '.join(ruler.TASKS)}"
            )
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
        raise ValueError(f"data.synthetic_rate={rate!r} must be a number in [0, 1]")
    if rate and not tasks:
        raise ValueError(f"data.synthetic_rate={rate} needs data.synthetic_tasks")
    w = data_config.synthetic_weight
    if isinstance(w, bool) or not isinstance(w, int | float) or not w > 0:
        raise ValueError(f"data.synthetic_weight={w!r} must be a number > 0")


@dataclasses.dataclass(frozen=True)
class Mix:
    """The training mix of one run: tasks, rate, answer weight, seed, tokenizer, wording."""

    tasks: tuple[str, ...]
    rate: float
    weight: float
    seed: int
    tokenizer: object
    template: str

    @classmethod
    def of(cls, data_config, *, seed: int, tokenizer, text: np.ndarray) -> Mix | None:
        """The mix `data_config` asks for, or None; every task is checked against the
        window length and the tokenizer on a sample of the training `text` (token ids)."""
        if not data_config.synthetic_rate:
            return None
        mix = cls(tuple(data_config.synthetic_tasks), float(data_config.synthetic_rate),
                  float(data_config.synthetic_weight), int(seed), tokenizer,
                  data_config.task_template)  # fmt: skip
        for task in mix.tasks:
            ruler.check(task, length=int(data_config.seq_len), tokenizer=tokenizer,
                        haystack=text, template=mix.template)  # fmt: skip
        return mix

    def special(self) -> np.ndarray:
        t = self.tokenizer
        return np.array(sorted({t.pad_id, t.bos_id, t.eos_id}), np.int64)

    def insert(
        self, window: np.ndarray, text: np.ndarray, indices
    ) -> tuple[np.ndarray, np.ndarray]:
        """(windows, answer): training windows [B, T + 1] with an example in place of row b
        with probability `rate`, its haystack drawn from text[b] (tokens of the training
        split from that window on); answer bool [B, T + 1] marks the answer tokens."""
        out, answer = window.copy(), np.zeros(window.shape, bool)
        length, special = window.shape[1] - 1, self.special()
        for b, index in enumerate(np.asarray(indices)):
            rng = np.random.default_rng([self.seed, int(index), SALT])
            if rng.random() >= self.rate:
                continue
            task = self.tasks[int(rng.integers(len(self.tasks)))]
            haystack = text[b][~np.isin(text[b], special)]
            size = int(rng.integers(length // 2, length + 1))
            ids, marks = example(task, size, length, seed=int(rng.integers(2**31)),
                                 tokenizer=self.tokenizer, haystack=haystack,
                                 template=self.template)  # fmt: skip
            n = len(ids)  # the example's tokens, then EOS and the row's own text
            out[b, :n], answer[b, :n] = ids, marks
            if n < length + 1:
                out[b, n] = self.tokenizer.eos_id
                out[b, n + 1 :] = window[b, : length - n]
        return out, answer


def example(task: str, size: int, length: int, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """(ids, answer) of a training example `size` tokens long (`ruler.training_window`,
    size + 1 ids), or `length` long where the task's template and needles do not fit in
    `size`."""
    try:
        return ruler.training_window(task, length=size, index=0, **kwargs)
    except ValueError:
        return ruler.training_window(task, length=length, index=0, **kwargs)
