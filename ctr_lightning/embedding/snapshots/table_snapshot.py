"""A snapshot of tiered tables on disk: row files streamed from every tier, and a manifest
written last, by an atomic rename, that makes it complete.

Saving holds one chunk of rows and the keys of the memory tiers, never a whole table;
the sealed segments of an SSD log on the same file system are not copied but shared by
hard link (:mod:`segment_sets`). Loading checks every file's size and checksum against
the manifest first, then streams the rows into the tiers (onto SSD where there is one),
or takes shared segments back into the SSD log by hard link, keeping the rows ``keep``
selects, so a snapshot loads into other storage budgets and, through ``keep``, into
another sharding.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ctr_lightning.embedding.snapshots.row_files import RowFileError, RowFileWriter, file_sha256, read_row_file
from ctr_lightning.embedding.snapshots.segment_sets import (
    SegmentSetWriter,
    can_share,
    read_segment_set,
    segment_rows,
    segment_set_rows,
    verify_segment_set,
)
from ctr_lightning.fault_points import reached

if TYPE_CHECKING:
    from ctr_lightning.embedding.local_tables import LocalTables

MANIFEST = "manifest.json"
# Checkpoints name snapshots by the rows' version and a random suffix (two runs, or a
# resumed run, never write into one directory).
SNAPSHOT_NAME = re.compile(r"v\d{9,}-[0-9a-f]{8}")
WRITING = ".writing-"  # + the writer's file prefix: locked while a save writes, gone once it is complete
FORMAT = "ctr-lightning-table-snapshot-2"  # 2: files may be segment sets (SnapshotFile.kind)
READABLE = ("ctr-lightning-table-snapshot-1", FORMAT)


# Whether saves share the SSD log's sealed segments by hard link (else their rows are
# copied into row files). A context, not an argument: every engine's save_snapshot reaches
# write_shard, on one rank or many, without each passing it on.
_LINK_SEGMENTS: ContextVar[bool] = ContextVar("link_segments", default=True)


@contextmanager
def segments_linked(link: bool) -> Iterator[None]:
    """Saves inside the block hard-link sealed SSD segments (``True``, the default: a
    snapshot then costs little more than the rows in memory, but shares those files with
    the SSD log and with every other snapshot linking them) or copy their rows
    (``False``: a snapshot independent of every other file)."""
    token = _LINK_SEGMENTS.set(link)
    try:
        yield
    finally:
        _LINK_SEGMENTS.reset(token)


def snapshot_name(version: int) -> str:
    """A new snapshot directory's name (``SNAPSHOT_NAME``) for rows of ``version``."""
    return f"v{version:09d}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class SnapshotFile:
    """One file: its name in the snapshot directory, size, SHA-256, the tables it holds
    rows of (with their counts) and the width of its rows. ``kind`` "rows": a row file;
    "segments": a segment set, whose hard-linked segments hold ``shared_bytes`` more
    (bytes the snapshot did not write)."""

    name: str
    bytes: int
    sha256: str
    width: int
    rows: dict[str, int]
    kind: str = "rows"
    shared_bytes: int = 0


@dataclass(frozen=True)
class SnapshotRef:
    """A complete snapshot: its directory and the SHA-256 of its manifest."""

    path: str
    manifest_sha256: str


