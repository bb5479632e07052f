"""Telling one ad-log layout from another by a file's first bytes, for error messages."""

from __future__ import annotations

from ctr_lightning.datamodules.criteo_schema import NUM_FIELDS

# The DataModule that reads each layout, by the name of its format class.
_READER = {"CriteoFormat": "CriteoDataModule", "AvazuFormat": "AvazuDataModule", "ParquetFormat": "ParquetDataModule"}


def sniff_layout(head: bytes) -> tuple[str, str] | None:
    """``(format class, what was seen)`` of a known layout these bytes begin, else None."""
    if head.startswith(b"PAR1"):
        return "ParquetFormat", "the Parquet magic bytes PAR1"
    first = head.split(b"\n", 1)[0].rstrip(b"\r")
    if first.startswith(b"id,click,hour"):
        return "AvazuFormat", "the Avazu CSV header id,click,hour,..."
    if first.count(b"\t") == NUM_FIELDS - 1 and first[:1] in (b"0", b"1"):
        return "CriteoFormat", f"{NUM_FIELDS} tab-separated fields starting with a 0/1 label (Criteo TSV)"
    return None


def format_hint(head: bytes, format_class: str) -> str:
    """A sentence naming the DataModule for a file that looks like another layout than
    ``format_class`` reads; empty when it does not look like a known one."""
    if head[:2] == b"\x1f\x8b":
        return "The file is gzip-compressed but its name does not end in .gz."
    seen = sniff_layout(head)
    if seen is None:
        return delimited_hint(head) if format_class in _FIXED_TEXT_LAYOUTS else ""
    if seen[0] == format_class:
        return ""
    return f"The file begins with {seen[1]}: read it with {_READER[seen[0]]}."


# Readers of one fixed text layout, whose unknown files another delimited reader may read.
_FIXED_TEXT_LAYOUTS = ("CriteoFormat", "AvazuFormat")


def delimited_hint(head: bytes) -> str:
    """A sentence naming DelimitedDataModule for text of no known layout, with the width
    and delimiter of its first line; empty when no delimiter is seen there."""
    first = head.split(b"\n", 1)[0].rstrip(b"\r")
    count, delimiter = max((first.count(d), d) for d in (b",", b"\t", b";", b"|"))
    if not count:
        return ""
    return (f"Read it with DelimitedDataModule (its first line has {count + 1} fields separated by "
            f"{delimiter.decode()!r}).")
