"""Every environment variable the package reads: one frozen :class:`Settings`,
read and checked once per process (:func:`current`), then handed to what uses
it. :data:`VARIABLES` is the table of variables, their bounds and defaults
(``docs/configuration.md``); a value outside them, or a name with the
package's prefix that is none of them (a misspelling), raises
:class:`~sglang_mxfp8_hicache.errors.BlockScaledHiCacheConfigError` with one
line naming the variable and what it should be.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError

logger = logging.getLogger(__name__)

PREFIX = "SGLANG_MXFP8_HICACHE_"
_SWITCH = dict.fromkeys(("1", "true", "yes", "on"), True)
_SWITCH.update(dict.fromkeys(("0", "false", "no", "off"), False))


def _default_seal_threads() -> int:
    return min(4, len(os.sched_getaffinity(0)))


def _switch(text: str) -> bool | None:
    return _SWITCH.get(text.lower())


def _whole(low: int, high: int) -> Callable[[str], int | None]:
    def parse(text: str) -> int | None:
        if not (text.isascii() and text.isdigit()):
            return None
        value = int(text)
        return value if low <= value <= high else None

    return parse


@dataclass(frozen=True)
class Variable:
    """One environment variable: the setting it fills, how its text parses
    (None: not accepted), what it accepts, in words, and its default."""

    setting: str
    parse: Callable[[str], object | None]
    accepts: str
    default: Callable[[], object]

    @property
    def name(self) -> str:
        return PREFIX + self.setting.upper()


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "disable", _switch, "1, true, yes, on or 0, false, no, off", lambda: False
    ),
    Variable(
        "staging_mb", _whole(0, 1 << 16), "a whole number of MiB, 0-65536", lambda: 512
    ),
    Variable(
        "seal_threads", _whole(1, 256), "a whole number, 1-256", _default_seal_threads
    ),
    Variable(
        "l3_chunk_pages", _whole(0, 1 << 16), "a whole number, 0-65536", lambda: 0
    ),
)
"""Every variable the package reads, in one table (``docs/configuration.md``)."""


@dataclass(frozen=True)
class Settings:
    """What the operator set, checked. Built from the environment by
    :meth:`from_environ`; defaults are :data:`VARIABLES`' defaults."""

    disable: bool
    """Register no hook: SGLang picks its own host pool."""
    staging_mb: int
    """Device staging per GPU, both directions, in MiB (0: none)."""
    seal_threads: int
    """Threads a sealed L3 batch's parts are sealed and checked on."""
    l3_chunk_pages: int
    """Pages of a sealed L3 batch's smallest chunk (0: one call per batch)."""

    @property
    def staging_bytes(self) -> int:
        return self.staging_mb << 20

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings of ``environ`` (the process's by default); raises on
        the first variable whose value it does not accept, then (unless the
        package is disabled) on a name with its prefix that no variable has."""
        environ = os.environ if environ is None else environ
        values = {}
        for variable in VARIABLES:
            text = environ.get(variable.name, "").strip()
            value = variable.parse(text) if text else variable.default()
            if value is None:
                raise BlockScaledHiCacheConfigError(
                    f"{variable.name}={text!r} is not accepted: give "
                    f"{variable.accepts}, or leave it unset."
                )
            values[variable.setting] = value
        if not values["disable"]:  # disabled, the package reads nothing more
            refuse_unknown_names(environ)
        return cls(**values)

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


def refuse_unknown_names(environ: Mapping[str, str]) -> None:
    """Raises on the first name (sorted) with :data:`PREFIX`, in any case, that
    is no variable's (a misspelt setting stays at its default, silently),
    naming the closest variable."""
    names = [variable.name for variable in VARIABLES]
    for name in sorted(environ):
        if name.upper().startswith(PREFIX) and name not in names:
            [closest] = difflib.get_close_matches(name.upper(), names, 1, cutoff=0)
            raise BlockScaledHiCacheConfigError(
                f"{name} is not a variable sglang-mxfp8-hicache reads: did you "
                f"mean {closest}? Rename or unset it."
            )


@functools.cache
def current() -> Settings:
    """The process's settings, read from its environment once and logged once."""
    settings = Settings.from_environ()
    logger.info("sglang-mxfp8-hicache settings: %s.", settings.describe())
    return settings
