"""The ``ctr-lightning`` command: LightningCLI with ctr-lightning's models and DataModules."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from argparse import RawDescriptionHelpFormatter
from typing import Any

import torch
from jsonargparse import DefaultHelpFormatter, Namespace
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter, Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_info

from ctr_lightning.callbacks import (
    BadLineMonitor,
    ExamplesPerSecond,
    HyperparameterTable,
    RunSummary,
    ScoreWriter,
    ShortRunLogging,
    StreamProgressBar,
)
from ctr_lightning.datamodules import (
    DriftingLogDataModule,
    AvazuDataModule,
    CriteoDataModule,
    DelimitedDataModule,
    ParquetDataModule,
    SyntheticCriteoDataModule,
    SyntheticStreamDataModule,
)
from ctr_lightning.models import MODELS, CTRModule, DLRMModule
from ctr_lightning.models.ctr_module import MODEL_CLASS_KEY

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

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # What the command line itself said: it wins over a checkpoint's hyper-parameters.
        self.command_line = list(args) if isinstance(args, (list, tuple)) else sys.argv[1:] if args is None else []
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        """The model of a resumed or loaded checkpoint, whether ``--ckpt_path`` names a file or ``last``.

        As Lightning does, the checkpoint's hyper-parameters replace the config's, so a
        checkpoint loads into the model it was saved from. Unlike Lightning, what the
        command line says of the model (``--model.storage.ssd_dir NEW``, a new learning
        rate) is applied after them and wins, and a model class the user named that is not
        the checkpoint's is an error naming both, instead of a run of the checkpoint's class.
        ``fit --ckpt_path last`` is first resolved to the newest run's ``last*.ckpt``
        (:func:`continue_last_run`), so both spellings behave the same.
        """
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        config = self.config[subcommand]
        if subcommand in ("fit", "validate", "test") and config["trainer"].get("logger") is None:
            # No logger named (fit without a config): the demo config's, not ./lightning_logs,
            # set before --ckpt_path last looks for the newest run in its directory.
            root = config["trainer"].get("default_root_dir") or "."
            config["trainer"]["logger"] = Namespace(
                class_path="lightning.pytorch.loggers.TensorBoardLogger",
                init_args=Namespace(save_dir=str(Path(root) / "runs"), name=_run_name(config.get("data")),
                                    default_hp_metric=False))
        if subcommand == "fit":
            continue_last_run(config)
        path = config.get("ckpt_path")
        if not path or not Path(path).is_file():
            return  # "best", "hpc", nothing, or a path Lightning reports missing itself
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        hparams = dict(checkpoint.get("hyper_parameters") or {})
        hparams.pop("_instantiator", None)
        saved = hparams.pop("_class_path", None) or checkpoint.get(MODEL_CLASS_KEY)
        named = self._named_model_class(subcommand)
        if saved is not None and named is not None and _class_name(saved) != _class_name(named):
            raise CheckpointMismatchError(
                f"--ckpt_path {path} holds a {_class_name(saved)} ({saved}), but this run asks for "
                f"{_class_name(named)} ({named}); name the checkpoint's model (--model {_class_name(saved)}) or "
                "start a new run without --ckpt_path")
        given = _model_arguments(self.command_line)
        if hparams:
            # The checkpoint's model replaces the config's whole. Its mappings (the storage)
            # go as options set to null first: merged into a value parsed from the config,
            # jsonargparse would mix two spellings of a StorageConfig and fail.
            mappings = {k: v for k, v in hparams.items() if isinstance(v, dict)}
            config["model"] = None
            self.config = self.parser.parse_object({subcommand: {"model": {
                "class_path": saved or self.parser.get_defaults()[f"{subcommand}.model"]["class_path"],
                "init_args": {k: v for k, v in hparams.items() if k not in mappings}}}}, self.config)
            given = [a for k, v in mappings.items() for a in (f"--model.{k}", "null", f"--model.{k}", json.dumps(v))
                     ] + given
        if given:
            self.config = self.parser.parse_args([subcommand, *given], namespace=self.config)

    def _named_model_class(self, subcommand: str) -> str | None:
        """The model class the config files or the command line name, None where only the
        default (DLRM) stands: then the checkpoint's class is taken."""
        default = self.parser.get_defaults().get(f"{subcommand}.model")
        named = (self.config[subcommand].get("model") or {}).get("class_path")
        default_class = default.get("class_path") if hasattr(default, "get") else None
        if named is None or named != default_class:
            return named
        for i, arg in enumerate(self.command_line):  # the default, named as such
            if arg in ("--model", "--model.class_path") and i + 1 < len(self.command_line):
                if not self.command_line[i + 1].lstrip().startswith("{"):
                    return named
            if arg.startswith(("--model=", "--model.class_path=")) and not arg.split("=", 1)[1].startswith("{"):
                return named
        for config_file in _config_files(self.command_line):
            section = (config_file.get(subcommand) or config_file).get("model") if isinstance(config_file, dict) else None
            if isinstance(section, dict) and section.get("class_path"):
                return named
        return None

    def before_instantiate_classes(self) -> None:
        if self.subcommand == "predict" and self.config["predict"].get("return_predictions") is None:
            self.config["predict"]["return_predictions"] = False  # the ScoreWriter has them; memory stays flat

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as error:
            # jsonargparse reports a model that refused to be built (a full or locked SSD
            # directory, a bad table setting) as "Does not validate against any of the Union
            # subtypes", with the refusal in its text: raise the refusal itself.
            cause = error.__cause__
            while cause is not None and cause.__cause__ is not None and _from_jsonargparse(cause):
                cause = cause.__cause__
            if cause is None or _from_jsonargparse(cause):
                raise
            if isinstance(cause, ValueError) and not os.environ.get("CTR_LIGHTNING_TRACE"):
                # A setting refused by name: the reason, and where (CTR_LIGHTNING_TRACE=1: the trace).
                raise SettingRefusedError(f"{cause} ({_origin(cause)}; CTR_LIGHTNING_TRACE=1 shows the trace)") from cause
            raise cause from None

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        root = config.get("default_root_dir") or "."
        if self.subcommand == "predict":
            # predict logs nothing: no run directory for it (its config goes beside the scores)
            config["logger"] = False
        if self.subcommand == "fit" and config.get("callbacks") is None:
            # No callbacks named: the demo config's, so a run ends with a checkpoint and a summary.
            checkpoint = [ModelCheckpoint(save_last=True)] if config.get("enable_checkpointing") is not False else []
            config["callbacks"] = [*checkpoint, ExamplesPerSecond(window=20), BadLineMonitor(), RunSummary()]
        configured = config.get("callbacks") or []
        configured = configured if isinstance(configured, list) else [configured]  # one callback may come bare
        given = list(callbacks) + [c for c in configured if isinstance(c, Callback)]
        extra: list[Callback] = []
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
            extra.append(StreamProgressBar())
        if self.subcommand == "fit":
            extra += [c() for c in (ShortRunLogging, HyperparameterTable) if not any(isinstance(g, c) for g in given)]
        if self.subcommand == "predict" and not any(isinstance(c, BasePredictionWriter) for c in given):
            extra.append(ScoreWriter(output_dir=str(Path(root) / "predictions")))
        return super()._instantiate_trainer(config, [*callbacks, *extra])


