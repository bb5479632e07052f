"""The ratios bench_kstep.sh prints for one link rate, from its ``config=steps_per_s=bytes``
results: each to stderr, and on stdout the line for k-step on both parts against fully
synchronous training (empty without those two configurations).

    python benchmarks/kstep_ratios.py 100mbit k1=1.05=8900000 k16=4.4=1050000 ...
"""

from __future__ import annotations

import sys

PAIRS = [("k16", "k1", "k16 / k1 (target >= 4)"), ("k16_fp32", "k1", "k16 float32 moments / k1"),
         ("k16_overlap", "k1", "k16 overlapped / k1"), ("k16", "k16_fp32", "k16 bfloat16 / float32 moments"),
         ("k16", "ddp_avg16", "k16 / DDPStrategy(model_averaging_period=16)"),
         ("emb_step", "emb_sync", "tables: dense k16, sparse per step / synchronous"),
         ("emb_sparse16", "emb_sync", "tables: dense k1, sparse k16 / synchronous"),
         ("emb_k16", "emb_step", "tables: sparse k16 / sparse per step (dense k16)"),
         ("emb_k16", "emb_sync", "tables: k16 dense+sparse / synchronous")]


def main(argv: list[str]) -> None:
    rate = argv[0]
    results = {name: (float(speed), float(sent)) for name, speed, sent in (a.split("=") for a in argv[1:])}
    for a, b, label in PAIRS:
        if a in results and b in results:
            speedup, fewer = results[a][0] / results[b][0], results[b][1] / max(results[a][1], 1.0)
            print(f"{label:<50} {speedup:.2f}x steps/s, {fewer:.1f}x fewer bytes", file=sys.stderr)
    if "emb_k16" in results and "emb_sync" in results:
        (fast, few), (slow, many) = results["emb_k16"], results["emb_sync"]
        print(f"k16 dense+sparse / synchronous: {fast / slow:.2f}x steps/s, {many / max(few, 1.0):.1f}x fewer bytes"
              + ("" if rate == "100mbit" else f" (at {rate})"))


if __name__ == "__main__":
    main(sys.argv[1:])
