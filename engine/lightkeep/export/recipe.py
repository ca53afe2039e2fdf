"""Which class, with which arguments, rebuilds a checkpoint's module (and its data module): the run's
``config.yaml`` (else a config given with ``--config``), its ``model:``/``data:`` section as a recipe
(``{"class_path", "init_args"}``), with the arguments a plain Lightning checkpoint's ``hyper_parameters`` kept."""

from pathlib import Path
from typing import Any

import yaml

from lightkeep.checkpoint_files import load_checkpoint_file
from lightkeep.config import its_arguments


def run_config(ckpt_path: Path, config_path: Path | None = None) -> dict[str, Any]:
    """``config_path``, else the config.yaml of the run folder the checkpoint is in."""
    path = config_path or ckpt_path.resolve().parent.parent / "config.yaml"  # <run>/checkpoints/<file>.ckpt
    if not path.is_file():
        where = f"no such file: {path}" if config_path else f"no config.yaml at {path}"
        raise ValueError(
            f"{ckpt_path} is not in a run folder's checkpoints/ ({where}), and a config names the model class to "
            "rebuild: export it where fit saved it (runs/<name>/version_N/checkpoints/), or give --config FILE "
            "with model: your.Module (a checkpoint of plain Lightning)"
        )
    return yaml.safe_load(path.read_text()) or {}


def with_checkpoint_hparams(recipe: dict[str, Any], ckpt_path: Path) -> dict[str, Any]:
    """The recipe with the arguments of a plain Lightning checkpoint's ``hyper_parameters`` that the class takes
    and the config does not set: ``save_hyperparameters()`` kept what built the saved network."""
    if ckpt_path.is_dir():
        return recipe
    hparams = load_checkpoint_file(ckpt_path, mmap=True).get("hyper_parameters")
    if not isinstance(hparams, dict) or "_class_path" in hparams:  # none, or the CLI's (config.yaml has them)
        return recipe
    given = {k: v for k, v in its_arguments(recipe["class_path"], hparams).items() if k not in recipe["init_args"]}
    return {**recipe, "init_args": {**given, **recipe["init_args"]}}


def section_recipe(section: Any, what: str) -> dict[str, Any]:
    """The recipe of a config's ``model:`` or ``data:`` section (``what``)."""
    if isinstance(section, str):  # `model: my.Model`
        section = {"class_path": section}
    if not isinstance(section, dict) or "class_path" not in section:
        raise ValueError(
            f"the run's config.yaml names no {what} class_path (the config of a LightningCLI of fixed classes, "
            f"LightningCLI(Net, ...)): give --config FILE with {what}: your.Net, its arguments read from the checkpoint"
        )
    return {"class_path": section["class_path"], "init_args": section.get("init_args") or {}}
