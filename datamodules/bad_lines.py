"""The bad-line policy: skip and count per file, or stop with file:line and the text; and the
bad-file policy: a file that cannot be read to its end stops the run, or is cut there."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

BadLinePolicy = Literal["skip", "raise"]
BadFilePolicy = Literal["fail", "skip"]
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


def unreadable_reason(record: int, error: str) -> str:
    """Where and why a file breaks off: ``record`` is the first record (1-based, header
    lines not counted) that could not be read."""
    return f"unreadable from record {record} on ({error})"


class UnreadableFileError(BadLineError):
    """A file that cannot be read to its end: a truncated or corrupt compressed stream, a
    damaged Parquet page, an I/O error. Raised under ``bad_files="fail"`` (the default),
    naming the file and the first record that could not be read.

    ``UnreadableFileError(message)`` alone is the whole message, as for :class:`BadLineError`.
    """

    def __init__(self, path: str, record: int | None = None, error: str | None = None) -> None:
        if record is None or error is None:
            super().__init__(path)
        else:
            super().__init__(path, None, f"{unreadable_reason(record, error)}; bad_files='skip' would use its "
                                         f"first {record - 1} records and skip the rest")
        self.record = record


@dataclass
class BadLineLog:
    """Counts of skipped lines per file, and the first few examples, for one reader; and
    the files it cut short under ``bad_files="skip"`` (see :meth:`record_unreadable`).

    Example::

        log = BadLineLog()
        log.record("day_0.tsv", 17, "invalid hex in C3", b"0\\t...")
        log.counts   # Counter({'day_0.tsv': 1})
    """

    counts: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    shipped: Counter[str] = field(default_factory=Counter)  # already reported to the main process
    # Files that broke off while being read -> the first record not read (1-based): each is
    # one bad file, not a bad line, whatever it held after the break.
    unreadable: dict[str, int] = field(default_factory=dict)
    unreadable_shipped: set[str] = field(default_factory=set)

    def record(self, path: str, line: int | None, reason: str, text: bytes | str | None = None) -> None:
        self.counts[path] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(str(BadLineError(path, line, reason, text)))

    def record_unreadable(self, path: str, record: int) -> None:
        self.unreadable[path] = min(record, self.unreadable.get(path, record))

    def unshipped_unreadable(self) -> tuple[tuple[str, int], ...]:
        """Files cut short since the last call, with their first record not read."""
        new = tuple(sorted((p, r) for p, r in self.unreadable.items() if p not in self.unreadable_shipped))
        self.unreadable_shipped.update(p for p, _ in new)
        return new

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
