"""Regular expressions from adapter_config.json, matched under one time bound.

An uploaded config is untrusted, and a catastrophic pattern (`(a+)+$`) backtracks for
ages on a long module name. Python's `re` cannot be interrupted, so patterns run in the
`regex` package (compatible with `re` for the syntax PEFT configs use) with a timeout taken
from one budget shared by every match of one config: the base model's module list is
finite, so resolving a config is a bounded amount of work or it is refused.
"""
from __future__ import annotations

import math
import re
import time

import regex

from .errors import AdapterPatternTimeoutError, AdapterValidationError

PATTERN_BUDGET_S = 1.0
# Compiling is not covered by the timeout, and `regex` expands counted repeats while
# compiling: `(a{10000}){10000}` compiles for minutes. Module-name patterns are short and
# rarely count, so both are capped before compiling.
MAX_PATTERN_CHARS = 1024
MAX_REPEAT_PRODUCT = 1000
_COUNTED_REPEAT = re.compile(r"\{(\d*),?(\d*)\}")


class PatternMatcher:
    """Matches config patterns until `budget_s` seconds of wall time are spent in total."""

    def __init__(self, budget_s: float = PATTERN_BUDGET_S) -> None:
        self.budget_s = budget_s
        self._deadline = time.monotonic() + budget_s
        self._compiled: dict[str, regex.Pattern[str]] = {}

    def check(self, pattern: object, field: str) -> str:
        """`pattern` itself when it is a valid regular expression; else a validation error."""
        if not isinstance(pattern, str):
            raise AdapterValidationError(f"{field} entries must be strings, not {pattern!r}")
        self._compile(pattern, pattern, field)
        return pattern

    def fullmatch(self, pattern: str, text: str, field: str) -> bool:
        return self._run(pattern, pattern, text, field, full=True) is not None

    def match(self, source: str, text: str, field: str, *, shown: str) -> regex.Match[str] | None:
        """`regex.match(source, text)`; `shown` is the config's own pattern, which errors name
        (`source` may wrap it, as PEFT does)."""
        return self._run(source, shown, text, field, full=False)

    def _run(self, source: str, shown: str, text: str, field: str, *, full: bool) -> regex.Match[str] | None:
        compiled = self._compile(source, shown, field)
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise AdapterPatternTimeoutError(shown, field, self.budget_s)
        try:
            return compiled.fullmatch(text, timeout=left) if full else compiled.match(text, timeout=left)
        except TimeoutError:
            raise AdapterPatternTimeoutError(shown, field, self.budget_s) from None

    def _compile(self, source: str, shown: str, field: str) -> regex.Pattern[str]:
        compiled = self._compiled.get(source)
        if compiled is None:
            _check_size(shown, field)
            try:
                compiled = regex.compile(source)
            except (regex.error, ValueError, OverflowError, RecursionError) as e:
                raise AdapterValidationError(
                    f"{field} pattern {shown!r} is not a valid regular expression: {e}"
                ) from None
            self._compiled[source] = compiled
        return compiled


def _check_size(pattern: str, field: str) -> None:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise AdapterValidationError(
            f"{field} pattern {pattern[:64]!r}... is {len(pattern)} characters long; at most "
            f"{MAX_PATTERN_CHARS} are accepted"
        )
    # An over-estimate (sequential repeats multiply too), which no module-name pattern reaches.
    counts = [max(int(a or 0), int(b or 0), 1) for a, b in _COUNTED_REPEAT.findall(pattern)]
    if math.prod(counts) > MAX_REPEAT_PRODUCT:
        raise AdapterValidationError(
            f"{field} pattern {pattern!r} repeats too much (its counted repeats multiply to more than "
            f"{MAX_REPEAT_PRODUCT}); list the module names instead"
        )
