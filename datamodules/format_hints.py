"""Telling one ad-log layout from another by a file's first bytes, for error messages."""

from __future__ import annotations

from ctr_lightning.datamodules.avazu_schema import AVAZU_COLUMNS, AVAZU_HEADERS, AVAZU_TEST_COLUMNS
from ctr_lightning.datamodules.criteo_schema import NUM_FIELDS

# The DataModule that reads each layout, by the name of its format class.
_READER = {"CriteoFormat": "CriteoDataModule", "AvazuFormat": "AvazuDataModule", "ParquetFormat": "ParquetDataModule"}


def sniff_layout(head: bytes) -> tuple[str, str] | None:
    """``(format class, what was seen)`` of a known layout these bytes begin, else None."""
    if head.startswith(b"PAR1"):
        return "ParquetFormat", "the Parquet magic bytes PAR1"
    first = head.split(b"\n", 1)[0].rstrip(b"\r")
    header = AVAZU_HEADERS.get(first)
    if header == AVAZU_COLUMNS or first.startswith(b"id,click,hour"):
        return "AvazuFormat", "the Avazu CSV header id,click,hour,..."
    if header == AVAZU_TEST_COLUMNS:
        return "AvazuFormat", "the Avazu CSV header of its test file id,hour,C1,... (no click: predict only)"
    # Header-less Avazu: the width alone would name any CSV of 24 columns, so the values
    # of the click and hour columns must fit too.
    fields = first.split(b",")
    if len(fields) == len(AVAZU_COLUMNS) and fields[1] in (b"0", b"1") and _is_hour(fields[2]):
        return "AvazuFormat", (f"a header-less Avazu CSV line ({len(AVAZU_COLUMNS)} fields, a 0/1 click, a YYMMDDHH "
                               f"hour)")
    if len(fields) == len(AVAZU_TEST_COLUMNS) and _is_hour(fields[1]):
        return "AvazuFormat", (f"a header-less Avazu CSV line of its test layout ({len(AVAZU_TEST_COLUMNS)} fields, no "
                               f"click, a YYMMDDHH hour: predict only)")
    tabs = first.count(b"\t")
    if tabs == NUM_FIELDS - 1 and first[:1] in (b"0", b"1"):
        return "CriteoFormat", f"{NUM_FIELDS} tab-separated fields starting with a 0/1 label (Criteo TSV)"
    if tabs == NUM_FIELDS - 2:
        return "CriteoFormat", (f"{NUM_FIELDS - 1} tab-separated fields (Criteo TSV without its label, as Kaggle's "
                                f"test.txt: predict only)")
    return None


def format_hint(head: bytes, format_class: str) -> str:
    """A sentence naming the DataModule for a file that looks like another layout than
    ``format_class`` reads, or like none of them (``DelimitedDataModule``, with the width
    and delimiter of its first line); empty when it is that layout, or not text."""
    if head[:2] == b"\x1f\x8b":
        return "The file is gzip-compressed but its name does not end in .gz."
    seen = sniff_layout(head)
    if seen is None:
        # The delimited reader itself reads any text: only the fixed layouts' readers point to it.
        return "" if format_class == "DelimitedFormat" else _delimited_hint(head)
    if seen[0] == format_class:
        return ""
    return f"The file begins with {seen[1]}: read it with {_READER[seen[0]]}."


_DELIMITERS = {b",": "comma", b"\t": "tab", b";": "semicolon", b"|": "pipe"}


def _delimited_hint(head: bytes) -> str:
    if not head or b"\0" in head:
        return ""  # empty, or binary: no delimited reader fits either
    first = head.split(b"\n", 1)[0].rstrip(b"\r")
    count, delimiter = max((first.count(d), d) for d in _DELIMITERS)
    if count:
        width = f"its first line has {count + 1} {_DELIMITERS[delimiter]}-separated fields"
    else:
        width = "its first line has no comma, tab, semicolon or pipe"
    return f"The file is none of the Criteo, Avazu or Parquet layouts: read it with DelimitedDataModule ({width})."


def _is_hour(value: bytes) -> bool:
    return len(value) == 8 and value.isdigit()
