import logging
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
CRITEO_SAMPLE = SHARED_DATA / "criteo_kaggle_sample"

# torchrec's KJT asks torch.fx whether it is tracing, which warns once per process.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


@pytest.fixture(scope="session", autouse=True)
def row_index_cache(tmp_path_factory):
    """The record counts of the files tests write are cached in the test run's own
    directory (processes the tests start inherit it), not in the user's home."""
    import os

    os.environ["CTR_LIGHTNING_CACHE"] = str(tmp_path_factory.mktemp("ctr_lightning_cache"))


@pytest.fixture(autouse=True)
def no_seed_left_behind():
    """``pl.seed_everything`` writes the seed into the environment, where the next test in
    this process (and the processes it starts) would find it: each test starts without."""
    import os

    yield
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        os.environ.pop(name, None)


@dataclass(frozen=True)
class CriteoSample:
    """Two Criteo-layout files of 4,584 and 1,999 rows: the real Kaggle samples, or
    synthetic files of the same layout and size (missing fields and negative I2 counts
    included) that the tests write themselves."""

    kind: str
    big: Path  # 4,584 rows
    head: Path  # 1,999 rows, no row shared with ``big``


@pytest.fixture(scope="session")
def synthetic_criteo_sample(tmp_path_factory) -> CriteoSample:
    from ctr_lightning.datamodules import write_synthetic_criteo

    root = tmp_path_factory.mktemp("synthetic_criteo")
    return CriteoSample("synthetic", write_synthetic_criteo(root / "big.tsv", rows=4584, seed=11, max_cardinality=50_000),
                        write_synthetic_criteo(root / "head.tsv", rows=1999, seed=11, stream=1,
                                               max_cardinality=50_000))


def real_criteo_sample() -> CriteoSample:
    """The real Criteo Kaggle samples (never committed); the test skips where they are absent."""
    if not (CRITEO_SAMPLE / "train_random4584.tsv").is_file():
        pytest.skip(f"real Criteo sample not found under {CRITEO_SAMPLE}")
    return CriteoSample("real", CRITEO_SAMPLE / "train_random4584.tsv", CRITEO_SAMPLE / "train_head1999.tsv")


@pytest.fixture(params=["synthetic", "real"])
def criteo_sample(request) -> CriteoSample:
    """Tests that need Criteo-layout logs but no real data run on synthetic files always,
    and on the real samples as an extra case where ../shared/data has them."""
    if request.param == "real":
        return real_criteo_sample()
    return request.getfixturevalue("synthetic_criteo_sample")


AVAZU_SAMPLE = SHARED_DATA / "avazu_sample" / "train_head100.csv"
AVAZU_HEADER = ("id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,app_category,"
                "device_id,device_ip,device_model,device_type,device_conn_type,C14,C15,C16,C17,C18,C19,C20,C21")


def write_avazu_layout(path: Path, rows: int, seed: int) -> Path:
    """Avazu CSV of ``rows`` random rows in the real layout: the header, a 64-bit id, a
    0/1 click, an hour as YYMMDDHH, and hex or integer categorical fields."""
    import numpy as np

    rng = np.random.default_rng(seed)
    hexes = lambda n: [f"{v:08x}" for v in rng.integers(0, 2**32, n)]  # noqa: E731
    lines = [AVAZU_HEADER]
    for i in range(rows):
        day, hour = rng.integers(21, 31), rng.integers(0, 24)
        fields = [str(rng.integers(0, 2**63)), str(int(rng.random() < 0.17)), f"1410{day:02d}{hour:02d}",
                  str(rng.choice([1005, 1002, 1010])), str(rng.integers(0, 3)), *hexes(6),
                  *hexes(3), str(rng.integers(0, 5)), str(rng.integers(0, 4)),
                  *[str(v) for v in rng.integers(0, 25000, 6)], str(rng.choice([-1, 100084, 100148])),
                  str(rng.integers(0, 200))]
        lines.append(",".join(fields))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(params=["synthetic", "real"])
def avazu_sample(request, tmp_path_factory) -> Path:
    """An Avazu CSV of 100 rows: written by the test, or the real sample where it is present."""
    if request.param == "real":
        if not AVAZU_SAMPLE.is_file():
            pytest.skip(f"real Avazu sample not found at {AVAZU_SAMPLE}")
        return AVAZU_SAMPLE
    return write_avazu_layout(tmp_path_factory.mktemp("avazu") / "train_head100.csv", rows=100, seed=5)


@pytest.fixture
def real_criteo() -> CriteoSample:
    """For the few tests about the real data itself."""
    return real_criteo_sample()


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on, for a test's process group."""
    return _free_port()


@pytest.fixture
def run_ranks(free_port):
    """:func:`launch_ranks` on a free port."""
    import functools

    return functools.partial(launch_ranks, port=free_port)


@pytest.fixture(scope="session")
def run_ranks_in_fixture():
    """:func:`launch_ranks` on a fresh free port each call, for fixtures wider than one test
    (one launch whose runs several tests check)."""
    return lambda script, args, world, **kwargs: launch_ranks(script, args, world, port=_free_port(), **kwargs)


