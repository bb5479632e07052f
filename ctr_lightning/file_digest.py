"""SHA-256 of a file, read in blocks: checksums of snapshots and of serving exports (no torch,
so the serving reader can use it)."""

from __future__ import annotations

import hashlib
import os


def file_sha256(path: str | os.PathLike, block: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()
