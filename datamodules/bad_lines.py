"""The bad-line policy: skip and count per file, or stop with file:line and the text."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

BadLinePolicy = Literal["skip", "raise"]
MAX_EXAMPLES = 5


class BadLineError(ValueError):
    """A malformed record in an ad log, with the file, line and text that caused it.

    ``BadLineError(message)`` alone is the whole message (as a DataLoader worker's
    exception is rebuilt in the main process).
    """

    def __init__(self, path: str, line: int | None = None, reason: str | None = None,
                 text: bytes | str | None = None) -> None:
        where = f"{path}:{line}" if line is not None else path
        shown = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        message = where if reason is None else f"{where}: {reason}"
        if shown is not None:
            message += f": {shown[:200]!r}"
        super().__init__(message)
        self.path, self.line, self.reason, self.text = path, line, reason, shown


@dataclass
class BadLineLog:
    """Counts of skipped lines per file, and the first few examples, for one reader.

    Example::

        log = BadLineLog()
        log.record("day_0.tsv", 17, "invalid hex in C3", b"0\\t...")
        log.counts   # Counter({'day_0.tsv': 1})
    """

    counts: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    shipped: Counter[str] = field(default_factory=Counter)  # already reported to the main process

    def record(self, path: str, line: int | None, reason: str, text: bytes | str | None = None) -> None:
        self.counts[path] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(str(BadLineError(path, line, reason, text)))

    def unshipped(self) -> tuple[tuple[str, int], ...]:
        """Counts recorded since the last call, per file; they are then marked as reported."""
        delta = self.counts - self.shipped
        self.shipped.update(delta)
        return tuple(sorted(delta.items()))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summarise(self, who: str) -> None:
        if not self.counts:
            return
        per_file = ", ".join(f"{p}: {n}" for p, n in sorted(self.counts.items()))
        log.warning("%s skipped %d bad lines (%s); first: %s", who, self.total, per_file,
                    "; ".join(self.examples))