@dataclass(frozen=True)
class SnapshotManifest:
    """What a complete snapshot holds: its files, the tables (name, dim, row width,
    ``num_embeddings``, initializer seed), each table's optimizer step count, and who
    wrote it: the number of ranks and each table's sharding."""

    format: str
    world_size: int
    tables: dict[str, dict[str, int]]
    steps: dict[str, int]
    files: list[SnapshotFile]
    # Per table, how the saving ranks split it ({"kind", "owner"}); empty from one process.
    # Loading does not need it (every row file names its tables and ids): it is a record.
    sharding: dict[str, dict[str, Any]] = field(default_factory=dict)
    # An incremental snapshot holds the rows changed since its parent's; the rest are the
    # parent's (and its parent's...). None: it holds every row.
    parent: SnapshotRef | None = None

    def to_json(self) -> str:
        data = asdict(self)
        for f in data["files"]:  # row files as format 1 wrote them: its manifests keep their hashes
            if f["kind"] == "rows" and not f["shared_bytes"]:
                del f["kind"], f["shared_bytes"]
        return json.dumps(data, indent=1, sort_keys=True)

    def sha256(self) -> str:
        """Of the manifest as written: a checkpoint names the snapshot it means by it."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def read(cls, directory: str | os.PathLike) -> SnapshotManifest:
        path = Path(directory) / MANIFEST
        if not path.exists():
            raise FileNotFoundError(f"table snapshot {directory}: no {MANIFEST}, so it is incomplete (a save that "
                                    f"did not finish) or not a snapshot")
        try:
            data = json.loads(path.read_text())
        except ValueError as e:  # not JSON, or not text
            raise ValueError(f"{path}: damaged manifest, not readable as JSON ({e})") from e
        if not isinstance(data, dict) or data.get("format") not in READABLE:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{path}: format {found!r}, expected one of {READABLE}")
        try:
            return cls(format=data["format"], world_size=int(data["world_size"]), tables=data["tables"],
                       steps={k: int(v) for k, v in data["steps"].items()},
                       files=[SnapshotFile(**f) for f in data["files"]], sharding=data.get("sharding", {}),
                       parent=SnapshotRef(**data["parent"]) if data.get("parent") else None)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{path}: damaged manifest, a field is missing or of the wrong type "
                             f"({type(e).__name__}: {e})") from e

    def chain(self, directory: str | os.PathLike) -> list[tuple[Path, SnapshotManifest]]:
        """This snapshot and its ancestors, newest first, each parent checked to be the
        one its child was saved over. A parent is looked for beside its child first (saves
        put it there; a copied run directory then reads its own copy, not the original),
        then at its recorded path."""
        out = [(Path(directory), self)]
        while out[-1][1].parent is not None:
            ref = out[-1][1].parent
            beside = out[-1][0].parent / Path(ref.path).name
            path = beside if (beside / MANIFEST).exists() else Path(ref.path)
            try:
                parent = SnapshotManifest.read(path)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"table snapshot {out[-1][0]} is incremental over {ref.path}, which is "
                                        f"gone or incomplete: {e}") from e
            if parent.sha256() != ref.manifest_sha256:
                raise ValueError(f"table snapshot {out[-1][0]} is incremental over {path}, whose manifest is "
                                 f"not the one it was saved over")
            out.append((path, parent))
        return out


def write_manifest(directory: str | os.PathLike, manifest: SnapshotManifest) -> None:
    """Write the manifest durably and atomically: the snapshot is complete from here on."""
    reached("snapshot_manifest")
    directory = Path(directory)
    _fsync_directory(directory)  # the files' and links' names, before the manifest that names them
    partial = directory / (MANIFEST + ".partial")
    try:
        with open(partial, "w") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise OSError(e.errno, f"writing {partial}: {e.strerror}; the snapshot is incomplete") from e
    os.replace(partial, directory / MANIFEST)
    _fsync_directory(directory)  # the rename itself


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ShardFiles:
    """What one rank wrote into a snapshot: its files, and per table the optimizer step
    count and the shape of its rows. Ranks' parts are joined into the manifest."""

    files: list[SnapshotFile]
    steps: dict[str, int]
    tables: dict[str, dict[str, int]]


def prepare_directory(directory: str | os.PathLike) -> Path:
    """The snapshot directory, created; an error if it holds a complete snapshot already."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / MANIFEST).exists():
        raise FileExistsError(f"table snapshot {directory} exists already; snapshots are never overwritten")
    return directory


_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


@contextmanager
def writing(directory: str | os.PathLike, writer: str) -> Iterator[Path]:
    """The snapshot directory (:func:`prepare_directory`), marked as written by this process
    for as long as the block runs: a lock file ``.writing-<writer>`` it holds an exclusive
    ``flock`` on, which the kernel drops when the process dies. A block that completes
    removes the file; one that raises leaves it, unlocked, so :func:`abandoned` knows the
    directory for what a killed or failed save left."""
    directory = prepare_directory(directory)
    lock = directory / f"{WRITING}{writer}"
    # Locked under another name first, then renamed (the lock goes with the file): a
    # ``.writing-`` file is never seen unlocked while its writer lives.
    staging = directory / f".locking-{writer}-{uuid.uuid4().hex[:8]}"
    fd = os.open(staging, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise
            # A file system without locks (some parallel ones): the file stays unlocked
            # while this save runs, and abandoned() cannot tell, so it keeps the directory.
        os.rename(staging, lock)
        yield directory
        try:
            lock.unlink()
        except OSError:
            pass  # a lock file beside a manifest is harmless; failing here would fail this rank alone
    finally:
        os.close(fd)


def abandoned(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` is a snapshot no process will complete: no manifest, and every
    writer that marked it (:func:`writing`) no longer writes. Unmarked directories, and any
    that cannot be checked (no locks on the file system, no permission...), are not known
    to be abandoned."""
    directory = Path(directory)
    try:
        locks = list(directory.glob(f"{WRITING}*"))
        if not locks or (directory / MANIFEST).exists():
            return False
        for lock in locks:
            fd = os.open(lock, os.O_RDWR)  # gone meanwhile (its writer completed): FileNotFoundError
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a writer holds it: BlockingIOError
            finally:
                os.close(fd)
        return not (directory / MANIFEST).exists()
    except OSError:
        return False


