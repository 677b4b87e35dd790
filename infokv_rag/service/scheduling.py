"""A fair (FIFO), reentrant model lock: threads take turns with the model instead of racing for it.

The engine takes `engine.lock` around every forward pass: per prefill chunk while a document is read,
per decoding step while an answer is generated. A plain lock is not fair (the releasing thread often
re-acquires it at once), so a long prefill could starve answers, or a stream of answers an upload.
`FairLock` hands the lock to the longest-waiting thread on release. The model worker builds its time
slices on top (see `ModelWorker._decode_loop`): the decoding thread keeps the lock for about as long as
the last prefill chunk took, then hands it back, so both get about half of the model's time while both
have work, and an answer waits at most one prefill chunk at a time.
"""

from __future__ import annotations

import threading
import time
from collections import deque


class FairLock:
    """Reentrant lock granted in arrival order (drop-in for `threading.RLock` in `with` blocks)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._held_since = 0.0
        self._waiters: deque[tuple[int, threading.Lock]] = deque()
        self.last_hold: dict[int, float] = {}
        """Seconds each thread (by ident) held the lock the last time, for time slicing."""
        self.total_hold: dict[int, float] = {}
        """Seconds each thread held the lock in all, for tests and diagnostics."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if timeout != -1:
            raise ValueError("FairLock does not support timeouts")
        me = threading.get_ident()
        with self._mutex:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None and not self._waiters:
                self._grant(me)
                return True
            if not blocking:
                return False
            gate = threading.Lock()
            gate.acquire()
            self._waiters.append((me, gate))
        gate.acquire()  # released by the thread that handed us the lock
        return True

    def _grant(self, ident: int) -> None:
        self._owner, self._depth = ident, 1
        self._held_since = time.perf_counter()

    def release(self) -> None:
        me = threading.get_ident()
        with self._mutex:
            if self._owner != me:
                raise RuntimeError("cannot release a FairLock held by another thread")
            self._depth -= 1
            if self._depth:
                return
            held = time.perf_counter() - self._held_since
            self.last_hold[me] = held
            self.total_hold[me] = self.total_hold.get(me, 0.0) + held
            self._owner = None
            if self._waiters:
                ident, gate = self._waiters.popleft()
                self._grant(ident)
                gate.release()

    @property
    def waiting(self) -> int:
        """Threads waiting for the lock."""
        with self._mutex:
            return len(self._waiters)

    def others_last_hold(self) -> float:
        """The longest last hold of the threads now waiting (how long they will keep the lock next)."""
        with self._mutex:
            return max((self.last_hold.get(ident, 0.0) for ident, _ in self._waiters), default=0.0)

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
