"""The SSD log's location index as it grows: one index grown whole at 82% (the anchor: the
design up to commit 5675b8c, loaded from git) against 256 shards grown one by one at their
own loads (now), side by side in ONE run, on the same keys.

Each write puts ``--batch`` new keys (as the SSD writer does with the rows a step evicts)
and each write is followed by a lookup of ``--batch`` keys, half stored, half not (as a step's
misses). Per design it prints the median and the longest write, their ratio (what the
out-of-core run's longest step waits on), the lookups' time a key, bytes an entry, and
the ratios now / anchor. The two run in lockstep: each write and lookup on one, then on the
other, alternating which goes first.

    python benchmarks/bench_ssd_index.py [--keys 20000000 --batch 50000]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ctr_lightning.embedding.tiers.ssd.location_index import LocationIndex

ROOT = Path(__file__).resolve().parents[1]
ANCHOR_COMMIT = "5675b8c"


def anchor_class() -> type:
    """The LocationIndex of ``ANCHOR_COMMIT`` (one table grown by half at 82%)."""
    source = subprocess.run(["git", "show", f"{ANCHOR_COMMIT}:ctr_lightning/embedding/tiers/ssd/location_index.py"],
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "anchor_location_index.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("anchor_location_index", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LocationIndex


def run(classes: dict[str, type], keys: int, batch: int) -> dict[str, dict[str, float]]:
    """Both designs in lockstep, each write and lookup timed for one then the other (the
    order alternating), so load on the machine falls on both alike."""
    rng = np.random.default_rng(0)
    indexes = {name: cls() for name, cls in classes.items()}
    tables = np.zeros(batch, dtype=np.int64)
    writes = {name: [] for name in classes}
    lookups = {name: [] for name in classes}
    previous = None
    for n, start in enumerate(range(0, keys, batch)):
        ids = rng.integers(0, 2**62, batch)
        query = np.concatenate([rng.choice(previous if previous is not None else ids, batch // 2),
                                rng.integers(0, 2**62, batch - batch // 2)])
        order = list(indexes) if n % 2 == 0 else list(indexes)[::-1]
        for name in order:
            t0 = time.perf_counter()
            indexes[name].put(tables, ids, np.full(batch, -1), np.arange(start, start + batch))
            writes[name].append(time.perf_counter() - t0)
        for name in order:
            t0 = time.perf_counter()
            indexes[name].lookup(tables, query)
            lookups[name].append(time.perf_counter() - t0)
        previous = ids
    out = {}
    for name, index in indexes.items():
        writes_ms = np.array(writes[name][2:]) * 1e3  # the first writes compile the kernels
        out[name] = {"median_write_ms": float(np.median(writes_ms)), "longest_write_ms": float(writes_ms.max()),
                     "total_write_s": float(np.sum(writes[name])),
                     "lookup_ns": float(np.median(lookups[name][2:]) / batch * 1e9),
                     "bytes_per_entry": index.nbytes / len(index)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=20_000_000)
    parser.add_argument("--batch", type=int, default=50_000)
    args = parser.parse_args()
    designs = {"anchor: one index grown whole": anchor_class(), "now: 256 shards grown one by one": LocationIndex}
    run(designs, 4 * args.batch, args.batch)  # compile
    results = run(designs, args.keys, args.batch)
    for name, r in results.items():
        print(f"{name}: write median {r['median_write_ms']:.2f} ms, longest {r['longest_write_ms']:.1f} ms "
              f"({r['longest_write_ms'] / r['median_write_ms']:.1f}x), all writes {r['total_write_s']:.2f} s, "
              f"lookup {r['lookup_ns']:.0f} ns a key, {r['bytes_per_entry']:.1f} B an entry", flush=True)
    old, new = results.values()
    print(f"\n{args.keys:,} keys in writes of {args.batch:,}: now / anchor")
    print(f"  longest write:  {new['longest_write_ms'] / old['longest_write_ms']:.2f}x")
    print(f"  longest / median write: {new['longest_write_ms'] / new['median_write_ms']:.1f}x vs "
          f"{old['longest_write_ms'] / old['median_write_ms']:.1f}x")
    print(f"  all writes:     {new['total_write_s'] / old['total_write_s']:.2f}x")
    print(f"  lookup a key:   {new['lookup_ns'] / old['lookup_ns']:.2f}x")
    print(f"  bytes an entry: {new['bytes_per_entry']:.1f} vs {old['bytes_per_entry']:.1f}")


if __name__ == "__main__":
    sys.exit(main())
