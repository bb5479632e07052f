"""``ctr-lightning plan`` and ``ctr-lightning topology``: the machine and the plan for a config,
without training."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from ctr_lightning.embedding.optimizers import SPARSE_OPTIMIZERS
from ctr_lightning.embedding.table_setup import MACHINE_CHECKS
from ctr_lightning.topology.access_profile import TableAccess, measure_access
from ctr_lightning.topology.discovery import discover
from ctr_lightning.topology.machine import Machine
from ctr_lightning.topology.placement_plan import Plan, PlanError
from ctr_lightning.topology.planner import ModelShape, PlanOptions, plan


def describe_machine(machine: Machine) -> str:
    """A few lines per NUMA node, GPU, NIC and drive."""
    lines = [f"machine {machine.hostname}: {len(machine.cpus)} CPUs usable, "
             f"{_gib(machine.memory_bytes)} memory ({_gib(machine.free_memory_bytes)} free)"]
    for n in machine.numa_nodes:
        lines.append(f"  numa node {n.id}: {len(n.cpus)} CPUs, {_gib(n.memory_bytes)} ({_gib(n.free_bytes)} free)")
    for g in machine.gpus:
        lines.append(f"  gpu {g.index}: {g.name or '?'} on numa {_opt(g.numa_node)}, "
                     f"{_gib(g.memory_bytes)} ({_gib(g.free_bytes)} free), pci {_opt(g.pci_address)}")
    if machine.gpus:
        lines.append(f"  nvlink islands: {'unknown' if machine.nvlink_groups is None else list(machine.nvlink_groups)}")
    for nic in machine.nics:
        speed = "speed unknown" if nic.speed_mbps is None else f"{nic.speed_mbps / 1000:g} Gb/s"
        lines.append(f"  nic {nic.name}: {speed} on numa {_opt(nic.numa_node)}, pci {_opt(nic.pci_address)}")
    for d in machine.drives:
        rot = {None: "?", True: "rotational", False: "solid-state"}[d.rotational]
        lines.append(f"  drive {d.name} ({d.kind or '?'}, {rot}, {_gib(d.size_bytes)}) on numa {_opt(d.numa_node)}")
        for fs in d.file_systems:
            lines.append(f"    {fs.mount_point} {fs.fstype} {_gib(fs.free_bytes)} free of {_gib(fs.total_bytes)}"
                         f"{'' if fs.writable else ', read-only'}")
    lines += [f"  note: {n}" for n in machine.notes]
    return "\n".join(lines)


def shape_from_config(config: Mapping[str, Any], rows_per_table: int | None = None) -> tuple[ModelShape, Any]:
    """The :class:`ModelShape` of a ``ctr-lightning fit`` config (any :class:`CTRModule`,
    DLRM unless its ``model.class_path`` names another, and its data), and the DataModule,
    built but not set up."""
    from ctr_lightning.models import DLRMModule

    model_class, model = model_from_config(config)
    data_spec = config.get("data") or {}
    if "class_path" not in data_spec:
        raise ValueError("the config has no data.class_path: plan needs the DataModule to know the features")
    module, _, name = data_spec["class_path"].rpartition(".")
    datamodule = getattr(importlib.import_module(module), name)(**(data_spec.get("init_args") or {}))
    features = list(getattr(datamodule, "sparse_feature_names", None) or model["sparse_feature_names"])
    dense_in = getattr(datamodule, "num_dense_features", None)
    dense_in = model["num_dense_features"] if dense_in is None else dense_in
    batch = (data_spec.get("init_args") or {}).get("batch_size") or getattr(datamodule, "batch_size", None)
    if not batch:
        raise ValueError(f"{data_spec['class_path']}: no batch_size in the config")
    rows = rows_per_table or model["num_embeddings"]
    strategy = (config.get("trainer") or {}).get("strategy")
    k = 1
    if isinstance(strategy, Mapping) and str(strategy.get("class_path", "")).endswith("KStepAdamStrategy"):
        k = int((strategy.get("init_args") or {}).get("k", 1))
    sparse_sync = model.get("sparse_sync") or "step"
    if sparse_sync == "k_step":  # the tables' interval: sync_every, else the strategy's k, else 16
        k = int(model.get("sync_every") or (k if k > 1 else 16))
    optimizer = SPARSE_OPTIMIZERS[model.get("sparse_optimizer") or "adam"](lr=model["sparse_learning_rate"])
    if issubclass(model_class, DLRMModule):
        tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=model["embedding_dim"], num_embeddings=rows,
                                     feature_names=[f]) for f in features]
        shape = ModelShape.dlrm(tables, optimizer, int(batch), int(dense_in), model["dense_arch_layer_sizes"],
                                model["over_arch_layer_sizes"], k=k, sparse_sync=sparse_sync)
        return shape, datamodule
    # Another model: its dense part counted from the built module (tables in memory, no rows
    # created), about 6 FLOPs per parameter and example for its linear layers' forward and backward.
    built = model_class(**{**model, "sparse_feature_names": features, "num_dense_features": int(dense_in),
                           "storage": None, "sharding": "row_wise", "sparse_sync": "step"})
    params = sum(p.numel() for p in built.dense_parameters())
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=built.table_dim, num_embeddings=rows,
                                 feature_names=[f]) for f in features]
    return ModelShape(tuple(tables), optimizer, int(batch), 6.0 * params, params, k, sparse_sync), datamodule


def model_from_config(config: Mapping[str, Any]) -> tuple[type, dict[str, Any]]:
    """A config's model class (DLRMModule unless ``model.class_path`` names another) and its
    arguments, the class's defaults filled in."""
    from ctr_lightning.models import DLRMModule

    spec = dict(config.get("model") or {})
    model_class: type = DLRMModule
    if "class_path" in spec:
        path = str(spec["class_path"])
        module, _, name = path.rpartition(".")
        model_class = getattr(importlib.import_module(module or "ctr_lightning.models"), name)
        spec = dict(spec.get("init_args") or {})
    defaults: dict[str, Any] = {}
    for klass in reversed(model_class.__mro__):
        if "__init__" in vars(klass) and klass.__module__.startswith("ctr_lightning"):
            defaults.update({p.name: p.default for p in inspect.signature(klass.__init__).parameters.values()
                             if p.default is not inspect.Parameter.empty})
    return model_class, {**defaults, **spec}