def launch_ranks(script: str, args: list[str], world: int, port: int, timeout: float = 300,
                 ddp_env: bool = True) -> list[dict]:
    """Run ``script`` as ``world`` processes of a process group on 127.0.0.1 and return the
    JSON each prints on its ``RESULT`` line, ordered by rank.

    With ``ddp_env`` the processes get the variables a launcher sets (RANK, WORLD_SIZE,
    MASTER_ADDR...), so Lightning joins them instead of starting its own; the script also
    gets its rank as the first argument. ``{port}`` in ``args`` becomes the port; if
    another process takes it first, the run starts again on a new one. All ranks share
    one ``timeout``; on any failure every rank's stderr tail is shown.
    """
    for _ in range(3):
        try:
            return _launch(script, args, world, port, timeout, ddp_env)
        except _PortTaken:
            port = _free_port()  # another process took it between the probe and the bind
    raise AssertionError(f"no free port for the process group after 3 tries (last {port})")


@pytest.fixture
def in_mount_namespace():
    """Runs a Python script in a mount namespace of its own (``unshare -m``), where it may
    mount real, small file systems that vanish with it; skips where that cannot be done."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode().strip()}")
    return lambda script, args, timeout=300: subprocess.run(["unshare", "-m", sys.executable, "-c", script, *args],
                                                            capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def until_one_exits():
    """:func:`launch_until_one_exits` on a fresh free port each call."""
    return lambda command, world, env_by_rank, timeout=300: launch_until_one_exits(
        command, world, _free_port(), env_by_rank, timeout)


def launch_until_one_exits(command: list[str], world: int, port: int, env_by_rank: list[dict[str, str]],
                           timeout: float = 300) -> list[tuple[int, str]]:
    """Run ``command`` as ``world`` ranks of a Lightning DDP run (launcher variables set,
    rank ``r`` with ``env_by_rank[r]`` added) until every rank has exited, or one has
    failed: then the others are killed too, as a job whose node died would be. Returns
    each rank's ``(exit code, stderr tail)``. The port is not retried: tests that launch
    several runs take a fresh one per run."""
    import os
    import subprocess
    import tempfile
    import time

    base = dict(os.environ, PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                WORLD_SIZE=str(world), NODE_RANK="0")
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(world)]  # files: no pipe to fill and block on
    procs = [subprocess.Popen(command, env=dict(base, LOCAL_RANK=str(r), RANK=str(r), **env_by_rank[r]),
                              stdout=subprocess.DEVNULL, stderr=logs[r], text=True) for r in range(world)]
    deadline, timed_out = time.monotonic() + timeout, True
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                timed_out = False
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    out = []
    for p, log in zip(procs, logs):
        log.seek(0)
        out.append((p.returncode, log.read()[-3000:]))
        log.close()
    if timed_out:
        raise AssertionError(f"ranks still ran after the {timeout:.0f} s deadline: {out}")
    return out


class _PortTaken(Exception):
    pass


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(script: str, args: list[str], world: int, port: int, timeout: float, ddp_env: bool) -> list[dict]:
    import json
    import os
    import subprocess
    import sys
    import threading
    import time

    base = dict(os.environ, PYTHONWARNINGS="ignore")
    if ddp_env and world > 1:
        base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0")
    args = [a.replace("{port}", str(port)) for a in args]
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), *args],
                              env=dict(base, LOCAL_RANK=str(r), RANK=str(r)) if ddp_env and world > 1 else base,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    # Every pipe is drained by a thread of its own, so no rank blocks on a full pipe while
    # another is being read, and all ranks share one deadline.
    outputs: dict[tuple[int, str], list[str]] = {(r, name): [] for r in range(world) for name in ("out", "err")}
    readers = [threading.Thread(target=lambda f, sink: sink.extend(f), args=(getattr(p, f"std{name}"), outputs[r, name]),
                                daemon=True)
               for r, p in enumerate(procs) for name in ("out", "err")]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            p.kill()
            p.wait()
        for t in readers:
            t.join(timeout=10)
    outs = [("".join(outputs[r, "out"]), "".join(outputs[r, "err"])) for r in range(world)]
    if any(p.returncode != 0 and ("EADDRINUSE" in err or "ddress already in use" in err)
           for p, (_, err) in zip(procs, outs)):
        raise _PortTaken()

    def tails() -> str:
        return "\n".join(f"--- rank {r} (exit {procs[r].returncode}) stderr tail:\n{err[-2000:]}"
                         for r, (_, err) in enumerate(outs))

    if hung:
        raise AssertionError(f"ranks {hung} still ran after the {timeout:.0f} s deadline\n{tails()}")
    results = []
    for r, (p, (out, _)) in enumerate(zip(procs, outs)):
        line = next((l for l in out.splitlines() if l.startswith("RESULT ")), None)
        assert p.returncode == 0 and line, f"rank {r} failed\n{tails()}"
        results.append(json.loads(line[len("RESULT "):]))
    return results


@pytest.fixture
def in_process(monkeypatch):
    """Calls ``ctr_lightning.cli.main`` here, in the test's process, from the repository
    root; main() installs its own root log handler, so the root logger is put back afterwards."""
    import sys

    from ctr_lightning.cli import main

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["ctr-lightning"])  # not pytest's own arguments
    yield main
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