def write_shard(engine: LocalTables, directory: str | os.PathLike, rank: int = 0, chunk_rows: int = 1 << 16,
                steps: dict[str, int] | None = None, changed_only: bool = False,
                prefix: str | None = None) -> ShardFiles:
    """Stream every row a :class:`LocalTables` engine holds into ``directory`` (one file per
    table group, named for ``rank`` or ``prefix``), or with ``changed_only`` those that may
    have changed since the engine's last snapshot; ``steps`` overrides the engine's step counts.
    Sealed SSD segments are hard-linked where the file system allows, unless saved inside
    ``segments_linked(False)``."""
    files, step_counts, tables = [], {}, {}
    prefix = prefix or f"rank{rank}"
    link = _LINK_SEGMENTS.get()
    for g, group in enumerate(engine.groups):
        name = f"{prefix}-group{g}.rows"
        ssd = group.ssd
        share = (SegmentSetWriter(Path(directory) / f"{prefix}-group{g}.segments", group.names, group.width,
                                  ssd.record_bytes)
                 if link and ssd is not None and ssd.shares_segments and can_share(ssd.directory, directory) else None)
        with RowFileWriter(Path(directory) / name, group.names, group.width) as out:
            for t, i, rows in group.export_chunks(chunk_rows, changed_only=changed_only, share=share):
                out.write(t, i, rows)
        files.append(SnapshotFile(name, out.size, out.sha256, group.width,
                                  dict(zip(group.names, out.rows_per_table))))
        if share is not None and share.segments:
            share.close()
            files.append(SnapshotFile(share.path.name, share.size, share.sha256, group.width,
                                      dict(zip(group.names, share.rows_per_table)), kind="segments",
                                      shared_bytes=share.shared_bytes))
        for local, table in enumerate(group.names):
            step_counts[table] = int(group.steps[local]) if steps is None else int(steps[table])
            config = group.tables[local]
            # With the seed, a reader can recompute the rows never stored (initial_rows).
            tables[table] = {"dim": config.embedding_dim, "width": group.width,
                             "num_embeddings": config.num_embeddings, "seed": group.seed}
    return ShardFiles(files, step_counts, tables)


def join_shards(parts: list[ShardFiles], sharding: dict[str, dict[str, Any]] | None = None,
                parent: SnapshotRef | None = None) -> SnapshotManifest:
    """The manifest of a snapshot written by ``len(parts)`` ranks, in rank order. A table's
    step count is the largest any rank holds (a rank that never saw the table has none)."""
    steps: dict[str, int] = {}
    tables: dict[str, dict[str, int]] = {}
    for part in parts:
        for table, count in part.steps.items():
            steps[table] = max(steps.get(table, 0), count)
        tables.update(part.tables)
    files = [f for part in parts for f in part.files]
    return SnapshotManifest(FORMAT, world_size=len(parts), tables=tables, steps=steps, files=files,
                            sharding=dict(sharding or {}), parent=parent)


def save_tables(engine: LocalTables, directory: str | os.PathLike, chunk_rows: int = 1 << 16,
                parent: SnapshotRef | None = None) -> SnapshotManifest:
    """Write every row of a :class:`LocalTables` engine to ``directory`` (one file per table
    group), then the manifest. With ``parent`` (the engine's last snapshot, saved or
    loaded) only the rows changed since are written. ``directory`` must not hold a
    snapshot already."""
    with writing(directory, "rank0") as directory:
        manifest = join_shards([write_shard(engine, directory, 0, chunk_rows, changed_only=parent is not None)],
                               parent=parent)
        write_manifest(directory, manifest)
    engine.mark_saved()
    return manifest


def verify(directory: str | os.PathLike, manifest: SnapshotManifest) -> None:
    """Every file of the manifest is there, of its size and SHA-256; else an error naming
    the file and its tables."""
    for f in manifest.files:
        path = Path(directory) / f.name
        tables = sorted(f.rows)
        if not path.exists():
            raise RowFileError(f"table snapshot {directory}: {f.name} (tables {tables}) is missing")
        if path.stat().st_size != f.bytes:
            raise RowFileError(f"table snapshot {directory}: {f.name} (tables {tables}) has {path.stat().st_size} "
                               f"bytes, the manifest says {f.bytes}")
        if file_sha256(path) != f.sha256:
            raise RowFileError(f"table snapshot {directory}: {f.name} (tables {tables}) does not match its "
                               f"checksum in the manifest")
        if f.kind == "segments":
            verify_segment_set(read_segment_set(path))