def plan_for_config(config: Mapping[str, Any], machine: Machine, num_nodes: int | None = None,
                    ranks_per_node: int | None = None, profile_batches: int = 0,
                    rows_per_table: int | None = None, ssd_dirs: tuple[str, ...] = ()) -> Plan:
    """The plan ``ctr-lightning fit`` makes for ``config`` on machines like ``machine``."""
    shape, datamodule = shape_from_config(config, rows_per_table)
    trainer = config.get("trainer") or {}
    _, model = model_from_config(config)
    storage = model.get("storage") if isinstance(model.get("storage"), Mapping) else {}
    storage = storage.get("init_args") or {} if "class_path" in storage else storage  # a parsed config's spec
    devices = trainer.get("devices")
    accelerator = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu"}.get(str(trainer.get("accelerator", "auto")), "auto")
    # storage: a StorageConfig's ssd_dir, or AutoStorage's ssd_dirs and fractions.
    auto = {k: storage[k] for k in ("dram_fraction", "hbm_fraction", "reserve_bytes") if k in storage}
    configured = tuple(storage.get("ssd_dirs") or ()) or ((storage["ssd_dir"],) if storage.get("ssd_dir") else ())
    options = PlanOptions(
        num_nodes=num_nodes or int(trainer.get("num_nodes", 1)),
        ranks_per_node=ranks_per_node or (devices if isinstance(devices, int) else None),
        accelerator=accelerator,
        ssd_dirs=ssd_dirs or configured,
        sharding=model.get("sharding", _default("sharding")),  # what fit would use
        **auto,
    )
    access: dict[str, TableAccess] | None = None
    if profile_batches:
        datamodule.setup("fit")
        access = measure_access(datamodule.train_dataloader(), {t.name: list(t.feature_names) for t in shape.tables},
                                {t.name: t.num_embeddings for t in shape.tables}, profile_batches)
    return plan(machine, shape, access, options)


