"""Fit a generated prompt to a token budget.

Every task generator is a function of one size parameter n (haystack pieces, distinct words,
coded words, ...) whose token count grows with n. `fit_size` finds an n whose exact token count
lands in [lower, budget] with few exact counts: a cheap monotone `estimate(n)` (prefix sums of
per-piece counts, or just n) is mapped to tokens by a line through the last two exact
measurements (secant), and the answer is kept inside a bracket of sizes known to fit / overflow
so the search always terminates (falling back to bisection). A million-token prompt takes 2-4
exact counts.
"""

from __future__ import annotations

from collections.abc import Callable

from longctx.errors import LongctxError


class LengthError(LongctxError):
    """A target length the task cannot be generated at (too short for its fixed text)."""


def _largest_n(estimate: Callable[[int], float], a: float, b: float, aim: float, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with a * estimate(n) + b <= aim (estimate is nondecreasing).

    Gallops up from lo first, so an estimate backed by a lazily grown stream is never asked
    about sizes far past the answer.
    """
    if a * estimate(lo) + b > aim:
        return lo
    step = 1
    while lo + step <= hi and a * estimate(lo + step) + b <= aim:
        lo += step
        step *= 2
    hi = min(hi, lo + step - 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a * estimate(mid) + b <= aim:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fit_size(
    measure: Callable[[int], int],
    estimate: Callable[[int], float],
    budget: int,
    lower: int,
    min_n: int = 0,
    max_n: int = 1 << 40,
    hint: int | None = None,
    what: str = "prompt",
) -> int:
    """The n whose `measure(n)` (exact tokens) is in [lower, budget], or the largest that fits.

    `estimate` must be nondecreasing in n. `hint` is tried first (a previous sample's answer).
    Raises LengthError when even `min_n` does not fit in `budget`.
    """
    seen: dict[int, int] = {}

    def m(n: int) -> int:
        if n not in seen:
            seen[n] = measure(n)
        return seen[n]

    fits, over = min_n, None  # bracket: measure(fits) <= budget < measure(over)
    t0 = m(min_n)
    if t0 > budget:
        raise LengthError(f"{what} needs {t0} tokens even with the smallest haystack; budget is {budget}")
    if t0 >= lower:
        return min_n
    points = [(estimate(min_n), t0)]
    aim = budget - 0.25 * (budget - lower)
    n = hint if hint is not None and min_n < hint <= max_n else None
    for _ in range(64):
        if n is None:
            (e1, t1) = points[-1]
            if len(points) >= 2 and points[-2][0] != e1:
                e0, t0_ = points[-2]
                a = (t1 - t0_) / (e1 - e0)
            else:
                a = t1 / e1 if e1 > 0 else 1.0
            a = max(a, 1e-9)
            b = t1 - a * e1
            hi = (over - 1) if over is not None else max_n
            n = _largest_n(estimate, a, b, aim, fits, hi)
            if n <= fits or (over is not None and n >= over):
                n = fits + 1 if over is None else (fits + over) // 2
            if over is not None and n <= fits:
                return fits
        n = min(n, max_n)
        t = m(n)
        if lower <= t <= budget:
            return n
        if t <= budget:
            fits = max(fits, n)
        else:
            over = n if over is None else min(over, n)
        if over is not None and over - fits <= 1:
            return fits
        if n == max_n and t <= budget:
            return n  # the generator cannot grow any further
        points.append((estimate(n), t))
        n = None
    return fits
