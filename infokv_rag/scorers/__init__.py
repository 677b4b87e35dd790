"""The compression methods, one module each, named after the method it declares as `METHOD`.

Adding a method is adding a module here (and its entry in tests/test_scorers.py): the command line,
the service, the benchmarks and the README's table all list `method_names()`. Method modules import
torch, so they are imported on first use: listing the names imports none of them.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from .base import Method

_HELPERS = frozenset({"base"})


@functools.cache
def method_names() -> tuple[str, ...]:
    """Every registered method, sorted by name."""
    found = (module.name for module in pkgutil.iter_modules(__path__))
    return tuple(sorted(name for name in found if name not in _HELPERS and not name.startswith("_")))


def method(name: object) -> Method[Any]:
    """The method registered as `name`; `ConfigError` names the choices when there is none (also for a name that is
    no string, which the cache below could not even hash; a long one is cut in the message, which servers answer)."""
    if not isinstance(name, str) or name not in method_names():
        shown = name[:40] if isinstance(name, str) else name
        raise ConfigError(f"unknown method {shown!r}; choose one of {', '.join(method_names())}")
    return _declared(name)


@functools.cache
def _declared(name: str) -> Method[Any]:
    declared: Method[Any] = importlib.import_module(f"{__name__}.{name}").METHOD
    if declared.name != name:
        raise ConfigError(
            f"module {__name__}.{name} declares method {declared.name!r}; a method's module bears its name"
        )
    return declared