def _default(name: str) -> Any:
    from ctr_lightning.models import CTRModule

    return inspect.signature(CTRModule.__init__).parameters[name].default


def plan_main(argv: list[str] | None = None) -> None:
    """``ctr-lightning plan --config X.yaml [fit's --model.* / --data.* / --trainer.* options]
    [--topology FILE.json] [--num_nodes N] ...``."""
    parser = argparse.ArgumentParser(
        prog="ctr-lightning plan",
        description="Print the machine's topology and the tiers `ctr-lightning fit` would set up with the same "
                    "config and options: per table its HBM / DRAM / SSD split; under storage: auto the placement "
                    "plan fit makes (per rank its GPU, CPUs, NIC and SSD directory, the bytes a step on each link "
                    "and the estimated step time).",
        epilog="Every other option is fit's and means what it means there: --config (several merge in order), "
               "--model.*, --data.*, --trainer.*.")
    parser.add_argument("--topology", help="a machine description (JSON from `ctr-lightning topology --save`) "
                                           "to plan for instead of this machine")
    parser.add_argument("--num_nodes", type=int, help="nodes like it (default: the config's trainer.num_nodes)")
    parser.add_argument("--ranks_per_node", type=int, help="default: trainer.devices, else one per GPU, else 1")
    parser.add_argument("--profile_batches", type=int, default=0,
                        help="count ids over the data's first N batches for each table's skew (default 0: "
                             "assume Zipf 1.05 over num_embeddings)")
    parser.add_argument("--rows_per_table", type=int, help="expected rows per table (default: num_embeddings)")
    parser.add_argument("--ssd_dir", action="append", default=[], help="an SSD directory (repeat for several)")
    parser.add_argument("--json", help="also write the tiers per table (and the plan) as JSON to this file")
    args, fit_args = parser.parse_known_args(argv)
    if not any(a.startswith(("--config", "--model", "--data")) or a == "-c" for a in fit_args):
        parser.error("give the config fit would run: --config X.yaml (and any of fit's options)")
    name = " + ".join(_config_names(fit_args)) or "the command line's config"
    # Another machine's plan: this one's SSD directories and memory are not the question.
    checks = MACHINE_CHECKS.set(not args.topology)
    try:
        config, model = fit_setup(fit_args)
    except (MemoryError, OSError) as err:  # what fit would refuse on this machine too
        raise SystemExit(f"ctr-lightning plan: {name} does not fit this machine: {err}") from None
    finally:
        MACHINE_CHECKS.reset(checks)
    machine = Machine.load(args.topology) if args.topology else discover()
    collections = _collections(model)
    tiers = {n: t for c in collections if c.auto_storage is None for n, t in c.table_tiers().items()}
    out: dict[str, Any] = {"tiers": tiers}
    text = [describe_machine(machine), ""]
    auto = any(c.auto_storage is not None for c in collections)
    try:
        result = plan_for_config(config, machine, args.num_nodes, args.ranks_per_node, args.profile_batches,
                                 args.rows_per_table, tuple(args.ssd_dir))
    except PlanError as err:
        if auto:  # fit plans the same way at its start, and stops there
            raise SystemExit(f"ctr-lightning plan: {name} does not fit: {err}") from None
        result, refusal = None, str(err)
    if auto:
        text.append(result.to_text(""))
        out["plan"] = result.to_text("")
    else:
        rows = args.rows_per_table or int(getattr(model, "hparams", {}).get("num_embeddings") or 0) or None
        accelerator = str((config.get("trainer") or {}).get("accelerator") or "auto")
        on_cpu = accelerator == "cpu" or not machine.gpus
        text.append(describe_tiers(tiers, rows, machine, name, on_cpu))
        text.append("")
        text.append("With storage: auto, fit would plan instead:" if result is not None else
                    f"With storage: auto, fit would refuse this machine: {refusal}")
        if result is not None:
            text.append(result.to_text(""))
    print("\n".join(text))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


