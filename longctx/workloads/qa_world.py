"""A synthetic encyclopedia: the offline stand-in for RULER's SQuAD (qa_1) and HotpotQA (qa_2).

An endless, self-consistent fictional world of towns and people, each described by one
encyclopedia-style paragraph with a title line (HotpotQA's document shape). Every fact is
generated, so a question's answer is known exactly and can only be found in the documents:
- single-hop questions (qa_1) ask one fact of one document (a town's founding year, a person's
  profession, ...), as SQuAD's do of one paragraph;
- two-hop questions (qa_2) go through a bridge entity: a person's document names their
  birthplace, and the birthplace's document holds the answer ("What is the main export of the
  town where X was born?"), as HotpotQA's bridge questions do.
Documents are generated lazily and prefix-stably: document i is the same however many exist.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from longctx.workloads.words import ADJECTIVES, NOUNS, plural

_SYL_A = ("bar", "cal", "dor", "el", "fen", "gal", "hal", "is", "kor", "lan", "mar", "nor", "or", "pel")
_SYL_B = ("a", "e", "i", "o", "u", "ae", "ia", "ou")
_SYL_C = ("brook", "dale", "mont", "vik", "stad", "holm", "ford", "mere", "wick", "by", "ton", "ria")
_NAMES = (
    "Ada Alvar Bryn Cato Dagny Edda Esko Fenna Gisli Hale Ilse Ivo Jora Kasimir Liesl Mads Nadia Odile "
    "Petra Quill Rosa Soren Tilde Ulla Vidar Wenna Xavi Yrsa Zeno Anselm Berit Cyra Dario Elin Femke"
)
_FIRST = tuple(_NAMES.split())
_KINDS = ("river town", "market town", "mountain village", "port city", "mining town", "university town")
_REGIONS = ("northern", "southern", "eastern", "western", "central", "coastal", "upland")
_EXPORTS = (
    "copper wire", "wool blankets", "rye flour", "glass beads", "salted fish", "clay pipes", "linen",
    "honey wine", "iron nails", "paper", "smoked cheese", "rope", "pottery", "barley", "timber",
    "silver thread", "dyed leather", "olive soap", "sugar beets", "clock springs",
)  # fmt: skip
_PROFESSIONS = (
    "cartographer", "composer", "botanist", "architect", "astronomer", "engineer", "novelist",
    "painter", "physician", "sculptor", "shipbuilder", "violinist", "chemist", "historian",
    "mathematician", "poet", "bookbinder", "glassblower",
)  # fmt: skip
_WORK_KINDS = ("treatise", "atlas", "symphony", "novel", "bridge design", "herbarium", "star catalogue")


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


@dataclass(frozen=True)
class Town:
    name: str
    kind: str
    region: str
    country: str
    founded: int
    founder: str
    export: str
    landmark: str
    river: str
    population: int


@dataclass(frozen=True)
class Person:
    name: str
    born: int
    died: int
    profession: str
    birthplace: int  # town index
    work: str
    pronoun: str


@dataclass(frozen=True)
class QAItem:
    """A question, its accepted answers, and the document ids that hold them (gold documents)."""

    question: str
    answers: tuple[str, ...]
    gold: tuple[int, ...]


class QAWorld:
    """Documents 2j (town j) and 2j+1 (person j), deterministic per seed."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(f"qa-world:{seed}")
        self.towns: list[Town] = []
        self.people: list[Person] = []
        self._docs: list[str] = []
        self._names: set[str] = set()
        self._countries = [self._place_name() for _ in range(12)]

    # ---- names -------------------------------------------------------------------------
    def _place_name(self) -> str:
        r = self.rng
        while True:
            name = (r.choice(_SYL_A) + r.choice(_SYL_B) + r.choice(_SYL_C)).capitalize()
            if r.random() < 0.5:
                name = (r.choice(_SYL_A) + r.choice(_SYL_B)).capitalize() + name.lower()
            if name not in self._names:
                self._names.add(name)
                return name

    def _person_name(self) -> str:
        r = self.rng
        while True:
            last = (
                r.choice(_SYL_A) + r.choice(_SYL_B) + r.choice(("n", "s", "rd", "ll", "k", ""))
            ).capitalize()
            name = f"{r.choice(_FIRST)} {last}"
            if name not in self._names:
                self._names.add(name)
                return name

    # ---- entities ----------------------------------------------------------------------
    def _grow(self) -> None:
        r = self.rng
        j = len(self.towns)
        town = Town(
            name=self._place_name(),
            kind=r.choice(_KINDS),
            region=r.choice(_REGIONS),
            country=r.choice(self._countries),
            founded=r.randint(1100, 1899),
            founder=self._person_name(),
            export=r.choice(_EXPORTS),
            landmark=f"{r.choice(ADJECTIVES).capitalize()} {r.choice(NOUNS).capitalize()} {r.choice(('Gate', 'Hall', 'Tower', 'Bridge', 'Abbey'))}",
            river=self._place_name(),
            population=r.randint(800, 400_000),
        )
        self.towns.append(town)
        born = r.randint(1600, 1950)
        person = Person(
            name=self._person_name(),
            born=born,
            died=born + r.randint(30, 95),
            profession=r.choice(_PROFESSIONS),
            birthplace=r.randint(0, j),
            work=f"The {r.choice(ADJECTIVES).capitalize()} {r.choice(NOUNS).capitalize()}",
            pronoun=r.choice(("He", "She")),
        )
        self.people.append(person)
        self._docs.append(self._town_doc(town))
        self._docs.append(self._person_doc(person))

    def _town_doc(self, t: Town) -> str:
        return (
            f"{t.name}\n{t.name} is {_a(t.kind)} in the {t.region} region of {t.country}. "
            f"It was founded in {t.founded} by {t.founder}. Its main export is {t.export}, and its "
            f"best-known landmark is the {t.landmark}. The {t.river} River runs through the town, "
            f"which had {t.population:,} inhabitants at the last census."
        )

    def _person_doc(self, p: Person) -> str:
        town = self.towns[p.birthplace]
        kind = self.rng.choice(_WORK_KINDS)
        pos = "his" if p.pronoun == "He" else "her"
        return (
            f"{p.name}\n{p.name} ({p.born}-{p.died}) was {_a(p.profession)} born in {town.name}. "
            f"{p.pronoun} is best remembered for {pos} {kind} {p.work}, which admirers of "
            f"{plural(self.rng.choice(NOUNS))} still study. {p.name} worked in {town.country} for "
            f"most of {pos} life."
        )

    def doc(self, i: int) -> str:
        """Document i (a title line, then one paragraph)."""
        while len(self._docs) <= i:
            self._grow()
        return self._docs[i]

    # ---- questions ---------------------------------------------------------------------
    def single_hop(self, rng: random.Random, pool: int = 4000) -> QAItem:
        """A question answered by one document (qa_1)."""
        i = rng.randrange(pool)
        self.doc(i)
        if i % 2 == 0:
            t = self.towns[i // 2]
            q, a = rng.choice(
                (
                    (f"In which year was {t.name} founded?", str(t.founded)),
                    (f"Who founded {t.name}?", t.founder),
                    (f"What is the main export of {t.name}?", t.export),
                    (f"Which river runs through {t.name}?", t.river),
                    (f"What is the best-known landmark of {t.name}?", t.landmark),
                )
            )
        else:
            p = self.people[i // 2]
            q, a = rng.choice(
                (
                    (f"What was the profession of {p.name}?", p.profession),
                    (f"In which town was {p.name} born?", self.towns[p.birthplace].name),
                    (f"What work is {p.name} best remembered for?", p.work),
                    (f"In which year was {p.name} born?", str(p.born)),
                )
            )
        return QAItem(q, (a,), (i,))

    def two_hop(self, rng: random.Random, pool: int = 2000) -> QAItem:
        """A bridge question through a person's birthplace (qa_2): two gold documents."""
        j = rng.randrange(pool)
        self.doc(2 * j + 1)
        p = self.people[j]
        t = self.towns[p.birthplace]
        q, a = rng.choice(
            (
                (f"What is the main export of the town where {p.name} was born?", t.export),
                (f"In which year was the birthplace of {p.name} founded?", str(t.founded)),
                (f"Which river runs through the town where {p.name} was born?", t.river),
                (f"Who founded the town in which {p.name} was born?", t.founder),
            )
        )
        return QAItem(q, (a,), (2 * j + 1, 2 * p.birthplace))
