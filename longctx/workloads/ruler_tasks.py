"""The 13 RULER tasks: specifications, prompt templates and sample generation.

Each task follows RULER's definition (NVIDIA/RULER, scripts/synthetic.yaml and
scripts/data/synthetic/*.py): the same needle formats, haystack kinds, question templates,
answer prefixes, output budgets and metrics. What differs is the source text, which is all
generated offline (see prose.py and qa_world.py), and the length fitting, which is exact to
the target tokenizer (see fit.py and haystack.py).

A sample's length counts its prompt tokens plus its output budget, as RULER's does; generated
samples land in [(1 - tolerance) * length, length].
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields

from longctx.checkpoint.chat_template import DOCUMENT_QUESTION_SEPARATOR
from longctx.errors import LongctxError
from longctx.workloads.fit import LengthError, fit_size
from longctx.workloads.haystack import PieceStream, insert_at_boundaries
from longctx.workloads.prose import essay_sentences
from longctx.workloads.qa_world import QAWorld
from longctx.workloads.tokens import PieceCache, TokenCounter
from longctx.workloads.words import longest_word, random_letters, random_needle, real_words, vocabulary

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {vtype} for {key} is: {value}."
# RULER inserts essay needles at one of 40 evenly spaced depths (percent of the sentences).
DEPTHS = [round(i * 100 / 39) for i in range(40)]
_SINGULAR = {"numbers": "number", "uuids": "uuid", "words": "word"}

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above."
)
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables"
    " are assigned the value {query}, they are:"
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the {num_cw} most common words in the above list?"
)
CWE_PREFIX = " Answer: The top {num_cw} words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. "
    "Please ignore the dots '....'. What are the three most frequently appeared words in the "
    "above coded text?"
)
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
QA_INSTRUCTION = "Answer the question based on the given documents. Only give me the answer and do not output any other words."
QA_TEMPLATE = (
    QA_INSTRUCTION
    + "\n\nThe following are given documents.\n\n{context}\n\n"
    + QA_INSTRUCTION
    + "\n\nQuestion: {query}"
)
QA_PREFIX = " Answer:"


@dataclass(frozen=True)
class TaskSpec:
    """One RULER task: its family, output budget (tokens), metric and family parameters."""

    name: str
    family: str  # niah | vt | cwe | fwe | qa
    max_new_tokens: int
    metric: str  # all (string_match_all) | part (string_match_part)
    haystack: str = ""  # niah: repeat | essay | needle
    key: str = "words"  # niah key kind
    value: str = "numbers"  # niah value kind
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1
    num_chains: int = 1  # vt
    num_hops: int = 4  # vt
    num_cw: int = 10  # cwe
    alpha: float = 2.0  # fwe
    hops: int = 1  # qa: 1 (SQuAD-like) or 2 (HotpotQA-like)


def _niah(name: str, haystack: str, key: str = "words", value: str = "numbers", **kw: int) -> TaskSpec:
    return TaskSpec(name, "niah", 128, "all", haystack=haystack, key=key, value=value, **kw)


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        _niah("niah_single_1", "repeat"),
        _niah("niah_single_2", "essay"),
        _niah("niah_single_3", "essay", value="uuids"),
        _niah("niah_multikey_1", "essay", num_k=4),
        _niah("niah_multikey_2", "needle"),
        _niah("niah_multikey_3", "needle", key="uuids", value="uuids"),
        _niah("niah_multivalue", "essay", num_v=4),
        _niah("niah_multiquery", "essay", num_k=4, num_q=4),
        TaskSpec("vt", "vt", 30, "all"),
        TaskSpec("cwe", "cwe", 120, "all"),
        TaskSpec("fwe", "fwe", 50, "all"),
        TaskSpec("qa_1", "qa", 32, "part", hops=1),
        TaskSpec("qa_2", "qa", 32, "part", hops=2),
    )
}


# the longest needle value of each kind (longctx.workloads.words: 7 digits; 8-4-4-4-12 hex), for the answer
# floor of `RulerGenerator.max_new_tokens`
_LONGEST_VALUE = {"numbers": "9999999", "uuids": "ffffffff-ffff-ffff-ffff-ffffffffffff"}


def cwe_listing(words: list[str]) -> str:
    """cwe's numbered word list ("1. a 2. b ..."), as its contexts and answers are written."""
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