def fit_setup(fit_args: list[str]) -> tuple[dict[str, Any], Any]:
    """What ``ctr-lightning fit`` with these options builds: its parsed config (model, data and
    trainer sections, overrides applied) and the model; a setting fit refuses ends the command."""
    from ctr_lightning.cli import CTRLightningCLI, build_cli

    class _PlanCLI(CTRLightningCLI):
        def instantiate_trainer(self, **kwargs: Any) -> Any:
            return None  # nothing runs: the model's tables and the data's shape are what plan reads

    cli = build_cli(fit_args, run=False, cli_class=_PlanCLI, parser_kwargs={"prog": "ctr-lightning plan"})
    config = cli.config.as_dict()
    return {key: config.get(key) for key in ("model", "data", "trainer")}, cli.model


def describe_tiers(tiers: Mapping[str, Mapping[str, Any]], rows: int | None, machine: Machine, name: str,
                   on_cpu: bool = True) -> str:
    """The tiers fit sets up as the config gives them, per table, and the DRAM they take at
    ``rows`` rows a table against this machine's (the device tier counts where it is DRAM:
    ``on_cpu``)."""
    lines = [f"Tiers fit sets up ({name}: storage as configured; rows a tier holds, 'all': every row the table gets)",
             f"{'table':<12}{'device tier':>14}{'host tier':>14}  ssd_dir"]
    memory = 0
    for table, t in tiers.items():
        device = "all" if t["device_rows"] is None else f"{t['device_rows']:,}"
        host = "all" if t["host_rows"] is None else f"{t['host_rows']:,}"
        lines.append(f"{table:<12}{device:>14}{host:>14}  {t['ssd_dir'] or '-'}")
        if rows:
            device = rows if t["device_rows"] is None else min(rows, t["device_rows"])
            host = 0 if t["device_rows"] is None else (rows - device if t["host_rows"] is None
                                                      else min(rows - device, t["host_rows"]))
            memory += (device * on_cpu + host) * t["row_bytes"]
    if rows:
        free = machine.free_memory_bytes
        tiers_named = "the device and host tiers" if on_cpu else "the host tiers (the device tier is GPU memory)"
        over = free is not None and memory > free
        lines.append(f"at {rows:,} rows a table {tiers_named} hold {_gib(memory)} of DRAM (this machine has "
                     f"{_gib(free)} free{': more than that, so fit would be killed as the rows arrive' if over else ''})")
    return "\n".join(lines)


def _collections(model: Any) -> list[Any]:
    from ctr_lightning.embedding.tiered import TieredEmbeddingBagCollection

    return [m for m in model.modules() if isinstance(m, TieredEmbeddingBagCollection)]


def _config_names(args: list[str]) -> list[str]:
    return [args[i + 1] if a in ("--config", "-c") else a.split("=", 1)[1]
            for i, a in enumerate(args) if a in ("--config", "-c") and i + 1 < len(args) or a.startswith("--config=")]


def topology_main(argv: list[str] | None = None) -> None:
    """``ctr-lightning topology [--save FILE.json]``."""
    parser = argparse.ArgumentParser(prog="ctr-lightning topology",
                                     description="Print this machine's topology, read from /sys and /proc.")
    parser.add_argument("--save", help="also write it as JSON, for `ctr-lightning plan --topology`")
    args = parser.parse_args(argv)
    machine = discover()
    print(describe_machine(machine))
    if args.save:
        machine.save(args.save)
        print(f"saved to {args.save}")


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _opt(value: object) -> str:
    return "?" if value is None else str(value)
