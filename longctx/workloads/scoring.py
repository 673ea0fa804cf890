"""RULER's scoring: string_match_all / string_match_part and the effective length.

Both metrics are case-insensitive substring tests of each reference answer in the prediction,
reported in percent:
- string_match_all (retrieval, vt, cwe, fwe): per sample, the fraction of references found;
- string_match_part (qa): per sample, 1 if any reference is found.
A prediction is first stripped and its control characters turned into newlines, as RULER does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

# RULER's threshold: Llama-2-7B's average score at 4K. A length is "effective" while the score
# stays above it.
EFFECTIVE_THRESHOLD = 85.6

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(pred: str) -> str:
    """Strip, and turn control characters (tabs, newlines, NULs, ...) into newlines."""
    return _CONTROL.sub("\n", pred.strip()).strip()


def sample_match_all(pred: str, refs: Sequence[str]) -> float:
    """Fraction of `refs` that occur in `pred` (case-insensitive), in [0, 1]."""
    p = postprocess(pred).lower()
    return sum(r.lower() in p for r in refs) / len(refs) if refs else 0.0


def sample_match_part(pred: str, refs: Sequence[str]) -> float:
    """1.0 if any of `refs` occurs in `pred` (case-insensitive), else 0.0."""
    p = postprocess(pred).lower()
    return float(any(r.lower() in p for r in refs))


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over samples of the fraction of references found, in percent (2 decimals)."""
    if not preds:
        return 0.0
    return round(100 * sum(sample_match_all(p, r) for p, r in zip(preds, refs)) / len(preds), 2)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Percent of samples where at least one reference is found (2 decimals)."""
    if not preds:
        return 0.0
    return round(100 * sum(sample_match_part(p, r) for p, r in zip(preds, refs)) / len(preds), 2)


METRICS = {"all": sample_match_all, "part": sample_match_part}


def effective_length(scores: Mapping[int, float], threshold: float = EFFECTIVE_THRESHOLD) -> int | None:
    """The longest tested length up to which every score is above `threshold`, or None.

    RULER reads the effective length off a score-vs-length table as the last length before the
    score falls to the threshold; a later recovery (a noisy long length scoring high again)
    does not extend it.
    """
    best = None
    for length in sorted(scores):
        if scores[length] > threshold:
            best = length
        else:
            break
    return best
