"""A model exported for serving, read back: a full export, or a chain of a full export (the
base) and the deltas written after it, applied in order. numpy and pyarrow only: a serving
host needs no torch.

``ctr-lightning export`` (and the :class:`~ctr_lightning.callbacks.ServingExport` callback)
writes an export directory: ``export.json``, ``dense.safetensors`` and Parquet files of
rows (``table``, ``id``, ``vector``; ``last_seen`` in tables that record each row's last
lookup step). A delta's ``export.json`` names the export it follows (``since``: a path
relative to it and the SHA-256 of that export's ``export.json``) and holds only the rows
changed since, plus a floor per table: rows last looked up before it are deleted (the
tombstone of every row that expired since). Every file's SHA-256 is checked on reading.

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

FORMAT = "ctr-lightning-export-1"
EXPORT_JSON = "export.json"


@dataclass
class ServingTable:
    """One table's stored rows: ``ids`` (ascending), ``vectors`` ``[n, dim]`` float32 and,
    where the table records it, each row's ``last_seen`` training step. Ids stored nowhere
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

    def apply(self, ids: np.ndarray, vectors: np.ndarray, last_seen: np.ndarray | None) -> None:
        """Rows of a delta: new ids added, known ones replaced."""
        all_ids = np.concatenate([self.ids, ids])
        order = np.argsort(all_ids, kind="stable")  # a delta's row after the row it replaces
        ordered = all_ids[order]
        newest = order[np.append(ordered[1:] != ordered[:-1], True)]
        self.ids = all_ids[newest]
        self.vectors = np.concatenate([self.vectors.reshape(-1, self.dim), vectors])[newest]
        if last_seen is not None and self.last_seen is not None:
            self.last_seen = np.concatenate([self.last_seen, last_seen])[newest]

    def delete_below(self, floor: int) -> None:
        """Rows last looked up before ``floor`` are gone (they expired)."""
        if self.last_seen is None:
            return
        keep = self.last_seen >= floor
        self.ids, self.vectors, self.last_seen = self.ids[keep], self.vectors[keep], self.last_seen[keep]


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
    if description.get("format") != FORMAT:
        raise ValueError(f"{path}: format {description.get('format')!r}, this reader reads {FORMAT!r}")
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
            if full or name not in tables:
                tables[name] = ServingTable(name, int(table["dim"]), table.get("unstored", "initial"),
                                            vectors=np.empty((0, int(table["dim"])), dtype=np.float32),
                                            last_seen=np.empty(0, dtype=np.int64) if stamped else None)
            for part in table["files"]:
                ids, vectors, last_seen = _read_rows(export / part["path"], int(table["dim"]), stamped,
                                                     part["sha256"] if verify else None)
                tables[name].apply(ids, vectors, last_seen)
            if stamped:
                tables[name].delete_below(int(table["floor"]))
    if verify:
        dense = chain[-1] / description["dense"]["path"]
        if file_sha256(dense) != description["dense"]["sha256"]:
            raise ValueError(f"{dense}: its SHA-256 is not the one {EXPORT_JSON} holds (damaged or replaced)")
    return ServingModel(description, chain, tables)


def _read_rows(path: Path, dim: int, stamped: bool, sha256: str | None) -> tuple[np.ndarray, np.ndarray,
                                                                                  np.ndarray | None]:
    if sha256 is not None and file_sha256(path) != sha256:
        raise ValueError(f"{path}: its SHA-256 is not the one {EXPORT_JSON} holds (damaged or replaced)")
    data = pq.read_table(path, columns=["id", "vector", *(["last_seen"] if stamped else [])])
    ids = data.column("id").to_numpy().astype(np.int64, copy=False)
    flat = data.column("vector").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    vectors = np.asarray(flat, dtype=np.float32).reshape(len(ids), dim)
    last_seen = data.column("last_seen").to_numpy().astype(np.int64, copy=False) if stamped else None
    return ids, vectors, last_seen
