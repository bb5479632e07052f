"""The machine's topology, and the placement plan made from it.

``discover()`` reads this machine (NUMA nodes, GPUs, NICs, drives, NVLink islands);
``plan(machine, shape)`` places tables on ranks and tiers and ranks on devices, priced by
a cost model. ``ctr-lightning plan --config X.yaml`` prints both. ``place_tables`` is the placer of
``storage="auto"`` (a ``TablePlacer``): it plans one rank's tiers where it runs.
"""

from ctr_lightning.topology.access_profile import TableAccess, measure_access
from ctr_lightning.topology.auto_placement import Placement, place_tables
from ctr_lightning.topology.cost_model import HardwareRates, StepEstimate
from ctr_lightning.topology.discovery import discover
from ctr_lightning.topology.gpu_links import TopoMatrix, parse_topo_matrix
from ctr_lightning.topology.machine import Drive, FileSystem, Gpu, Machine, Nic, NumaNode
from ctr_lightning.topology.placement_plan import Plan, PlanError, RankPlacement, TablePlacement
from ctr_lightning.topology.planner import ModelShape, PlanOptions, plan

__all__ = [
    "Drive", "FileSystem", "Gpu", "HardwareRates", "Machine", "ModelShape", "Nic", "NumaNode", "Plan",
    "PlanError", "PlanOptions", "RankPlacement", "StepEstimate", "TableAccess", "TablePlacement", "TopoMatrix",
    "discover", "measure_access", "parse_topo_matrix", "plan",
    "Placement", "place_tables",
]
