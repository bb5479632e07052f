"""The ``ctr-lightning`` command: LightningCLI with ctr-lightning's models and DataModules."""

from __future__ import annotations

import inspect
import json
import logging
import re
import sys
import warnings
from pathlib import Path
from argparse import RawDescriptionHelpFormatter
from typing import Any

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter, Callback, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from ctr_lightning.callbacks import ScoreWriter, StreamProgressBar
from ctr_lightning.datamodules import (
    AvazuDataModule,
    CriteoDataModule,
    ParquetDataModule,
    SyntheticCriteoDataModule,
    SyntheticStreamDataModule,
)
from ctr_lightning.models import MODELS, CTRModule, DLRMModule

DEMO_HINT = """ctr-lightning: nothing to train on. Start from a config:

  ctr-lightning fit --config configs/demo.yaml        # a DLRM on synthetic Criteo-layout logs
  ctr-lightning fit --config configs/dcnv2.yaml       # the same data, DCN-v2 (also deepfm.yaml, wide_deep.yaml)
  ctr-lightning fit --config configs/criteo.yaml --data.train_paths [day_0.gz] --data.val_paths [day_1.gz]

or name the data yourself: ctr-lightning fit --data CriteoDataModule --data.train_paths [...].
ctr-lightning fit --help lists every model, DataModule and option."""


