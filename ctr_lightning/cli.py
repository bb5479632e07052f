"""The ``ctr-lightning`` command: LightningCLI with ctr-lightning's models and DataModules."""

from __future__ import annotations

import inspect
import logging
import re
import sys
from pathlib import Path
from argparse import RawDescriptionHelpFormatter
from typing import Any

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from ctr_lightning.datamodules import (
    AvazuDataModule,
    CriteoDataModule,
    ParquetDataModule,
    SyntheticCriteoDataModule,
    SyntheticStreamDataModule,
)
from ctr_lightning.models import DLRMModule


class _HelpFormatter(RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """Keeps the line breaks of the epilog."""


class CTRLightningCLI(LightningCLI):
    """LightningCLI whose model takes its feature layout from the DataModule.

    Example::

        ctr-lightning fit --config configs/demo.yaml --trainer.max_steps 200
    """

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # Data is chosen by class (--data CLASS), so its arguments are listed here as well.
        kwargs.setdefault("epilog", _datamodule_help())
        kwargs.setdefault("formatter_class", _HelpFormatter)
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The data decides the features; the model's tables follow them.
        parser.link_arguments("data.sparse_feature_names", "model.sparse_feature_names", apply_on="instantiate")
        parser.link_arguments("data.num_dense_features", "model.num_dense_features", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        if self.subcommand == "fit":
            continue_last_run(self.config["fit"])


def continue_last_run(config: Any) -> None:
    """``fit --ckpt_path last`` resumes the newest run of the configured logger, in its own
    log directory.

    Lightning looks for ``last.ckpt`` in the checkpoint directory of *this* run, which for
    a logger with automatic versions is a new, empty ``version_N``, so a resume would
    quietly start from scratch. Here the logger's version is set to the newest earlier
    version that holds a ``last*.ckpt`` (when none is set and no ModelCheckpoint names its
    own ``dirpath``): Lightning then finds that checkpoint, and the resumed run logs on
    into the same TensorBoard directory.
    """
    if config.get("ckpt_path") != "last":
        return
    trainer = config.get("trainer") or {}
    logger = trainer.get("logger")
    if not hasattr(logger, "get") or logger.get("init_args") is None:
        return  # no logger, several loggers, or True (Lightning's default, which resolves its own)
    args = logger["init_args"]
    if args.get("version") is not None or args.get("save_dir") is None:
        return
    for callback in trainer.get("callbacks") or []:
        if "ModelCheckpoint" in str(callback.get("class_path", "")) and (callback.get("init_args") or {}).get("dirpath"):
            return  # checkpoints in a fixed directory: Lightning finds last.ckpt there itself
    runs = Path(args["save_dir"]) / (args.get("name") or "")
    versions = [(int(m.group(1)), d) for d in runs.glob("version_*")
                if (m := re.fullmatch(r"version_(\d+)", d.name)) and any((d / "checkpoints").glob("last*.ckpt"))]
    if versions:
        version = max(versions)[0]
        args["version"] = version
        rank_zero_info(f"--ckpt_path last: resuming {runs / f'version_{version}'}, logging on into it")


def _datamodule_help() -> str:
    lines = ["DataModules (pick with --data CLASS or a config's data.class_path, then set --data.ARG VALUE;"
             " --data.help CLASS shows types and defaults):"]
    for cls in (CriteoDataModule, SyntheticCriteoDataModule, AvazuDataModule, ParquetDataModule,
                SyntheticStreamDataModule):
        lines.append(f"  {cls.__name__}: " + ", ".join(f"--data.{a}" for a in _init_arguments(cls)))
    lines.append("Also: ctr-lightning export --ckpt_path PATH --out DIR writes a checkpoint's model for serving "
                 "(Parquet tables, safetensors dense part).")
    return "\n".join(lines)


def _init_arguments(cls: type) -> list[str]:
    """The arguments a class takes, those its ``**kwargs`` pass on to its bases included
    (the format, which each DataModule builds itself, excluded)."""
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is LightningDataModule:
            continue
        parameters = inspect.signature(klass.__init__).parameters.values()
        names += [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD or p.kind is p.KEYWORD_ONLY]
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return [n for n in dict.fromkeys(names) if n not in ("self", "log_format")]


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["export"]:  # not a Trainer method: a command of its own
        from ctr_lightning.serving_export import main as export_main

        export_main(argv[1:])
        return
    if argv[:1] in (["plan"], ["topology"]):
        from ctr_lightning.topology.plan_command import plan_main, topology_main

        (plan_main if argv[0] == "plan" else topology_main)(argv[1:])
        return
    # torchrec's KJT asks torch.fx whether it is tracing, which warns once per process.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    # fbgemm_gpu logs INFO lines through the root logger, whose implicit basicConfig() then
    # echoes all of Lightning's output a second time. One WARNING handler of our own stops both.
    for handler in list(logging.root.handlers):
        logging.root.removeHandler(handler)
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)  # records propagated from other loggers skip the root's level
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.root.addHandler(handler)
    logging.root.setLevel(logging.WARNING)
    CTRLightningCLI(
        DLRMModule,
        LightningDataModule,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
