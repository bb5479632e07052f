"""The cost model against a published result, and plans for clusters that are not here.

TorchRec's DLRM on Criteo 1TB (facebookresearch/dlrm, ``torchrec_dlrm`` README: 26 tables
of dim 128 capped at 40M rows, bottom MLP 512-256-128, top 1024-1024-512-256-1, row-wise
Adagrad, global batch 16384) trains at about 1.67M examples/s on 8 A100s and about 740k
on one. The A100 rates are vendors' figures (``HardwareRates.published``), fixed before
this comparison, not fitted to it; the machine is the recorded DGX A100
(tests/topology/machines/dgx_a100.json). Prints both estimates against the figures, then
the plan for a 10 TB model on 16 such nodes with k-step merging, the paper's setting.

    python benchmarks/plan_published.py
"""

from __future__ import annotations

from pathlib import Path

from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding import RowWiseAdagrad
from ctr_lightning.topology import Machine, ModelShape, PlanOptions, plan

DGX = Path(__file__).resolve().parents[1] / "tests/topology/machines/dgx_a100.json"
# MLPerf / torchrec_dlrm's num_embeddings_per_feature for Criteo 1TB with the 40M cap.
CRITEO_1TB = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938,
              155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
PUBLISHED = {1: 740e3, 8: 1.67e6}


def criteo_shape(batch: int, rows: list[int] = CRITEO_1TB, k: int = 1, sparse_sync: str = "step") -> ModelShape:
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=128, num_embeddings=n, feature_names=[f"f{i}"])
              for i, n in enumerate(rows)]
    return ModelShape.dlrm(tables, RowWiseAdagrad(lr=0.005), batch, 13, (512, 256), (1024, 1024, 512, 256, 1), k=k,
                            sparse_sync=sparse_sync)


def main() -> None:
    dgx = Machine.load(DGX)
    size = sum(CRITEO_1TB) * criteo_shape(1).row_bytes(criteo_shape(1).tables[0])
    print(f"TorchRec DLRM, Criteo 1TB: {sum(CRITEO_1TB):,} rows, {size / 2**30:.1f} GiB with row-wise Adagrad")
    print("| GPUs | batch a GPU | estimated step | estimated examples/s | published | estimate / published |")
    print("|---|---|---|---|---|---|")
    for gpus, figure in PUBLISHED.items():
        p = plan(dgx, criteo_shape(16384 // gpus), options=PlanOptions(ranks_per_node=gpus))
        e = p.step_estimate
        print(f"| {gpus} | {16384 // gpus} | {e.seconds * 1e3:.1f} ms ("
              + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in e.parts.items() if v > 5e-5)
              + f") | {p.examples_per_second:,.0f} | {figure:,.0f} | {p.examples_per_second / figure:.2f}x |")
        if gpus == 1:
            t = max(p.tables, key=lambda t: t.rows)
            print(f"|   | | one GPU: {t.name} keeps {t.device_rows:,} of {t.rows:,} rows in HBM, {t.host_rows:,} in "
                  f"DRAM ({t.device_coverage:.3f} of lookups from HBM under Zipf 1.05) | | | |")

    # The paper's setting: 10 TB of sparse parameters, 16 nodes, k-step merging across nodes.
    rows = 10 * 10**12 // criteo_shape(1).row_bytes(criteo_shape(1).tables[0]) // 26
    step = plan(dgx, criteo_shape(2048, [rows] * 26, k=16), options=PlanOptions(num_nodes=16))
    shape = criteo_shape(2048, [rows] * 26, k=16, sparse_sync="k_step")
    p = plan(dgx, shape, options=PlanOptions(num_nodes=16))
    lines = p.to_text().splitlines()
    print()
    print(f"10 TB model: 26 tables x {rows:,} rows of 516 B, 16 DGX A100 nodes, k=16 for the dense part and the "
          f"tables (sparse_sync='k_step'); with the tables synced every step instead: "
          f"{step.step_estimate.seconds * 1e3:.0f} ms a step, {step.step_estimate.link_bytes['inter-node'] / 2**30:.2f} "
          f"GiB a step across nodes")
    table_rows = [line for line in lines if line.startswith("t") and not line.startswith("table")]
    print("\n".join(lines[:3] + [""] + lines[4:5] + table_rows[:3] + ["..."]))
    rank_lines = [line for line in lines if line[:4].strip().isdigit()]
    header = next(line for line in lines if line.startswith("rank"))
    print("\n".join([header] + rank_lines[:9] + ["... (128 ranks)"] + lines[-3:]))


if __name__ == "__main__":
    main()