class _SaveRunConfig(SaveConfigCallback):
    """LightningCLI's config.yaml in the run's log directory; for predict, which has none,
    beside the scores (the ScoreWriter's output directory)."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "predict":
            super().setup(trainer, pl_module, stage)
            return
        writer = next((c for c in trainer.callbacks if isinstance(c, ScoreWriter)), None)
        if writer is not None and trainer.is_global_zero and not self.already_saved:
            writer.output_dir.mkdir(parents=True, exist_ok=True)
            self.parser.save(self.config, str(writer.output_dir / self.config_filename), skip_none=False,
                             overwrite=True, multifile=self.multifile)
        self.already_saved = True


def _run_name(data: Any) -> str:
    """A run directory's name for a parsed ``data`` spec: ``CriteoDataModule`` -> ``criteo``."""
    class_path = str((data or {}).get("class_path") or "") if hasattr(data, "get") else ""
    name = re.sub(r"DataModule$", "", class_path.rsplit(".", 1)[-1]) or "run"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class CheckpointMismatchError(ValueError):
    """``--ckpt_path`` holds another model class than the one the run names."""


class SettingRefusedError(ValueError):
    """A model or DataModule refused its settings while being built (a missing column, a
    bad table setting, a full SSD directory): the command prints the reason, no trace."""


