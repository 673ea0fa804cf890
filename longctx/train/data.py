"""Training batches generated on the fly: RULER-style retrieval in the byte-level tokenizer, plus prose.

Retrieval rows are RULER samples from the workloads' own generator (`RulerGenerator`: the same
needle formats, haystacks, questions and answer prefixes the suite asks, fitted exactly to a
length in byte tokens), each with a fresh generator seed so every row has its own haystack:

    [task text + answer prefix] [" " answer] <|endoftext|> [prose filling the row]

covering single and multi-key needles (numbers, words and UUIDs as keys/values) in noise,
essay-prose and distractor-needle haystacks, multi-value and multi-query needles, and
variable-tracking chains. Plain-text rows (essay prose) keep the model a language model.

Every target position has a kind: ANSWER (the answer bytes and the EOS after them), LM (the
rest: task text, haystack, prose), or IGNORE. The loss weights them separately (loop.py).
A batch is a pure function of (DataConfig, step): resuming at step n regenerates the batches a
run would have seen, and rows/seq lengths follow a curriculum over steps.

With `pose_max` > 0 a batch also carries rotary position ids that skip (`pose_positions`: PoSE,
Zhu et al. 2023), so rows of S tokens show the model relative distances up to `pose_max`.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from longctx.checkpoint.chat_template import apply_chat_template
from longctx.checkpoint.tokenizer import NUM_BYTES, SPECIAL_TOKENS
from longctx.errors import LongctxError
from longctx.seeds import SEED_RANGE, is_seed
from longctx.workloads.prose import essay_sentences
from longctx.workloads.ruler_tasks import TASKS, RulerGenerator, document_turn
from longctx.workloads.tokens import ByteCounter

EOS_ID = NUM_BYTES + SPECIAL_TOKENS.index("<|endoftext|>")
PAD_ID = NUM_BYTES + SPECIAL_TOKENS.index("<|pad|>")
IGNORE, LM, ANSWER = 0, 1, 2

# The retrieval families of RULER, equally likely by default (cwe/fwe/qa are left to later work).
DEFAULT_TASKS: tuple[tuple[str, float], ...] = (
    ("niah_single_1", 1.0),
    ("niah_single_2", 1.0),
    ("niah_single_3", 1.0),
    ("niah_multikey_1", 1.0),
    ("niah_multikey_2", 1.0),
    ("niah_multikey_3", 1.0),
    ("niah_multivalue", 1.0),
    ("niah_multiquery", 1.0),
    ("vt", 1.0),
)


MAX_VT_HOPS = 16  # the longest vt chain a row may ask for (RULER's is 4)


class DataError(LongctxError):
    """A data configuration that cannot produce batches."""


@dataclass(frozen=True)
class DataConfig:
    """What batches a run sees. `curriculum`: (first step, sequence length) pairs, ascending."""

    seed: int = 0
    tokens_per_step: int = 32768
    # short rows first: retrieval appears at 512 (after the copy rows teach induction), then length
    curriculum: tuple[tuple[int, int], ...] = (
        (0, 512),
        (1500, 1024),
        (3500, 2048),
        (5500, 4096),
        (7000, 8192),
        (8500, 16384),
    )
    text_fraction: float = 0.1  # rows of plain prose
    # rows of random strings that recur (only copying predicts them): without them the H200 runs never
    # learned retrieval (docs/training.md, "What the runs showed")
    copy_fraction: float = 0.3
    # copy rows whose strings are UUIDs (16 symbols, so a byte recurs inside a string and copying it
    # needs more than the byte before it: run 23's UUID misses with the needle selected are such
    # slips, `826d009d` for 826a009d); 0 draws nothing, so the rows stay bit for bit those of a run
    # without it
    copy_hex_fraction: float = 0.0
    # copy rows (of those not drawn for UUIDs) whose strings are capital letters (5-16 of them): the
    # other copy rows pool lowercase letters and digits, so no row but vt's ever asked the model to copy
    # capitals, and a byte-level model's copying does not carry over to bytes it never copied (run 29
    # given a vt name's first letters in the haystack does not go on with it); 0 draws nothing, so the
    # rows stay bit for bit those of a run without it
    copy_upper_fraction: float = 0.0
    # copy rows (any alphabet) laid out as pairs: each string written twice at a random distance with
    # random chunks of the same alphabet between (`_copy_row`). Pooled rows repeat a few strings so often
    # that the row's byte statistics predict most of a repeat (the shipped model's loss on a repeat's bytes
    # from the 9th on is 1.8 nats, 2.4 on its 2nd: no induction); in pairs only finding the earlier
    # occurrence does. 0 draws nothing, so the rows stay bit for bit those of a run without it
    copy_pairs_fraction: float = 0.0
    min_length_fraction: float = 0.5  # a retrieval sample fills [fraction * S, S] tokens
    tasks: tuple[tuple[str, float], ...] = field(default=DEFAULT_TASKS)
    # PoSE positional skips (`pose_positions`): 0 keeps positions 0..S-1 (no `Batch.positions`);
    # otherwise a `pose_prob` share of rows is cut into `pose_chunks` pieces whose positions jump
    # so that the row spans up to `pose_max` positions
    pose_max: int = 0
    pose_prob: float = 0.75
    pose_chunks: int = 2
    # a share of the skipped rows whose total skip is drawn uniformly instead of log-uniformly, so far
    # distances (the top octave of pose_max, where a 1M request's needle sits) come up as often as near
    # ones; 0 draws nothing, so the rows stay bit for bit those of a run without it
    pose_far: float = 0.0
    # retrieval rows rendered as a one-message chat (`chat_prompt`: the checkpoint's chat template, the
    # form of the server's /v1/chat/completions and `longctx ruler --chat`); 0 draws nothing, so the
    # raw-prompt rows stay bit for bit those of a run without it
    chat_fraction: float = 0.0
    # niah rows (of those not drawn for chat) as the QA endpoint asks them (`document_prompt`: the
    # haystack as the document, the question after it, no RULER instruction line); 0 draws nothing
    document_fraction: float = 0.0
    # steps that go back to a shorter length of the curriculum (one of those begun before, drawn
    # per step) so the short rows stay in the mix as the rows lengthen; 0 follows the curriculum
    replay_fraction: float = 0.0
    # vt rows' chain lengths, one drawn per row (e.g. (1, 2, 3, 4): chains shorter than RULER's four hops
    # first steps toward them); empty keeps RULER's four, and the rows bit for bit those of a run without it
    vt_hops: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Refuse (DataError `about` the field at fault) a config that cannot make batches: NaN is out of every
        range."""
        if not is_seed(self.seed):
            raise DataError.about("seed", self.seed, f"must be {SEED_RANGE}")
        cur = curriculum_text(self.curriculum)
        if not self.curriculum or self.curriculum[0][0] != 0:
            raise DataError.about("curriculum", cur, "must start at step 0")
        if any(b[0] <= a[0] for a, b in zip(self.curriculum, self.curriculum[1:])):
            raise DataError.about("curriculum", cur, "steps must increase")
        if any(s < 64 for _, s in self.curriculum):
            raise DataError.about("curriculum", cur, "sequence lengths must be at least 64")
        bad = [t for t, _ in self.tasks if t not in TASKS]
        if bad:
            raise DataError.about("tasks", repr(bad[0]), f"unknown task (the tasks: {', '.join(TASKS)})")
        if any(not 0.0 <= w < math.inf for _, w in self.tasks) or not sum(w for _, w in self.tasks) > 0.0:
            raise DataError.about("tasks", None, "weights must be finite and >= 0 with at least one above 0")
        for name, lo in (("tokens_per_step", 1), ("pose_max", 0), ("pose_chunks", 2)):
            if getattr(self, name) < lo:
                raise DataError.about(name, getattr(self, name), f"must be >= {lo}")
        for name in (
            "text_fraction",
            "copy_fraction",
            "copy_hex_fraction",
            "copy_upper_fraction",
            "copy_pairs_fraction",
            "pose_prob",
            "pose_far",
            "chat_fraction",
            "document_fraction",
        ):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise DataError.about(name, getattr(self, name), "must be in [0, 1]")
        if not 0.0 <= self.replay_fraction < 1.0:
            raise DataError.about("replay_fraction", self.replay_fraction, "must be in [0, 1)")
        if any(not 1 <= h <= MAX_VT_HOPS for h in self.vt_hops):
            raise DataError.about(
                "vt_hops", ",".join(map(str, self.vt_hops)), f"must each be in [1, {MAX_VT_HOPS}]"
            )

    def seq_len(self, step: int) -> int:
        """The curriculum's length at `step`, or (a `replay_fraction` share of the steps, chosen by
        a generator seeded from (seed, step)) one of the shorter lengths begun before it."""
        cur = self.curriculum_len(step)
        shorter = self.replay_lengths(step) if self.replay_fraction > 0.0 else []
        if not shorter:
            return cur
        rng = random.Random(self.seed * 1_000_003 + step * 7 + 5)
        return shorter[rng.randrange(len(shorter))] if rng.random() < self.replay_fraction else cur

    def curriculum_len(self, step: int) -> int:
        """The curriculum's own length at `step` (no replay)."""
        return [s for first, s in self.curriculum if first <= step][-1]

    def replay_lengths(self, step: int) -> list[int]:
        """The lengths a replayed step at `step` draws from, each alike: the curriculum's shorter ones
        begun by then."""
        cur = self.curriculum_len(step)
        return sorted({s for first, s in self.curriculum if first <= step and s < cur})

    def batch_size(self, step: int) -> int:
        return max(1, self.tokens_per_step // self.seq_len(step))


def parse_vt_hops(text: str) -> tuple[int, ...]:
    """'1,2,3,4' -> (1, 2, 3, 4): vt chain lengths (DataError for anything else)."""
    try:
        hops = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise DataError.about("vt_hops", repr(text), "expected hop counts like 1,2,3,4") from None
    if any(not 1 <= h <= MAX_VT_HOPS for h in hops):
        raise DataError.about("vt_hops", repr(text), f"each hop count must be in [1, {MAX_VT_HOPS}]")
    return hops


def parse_task_weights(text: str) -> tuple[tuple[str, float], ...]:
    """'niah_multikey_1=3,vt=0' -> DEFAULT_TASKS with those weights (the others keep 1.0); a task not in
    DEFAULT_TASKS joins the mix."""
    weights = dict(DEFAULT_TASKS)
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, w = part.partition("=")
        try:
            weight = float(w)
        except ValueError:
            weight = -1.0
        if not sep or not name.strip() or not 0.0 <= weight < math.inf:
            raise DataError.about("tasks", repr(text), "expected TASK=WEIGHT,... with finite weights >= 0")
        weights[name.strip()] = weight
    return tuple(weights.items())


def parse_curriculum(text: str) -> tuple[tuple[int, int], ...]:
    """'0:1024,1500:4096' -> ((0, 1024), (1500, 4096))."""
    expected = "expected STEP:LENGTH,STEP:LENGTH,..."
    try:
        pairs = [tuple(int(x) for x in p.split(":")) for p in text.split(",") if p.strip()]
    except ValueError:
        raise DataError.about("curriculum", repr(text), expected) from None
    if any(len(p) != 2 for p in pairs):
        raise DataError.about("curriculum", repr(text), expected)
    return tuple((a, b) for a, b in pairs)  # type: ignore[misc]


def curriculum_text(curriculum: tuple[tuple[int, int], ...]) -> str:
    """((0, 1024), (1500, 4096)) -> '0:1024,1500:4096', as --curriculum takes it."""
    return ",".join(f"{a}:{b}" for a, b in curriculum)


@dataclass
class Batch:
    ids: torch.Tensor  # [B, S] int64 inputs
    targets: torch.Tensor  # [B, S] int64 next tokens (PAD where kind is IGNORE)
    kind: torch.Tensor  # [B, S] uint8: IGNORE / LM / ANSWER per target
    step: int
    tasks: list[str]
    # [B, S] bool over input positions: the bytes of the first answer value where it stands in the
    # prompt (the needle a retrieval row's answer copies; all False in other rows)
    needle: torch.Tensor
    # [B, S] int64 rotary position ids (PoSE skips, `pose_positions`); None: 0..S-1 in every row
    positions: torch.Tensor | None = None

    def pin_memory(self) -> Batch:
        """Page-locked copies (the DataLoader's `pin_memory` calls this): a step's host-to-device copies
        are then asynchronous, where a copy from pageable memory first waits for the GPU to drain."""
        return dataclasses.replace(
            self,
            ids=self.ids.pin_memory(),
            targets=self.targets.pin_memory(),
            kind=self.kind.pin_memory(),
            needle=self.needle.pin_memory(),
            positions=None if self.positions is None else self.positions.pin_memory(),
        )


def answer_text(task: str, outputs: tuple[str, ...]) -> str:
    """The completion after the answer prefix: RULER's example style for vt, a sentence otherwise."""
    if TASKS[task].family == "vt":
        return " " + " ".join(outputs)
    return " " + ", ".join(outputs) + "."


def _prose(rng: random.Random, n_bytes: int) -> bytes:
    out: list[str] = []
    size = 0
    for i, (s, par) in enumerate(essay_sentences(rng.getrandbits(32))):
        piece = ("" if i == 0 else "\n\n" if par else " ") + s
        out.append(piece)
        size += len(piece)
        if size >= n_bytes:
            break
    return "".join(out).encode("utf-8")[:n_bytes]


def _uuid(rng: random.Random) -> str:
    """A random UUID-shaped string (8-4-4-4-12 lowercase hex digits) from `rng`."""
    h = "".join(rng.choices("0123456789abcdef", k=32))
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _copy_row(
    rng: random.Random,
    n: int,
    hex_fraction: float = 0.0,
    upper_fraction: float = 0.0,
    pairs_fraction: float = 0.0,
) -> list[int]:
    """Random strings (8-48 letters/digits) drawn with replacement from a small pool: every repeat is
    predictable only by finding its earlier occurrence (the induction pattern retrieval is built on).
    A `hex_fraction` share of the rows pools UUIDs instead, and an `upper_fraction` share of the others
    strings of 5-16 capital letters (no draw when either is 0). A `pairs_fraction` share of the rows
    (any alphabet; no draw at 0) writes each string at most twice, with random chunks of 1-24 symbols of
    its alphabet between any two strings: a repeat is predictable by its earlier occurrence and by
    nothing else in the row."""
    size_pool = rng.randint(4, 24)
    fresh: Callable[[], str]  # a new string of the row's kind, for pairs
    if hex_fraction > 0.0 and rng.random() < hex_fraction:
        alphabet = "0123456789abcdef"
        pool = [_uuid(rng) for _ in range(size_pool)]
        fresh = lambda: _uuid(rng)  # noqa: E731
    else:
        if upper_fraction > 0.0 and rng.random() < upper_fraction:
            alphabet = string.ascii_uppercase
            pool = ["".join(rng.choices(alphabet, k=rng.randint(5, 16))) for _ in range(size_pool)]
        else:
            alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
            pool = ["".join(rng.choices(alphabet, k=rng.randint(8, 48))) for _ in range(size_pool)]
        lengths = [len(w) for w in pool]  # (pairs: the pool's draw sets the strings' lengths)
        fresh = lambda: "".join(rng.choices(alphabet, k=rng.choice(lengths)))  # noqa: E731
    if pairs_fraction > 0.0 and rng.random() < pairs_fraction:
        return _pairs_row(rng, n, alphabet, fresh)
    out: list[str] = []
    size = 0
    while size <= n:  # the joined text is size - 1 bytes long
        w = rng.choice(pool)
        out.append(w)
        size += len(w) + 1
    return list(" ".join(out).encode("ascii")[:n])


def _pairs_row(rng: random.Random, n: int, alphabet: str, fresh: Callable[[], str]) -> list[int]:
    """`_copy_row`'s pairs layout: a random chunk of 1-24 symbols of `alphabet`, then a string (a `fresh`
    one, or with even odds one written once before), until n bytes; no string is written a third time."""
    out: list[str] = []
    size = 0
    waiting: list[str] = []  # strings written once
    while size <= n:
        if waiting and rng.random() < 0.5:
            w = waiting.pop(rng.randrange(len(waiting)))
        else:
            w = fresh()
            waiting.append(w)
        chunk = "".join(rng.choices(alphabet, k=rng.randint(1, 24)))
        out += [chunk, w]
        size += len(chunk) + len(w) + 2
    return list(" ".join(out).encode("ascii")[:n])


_SPECIAL_IDS = {t: NUM_BYTES + i for i, t in enumerate(SPECIAL_TOKENS)}
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
_NOT_A_VALUE_BYTE = 0  # stands for a special token when the needle is searched in bytes


def encode_text(text: str) -> list[int]:
    """Byte-level token ids of `text` with its special-token strings as their ids: what the
    checkpoint's tokenizer.json gives (`make_tokenizer`), without building a tokenizer per row."""
    ids: list[int] = []
    at = 0
    for m in _SPECIAL_RE.finditer(text):
        ids += text[at : m.start()].encode("utf-8")
        ids.append(_SPECIAL_IDS[m.group()])
        at = m.end()
    ids += text[at:].encode("utf-8")
    return ids


def chat_prompt(text: str, answer_prefix: str) -> str:
    """A retrieval prompt as a one-message chat: the default chat template's user turn and generation
    prompt, then the answer prefix (as `longctx ruler --chat` renders it; a chat client that sends
    no prefix gets the same prompt up to the assistant tag, and the model writes the prefix)."""
    return apply_chat_template([{"role": "user", "content": text}]) + answer_prefix.lstrip()


def document_prompt(task: str, text: str, answer_prefix: str) -> str:
    """A niah sample as `POST /v1/documents/{id}/ask` renders it: a one-message chat whose user turn is
    the haystack (the document, without RULER's instruction line), then the question
    (`document_turn`), then the answer prefix as the model's own first words (`chat_prompt`'s
    convention)."""
    if TASKS[task].family != "niah":
        raise DataError(f"{task} has no document form (niah tasks only)")
    try:
        user = document_turn(text)
    except LongctxError as e:
        raise DataError(f"{task}: {e}") from None
    return chat_prompt(user, answer_prefix)


def _retrieval(rng: random.Random, cfg: DataConfig, S: int) -> tuple[list[int], list[int], str, list[int]]:
    names = [t for t, _ in cfg.tasks]
    task = rng.choices(names, weights=[w for _, w in cfg.tasks])[0]
    length = rng.randint(max(64, int(cfg.min_length_fraction * S)), S)
    # half RULER's output budget: every answer here (+ EOS) fits in 64 tokens, the prompt gets the rest
    gen = RulerGenerator(ByteCounter(), seed=rng.getrandbits(32), max_new_tokens_scale=0.5)
    spec = None  # (vt_hops: this row's chain length)
    if cfg.vt_hops and TASKS[task].family == "vt":
        spec = dataclasses.replace(TASKS[task], num_hops=rng.choice(cfg.vt_hops))
    sample = None
    for t, L in ((task, length), (task, S), ("niah_single_1", S)):
        try:
            sample = gen.sample(t, L, 0, spec if t == task else None)
            task = t
            break
        except LongctxError:
            continue
    if sample is None:
        raise DataError.about(
            "curriculum",
            curriculum_text(cfg.curriculum),
            f"sequence length {S} is too short for any retrieval task",
        )
    if cfg.chat_fraction > 0 and rng.random() < cfg.chat_fraction:
        prompt = encode_text(chat_prompt(sample.input, sample.answer_prefix))
    elif cfg.document_fraction > 0 and TASKS[task].family == "niah" and rng.random() < cfg.document_fraction:
        prompt = encode_text(document_prompt(task, sample.input, sample.answer_prefix))
    else:
        prompt = list((sample.input + sample.answer_prefix).encode("utf-8"))
    answer = list(answer_text(task, sample.outputs).encode("utf-8")) + [EOS_ID]
    ids = prompt + answer
    kinds = [LM] * len(prompt) + [ANSWER] * len(answer)
    value = sample.outputs[0].encode("utf-8")
    # the answer copies the last occurrence before it (vt: its chain's)
    at = bytes(i if i < NUM_BYTES else _NOT_A_VALUE_BYTE for i in prompt).rfind(value)
    needle = list(range(at, at + len(value))) if at >= 0 else []
    return ids, kinds, task, needle


def check_retrieval_fits(cfg: DataConfig) -> None:
    """DataError now, not at the first batch (perhaps in a DataLoader worker), when the curriculum's
    shortest length holds no retrieval sample and the mix draws retrieval rows."""
    if cfg.copy_fraction + cfg.text_fraction < 1.0:
        _retrieval(random.Random(cfg.seed), cfg, min(s for _, s in cfg.curriculum))


def make_row(cfg: DataConfig, step: int, row: int, S: int) -> tuple[list[int], list[int], str, list[int]]:
    """S + 1 token ids, their kinds (the kind of token i is that of target i - 1), the task, and the
    positions of the needle's value bytes in the prompt (retrieval rows; else empty)."""
    rng = random.Random(f"{cfg.seed}:{step}:{row}")
    u = rng.random()
    if u < cfg.copy_fraction:
        return (
            _copy_row(rng, S + 1, cfg.copy_hex_fraction, cfg.copy_upper_fraction, cfg.copy_pairs_fraction),
            [LM] * (S + 1),
            "copy",
            [],
        )
    needle: list[int] = []
    if u - cfg.copy_fraction < cfg.text_fraction:
        ids: list[int] = []
        kinds: list[int] = []
        task = "text"
    else:
        ids, kinds, task, needle = _retrieval(rng, cfg, S)
        ids, kinds = ids[: S + 1], kinds[: S + 1]
        needle = [p for p in needle if p < S]
    need = S + 1 - len(ids)
    if need > 0:
        ids += list(_prose(rng, need))
        kinds += [LM] * need
    return ids, kinds, task, needle


def pose_positions(cfg: DataConfig, step: int, B: int, S: int) -> torch.Tensor:
    """Rotary position ids [B, S] (int64) for the rows of `step`: PoSE's positional skips.

    Each row independently, with probability `pose_prob` (when S < `pose_max`): `pose_chunks` - 1 cut
    points are drawn uniformly without replacement from 1..S-1, splitting the row into contiguous
    pieces that keep consecutive positions; a total skip K is drawn log-uniformly over 1..pose_max-S,
    K = min(pose_max - S, floor((pose_max - S + 1) ** u)) with u ~ U[0, 1) (so P(K >= k) ~ 1 -
    ln k / ln(pose_max - S + 1): near and far distances alike; with probability `pose_far` instead
    uniformly over 1..pose_max-S, so far ones are the rule), and split over the gaps between
    pieces at uniform cut points of 0..K (with more than two pieces a gap may be 0). Positions then
    increase strictly, start at 0 (rotary attention sees only differences, so an offset would change
    nothing) and end at S - 1 + K <= pose_max - 1. Other rows, and every row when S >= pose_max,
    are 0..S-1. The token order, and with it the causal mask and the top-k, is the row's own.

    A pure function of (cfg, step): its own random stream per row, so the rows' tokens are the same
    with or without skips and DataLoader workers draw the same positions as the main process.
    """
    pos = torch.arange(S, dtype=torch.int64).repeat(B, 1)
    budget = cfg.pose_max - S
    if budget <= 0 or cfg.pose_prob <= 0:
        return pos
    for b in range(B):
        rng = random.Random(f"{cfg.seed}:{step}:{b}:pose")
        if rng.random() >= cfg.pose_prob:
            continue
        cuts = sorted(rng.sample(range(1, S), min(cfg.pose_chunks, S) - 1))
        if cfg.pose_far > 0 and rng.random() < cfg.pose_far:
            total = rng.randint(1, budget)
        else:
            total = min(budget, math.floor((budget + 1) ** rng.random()))
        split = sorted(rng.randint(0, total) for _ in range(len(cuts) - 1))
        gaps = [hi - lo for lo, hi in zip([0, *split], [*split, total])]
        for at, gap in zip(cuts, gaps):
            pos[b, at:] += gap
    return pos


def make_batch(cfg: DataConfig, step: int) -> Batch:
    """The batch of `step`: [batch_size(step), seq_len(step)], deterministic in (cfg, step)."""
    S, B = cfg.seq_len(step), cfg.batch_size(step)
    rows = [make_row(cfg, step, r, S) for r in range(B)]
    full = torch.tensor([r[0] for r in rows], dtype=torch.int64)  # [B, S + 1]
    kinds = torch.tensor([r[1] for r in rows], dtype=torch.uint8)
    kind = kinds[:, 1:].contiguous()  # the kind of a target is that of the token it predicts
    needle = torch.zeros(B, S, dtype=torch.bool)
    for b, r in enumerate(rows):
        needle[b, r[3]] = True
    positions = pose_positions(cfg, step, B, S) if cfg.pose_max > 0 else None
    return Batch(
        full[:, :-1].contiguous(),
        full[:, 1:].contiguous(),
        kind,
        step,
        [r[2] for r in rows],
        needle,
        positions,
    )


class BatchDataset(torch.utils.data.Dataset):
    """Steps [start, stop) as a map-style dataset, so DataLoader workers build batches in parallel."""

    def __init__(self, cfg: DataConfig, start: int, stop: int) -> None:
        self.cfg, self.start, self.stop = cfg, start, stop

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __getitem__(self, i: int) -> Batch:
        return make_batch(self.cfg, self.start + i)


def collate(b: Batch) -> Batch:
    return b
