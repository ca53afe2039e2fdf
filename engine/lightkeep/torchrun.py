"""``python -m lightkeep.torchrun ARGS``: torchrun (``torch.distributed.run``, the same arguments) for this engine's
runs, as ``scripts/torchrun.sh`` and ``scripts/train_resilient.sh --torchrun`` start it on each node.

When its workers fail, torchrun ends in a traceback and a table of the failed ranks, after the line a rank of this
node printed (``lightkeep.rank_failures``): here the node's output ends with that line alone, or, where no rank of
this node said anything (its only worker was killed), with one line naming the rank and how it ended. The exit code
is 1 either way, as a launcher reads a failure. Restarts (``--max-restarts``) are torchrun's, unchanged.

A finished job: torchrun's agent then waits at its exit barrier until the agent of every node has arrived, up to
300 s, so that node 0's, which holds the rendezvous store, does not leave first; an agent that is gone (its node
lost after its ranks finished) makes the others wait it all. Every rank has finished by then (the engine's last
collective, ``DestroyProcessGroup``'s barrier, has passed), so after ``NOTE_S`` this says why it waits, and after
``EXIT_WAIT_S`` it stops waiting and says so.
"""

import logging
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

from lightkeep.compat_torch import exit_barrier_waits
from lightkeep.rank_failures import REPORT_ENV

NOTE_S = 10.0  # a finished node's wait at the exit barrier longer than this is said
EXIT_WAIT_S = 60.0  # and ended after this


def _describe(rank: int, code: int, local: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (kill -9, or out of memory)" if -code == signal.SIGKILL else ""
        return f"rank {rank} (local rank {local}) was killed by {name}{hint}"
    return f"rank {rank} (local rank {local}) exited with code {code}"


_left: list[threading.Thread] = []  # an exit barrier this node stopped waiting for, still blocked


def _wait_at_exit_barrier(wait: threading.Thread) -> None:
    """Waits for ``wait`` (the exit barrier on its thread), saying why after ``NOTE_S`` and leaving it after
    ``EXIT_WAIT_S``."""
    wait.join(NOTE_S)
    if not wait.is_alive():
        return
    print(
        "torchrun: this node's ranks finished; waiting for the torchrun agents of the other nodes at torchrun's exit "
        f"barrier (an agent that is gone would hold it 300 s; at most {EXIT_WAIT_S:g} s here)",
        file=sys.stderr,
        flush=True,
    )
    wait.join(EXIT_WAIT_S - NOTE_S)
    if wait.is_alive():
        _left.append(wait)
        print(
            f"torchrun: not every node's agent reached the exit barrier in {EXIT_WAIT_S:g} s (gone?); every rank had "
            "finished, so this node does not wait longer",
            file=sys.stderr,
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    report = Path(os.environ.get(REPORT_ENV) or tempfile.mkstemp(prefix="lightkeep-report-", suffix=".txt")[1])
    ours = REPORT_ENV not in os.environ
    os.environ[REPORT_ENV] = str(report)  # a rank of this node writes its line there (the workers inherit it)
    # the agent's own lines on a worker's failure (its exit code, the SIGTERMs it sends): said below, in one line
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        with exit_barrier_waits(_wait_at_exit_barrier):
            torchrun(argv)
    except ChildFailedError as error:
        said = report.read_text().strip() if report.is_file() else ""
        if not said:
            rank, failure = error.get_first_failure()
            what = _describe(rank, failure.exitcode, failure.local_rank)
            print(f"error: {what} on this node: torchrun stopped its ranks", file=sys.stderr)
        return 1
    finally:
        if ours:
            report.unlink(missing_ok=True)
    if _left:  # its thread is blocked on the store: the interpreter's teardown could abort under it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