def continue_last_run(config: Any) -> None:
    """``fit --ckpt_path last`` resumes the newest run of the configured logger, in its own
    log directory, from that run's newest ``last*.ckpt``.

    Lightning looks for ``last.ckpt`` in the checkpoint directory of *this* run, which for
    a logger with automatic versions is a new, empty ``version_N``, so a resume would
    quietly start from scratch. Here the logger's version is set to the newest earlier
    version that holds a ``last*.ckpt`` (when none is set and no ModelCheckpoint names its
    own ``dirpath``), and ``ckpt_path`` becomes that file: the resumed run logs on into the
    same TensorBoard directory, and loads as ``--ckpt_path FILE`` would. Where no checkpoint
    is found, one line says so and the run starts fresh, in the newest run directory when
    that one never reached a checkpoint (a run killed early), so no directory is left
    behind for each retry.
    """
    if config.get("ckpt_path") != "last":
        return
    trainer = config.get("trainer") or {}
    for callback in trainer.get("callbacks") or []:
        dirpath = (callback.get("init_args") or {}).get("dirpath") if hasattr(callback, "get") else None
        if "ModelCheckpoint" in str(callback.get("class_path", "")) and dirpath:
            # Checkpoints in a fixed directory: the newest last*.ckpt there, as Lightning picks it.
            _resume_from(config, sorted(Path(dirpath).glob("last*.ckpt"), key=lambda p: p.stat().st_mtime),
                         Path(dirpath))
            return
    logger = trainer.get("logger")
    if not hasattr(logger, "get") or logger.get("init_args") is None:
        return  # no logger, several loggers, or True (Lightning's default, which resolves its own)
    args = logger["init_args"]
    if args.get("version") is not None or args.get("save_dir") is None:
        return
    runs = Path(args["save_dir"]) / (args.get("name") or "")
    versions = sorted((int(m.group(1)), d) for d in runs.glob("version_*")
                      if (m := re.fullmatch(r"version_(\d+)", d.name)) and d.is_dir())
    with_last = [(v, d) for v, d in versions
                 if any((d / "checkpoints").glob("last*.ckpt"))]
    if with_last:
        version, run = with_last[-1]
        args["version"] = version
        rank_zero_info(f"--ckpt_path last: resuming {run}, logging on into it")
        _resume_from(config, sorted((run / "checkpoints").glob("last*.ckpt"), key=lambda p: p.stat().st_mtime), run)
        return
    _resume_from(config, [], runs)
    if versions and not any((versions[-1][1] / "checkpoints").glob("*.ckpt")):
        args["version"] = versions[-1][0]  # the newest run never reached a checkpoint: start it again
        rank_zero_info(f"--ckpt_path last: starting afresh in {versions[-1][1]}, which holds no checkpoint")


def _resume_from(config: Any, candidates: list[Path], where: Path) -> None:
    if candidates:
        config["ckpt_path"] = str(candidates[-1])
    else:
        config["ckpt_path"] = None  # not Lightning's hint to set save_last, which may well be set
        rank_zero_info(f"--ckpt_path last: no checkpoint found under {where}; the run starts fresh")


def _model_arguments(command_line: list[str]) -> list[str]:
    """The ``--model...`` options of a command line, each with its value."""
    out: list[str] = []
    for i, arg in enumerate(command_line):
        name = arg.split("=", 1)[0]
        if name != "--model" and not name.startswith("--model."):
            continue
        if "=" in arg:
            out.append(arg)
        elif i + 1 < len(command_line):
            out += [arg, command_line[i + 1]]
    return out


