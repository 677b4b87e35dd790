"""A fair, reentrant model lock: threads share the model's time in turns instead of racing for it.

The engine takes `engine.lock` around every forward pass: per prefill chunk while a document is read,
per decoding step while an answer is generated. A plain lock is not fair (the releasing thread often
re-acquires it at once), so a long prefill could starve answers or a stream of answers starve an upload.
`FairLock` hands the lock over by start-time fair queueing: each thread's virtual time grows by the
seconds it held the lock, and the waiting thread with the least virtual time goes next. With one
decoding thread and one prefill thread, each gets about half of the model's time while both are busy,
and a waiting answer is delayed by at most the one prefill chunk in progress.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class _Waiter:
    ident: int
    start: float
    arrival: int
    event: threading.Event = field(default_factory=threading.Event)


class FairLock:
    """Reentrant lock with fair hand-over between threads (drop-in for `threading.RLock` in `with`)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._held_since = 0.0
        self._owner_start = 0.0
        self._virtual = 0.0  # start tag of the holder: the system's virtual time
        self._finish: dict[int, float] = {}
        self._waiters: list[_Waiter] = []
        self._arrivals = 0
        self.held_seconds: dict[int, float] = {}
        """Seconds each thread (by ident) held the lock, for tests and diagnostics."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if timeout != -1:
            raise ValueError("FairLock does not support timeouts")
        me = threading.get_ident()
        with self._mutex:
            if self._owner == me:
                self._depth += 1
                return True
            start = max(self._finish.get(me, 0.0), self._virtual)
            if self._owner is None and not self._waiters:
                self._grant(me, start)
                return True
            if not blocking:
                return False
            self._arrivals += 1
            waiter = _Waiter(me, start, self._arrivals)
            self._waiters.append(waiter)
        waiter.event.wait()  # the releasing thread made us the owner before setting the event
        return True

    def _grant(self, ident: int, start: float) -> None:
        self._owner, self._depth = ident, 1
        self._owner_start = start
        self._virtual = max(self._virtual, start)
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
            self.held_seconds[me] = self.held_seconds.get(me, 0.0) + held
            self._finish[me] = self._owner_start + held
            self._owner = None
            if len(self._finish) > 256:  # forget threads that are gone
                alive = {t.ident for t in threading.enumerate()}
                self._finish = {k: v for k, v in self._finish.items() if k in alive}
            if self._waiters:
                nxt = min(self._waiters, key=lambda w: (w.start, w.arrival))
                self._waiters.remove(nxt)
                self._grant(nxt.ident, nxt.start)
                nxt.event.set()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
