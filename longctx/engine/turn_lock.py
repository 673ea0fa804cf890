"""`TurnLock`: the engine's lock, reentrant and fair to the threads waiting for it.

One thread at a time steps the engine (the scheduler, the stages, the launched step), holding the lock
for a step, not for a whole call. A plain lock released by a thread that steps in a loop went back to
that thread far more often than to one waiting to be woken; `give_way` after each step hands it over.
"""

from __future__ import annotations

import threading


class TurnLock:
    """A reentrant lock whose holder, having stepped and released it, lets the threads waiting for it take
    it before it steps again (`give_way`). A released lock goes back to the thread that released it far
    more often than to one waiting to be woken, so a thread stepping in a loop (a long `generate`,
    AsyncEngine's driver) kept another thread's call from adding its requests, or reading outputs its
    steps had made, for hundreds of steps."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._turn = threading.Condition(threading.Lock())
        self._waiting = 0  # threads blocked in acquire
        self._owner: int | None = None
        self._depth = 0

    def acquire(self) -> bool:
        if not self._lock.acquire(blocking=False):
            with self._turn:
                self._waiting += 1
            try:
                self._lock.acquire()
            finally:
                with self._turn:
                    self._waiting -= 1
                    self._turn.notify_all()
        self._owner = threading.get_ident()
        self._depth += 1
        return True

    def release(self) -> None:
        self._depth -= 1
        if not self._depth:
            self._owner = None
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def give_way(self, timeout: float = 0.005) -> None:
        """Wait (at most `timeout` seconds) until the threads waiting for the lock have taken it; nothing
        to wait for while this thread still holds it (`pin_document` steps holding it throughout)."""
        if self._waiting and self._owner != threading.get_ident():
            with self._turn:
                self._turn.wait_for(lambda: not self._waiting, timeout)
