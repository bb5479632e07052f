"""A model exported for serving, read back: a full export, or a chain of a full export (the
base) and the deltas written after it, applied in order. numpy and pyarrow only: a serving
host needs no torch.

``ctr-lightning export`` (and the :class:`~ctr_lightning.callbacks.ServingExport` callback)
writes an export directory: ``export.json``, ``dense.safetensors`` and Parquet files of
rows (``table``, ``id``, ``vector``; ``last_seen`` in tables that record each row's last
lookup step; ``score_bucket`` in tables kept by a score, ``Expiry(max_rows, score=...)``).
A delta's ``export.json`` names the export it follows (``since``: a path relative to it and
the SHA-256 of that export's ``export.json``) and holds only the rows changed since, plus a
floor per table on the column its ``ranked_by`` names (``last_seen``, or ``score_bucket``):
after the delta's rows are applied, rows under it are deleted (the tombstone of every row
that expired or was evicted since). That is exact because a table's floor never falls and a
row's rank only rises while it lives: the rank the reader holds for a row gone since is under
the new floor (a row gone and back since comes anew in the delta). Every file's SHA-256 is checked on reading.

Example::

    from ctr_lightning.serving import read_export
    model = read_export("serving/000420")        # its deltas followed back to the base
    vectors, found = model.tables["t_C1"].lookup(ids)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from ctr_lightning.file_digest import file_sha256

FORMAT = "ctr-lightning-export-2"  # 2: tables kept by a score carry score_bucket, ranked_by
READABLE = ("ctr-lightning-export-1", FORMAT)
RANKS = ("last_seen", "score_bucket")  # what a table's floor applies to (export.json's ranked_by)
EXPORT_JSON = "export.json"


@dataclass
class ServingTable:
    """One table's stored rows: ``ids`` (ascending), ``vectors`` ``[n, dim]`` float32 and,
    where the table records it, each row's ``last_seen`` training step and, in a table kept
    by a score, its ``score_bucket`` (the rank its floor applies to). Ids stored nowhere
    read zeros or their initial row (``unstored``: ``"zeros"`` | ``"initial"``, see
    ``export.json``'s ``unstored_rows``).

    Example::

        vectors, found = table.lookup(np.array([7, 42]))
    """

    name: str
    dim: int
    unstored: str
    ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    vectors: np.ndarray = field(default_factory=lambda: np.empty((0, 0), dtype=np.float32))
    last_seen: np.ndarray | None = None
    score_bucket: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(vectors [n, dim], found)``: the stored rows of ``ids``, zeros where not stored."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.zeros((len(ids), self.dim), dtype=np.float32)
        if not len(self.ids):
            return out, np.zeros(len(ids), dtype=bool)
        pos = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        found = self.ids[pos] == ids
        out[found] = self.vectors[pos[found]]
        return out, found

    def apply(self, ids: np.ndarray, vectors: np.ndarray, last_seen: np.ndarray | None,
              score_bucket: np.ndarray | None = None) -> None:
        """Rows of a delta: new ids added, known ones replaced."""
        all_ids = np.concatenate([self.ids, ids])
        order = np.argsort(all_ids, kind="stable")  # a delta's row after the row it replaces
        ordered = all_ids[order]
        newest = order[np.append(ordered[1:] != ordered[:-1], True)]
        self.ids = all_ids[newest]
        self.vectors = np.concatenate([self.vectors.reshape(-1, self.dim), vectors])[newest]
        if last_seen is not None and self.last_seen is not None:
            self.last_seen = np.concatenate([self.last_seen, last_seen])[newest]
        if score_bucket is not None and self.score_bucket is not None:
            self.score_bucket = np.concatenate([self.score_bucket, score_bucket])[newest]

    def delete_below(self, floor: int, ranked_by: str = "last_seen") -> None:
        """Rows whose rank (``ranked_by``: last lookup step, or score bucket) is under
        ``floor`` are gone (expired, or evicted by the table's row cap)."""
        rank = self.score_bucket if ranked_by == "score_bucket" else self.last_seen
        if rank is None:
            return
        keep = rank >= floor
        self.ids, self.vectors = self.ids[keep], self.vectors[keep]
        if self.last_seen is not None:
            self.last_seen = self.last_seen[keep]
        if self.score_bucket is not None:
            self.score_bucket = self.score_bucket[keep]


@dataclass
class ServingModel:
    """An export read back: its ``tables``, the newest ``description`` (``export.json``),
    the ``chain`` of export directories applied (base first) and the dense part's file.

    Example::

        model = read_export("serving/000420")
        model.dense_path    # safetensors: every tensor of the model but the tables
    """

    description: dict[str, Any]
    chain: list[Path]
    tables: dict[str, ServingTable]

    @property
    def dense_path(self) -> Path:
        return self.chain[-1] / self.description["dense"]["path"]


def read_description(directory: str | os.PathLike) -> dict[str, Any]:
    """An export's ``export.json``, or an error naming the directory."""
    path = Path(directory) / EXPORT_JSON
    try:
        description = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{directory}: no {EXPORT_JSON} (not an export, or one cut short)") from None
    if description.get("format") not in READABLE:
        raise ValueError(f"{path}: format {description.get('format')!r}, this reader reads {READABLE}")
    return description


def export_chain(directory: str | os.PathLike) -> list[Path]:
    """The exports a directory's model is built from, base first: each delta's ``since``
    followed back to a full export, each link's ``export.json`` checked by its SHA-256."""
    chain = [Path(directory)]
    while True:
        since = read_description(chain[-1]).get("since")
        if since is None:
            return chain[::-1]
        parent = (chain[-1] / since["path"]).resolve()
        if not (parent / EXPORT_JSON).exists():
            raise FileNotFoundError(f"{chain[-1]}: the export it follows, {parent}, is gone")
        if file_sha256(parent / EXPORT_JSON) != since["sha256"]:
            raise ValueError(f"{chain[-1]}: the export it follows, {parent}, is not the one it was written after "
                             f"(its {EXPORT_JSON} changed)")
        if len(chain) > 100_000:
            raise ValueError(f"{directory}: the chain of exports does not end (a loop?)")
        chain.append(parent)


def read_export(directory: str | os.PathLike, verify: bool = True) -> ServingModel:
    """The model of an export directory: base and deltas applied in order (see the module).
    ``verify``: check every file's SHA-256 against ``export.json``."""
    chain = export_chain(directory)
    tables: dict[str, ServingTable] = {}
    description: dict[str, Any] = {}
    for export in chain:
        description = read_description(export)
        full = description.get("since") is None
        for name, table in description["tables"].items():
            stamped = table.get("floor") is not None
            ranked_by = table.get("ranked_by", "last_seen")  # format 1: always the last lookup step
            if ranked_by not in RANKS:
                raise ValueError(f"{export}: table {name!r} ranks its rows by {ranked_by!r}, this reader knows {RANKS}")
            scored = stamped and ranked_by == "score_bucket"
            if full or name not in tables:
                tables[name] = ServingTable(name, int(table["dim"]), table.get("unstored", "initial"),
                                            vectors=np.empty((0, int(table["dim"])), dtype=np.float32),
                                            last_seen=np.empty(0, dtype=np.int64) if stamped else None,
                                            score_bucket=np.empty(0, dtype=np.int64) if scored else None)
            elif scored != (tables[name].score_bucket is not None):
                # The rows before it carry another rank than its floor's: it could not delete them.
                raise ValueError(f"{export}: table {name!r} ranks its rows by {ranked_by if stamped else 'nothing'}, "
                                 f"the exports before it otherwise (an older version, or another Expiry); read a "
                                 f"full export")
            for part in table["files"]:
                ids, vectors, last_seen, buckets = _read_rows(export / part["path"], int(table["dim"]), stamped,
                                                              scored, part["sha256"] if verify else None)
                tables[name].apply(ids, vectors, last_seen, buckets)
            if stamped:
                tables[name].delete_below(int(table["floor"]), ranked_by)
    if verify:
        dense = chain[-1] / description["dense"]["path"]
        if file_sha256(dense) != description["dense"]["sha256"]:
            raise ValueError(f"{dense}: its SHA-256 is not the one {EXPORT_JSON} holds (damaged or replaced)")
    return ServingModel(description, chain, tables)


def _read_rows(path: Path, dim: int, stamped: bool, scored: bool, sha256: str | None) -> tuple[
        np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``(ids, vectors, last_seen, score_bucket)`` of one Parquet file (None: not read)."""
    if sha256 is not None and file_sha256(path) != sha256:
        raise ValueError(f"{path}: its SHA-256 is not the one {EXPORT_JSON} holds (damaged or replaced)")
    data = pq.read_table(path, columns=["id", "vector", *(["last_seen"] if stamped else []),
                                        *(["score_bucket"] if scored else [])])
    ids = data.column("id").to_numpy().astype(np.int64, copy=False)
    flat = data.column("vector").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    vectors = np.asarray(flat, dtype=np.float32).reshape(len(ids), dim)
    last_seen = data.column("last_seen").to_numpy().astype(np.int64, copy=False) if stamped else None
    buckets = data.column("score_bucket").to_numpy().astype(np.int64, copy=False) if scored else None
    return ids, vectors, last_seen, buckets
