"""Sweeps (the ``sweep`` extra: ``pip install -e ".[sweep]"``): an Optuna study whose trials are ordinary ``fit`` runs
with every guarantee of the engine; killed and restarted, it continues each trial from its ``last.ckpt``.

``study`` runs it (``python -m lightkeep sweep``), ``space`` checks its definition, ``worker`` takes trials under the
study's lock, ``trial`` reports a trial's metric from inside its fit, ``report`` shows the study to a person. Nothing
outside this folder imports it but ``lightkeep.main``, when the subcommand is ``sweep``.
"""
