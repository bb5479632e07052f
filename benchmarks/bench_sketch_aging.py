"""Admission's sighting sketch over a run without end: counters that only grow (the anchor,
``Admission(admit_after=2)``) against counters halved every ``--halve_every`` steps
(``Admission(admit_after=2, halve_every=...)``), side by side in ONE run on the same stream.

The stream: every step ``--batch`` lookups of one table, a share ``--new`` of them ids never
seen before (each seen once, ever: an admission filter should give them no row) and the
rest from a Zipf head of recurring ids. A sketch of fixed size that never forgets fills up
with the once-seen ids, and their collisions then admit new ids at their first sighting:
rows a rare id should not get. Per period of ``--report`` steps it prints, for each setting,
the share of once-seen ids admitted (false admissions), the share of the sketch's counters
not zero, and the ratio halving / anchor.

    python benchmarks/bench_sketch_aging.py [--steps 1500 --batch 20000 --new 0.2 --halve_every 250]
"""

from __future__ import annotations

import argparse

import numpy as np

from ctr_lightning.embedding import Admission
from ctr_lightning.embedding.lifecycle.admission_gate import AdmissionGate
from ctr_lightning.embedding.lifecycle.sighting_sketch import min_sketch_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=20000)
    parser.add_argument("--new", type=float, default=0.2, help="share of a step's lookups that are once-seen ids")
    parser.add_argument("--halve_every", type=int, default=250)
    parser.add_argument("--sketch_bytes", type=int, default=Admission().sketch_bytes, help="per table (default: "
                        f"Admission's, 4 MiB; the least is {min_sketch_bytes()})")
    parser.add_argument("--report", type=int, default=250)
    args = parser.parse_args()

    settings = {"anchor: never halved": Admission(admit_after=2, sketch_bytes=args.sketch_bytes),
                f"halved every {args.halve_every} steps": Admission(admit_after=2, sketch_bytes=args.sketch_bytes,
                                                                    halve_every=args.halve_every)}
    gates = {name: AdmissionGate(["t"], [s], [(1, 0)]) for name, s in settings.items()}
    stored = {name: np.empty(0, dtype=np.int64) for name in settings}  # head ids admitted: not counted, as in a table
    rng = np.random.default_rng(0)
    fresh = 1 << 50  # once-seen ids count up from here, far from the head's
    false = {name: 0 for name in settings}
    once = 0
    print(f"sketch {args.sketch_bytes} bytes; {args.batch} lookups a step, {args.new:.0%} once-seen ids")
    print(f"{'steps':>6} | " + " | ".join(f"{n}: once-seen admitted, counters used" for n in settings) + " | ratio")
    for step in range(args.steps):
        n_new = int(args.batch * args.new)
        new_ids = np.arange(fresh, fresh + n_new, dtype=np.int64)
        fresh += n_new
        head = (rng.zipf(1.2, args.batch - n_new) * 7919) % (1 << 40)
        ids, counts = np.unique(np.concatenate([head, new_ids]), return_counts=True)
        is_new = ids >= (1 << 50)
        once += int(is_new.sum())
        steps = np.array([step], dtype=np.int64)
        for name, gate in gates.items():
            unstored = is_new | ~np.isin(ids, stored[name], assume_unique=True)
            admitted = gate.admit(np.zeros(int(unstored.sum()), dtype=np.int64), ids[unstored], counts[unstored], steps)
            false[name] += int((admitted & is_new[unstored]).sum())
            stored[name] = np.union1d(stored[name], ids[unstored][admitted & ~is_new[unstored]])
        if (step + 1) % args.report == 0:
            shares = {name: false[name] / once for name in settings}
            used = {name: float((gate.sketches[0].counts > 0).mean()) for name, gate in gates.items()}
            names = list(settings)
            ratio = shares[names[1]] / shares[names[0]] if shares[names[0]] else float("nan")
            print(f"{step + 1:>6} | " + " | ".join(f"{shares[n]:.4f}, {used[n]:.3f}" for n in names)
                  + f" | {ratio:.3f}")
            false = {name: 0 for name in settings}
            once = 0


if __name__ == "__main__":
    main()