def _config_files(command_line: list[str]) -> list[Any]:
    """The contents of the ``--config`` files a command line names (unreadable ones left
    out: the parser has reported them already)."""
    import yaml

    out = []
    for i, arg in enumerate(command_line):
        value = arg.split("=", 1)[1] if arg.startswith("--config=") else (
            command_line[i + 1] if arg in ("--config", "-c") and i + 1 < len(command_line) else None)
        if value is not None and Path(value).is_file():
            try:
                out.append(yaml.safe_load(Path(value).read_text()))
            except (OSError, yaml.YAMLError):
                continue
    return out


def _from_jsonargparse(error: BaseException) -> bool:
    """Whether an exception was raised by jsonargparse itself, not by the code it called."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "jsonargparse" in tb.tb_frame.f_code.co_filename


def _origin(error: BaseException) -> str:
    """Where an exception was raised: ``file.py:line``."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"raised at {Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno}" if tb is not None else "raised"


def _class_name(class_path: str) -> str:
    return class_path.rsplit(".", 1)[-1]


COMMANDS = (
    ("fit", "train a model (and validate it as the config says)"),
    ("validate", "one evaluation pass over the validation data"),
    ("test", "one evaluation pass over the test data"),
    ("predict", "score data with a checkpoint, to predictions/scores-rank<r>.tsv"),
    ("export", "a checkpoint's model for serving, whole or as a delta after an earlier export (--since)"),
    ("plan", "the placement fit would follow, on this machine or a recorded one"),
    ("topology", "what this machine has: NUMA nodes, GPUs, NICs, drives"),
)


def _datamodule_help() -> str:
    lines = ["Commands (ctr-lightning COMMAND --help for each):"]
    lines += [f"  {name:<10}{what}" for name, what in COMMANDS]
    lines += ["Models (pick with --model CLASS or a config's model.class_path, default DLRMModule, then set "
             "--model.ARG VALUE; --model.help CLASS shows types and defaults):"]
    for model in MODELS:
        lines.append(f"  {model.__name__}: " + ", ".join(f"--model.{a}" for a in _init_arguments(model)
                                                         if a not in _init_arguments(CTRModule)))
    lines.append("  every model: " + ", ".join(f"--model.{a}" for a in _init_arguments(CTRModule)))
    lines += ["DataModules (pick with --data CLASS or a config's data.class_path, then set --data.ARG VALUE;"
              " --data.help CLASS shows types and defaults):"]
    for cls in (CriteoDataModule, SyntheticCriteoDataModule, AvazuDataModule, ParquetDataModule, DelimitedDataModule,
                SyntheticStreamDataModule, DriftingLogDataModule):
        lines.append(f"  {cls.__name__}: " + ", ".join(f"--data.{a}" for a in _init_arguments(cls)))
    lines.append("Also: ctr-lightning predict --config X --ckpt_path PATH --data.predict_paths [...] streams scores "
                 "to predictions/scores-rank<r>.tsv (ScoreWriter); ctr-lightning export --ckpt_path PATH --out DIR "
                 "[--since EARLIER_EXPORT] writes a checkpoint's model for serving (Parquet tables, safetensors dense "
                 "part), read back with ctr_lightning.serving.read_export.")
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
    return any(a.startswith(("--config", "--data", "-h", "--help", "--print_config")) or a == "-c"
               or a.split("=", 1)[0].endswith(".help") for a in args)


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["export"]:  # not a Trainer method: a command of its own
        from ctr_lightning.serving_export import main as export_main

        export_main(argv[1:])
        return
    if argv[:1] in (["plan"], ["topology"]):
        from ctr_lightning.plan_command import plan_main, topology_main

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
    build_cli(args)


def build_cli(args: list[str] | None, run: bool = True, cli_class: type[CTRLightningCLI] = CTRLightningCLI,
              **kwargs: Any) -> CTRLightningCLI:
    """The ``ctr-lightning`` LightningCLI on ``args`` (None: ``sys.argv``), run; with ``run``
    False, the model and data built from the config, no subcommand (what ``plan`` reads).
    A refused setting or a checkpoint of another model ends the command with its reason."""
    try:
        return cli_class(
            CTRModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=_SaveRunConfig if run else None,
            save_config_kwargs={"overwrite": True},
            args=args if args is None else _storage_args(list(args)),
            run=run,
            **kwargs,
        )
    except (CheckpointMismatchError, SettingRefusedError) as error:
        print(f"ctr-lightning: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
