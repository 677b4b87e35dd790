"""Loaded documents kept in memory: each loaded once however many callers want it, the latest few kept."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class _KeyLoad:
    """One key's load lock and how many callers hold or wait on it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    callers: int = 0


class LoadOnceCache(Generic[K, V]):
    """The `capacity` most recently used values, by key; `get_or_load` loads a missing key once.

    Callers that want the same missing key wait for one load (one lock per key, kept while any of them waits);
    other keys load in parallel. A failed load raises to its own caller; the next caller in line tries again.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._values: OrderedDict[K, V] = OrderedDict()
        self._loading: dict[K, _KeyLoad] = {}
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > self.capacity:
                self._values.popitem(last=False)

    def pop(self, key: K) -> V | None:
        with self._lock:
            return self._values.pop(key, None)

    def get_or_load(self, key: K, load: Callable[[], V]) -> V:
        value = self.get(key)
        if value is not None:
            return value
        with self._lock:
            loading = self._loading.setdefault(key, _KeyLoad())
            loading.callers += 1
        try:
            with loading.lock:
                value = self.get(key)
                if value is None:  # not loaded yet, or the load before this one failed
                    value = load()
                    self.put(key, value)
        finally:
            # Only the last caller lets the key's lock go: a newcomer while any wait must queue behind them.
            with self._lock:
                loading.callers -= 1
                if loading.callers == 0:
                    del self._loading[key]
        return value
