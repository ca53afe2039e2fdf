"""``python -m project fit|validate|test|predict|sweep|compare ...``: the engine's command line (lightkeep) with this
project's base config, ``configs/default.yaml``."""

import gc
from pathlib import Path

from lightkeep import cli_main

# beside the package (a source checkout, or `pip install -e`), else the working directory (installed into
# site-packages, run from the project folder)
BASE_CONFIGS = (Path(__file__).resolve().parent.parent / "configs" / "default.yaml", Path("configs") / "default.yaml")


def main(args: list[str] | None = None, run: bool = True):
    """``python -m project ARGS`` (``args=None``: ``sys.argv``); ``run=False`` parses and builds only."""
    return cli_main(args, run=run, base_config=BASE_CONFIGS, program=__package__)


if __name__ == "__main__":
    try:
        main()
    finally:
        # The process ends here: its objects are left out of the garbage collection at exit (1.2 s with Lightning's
        # ~450k objects). cli_main itself leaves the heap as it found it (lightkeep.run_scope).
        gc.freeze()
