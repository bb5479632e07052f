"""One run at a time on an SSD directory: a second process is refused at set-up, naming the
holder, before it deletes or truncates anything; tiers of one process share a directory."""

import gc
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ctr_lightning.embedding import StorageConfig, TieredEmbeddingBagCollection
from ctr_lightning.embedding.tiers.ssd.directory_lock import LOCK_FILE, DirectoryInUseError

# Two groups of tiers in one directory: hashed ids (a log of segment files) and bounded
# ids (one file of records at fixed offsets).
TABLES = [EmbeddingBagConfig(name="hashed", embedding_dim=8, num_embeddings=10**6, feature_names=["h"]),
          EmbeddingBagConfig(name="bounded", embedding_dim=4, num_embeddings=10**4, feature_names=["b"])]
ID_SPACE = {"hashed": "hashed", "bounded": "bounded"}
IDS = torch.arange(600) * 7


def collection(directory) -> TieredEmbeddingBagCollection:
    return TieredEmbeddingBagCollection(TABLES, id_space=ID_SPACE,
                                        storage=StorageConfig(device_rows=200, host_rows=0, ssd_dir=str(directory)))


def train(ebc: TieredEmbeddingBagCollection) -> None:
    """A few steps over more rows than the device tier holds: the rest go to SSD."""
    for step in range(6):
        ids = IDS[step * 100 : (step + 1) * 100]
        kjt = KeyedJaggedTensor.from_lengths_sync(["h", "b"], torch.cat([ids, ids]), torch.ones(200, dtype=torch.int32))
        ebc(kjt).values().sum().backward()


# Trains on the directory, tells its PID and its rows, then holds them until told to read
# them back; with "fork", it leaves a forked child behind (a data loader worker) and waits.
HOLDER = r"""
import os, sys, time
sys.path.insert(0, sys.argv[2])
from test_directory_lock import IDS, collection, train
ebc = collection(sys.argv[1])
train(ebc)
before = {name: ebc.rows(name, IDS) for name in ("hashed", "bounded")}
child = os.fork() if len(sys.argv) > 3 else -1
if child == 0:
    time.sleep(120)
    os._exit(0)
print("READY", child, flush=True)
sys.stdin.readline()
print("INTACT", all(bool((ebc.rows(name, IDS) == rows).all()) for name, rows in before.items()), flush=True)
"""


def start_holder(directory: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    """The holder, and the PID of its forked child (-1: none)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), str(Path(__file__).parent), *extra],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = holder.stdout.readline()
    if not line.startswith("READY"):
        holder.kill()
        pytest.fail(f"the holder did not start: {line}{holder.stderr.read()[-3000:]}")
    return holder, int(line.split()[1])


def contents(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_a_second_process_is_refused_naming_the_holder_and_leaves_its_files_alone(tmp_path):
    ssd = tmp_path / "ssd"
    holder, _ = start_holder(ssd)
    try:
        on_disk = contents(ssd)
        assert any(name.endswith(".seg") for name in on_disk) and any(name.endswith(".rows") for name in on_disk)
        second = collection(ssd)
        with pytest.raises(DirectoryInUseError, match=rf"{ssd} is in use by another process \(PID {holder.pid}\)"
                                                      r".*choose another directory \(StorageConfig.ssd_dir\) "
                                                      r"or stop that run"):
            second.rows("hashed", IDS)  # the first use builds the tiers
        assert contents(ssd) == on_disk
        out, err = holder.communicate("\n", timeout=60)
        assert "INTACT True" in out, out + err[-3000:]
    finally:
        holder.kill()
        holder.wait()
    # Its process gone, the directory is free again.
    train(collection(ssd))


def test_tiers_of_one_process_share_a_directory_and_free_it_once_gone(tmp_path):
    ssd = tmp_path / "ssd"
    first, second = collection(ssd), collection(ssd)  # a resumed run beside the one it replaces
    train(first)
    train(second)
    assert (ssd / LOCK_FILE).read_text().strip() == str(os.getpid())
    # An SSD write still in its thread keeps its collection alive until it is done: wait for
    # them (storage_stats drains the writes), so that deleting the collections frees the lock.
    first.storage_stats(), second.storage_stats()
    del first, second
    gc.collect()
    holder, _ = start_holder(ssd)  # another process may use it now
    holder.kill()
    holder.wait()


def test_a_killed_run_frees_its_directory_while_its_forked_children_live(tmp_path):
    ssd = tmp_path / "ssd"
    holder, child = start_holder(ssd, "fork")
    try:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        os.kill(child, 0)  # still alive, with the holder's descriptors
        train(collection(ssd))
    finally:
        holder.kill()
        holder.wait()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
