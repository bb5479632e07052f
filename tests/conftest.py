import logging
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CRITEO_SAMPLE = SHARED_DATA / "criteo_kaggle_sample"

# torchrec's KJT asks torch.fx whether it is tracing, which warns once per process.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


@pytest.fixture
def criteo_sample() -> Path:
    """The real Criteo Kaggle samples (never committed); tests skip where they are absent."""
    if not (CRITEO_SAMPLE / "train_random4584.tsv").is_file():
        pytest.skip(f"real Criteo sample not found under {CRITEO_SAMPLE}")
    return CRITEO_SAMPLE


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on, for a test's process group."""
    return _free_port()


@pytest.fixture
def run_ranks(free_port):
    """:func:`launch_ranks` on a free port."""
    import functools

    return functools.partial(launch_ranks, port=free_port)


def launch_ranks(script: str, args: list[str], world: int, port: int, timeout: float = 600,
                 ddp_env: bool = True) -> list[dict]:
    """Run ``script`` as ``world`` processes of a process group on 127.0.0.1 and return the
    JSON each prints on its ``RESULT`` line, ordered by rank.

    With ``ddp_env`` the processes get the variables a launcher sets (RANK, WORLD_SIZE,
    MASTER_ADDR...), so Lightning joins them instead of starting its own; the script also
    gets its rank as the first argument. ``{port}`` in ``args`` becomes the port; if
    another process takes it first, the run starts again on a new one.
    """
    for _ in range(3):
        try:
            return _launch(script, args, world, port, timeout, ddp_env)
        except _PortTaken:
            port = _free_port()  # another process took it between the probe and the bind
    raise AssertionError(f"no free port for the process group after 3 tries (last {port})")


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

    base = dict(os.environ, PYTHONWARNINGS="ignore")
    if ddp_env and world > 1:
        base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0")
    args = [a.replace("{port}", str(port)) for a in args]
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), *args],
                              env=dict(base, LOCAL_RANK=str(r), RANK=str(r)) if ddp_env and world > 1 else base,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    results = []
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]  # a hang (e.g. at an epoch's end) fails here
    finally:
        for p in procs:
            p.kill()
    if any(p.returncode != 0 and ("EADDRINUSE" in err or "ddress already in use" in err)
           for p, (_, err) in zip(procs, outs)):
        raise _PortTaken()
    for p, (out, err) in zip(procs, outs):
        line = next((l for l in out.splitlines() if l.startswith("RESULT ")), None)
        assert p.returncode == 0 and line, err[-3000:]
        results.append(json.loads(line[len("RESULT "):]))
    return results