@dataclass(frozen=True)
class Sample:
    """One generated RULER sample. The prompt sent is `render(input, answer_prefix)`."""

    task: str
    length: int
    index: int
    seed: int
    input: str
    answer_prefix: str
    outputs: tuple[str, ...]
    max_new_tokens: int
    prompt_tokens: int  # exact, in the target tokenizer, of the rendered prompt

    def to_json(self) -> dict:
        d = asdict(self)
        d["outputs"] = list(self.outputs)
        return d


Renderer = Callable[[str, str], str]
Build = Callable[[int], tuple[str, str, tuple[str, ...]]]


def split_niah(text: str) -> tuple[str, str]:
    """A niah sample's input as (document, question): the haystack without RULER's instruction line,
    and the question after it (without its leading newline), the two parts a long-document QA client
    sends (`longctx ruler --documents`, the trainer's document rows)."""
    _, head, rest = text.partition("afterwards.\n")  # the instruction line ends the head
    document, at, question = rest.rpartition("\nWhat ")  # the question is the text's last line
    if not (head and at):
        raise LongctxError("not a RULER niah input (no instruction line or no question)")
    return document, "What " + question


def document_turn(text: str) -> str:
    """A niah sample's input as a long-document QA request's user turn: the document, then the question
    (`split_niah`), joined as POST /v1/documents/{id}/ask joins them."""
    document, question = split_niah(text)
    return document + DOCUMENT_QUESTION_SEPARATOR + question


def raw_render(text: str, answer_prefix: str) -> str:
    """Raw completion: the task text followed by the answer prefix the model continues."""
    return text + answer_prefix