class _HelpFormatter(RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """Keeps the line breaks of the epilog."""


class CTRLightningCLI(LightningCLI):
    """LightningCLI whose model (any :class:`CTRModule`, DLRM unless named) takes its feature
    layout from the DataModule; streamed epochs get a progress bar with a total, and
    ``predict`` streams scores to files instead of holding them.

    Example::

        ctr-lightning fit --config configs/demo.yaml --trainer.max_steps 200
        ctr-lightning fit --config configs/demo.yaml --model DCNv2Module --model.cross_layers 2
    """

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # Data is chosen by class (--data CLASS), so its arguments are listed here as well.
        kwargs.setdefault("epilog", _datamodule_help())
        kwargs.setdefault("formatter_class", _HelpFormatter)
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The data decides the features; the model's tables follow them.
        parser.link_arguments("data.sparse_feature_names", "model.init_args.sparse_feature_names",
                              apply_on="instantiate")
        parser.link_arguments("data.num_dense_features", "model.init_args.num_dense_features", apply_on="instantiate")
        # A config's model: section without a class_path is a DLRM's, as before other models came.
        parser.set_defaults({"model": {"class_path": f"{DLRMModule.__module__}.{DLRMModule.__qualname__}"}})

    def before_instantiate_classes(self) -> None:
        if self.subcommand == "fit":
            continue_last_run(self.config["fit"])
        if self.subcommand == "predict" and self.config["predict"].get("return_predictions") is None:
            self.config["predict"]["return_predictions"] = False  # the ScoreWriter has them; memory stays flat

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        configured = config.get("callbacks") or []
        configured = configured if isinstance(configured, list) else [configured]  # one callback may come bare
        given = list(callbacks) + [c for c in configured if isinstance(c, Callback)]
        extra: list[Callback] = []
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
            extra.append(StreamProgressBar())
        if self.subcommand == "predict" and not any(isinstance(c, BasePredictionWriter) for c in given):
            root = config.get("default_root_dir") or "."
            extra.append(ScoreWriter(output_dir=str(Path(root) / "predictions")))
        return super()._instantiate_trainer(config, [*callbacks, *extra])


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
    lines = ["Models (pick with --model CLASS or a config's model.class_path, default DLRMModule, then set "
             "--model.ARG VALUE; --model.help CLASS shows types and defaults):"]
    for model in MODELS:
        lines.append(f"  {model.__name__}: " + ", ".join(f"--model.{a}" for a in _init_arguments(model)
                                                         if a not in _init_arguments(CTRModule)))
    lines.append("  every model: " + ", ".join(f"--model.{a}" for a in _init_arguments(CTRModule)))
    lines += ["DataModules (pick with --data CLASS or a config's data.class_path, then set --data.ARG VALUE;"
              " --data.help CLASS shows types and defaults):"]
    for cls in (CriteoDataModule, SyntheticCriteoDataModule, AvazuDataModule, ParquetDataModule,
                SyntheticStreamDataModule):
        lines.append(f"  {cls.__name__}: " + ", ".join(f"--data.{a}" for a in _init_arguments(cls)))
    lines.append("Also: ctr-lightning predict --config X --ckpt_path PATH --data.predict_paths [...] streams scores "
                 "to predictions/scores-rank<r>.tsv (ScoreWriter); ctr-lightning export --ckpt_path PATH --out DIR "
                 "writes a checkpoint's model for serving (Parquet tables, safetensors dense part).")
    return "\n".join(lines)


def _init_arguments(cls: type) -> list[str]:
    """The arguments a class takes, those its ``**kwargs`` pass on to its bases included
    (the format, which each DataModule builds itself, excluded; Lightning's own bases not read)."""
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass in (LightningDataModule, LightningModule):
            continue
        parameters = inspect.signature(klass.__init__).parameters.values()
        names += [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD or p.kind is p.KEYWORD_ONLY]
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return [n for n in dict.fromkeys(names) if n not in ("self", "log_format", "kwargs")]


_NULLS = ("null", "none", "~")
_STORAGE = re.compile(r"--model\.(?:init_args\.)?storage(?:\.init_args)?")
_STORAGE_KEY = re.compile(_STORAGE.pattern + r"\.(\w+)(=.*)?", re.DOTALL)


def _storage_args(args: list[str]) -> list[str]:
    """``--model.storage`` arguments as a user means them, where jsonargparse would not.

    The model is a subclass spec, and jsonargparse merges a mapping given for one of its
    class-typed arguments into the value the config already holds: AutoStorage's keys
    would land on the config's StorageConfig and fail. A ``null`` first makes
    ``--model.storage '{...}'`` a replacement; a ``class_path`` mapping or ``auto`` keep
    jsonargparse's own meaning. A dotted key set to null (``--model.storage.ssd_dir=null``)
    reaches jsonargparse as the string ``"None"`` (an SSD directory of that name) or fails
    an int's check, so it goes as a StorageConfig mapping with that key null, which
    jsonargparse merges as meant (a storage that is ``auto`` or an AutoStorage then
    becomes a StorageConfig: these keys are StorageConfig's). Other dotted keys go as
    given. ``--model.init_args.storage...``, jsonargparse's full spelling, counts the same.
    """
    from ctr_lightning.embedding import StorageConfig

    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        value, step = None, 1
        if _STORAGE.fullmatch(arg) and i + 1 < len(args):
            value, step = args[i + 1], 2
        elif _STORAGE.fullmatch(arg.split("=", 1)[0]) and "=" in arg:
            value = arg.split("=", 1)[1]
        if value is not None and value.lstrip().startswith("{") and "class_path" not in value:
            out += ["--model.storage", "null", "--model.storage", value]
            i += step
            continue
        dotted = _STORAGE_KEY.fullmatch(arg)
        if dotted and dotted.group(1) in StorageConfig.__dataclass_fields__:
            if dotted.group(2) is not None:
                value = dotted.group(2)[1:]
            elif i + 1 < len(args):
                value, step = args[i + 1], 2
            if value is not None and value.strip().lower() in _NULLS:
                out += ["--model.storage", json.dumps({"class_path": "ctr_lightning.embedding.StorageConfig",
                                                       "init_args": {dotted.group(1): None}})]
                i += step
                continue
        out.append(arg)
        i += 1
    return out


def _names_data(args: list[str]) -> bool:
    """Whether a command line can name its data: a config, a --data option, or a help or
    print request (which needs none)."""
    return any(a.startswith(("--config", "--data", "-h", "--help", "--print_config")) or a == "-c" for a in args)


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
    if argv[:1] in (["fit"], ["validate"], ["test"], ["predict"]) and not _names_data(argv[1:]):
        print(DEMO_HINT, file=sys.stderr)
        raise SystemExit(2)
    warnings.filterwarnings("ignore", message="Couldn.t infer the batch indices")  # ScoreWriter needs none
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
    if args is None:
        sys.argv[1:] = _storage_args(argv)  # LightningCLI warns when given args beside sys.argv
    else:
        args = _storage_args(list(args))
    CTRLightningCLI(
        CTRModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
