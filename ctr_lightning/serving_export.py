"""A trained model for serving, from a Lightning checkpoint: tables as Parquet, the dense
part as safetensors, and ``export.json`` describing both.

Layout of ``out``::

    export.json                        format, model class and hyperparameters, tables, files
    dense.safetensors                  every tensor of the state dict but the tables
    tables/<table>/part-00000.parquet  columns table (string), id (int64), vector (float32[dim]),
                                       last_seen (int64) where the table records it, and
                                       score_bucket (int64) where a score keeps its rows

Only the weights of a row are exported (no optimizer state), each stored row once. Rows
never stored were never trained; their value in the trained model is its initial one,
``initial_rows(seed, table_key(table), id, dim, *range_bounds(low, high))`` from
:mod:`ctr_lightning.embedding.initializer`, ``[low, high]`` being the table's
``init_range`` (``export.json`` holds it and the seed per table; torchrec's default
``-+sqrt(1 / num_embeddings)`` unless the table's config set another), or whatever default a
server prefers; in a table that admits ids selectively (``"unstored": "zeros"``) a row stored
nowhere was never admitted and reads zeros. In a table with an
:class:`~ctr_lightning.embedding.Expiry`, a row gone is left out (it reads as one stored
nowhere), and each row's last lookup step is written: a delta export (``since``) holds only
the rows looked up since the export it follows, and each table's floor deletes the rows gone
since. The floor applies to the rank the model decides by (``ranked_by`` in ``export.json``):
the last lookup step, or, in a table kept by a score (``Expiry(max_rows, score=...)``), the
bucket of the score key stored after the stamp, written per row (a row's score changes only
when it is looked up, and so does its bucket). :mod:`ctr_lightning.serving` reads them
back. The rows stream from the checkpoint's table snapshot (or from its in-file
tables) a chunk at a time, so memory stays constant whatever the tables' size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import ctr_lightning  # noqa: F401 - registers the config classes a checkpoint may hold
from ctr_lightning.embedding.lifecycle.row_expiry import SCORE_WORDS, STAMP_WORDS, read_last_seen, score_bucket
from ctr_lightning.file_digest import file_sha256
from ctr_lightning.serving import EXPORT_JSON, FORMAT, RANKS, read_description
from ctr_lightning.embedding.snapshots.table_snapshot import MANIFEST, SnapshotManifest, read_snapshot_file, verify
from ctr_lightning.embedding.tiers.key_index import KeyIndex



def _table_chunks(extra: dict[str, Any], chunk_rows: int, beside: Path) -> tuple[
        dict[str, dict[str, int]], dict[str, int], Iterator[tuple[str, np.ndarray, torch.Tensor]]]:
    """The tables of one collection's extra state, their step counts and ``(table, ids,
    rows)`` chunks of them.
    A snapshot is looked for by name in ``beside`` (the checkpoint's ``table_snapshots``)
    first, as a resume does: a copied run directory exports its own files."""
    if "snapshot" in extra:
        directory = Path(extra["snapshot"])
        if (beside / directory.name / MANIFEST).exists():
            directory = beside / directory.name
        manifest = SnapshotManifest.read(directory)
        if manifest.sha256() != extra["manifest_sha256"]:
            raise ValueError(f"table snapshot {directory}: its manifest is not the one the checkpoint refers to")
        chain = manifest.chain(directory)
        for path, member in chain:
            verify(path, member)

        def from_files() -> Iterator[tuple[str, np.ndarray, torch.Tensor]]:
            # An incremental snapshot's rows, then its ancestors' rows it does not replace:
            # the keys of all but the oldest are remembered (the changed rows, not the table).
            given = KeyIndex()
            codes = {name: code for code, name in enumerate(manifest.tables)}
            for depth, (path, member) in enumerate(chain):
                for f in member.files:
                    for names, tables, ids, rows in read_snapshot_file(path, f):
                        # A table an ancestor has but the newest snapshot dropped: -1, never given.
                        keys = np.array([codes.get(n, -1) for n in names], dtype=np.int64)[tables]
                        known = keys >= 0
                        tables, ids, keys = tables[known], ids[known], keys[known]
                        rows = rows[torch.from_numpy(np.flatnonzero(known))]
                        fresh = given.lookup(keys, ids) < 0 if depth else np.ones(len(ids), dtype=bool)
                        if depth + 1 < len(chain):
                            given.insert(keys[fresh], ids[fresh], np.zeros(int(fresh.sum()), dtype=np.int64))
                        for code, name in enumerate(names):
                            mine = np.flatnonzero((tables == code) & fresh)
                            if len(mine):
                                yield name, ids[mine], rows[torch.from_numpy(mine)]

        return manifest.tables, dict(manifest.steps), from_files()
    if "tables" not in extra:
        raise KeyError("the checkpoint's table collection holds neither a snapshot reference nor tables")
    state = extra["tables"]

    def from_state() -> Iterator[tuple[str, np.ndarray, torch.Tensor]]:
        for name, table in state.items():
            for start in range(0, len(table["ids"]), chunk_rows):
                yield name, table["ids"][start : start + chunk_rows].numpy(), table["rows"][start : start + chunk_rows]

    # In-file tables carry their widths (older checkpoints do not: then the model's embedding_dim).
    dims = extra.get("dims") or {}
    return ({name: ({"dim": dims[name]} if name in dims else {}) for name in state},
            {name: int(table["steps"]) for name, table in state.items()}, from_state())


class _TableWriter:
    """Parquet files of one table, a new file every ``rows_per_file`` rows."""

    def __init__(self, directory: Path, name: str, dim: int, rows_per_file: int, stamped: bool,
                 scored: bool = False) -> None:
        self.directory, self.name, self.dim, self.rows_per_file = directory, name, dim, rows_per_file
        directory.mkdir(parents=True, exist_ok=True)
        self.schema = pa.schema([("table", pa.string()), ("id", pa.int64()), ("vector", pa.list_(pa.float32(), dim)),
                                 *([("last_seen", pa.int64())] if stamped else []),
                                 *([("score_bucket", pa.int64())] if scored else [])])
        self.files: list[dict[str, Any]] = []
        self._writer: pq.ParquetWriter | None = None
        self._in_file = 0
        self.rows = 0

    def write(self, ids: np.ndarray, vectors: np.ndarray, last_seen: np.ndarray | None,
              buckets: np.ndarray | None = None) -> None:
        start = 0
        while start < len(ids):
            if self._writer is None:
                path = self.directory / f"part-{len(self.files):05d}.parquet"
                self._writer = pq.ParquetWriter(path, self.schema)
                self.files.append({"path": str(path), "rows": 0})
                self._in_file = 0
            n = min(len(ids) - start, self.rows_per_file - self._in_file)
            flat = pa.array(np.ascontiguousarray(vectors[start : start + n], dtype=np.float32).reshape(-1))
            columns = [pa.array([self.name] * n, pa.string()), pa.array(ids[start : start + n]),
                       pa.FixedSizeListArray.from_arrays(flat, self.dim)]
            if last_seen is not None:
                columns.append(pa.array(last_seen[start : start + n]))
            if buckets is not None:
                columns.append(pa.array(buckets[start : start + n]))
            batch = pa.record_batch(columns, schema=self.schema)
            self._writer.write_batch(batch)
            self._in_file += n
            self.files[-1]["rows"] += n
            self.rows += n
            start += n
            if self._in_file == self.rows_per_file:
                self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def export_for_serving(ckpt_path: str | os.PathLike, out: str | os.PathLike, rows_per_file: int = 1 << 20,
                       chunk_rows: int = 1 << 16, since: str | os.PathLike | None = None) -> dict[str, Any]:
    """Write the model of ``ckpt_path`` to ``out`` (see the module's docstring); returns
    what ``export.json`` holds. ``out`` must be empty or not exist.

    With ``since``, an earlier export of the same run, write a delta: only the rows changed
    since (looked up in training at or after that export's step counts), plus each table's
    floor (rows whose rank, last lookup step or score bucket, is under it are gone), the
    dense part whole, and ``since`` naming that export with its ``export.json``'s SHA-256.
    Every table must record its rows' last lookup step
    (:class:`~ctr_lightning.embedding.Expiry`, ``Expiry()`` for none to expire; a row cap by
    score records it too). :func:`ctr_lightning.serving.read_export` applies the chain.

    Example::

        export_for_serving("runs/demo/version_0/checkpoints/last.ckpt", "serving/v1")
        export_for_serving("runs/demo/version_0/checkpoints/step=2000.ckpt", "serving/v2", since="serving/v1")
    """
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"export: {out} is not empty; export into a new directory")
    previous = read_description(since) if since is not None else None
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    state = ckpt["state_dict"]
    extras = {k: v for k, v in state.items() if k.endswith("_extra_state") and isinstance(v, dict)}
    if not extras:
        raise KeyError(f"export: {ckpt_path} holds no table collection (no '*_extra_state' in its state dict)")
    # One collection may be reachable under several names (DLRMModule: embeddings, and
    # torchrec's DLRM sparse arch): export it once.
    collections: dict[str, dict[str, Any]] = {}
    for key, extra in extras.items():
        identity = extra.get("snapshot") or ",".join(sorted(extra.get("tables", {})))
        collections.setdefault(identity, extra)
    hparams = dict(ckpt.get("hyper_parameters") or {})
    (out / "tables").mkdir(parents=True)

    tables_out: dict[str, dict[str, Any]] = {}
    for extra in collections.values():
        configs, steps, chunks = _table_chunks(extra, chunk_rows, Path(ckpt_path).parent / "table_snapshots")
        floors = {name: int(floor) for name, floor in (extra.get("expiry") or {}).items()}  # stamped tables
        scored = set(extra.get("expiry_scored") or [])  # their floors rank score buckets, not steps
        ranks = {name: RANKS[1] if name in scored else RANKS[0] for name in floors}
        changed_from = _changed_from(previous, since, configs, steps, ranks) if previous is not None else {}
        writers = {name: _TableWriter(out / "tables" / name, name,
                                      int(config.get("dim") or hparams["embedding_dim"]), rows_per_file,
                                      stamped=name in floors, scored=name in scored)
                   for name, config in configs.items()}
        for name, ids, rows in chunks:
            last_seen = buckets = None
            if name in floors:  # rows gone (expired, evicted) may still lie in the snapshot's files: left out
                column = rows.shape[1] - STAMP_WORDS - (SCORE_WORDS if name in scored else 0)
                last_seen = read_last_seen(rows, column)
                changed = last_seen >= changed_from.get(name, 0)  # a row never trained has -1: never
                if name in scored:  # alive by the score's bucket (a row never trained has none)
                    buckets = score_bucket(rows[:, column + STAMP_WORDS].numpy())
                    keep = changed & (buckets >= floors[name])
                    buckets = buckets[keep]
                else:
                    keep = changed & (last_seen >= floors[name])
                ids, rows, last_seen = ids[keep], rows[torch.from_numpy(keep)], last_seen[keep]
            writers[name].write(ids, rows[:, : writers[name].dim].numpy(), last_seen, buckets)
        for name, config in configs.items():
            tables_out[name] = _table_entry(name, config, writers[name], out, hparams, extra, steps, floors, ranks)

    dense = {k: v.detach().clone().contiguous() for k, v in state.items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    save_file(dense, str(out / "dense.safetensors"))
    description = {
        "format": FORMAT,
        "checkpoint": str(Path(ckpt_path).resolve()),
        "global_step": ckpt.get("global_step"),
        "hyper_parameters": _plain(hparams),
        "dense": {"path": "dense.safetensors", "sha256": file_sha256(out / "dense.safetensors"),
                  "tensors": len(dense)},
        "tables": tables_out,
        "unstored_rows": "a table's 'unstored': 'initial': initial_rows(seed, table_key(table), id, dim, "
                         "*range_bounds(*init_range)) of ctr_lightning.embedding.initializer, uniform in the "
                         "table's init_range; 'zeros': zeros (ids never admitted)",
    }
    if since is not None:
        description["since"] = {"path": os.path.relpath(Path(since).resolve(), out.resolve()),
                                "sha256": file_sha256(Path(since) / EXPORT_JSON)}
    partial = out / "export.json.partial"
    partial.write_text(json.dumps(description, indent=1, sort_keys=True))
    os.replace(partial, out / EXPORT_JSON)  # last: the export is complete once it is there
    return description


def _changed_from(previous: dict[str, Any], since: str | os.PathLike, configs: dict[str, Any],
                  steps: dict[str, int], ranks: dict[str, str]) -> dict[str, int]:
    """Per table, the step from which a row's last lookup makes it part of a delta after
    ``previous`` (the tables' step counts then); an error naming the table where a delta
    cannot be written. ``ranks``: per stamped table, what its floor applies to."""
    out = {}
    for name in configs:
        if name not in ranks:
            raise ValueError(f"export --since {since}: table {name!r} does not record its rows' last lookup step, "
                             f"so the rows changed since cannot be told apart; give it an Expiry (Expiry() expires "
                             f"nothing) and export in full")
        entry = previous["tables"].get(name)
        if entry is None:
            continue  # a table new since: all its rows
        # The reader deletes by the floor's rank over the rows before the delta too: they must carry it.
        ranked_by = entry.get("ranked_by", RANKS[0]) if entry.get("floor") is not None else None
        if RANKS[1] in (ranks[name], ranked_by) and ranked_by != ranks[name]:
            raise ValueError(f"export --since {since}: table {name!r} ranks its rows by {ranks[name]} now, the export "
                             f"it would follow by {ranked_by or 'nothing'} (an older version, or another Expiry); "
                             f"export in full")
        before = entry.get("steps")
        if before is None:
            continue
        if int(before) > steps[name]:
            raise ValueError(f"export --since {since}: table {name!r} is at step {steps[name]} in this checkpoint, "
                             f"before the {before} steps of the export it would follow; export in full")
        out[name] = int(before)
    return out


def _table_entry(name: str, config: dict[str, Any], writer: _TableWriter, out: Path, hparams: dict[str, Any],
                 extra: dict[str, Any], steps: dict[str, int], floors: dict[str, int],
                 ranks: dict[str, str]) -> dict[str, Any]:
    """A table's entry of ``export.json``."""
    writer.close()
    init_ranges = extra.get("init_ranges") or {}  # tables at torchrec's default range are not listed
    zero_unstored = set(extra.get("zero_unstored") or ())  # tables that admit ids selectively
    num_embeddings = int(config.get("num_embeddings") or hparams.get("num_embeddings", 0))
    bound = math.sqrt(1 / num_embeddings) if num_embeddings else None
    return {
        "dim": writer.dim,
        "num_embeddings": num_embeddings,
        "seed": int(config.get("seed", hparams.get("seed", 0))),
        "init_range": [float(x) for x in init_ranges[name]] if name in init_ranges else
                      (None if bound is None else [-bound, bound]),
        "unstored": "zeros" if name in zero_unstored else "initial",
        "steps": int(steps.get(name, 0)),
        # Rows whose rank (last lookup step, or score bucket) is under it are gone: a reader
        # deletes them (a delta's tombstones).
        "floor": floors.get(name),
        **({"ranked_by": ranks[name]} if name in ranks else {}),
        "rows": writer.rows,
        "files": [{"path": str(Path(f["path"]).relative_to(out)), "rows": f["rows"],
                   "sha256": file_sha256(f["path"])} for f in writer.files],
    }


def _plain(value: Any) -> Any:
    """Hyperparameters as JSON: config dataclasses and tuples become dicts and lists."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def main(argv: list[str] | None = None) -> None:
    """``ctr-lightning export --ckpt_path PATH --out DIR``."""
    parser = argparse.ArgumentParser(
        prog="ctr-lightning export",
        description="Write a checkpoint's model for serving: tables as Parquet (table, id, vector), the dense "
                    "part as safetensors, export.json describing both.")
    parser.add_argument("--ckpt_path", required=True, help="a .ckpt written by ctr-lightning fit")
    parser.add_argument("--out", required=True, help="a new, empty directory")
    parser.add_argument("--rows_per_file", type=int, default=1 << 20, help="rows per Parquet file")
    parser.add_argument("--since", default=None,
                        help="an earlier export of the same run: write a delta, only the rows changed since (tables "
                             "need an Expiry, which records each row's last lookup step; a row cap by score does)")
    args = parser.parse_args(argv)
    description = export_for_serving(args.ckpt_path, args.out, rows_per_file=args.rows_per_file, since=args.since)
    rows = sum(t["rows"] for t in description["tables"].values())
    kind = f"a delta after {args.since}:" if args.since else "exported"
    print(f"{kind} {len(description['tables'])} tables ({rows:,} rows) and {description['dense']['tensors']} "
          f"dense tensors to {args.out}")