def read_snapshot_file(directory: str | os.PathLike, f: SnapshotFile,
                       chunk_rows: int = 1 << 16) -> Iterator[tuple[list[str], np.ndarray, np.ndarray, torch.Tensor]]:
    """``(table_names, tables, ids, rows)`` of one file of a snapshot, a chunk at a time,
    whatever its kind (``chunk_rows`` for segment sets; row files come in the chunks they
    were written in)."""
    if f.kind == "segments":
        return segment_set_rows(Path(directory) / f.name, f.width, chunk_rows)
    return read_row_file(Path(directory) / f.name, f.width)


def load_tables(engine: LocalTables, directory: str | os.PathLike,
                keep: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> SnapshotManifest:
    """Replace every row of a :class:`LocalTables` engine by the snapshot's, streaming;
    ``keep(table, ids)`` selects the rows this engine holds (a shard), default all."""
    manifest = SnapshotManifest.read(directory)
    missing = [t.name for t in engine.tables if t.name not in manifest.tables]
    if missing:
        raise KeyError(f"table snapshot {directory} has no rows for tables {missing}; it has "
                       f"{sorted(manifest.tables)}")
    for t in engine.tables:
        group, local = engine.group_of(t.name)
        saved = manifest.tables[t.name]
        widened = group.expiry is not None and saved["width"] == group.expiry.column  # saved without expiry
        if saved["dim"] != t.embedding_dim or (saved["width"] != group.width and not widened):
            raise ValueError(f"table {t.name!r}: snapshot rows have dim {saved['dim']} and width {saved['width']} "
                             f"(weights + optimizer state), this collection stores dim {t.embedding_dim}, width "
                             f"{group.width}")
        if group.is_bounded(local) and saved["num_embeddings"] > t.num_embeddings:
            raise ValueError(f"table {t.name!r}: snapshot of {saved['num_embeddings']} rows (num_embeddings) does "
                             f"not fit a bounded table of {t.num_embeddings}")
    chain = manifest.chain(directory)
    for path, member in chain:
        verify(path, member)
    for group in engine.groups:
        group.begin_load()
    held = {t.name for t in engine.tables}
    # Newest first: a row an incremental snapshot holds replaces its ancestors' copies.
    for depth, (path, member) in enumerate(chain):
        # Rows saved without expiry count as looked up at the last step of the snapshot that
        # holds them (an older member of the chain may: a run saved after such a load).
        steps = {id(g): np.array([member.steps[name] for name in g.names], dtype=np.int64) for g in engine.groups}
        for f in member.files:
            for names, tables, ids, rows in _rows_to_load(engine, path, f, keep, older=depth > 0):
                for code, name in enumerate(names):
                    if name not in held:
                        continue  # a table this collection does not have
                    mine = tables == code
                    table_ids, table_rows = ids[mine], rows[torch.from_numpy(np.flatnonzero(mine))]
                    if keep is not None:
                        kept = keep(name, torch.from_numpy(table_ids)).numpy()
                        table_ids, table_rows = table_ids[kept], table_rows[torch.from_numpy(np.flatnonzero(kept))]
                    group, local = engine.group_of(name)
                    if len(table_ids):
                        table_rows = group.loadable(name, table_rows, steps[id(group)])
                        group.load_chunk(np.full(len(table_ids), local, dtype=np.int64), table_ids, table_rows,
                                         older=depth > 0)
    for group in engine.groups:
        group.steps = np.array([manifest.steps[name] for name in group.names], dtype=np.int64)
    engine.mark_saved()
    return manifest


def _rows_to_load(engine: LocalTables, directory: Path, f: SnapshotFile,
                  keep: Callable[[str, torch.Tensor], torch.Tensor] | None,
                  older: bool) -> Iterator[tuple[list[str], np.ndarray, np.ndarray, torch.Tensor]]:
    """The rows of ``f`` to load as rows: a segment set's segments the SSD log of the
    group they came from takes by hard link are left out (taken here)."""
    if f.kind != "segments":
        yield from read_snapshot_file(directory, f)
        return
    segment_set = read_segment_set(directory / f.name)
    group = next((g for g in engine.groups if g.names == segment_set.tables), None)
    left = range(len(segment_set.segments))
    if group is not None:
        def kept(tables: np.ndarray, ids: np.ndarray) -> np.ndarray:
            mask = np.ones(len(ids), dtype=bool)
            if keep is not None:
                for code, name in enumerate(segment_set.tables):
                    mine = np.flatnonzero(tables == code)
                    mask[mine] = keep(name, torch.from_numpy(ids[mine])).numpy()
            return mask

        left = group.adopt_segments(segment_set, kept if keep is not None else None, older)
    for n in left:
        for tables, ids, rows in segment_rows(segment_set, segment_set.segments[n]):
            yield segment_set.tables, tables, ids, rows
