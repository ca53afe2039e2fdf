"""Runs the exactness tests again and again beside busy CPU burners: a guarantee that holds only on an idle machine
shows up here as a failure count.

    python scripts/stress_exactness.py --repeats 5 --busy 2          # every test 5 times, 2 burners beside them
    python scripts/stress_exactness.py --repeats 10 --only workers   # one test (a substring of its node id)

Each repetition is one pytest run of the selected tests (the uninterrupted reference runs are shared within it) with
a new ``TEST_SEED``; it prints pass/fail counts per test at the end. A failed repetition prints its seed and pytest's
output, and keeps its ``--basetemp`` folder (the runs, checkpoints and logs); ``TEST_SEED=<seed> pytest <node id>``
repeats its random draws. Not part of ``make test``: it runs for as long as it is given (``--max-minutes``).
"""

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/test_resume.py::test_resume_from_mid_epoch_checkpoint_is_exact",  # kill -9 mid-epoch
    "tests/test_resume.py::test_resume_with_loader_workers_is_exact",  # the same, with loader workers
    "tests/test_resume.py::test_resume_at_a_random_step_is_exact",  # kill -9 at a drawn step
    "tests/test_resume.py::test_two_rank_ddp_resume_mid_epoch_is_exact",  # kill -9 under 2-rank DDP
    "tests/test_resume.py::test_sigterm_saves_last_and_exits_143_and_the_resume_is_exact",  # preemption
    "tests/test_launch.py::test_sigusr1_makes_lightning_checkpoint_and_requeue_and_the_requeued_job_resumes",
    "tests/test_interrupts.py::test_ctrl_c_under_ddp_saves_last_and_leaves_no_process_behind",
    "tests/test_sweep.py::test_sweep_runs_trials_as_runs_prunes_the_bad_one_and_a_killed_sweep_continues_exactly",
]


def outcomes(junit: Path) -> dict[str, str]:
    """``{node id: passed|failed|error|skipped}`` of the tests a pytest run reported in its JUnit XML."""
    if not junit.is_file():
        return {}
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        node = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        result[node] = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(
            kinds[0] if kinds else "", "passed"
        )
    return result


def run_bounded(command: list[str], env: dict[str, str], timeout: float) -> tuple[str, int]:
    """pytest's output and exit code; past ``timeout`` its whole process group (the runs it started) is killed."""
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out, proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return f"{out}\nkilled after --timeout {timeout:.0f} s", -9
    finally:
        if proc.poll() is None:  # interrupted: the runs it started go too
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="pytest runs of the selected tests")
    parser.add_argument("--busy", type=int, default=2, help="CPU burner processes beside them (busy loops)")
    parser.add_argument("--only", default="", help="run only the tests whose node id contains this")
    parser.add_argument("--max-minutes", type=float, default=120, help="start no repetition after this long")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one repetition may take")
    parser.add_argument("--keep", type=Path, default=None, help="folder for failed runs' basetemp (default: a temp)")
    args = parser.parse_args()
    tests = [t for t in TESTS if args.only in t]
    if not tests:
        parser.error(f"no test matches --only {args.only!r}; the tests: {', '.join(TESTS)}")
    root = args.keep or Path(tempfile.mkdtemp(prefix="stress-exactness-"))
    root.mkdir(parents=True, exist_ok=True)
    counts: dict[str, Counter] = {t: Counter() for t in tests}
    failures: list[str] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally below: no burner left behind
    burn = [sys.executable, "-c", "while True: pass"]
    burners = [subprocess.Popen(burn, stdout=subprocess.DEVNULL) for _ in range(args.busy)]
    start = time.monotonic()
    try:
        for rep in range(args.repeats):
            if time.monotonic() - start > 60 * args.max_minutes:
                print(f"--max-minutes {args.max_minutes} reached after {rep} repetition(s)")
                break
            seed = random.SystemRandom().randrange(2**32)
            base, junit = root / f"rep{rep}-seed{seed}", root / f"rep{rep}-seed{seed}.xml"
            command = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-q",
                       f"--basetemp={base}", f"--junitxml={junit}", *tests]  # fmt: skip
            began = time.monotonic()
            out, code = run_bounded(command, {**os.environ, "TEST_SEED": str(seed)}, args.timeout)
            got = outcomes(junit)
            for test in tests:
                counts[test][got.get(test, "not run")] += 1
            bad = [t for t in tests if got.get(t) != "passed"]
            print(f"repetition {rep + 1}/{args.repeats}, TEST_SEED={seed}: {len(tests) - len(bad)}/{len(tests)} passed"
                  f" in {time.monotonic() - began:.0f} s", flush=True)  # fmt: skip
            if bad or code != 0:
                failures += [f"{t} (TEST_SEED={seed}, runs kept in {base})" for t in bad]
                print(out[-12000:], flush=True)
            else:
                shutil.rmtree(base, ignore_errors=True)
                junit.unlink(missing_ok=True)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    print(f"\n{'passed':>6} {'failed':>6} {'other':>6}  test  (--busy {args.busy})")
    for test, count in counts.items():
        other = sum(count.values()) - count["passed"] - count["failed"]
        print(f"{count['passed']:>6} {count['failed']:>6} {other:>6}  {test}")
    for failure in failures:
        print(f"FAILED {failure}")
    if not failures and args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