class RulerGenerator:
    """Generates RULER samples fitted to target lengths in one tokenizer, deterministic per seed.

    `render(input, answer_prefix)` gives the exact prompt (raw text, or a chat template); its
    tokens plus the task's output budget must fit the target length.
    """

    def __init__(
        self,
        counter: TokenCounter,
        seed: int = 0,
        render: Renderer = raw_render,
        max_new_tokens_scale: float = 1.0,
        tolerance: float = 0.02,
    ) -> None:
        self.counter = counter
        self.seed = seed
        self.render = render
        self.scale = max_new_tokens_scale
        self.tolerance = tolerance
        self._cache = PieceCache(counter)
        self._streams: dict[str, PieceStream] = {}
        self._hints: dict[tuple[str, int], int] = {}
        self._world: QAWorld | None = None
        self._vocab: list[str] = []

    # ---- public ------------------------------------------------------------------------
    def max_new_tokens(self, task: str) -> int:
        """RULER's output budget times the scale, but a scale below 1 never cuts below the task's
        answer: RULER's budgets are BPE tokens, and scaled down for a byte tokenizer vt's 30 would cut
        its 30-byte answer (five names) to two names, and cwe's 120 its ten words to about five."""
        return self._budget(TASKS[task])

    def _budget(self, spec: TaskSpec) -> int:
        return max(1, math.ceil(spec.max_new_tokens * self.scale), self._answer_tokens(spec))

    def _answer_tokens(self, spec: TaskSpec) -> int:
        """The tokens of the longest answer `spec` asks for, written as the answer prefix leads the
        model to (vt: the names after a space; niah: the values, comma-separated, and a full stop; cwe:
        the numbered list of its words, as its example answers, but no more than RULER's own budget,
        which ten of the longest invented words would pass); 0 for the families whose answers are not
        so bounded."""
        if spec.family == "vt":
            return self.counter.count(" " + " ".join(["VARXX"] * (spec.num_hops + 1)))
        if spec.family == "niah" and spec.value in _LONGEST_VALUE:
            values = [_LONGEST_VALUE[spec.value]] * (spec.num_v * spec.num_q)
            return self.counter.count(" " + ", ".join(values) + ".")
        if spec.family == "cwe":
            words = cwe_listing(["w" * longest_word()] * spec.num_cw)
            return min(self.counter.count(" " + words), spec.max_new_tokens)
        return 0

    def sample(self, task: str, length: int, index: int, spec: TaskSpec | None = None) -> Sample:
        """Sample `index` of `task` at `length` tokens (prompt + output budget). `spec`: the task with
        other family parameters (e.g. a vt chain of fewer hops, for training); its samples are drawn
        apart from the task's own, and None or the task's own spec gives exactly those."""
        if task not in TASKS:
            raise LongctxError(f"unknown RULER task {task!r}")
        base = TASKS[task]
        spec = base if spec is None else spec
        if spec.name != task or spec.family != base.family:
            raise LongctxError(f"a spec for {task!r} must keep its name and family")
        # a variant's own name for its random draws and size hints: the parameters it changes
        variant = task + "".join(
            f",{f.name}={getattr(spec, f.name)}"
            for f in fields(spec)
            if getattr(spec, f.name) != getattr(base, f.name)
        )
        key = f"{self.seed}:{variant}:{length}:{index}"
        out_budget = self._budget(spec)
        budget = length - out_budget
        lower = math.ceil(length * (1 - self.tolerance)) - out_budget
        build, estimate, min_n, max_n = getattr(self, f"_{spec.family}")(spec, key, budget)
        built: dict[int, tuple[str, str, tuple[str, ...], int]] = {}

        def measure(n: int) -> int:
            if n not in built:
                text, prefix, outputs = build(n)
                built[n] = (text, prefix, outputs, self.counter.count(self.render(text, prefix)))
            return built[n][3]

        hint = self._hint(variant, spec, length) if index else None
        n = fit_size(measure, estimate, budget, lower, min_n, max_n, hint=hint, what=f"{variant} at {length}")
        measure(n)
        text, prefix, outputs, tokens = built[n]
        if index == 0:
            self._hints[(variant, length)] = n
        return Sample(task, length, index, self.seed, text, prefix, outputs, out_budget, tokens)

    # ---- shared haystacks --------------------------------------------------------------
    def _hint(self, variant: str, spec: TaskSpec, length: int) -> int:
        # Start every sample's search from sample 0's size: a good guess that does not depend on
        # which other samples this process happened to generate (so output stays deterministic).
        if (variant, length) not in self._hints:
            self.sample(spec.name, length, 0, spec)
        return self._hints[(variant, length)]

    def _stream(self, kind: str) -> PieceStream:
        if kind not in self._streams:
            if kind == "essay":
                records: Iterator[str] = (
                    ("" if i == 0 else "\n\n" if par else " ") + s
                    for i, (s, par) in enumerate(essay_sentences(self.seed))
                )
            else:
                records = (("" if i == 0 else "\n") + NOISE for i in _count())
            self._streams[kind] = PieceStream(records, self._cache)
        return self._streams[kind]

    def _vocabulary(self, n: int) -> list[str]:
        # `vocabulary` is prefix-stable, so one list grown geometrically serves every size.
        if len(self._vocab) < n:
            self._vocab = vocabulary(max(n, 2 * len(self._vocab)), self.seed)
        return self._vocab[:n]

    # ---- families ----------------------------------------------------------------------
    def _niah(self, spec: TaskSpec, key: str, budget: int):
        rng = random.Random(key)
        num_k = max(spec.num_k, spec.num_q)
        keys: list[str] = []
        while len(keys) < num_k:
            k = random_needle(spec.key, rng)
            if k not in keys:
                keys.append(k)
        values = [[random_needle(spec.value, rng) for _ in range(spec.num_v)] for _ in keys]
        needles = [NEEDLE.format(vtype=spec.value, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        asked = rng.sample(range(num_k), spec.num_q)
        queries = [keys[i] for i in asked]
        outputs = tuple(v for i in asked for v in values[i])
        query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
        if spec.num_q * spec.num_v == 1:
            vt = _SINGULAR[spec.value]
            head = f"A special magic {vt} is hidden within the following text. Make sure to memorize it. I will quiz you about the {vt} afterwards.\n"
            question = f"\nWhat is the special magic {vt} for {query} mentioned in the provided text?"
            prefix = f" The special magic {vt} for {query} mentioned in the provided text is"
        else:
            vt = spec.value
            head = f"Some special magic {vt} are hidden within the following text. Make sure to memorize it. I will quiz you about the {vt} afterwards.\n"
            question = f"\nWhat are all the special magic {vt} for {query} mentioned in the provided text?"
            prefix = f" The special magic {vt} for {query} mentioned in the provided text are"

        if spec.haystack == "needle":
            stream = PieceStream(self._distractors(spec, key, set(keys)), self._cache)
        else:
            stream = self._stream(spec.haystack)
        sep = " " if spec.haystack == "essay" else "\n"

        def build(n: int) -> tuple[str, str, tuple[str, ...]]:
            pos_rng = random.Random(key + ":positions")
            bounds = stream.boundaries(n)
            if spec.haystack == "essay":
                sentences = len(bounds) - 1
                depths = pos_rng.sample(DEPTHS, len(needles))
                positions = sorted(bounds[int(sentences * d / 100)] for d in depths)
            else:
                positions = sorted(_pick(pos_rng, sorted(set(bounds[:-1])) or [0], len(needles)))
            context = insert_at_boundaries(stream, n, needles, positions, sep)
            return head + context + question, prefix, outputs

        return build, stream.estimate, 0, 1 << 40

    def _distractors(self, spec: TaskSpec, key: str, real_keys: set[str]) -> Iterator[str]:
        rng = random.Random(key + ":distractors")
        first = True
        while True:
            k = random_needle(spec.key, rng)
            if k in real_keys:
                continue  # a distractor must never answer the question
            yield ("" if first else "\n") + NEEDLE.format(
                vtype=spec.value, key=k, value=random_needle(spec.value, rng)
            )
            first = False

    def _vt(self, spec: TaskSpec, key: str, budget: int):
        rng = random.Random(key)
        used: set[str] = set()

        def chain() -> tuple[list[str], list[str], str]:
            names: list[str] = []
            while len(names) < spec.num_hops + 1:
                v = random_letters(rng, 5)
                if v not in used:
                    used.add(v)
                    names.append(v)
            value = str(rng.randint(10000, 99999))
            stmts = [f"VAR {names[0]} = {value}"] + [
                f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(spec.num_hops)
            ]
            return names, stmts, value

        # One worked example first, as RULER does (its own chain, a few noise lines).
        ex_names, ex_stmts, ex_value = chain()
        ex_lines = [NOISE] * (spec.num_hops + 2)
        for j, p in enumerate(sorted(rng.sample(range(len(ex_lines)), len(ex_stmts)))):
            ex_lines.insert(p + j, ex_stmts[j])
        example = (
            VT_TEMPLATE.format(context="\n".join(ex_lines), query=ex_value)
            + VT_PREFIX.format(num_v=spec.num_hops + 1, query=ex_value)
            + " "
            + " ".join(ex_names)
            + "\n\n"
        )
        chains = [chain() for _ in range(spec.num_chains)]
        names, _, value = chains[0]
        prefix = VT_PREFIX.format(num_v=spec.num_hops + 1, query=value)
        stream = self._stream("repeat")

        def build(n: int) -> tuple[str, str, tuple[str, ...]]:
            pos_rng = random.Random(key + ":positions")
            cands = sorted(set(stream.boundaries(n)[:-1])) or [0]
            inserts: list[str] = []
            positions: list[int] = []
            for _, stmts, _ in chains:
                inserts += stmts
                positions += sorted(_pick(pos_rng, cands, len(stmts)))
            context = insert_at_boundaries(stream, n, inserts, positions, "\n")
            return example + VT_TEMPLATE.format(context=context, query=value), prefix, tuple(names)

        return build, stream.estimate, 0, 1 << 40

    def _cwe(self, spec: TaskSpec, key: str, budget: int):
        num_cw = spec.num_cw
        prefix = CWE_PREFIX.format(num_cw=num_cw)

        def make(long: bool) -> Build:
            # RULER: 30/3 repeats for common/uncommon words with a 40-word example, and 6/1 with
            # a 20-word example when the context is short. It switches at 4096 tokens; here the
            # switch is when the long form's fixed part would take over half the budget, which
            # is the same point for a ~4-bytes-per-token tokenizer and right for byte tokens too.
            ex_n, ex_fc, ex_fu, fc, fu = (40, 10, 3, 30, 3) if long else (20, 3, 1, 6, 1)
            r = random.Random(key + (":long" if long else ":short"))
            ex_words = r.sample(real_words(), ex_n)
            ex_entries = ex_words[:num_cw] * ex_fc + ex_words[num_cw:] * ex_fu
            r.shuffle(ex_entries)
            example = (
                CWE_TEMPLATE.format(context=cwe_listing(ex_entries), num_cw=num_cw)
                + prefix
                + " "
                + cwe_listing(ex_words[:num_cw])
                + "\n"
            )
            taken = set(ex_words)

            def build(n: int) -> tuple[str, str, tuple[str, ...]]:
                pool = [w for w in self._vocabulary(max(n, len(real_words())) + ex_n) if w not in taken]
                wr = random.Random(key + ":words")
                words = wr.sample(pool[: max(n, len(real_words()) - ex_n)], n)
                entries = words[:num_cw] * fc + words[num_cw:] * fu
                wr.shuffle(entries)
                text = example + CWE_TEMPLATE.format(context=cwe_listing(entries), num_cw=num_cw)
                return text, prefix, tuple(words[:num_cw])

            return build

        build = make(long=True)
        text, pre, _ = build(num_cw)
        if self.counter.count(self.render(text, pre)) > budget / 2:
            build = make(long=False)
        return build, float, num_cw, 1 << 30

    def _fwe(self, spec: TaskSpec, key: str, budget: int):
        rng = random.Random(key)
        size = max(budget // 50, 8)  # RULER: a vocabulary of max_seq_length // 50 coded words
        vocab: set[str] = set()
        while len(vocab) < size:
            vocab.add(random_letters(rng, 6, "abcdefghijklmnopqrstuvwxyz"))
        words = sorted(vocab)
        rng.shuffle(words)
        words[0] = "..."  # the most frequent "word" is noise the question says to ignore
        zeta = _zeta(spec.alpha)
        weights = [k**-spec.alpha / zeta for k in range(1, len(words) + 1)]

        def build(n: int) -> tuple[str, str, tuple[str, ...]]:
            text = [w for w, p in zip(words, weights) for _ in range(int(n * p))]
            random.Random(key + ":order").shuffle(text)
            return FWE_TEMPLATE.format(context=" ".join(text)), FWE_PREFIX, tuple(words[1:4])

        # Below ~100 words the floors of the Zipf counts can tie ranks 4 and 5.
        return build, float, 100, 1 << 30

    def _qa(self, spec: TaskSpec, key: str, budget: int):
        rng = random.Random(key)
        if self._world is None:
            self._world = QAWorld(self.seed)
        world = self._world
        item = world.single_hop(rng) if spec.hops == 1 else world.two_hop(rng)
        gold = [world.doc(i) for i in item.gold]
        start = rng.randrange(4000)

        def records() -> Iterator[str]:
            i, first = start, True
            while True:
                if i not in item.gold:
                    yield ("" if first else "\n\n") + world.doc(i)
                    first = False
                i += 1

        stream = PieceStream(records(), self._cache)

        def build(n: int) -> tuple[str, str, tuple[str, ...]]:
            b = stream.boundaries(n)
            docs = [d for d in (stream.text(b[i], b[i + 1]).lstrip("\n") for i in range(len(b) - 1)) if d]
            pos_rng = random.Random(key + ":positions")
            for g in gold:
                docs.insert(pos_rng.randint(0, len(docs)), g)
            context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
            return QA_TEMPLATE.format(context=context, query=item.question), QA_PREFIX, item.answers

        return build, stream.estimate, 0, 1 << 40


def _count() -> Iterator[int]:
    i = 0
    while True:
        yield i
        i += 1


def _pick(rng: random.Random, candidates: list[int], k: int) -> list[int]:
    """k distinct candidates when there are enough, else k draws with repetition."""
    return rng.sample(candidates, k) if len(candidates) >= k else rng.choices(candidates, k=k)


def _zeta(alpha: float) -> float:
    """Riemann zeta(alpha) for alpha > 1 (partial sum + integral tail)."""
    n = 10_000
    return sum(k**-alpha for k in range(1, n)) + n ** (1 - alpha) / (alpha - 1) + 0.5 * n**-alpha


def parse_tasks(text: str) -> list[str]:
    """'all', or a comma list of task names (RULER's 13 names); a bad one is refused `about` the setting
    `tasks`."""
    if text.strip() == "all":
        return list(TASKS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in TASKS]
    if bad or not names:  # (an empty list ran all 13)
        value, what = (bad[0], "unknown task") if bad else (text, "no task given")
        raise LongctxError.about("tasks", repr(value), f"{what}; choose from {', '.join(TASKS)} or 'all'")
    return list(dict.fromkeys(names))


__all__ = ["TASKS", "Sample", "RulerGenerator", "TaskSpec", "LengthError", "parse_tasks", "raw_render"]
