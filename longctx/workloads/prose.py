"""Essay-like prose, generated offline: the stand-in for RULER's Paul Graham essay haystack.

A small sentence grammar over the built-in word lists writes reflective, essay-shaped text
("Most founders learn this slowly. If you question the market, you will notice ...") that is
deterministic per seed and never ends, so a haystack of any length can be cut from it. It is
grammatical but meaningless, which matters for comparability (see docs/workloads.md): a real
essay carries topical content a model can be distracted by; this text carries only surface form.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from longctx.workloads.words import ADJECTIVES, ADVERBS, NOUNS, TOPICS, VERBS, plural, third_person

_CONNECTORS = (
    "In practice",
    "Of course",
    "For example",
    "Oddly enough",
    "As a rule",
    "In the end",
    "At first",
    "On the other hand",
    "Even so",
    "In hindsight",
    "Sometimes",
    "Historically",
    "To be fair",
    "More often than not",
)
_OPENERS = ("I think", "It seems to me that", "My guess is that", "I suspect", "Most people assume")
_DETS = ("the", "a", "every", "this", "that", "one")


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


class _Grammar:
    def __init__(self, rng: random.Random) -> None:
        self.r = rng

    def c(self, seq: tuple[str, ...]) -> str:
        return self.r.choice(seq)

    def np(self) -> str:
        det = self.c(_DETS)
        noun = self.c(TOPICS) if self.r.random() < 0.6 else self.c(NOUNS)
        if self.r.random() < 0.4:
            noun = f"{self.c(ADJECTIVES)} {noun}"
        return _a(noun) if det == "a" else f"{det} {noun}"

    def nps(self) -> str:
        noun = plural(self.c(TOPICS))
        return f"{self.c(ADJECTIVES)} {noun}" if self.r.random() < 0.3 else noun

    def clause(self) -> str:
        r, c = self.r, self.c
        form = r.randrange(6)
        if form == 0:
            return f"{self.np()} {third_person(c(VERBS))} {self.np()}"
        if form == 1:
            return f"most {self.nps()} {c(VERBS)} {self.np()} {c(ADVERBS)}"
        if form == 2:
            return f"{self.nps()} rarely {c(VERBS)} what they cannot {c(VERBS)}"
        if form == 3:
            return (
                f"the {c(ADJECTIVES)} part of {_a(c(TOPICS))} is how it {third_person(c(VERBS))} {self.nps()}"
            )
        if form == 4:
            return f"you can {c(VERBS)} {self.np()} without trying to {c(VERBS)} {self.np()}"
        return f"{self.np()} is {c(ADVERBS)} more {c(ADJECTIVES)} than {self.np()}"

    def sentence(self) -> str:
        r, c = self.r, self.c
        form = r.randrange(8)
        if form == 0:
            s = f"{c(_CONNECTORS)}, {self.clause()}."
        elif form == 1:
            s = f"If you {c(VERBS)} {self.np()}, you will {c(ADVERBS)} {c(VERBS)} {self.np()}."
        elif form == 2:
            s = f"{c(_OPENERS)} {self.clause()}."
        elif form == 3:
            s = f"What makes {self.nps()} {c(ADJECTIVES)} is not {self.np()}, but {self.np()}."
        elif form == 4:
            s = f"{self.clause()}, and {self.clause()}."
        elif form == 5:
            s = f"Few {self.nps()} notice how much {self.np()} {third_person(c(VERBS))} {self.np()}."
        elif form == 6:
            s = f"Why do {self.nps()} {c(VERBS)} {self.np()}? Because {self.clause()}."
        else:
            s = f"It is {c(ADVERBS)} {c(ADJECTIVES)} to {c(VERBS)} {self.np()} when {self.clause()}."
        return s[0].upper() + s[1:]


def essay_sentences(seed: int) -> Iterator[tuple[str, bool]]:
    """Endless (sentence, starts_paragraph) pairs of essay-like prose, deterministic per seed."""
    g = _Grammar(random.Random(f"essay:{seed}"))
    left = 0
    while True:
        new_par = left == 0
        if new_par:
            left = g.r.randint(4, 9)
        left -= 1
        yield g.sentence(), new_par
