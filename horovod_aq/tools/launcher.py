"""Run Python functions on N local Horovod ranks and collect every rank's result.

This is the multi-process harness behind the test suite, ``horovod-aq doctor --full`` and the
benchmarks. It launches ``horovodrun -np N -H localhost:N --gloo|--mpi`` (the real launcher, so
both controllers are exercised exactly as users run them), runs a *list* of functions in every
rank in the same order (one launch amortizes the seconds each rank spends importing torch or
TensorFlow), and returns, for each function, each rank's return value or traceback.

Guarantees:

* **No hangs.** The whole launch has a hard wall-clock timeout; on expiry every process of the
  launch is killed and :class:`LaunchError` carries the output gathered so far. A caller
  interrupted while it waits (Ctrl-C, a test runner's timeout signal) kills the launch's
  processes before the exception goes on.
* **One thread per rank** (``OMP_NUM_THREADS=1`` …; helpers in the functions set the framework
  thread pools) and generous Gloo/start timeouts, because CI machines are slow and noisy.
* **Every traceback.** When a function fails on any rank, :meth:`LaunchResult.get` raises with
  the traceback of each failing rank.

Functions are shipped with cloudpickle (by value for test modules), so they may be defined in
test files. Each function is called with no arguments, or with the keyword arguments given as
``(fn, kwargs)`` pairs.

:func:`run_elastic` runs a script under elastic ``horovodrun`` (``--min-np/--max-np``, a host
discovery script) with the same timeouts and environment.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

#: Per-operation Gloo timeout and rank start timeout given to horovodrun (seconds).
GLOO_TIMEOUT_S = 120
START_TIMEOUT_S = 120
#: Environment every rank gets: one compute thread, quiet TensorFlow.
RANK_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
}

Check = Callable[..., Any] | tuple[Callable[..., Any], dict]


NOT_REACHED = "not reached"
#: The key under which a rank's report carries its per-check seconds (not a check name).
_DURATIONS = "\0durations"


class LaunchError(RuntimeError):
    """The launch itself failed (timeout, launcher error, a rank died before reporting)."""


@dataclasses.dataclass
class RankFailure:
    """What a rank reports when a function raised: exception type, message and traceback."""

    rank: int
    error: str
    traceback: str


def check_name(check: Check) -> str:
    fn = check[0] if isinstance(check, tuple) else check
    return getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))


@dataclasses.dataclass
class LaunchResult:
    """Per-function, per-rank outcomes of one launch (``outcomes[name][rank]``)."""

    np: int
    controller: str
    outcomes: dict[str, list[Any]]
    log: str
    #: seconds each rank spent in each check (``durations[name][rank]``; None: not reached)
    durations: dict[str, list[float | None]] = dataclasses.field(default_factory=dict)

    def get(self, check: Check | str) -> list[Any]:
        """Return every rank's value for ``check``; raise AssertionError with each rank's traceback
        if it failed on any rank, or if a rank never reached it."""
        name = check if isinstance(check, str) else check_name(check)
        if name not in self.outcomes:
            raise KeyError(f"{name} was not part of this launch")
        values = self.outcomes[name]
        failures = [v for v in values if isinstance(v, RankFailure)]
        if failures:
            parts = [f"{name} failed on {len(failures)}/{self.np} ranks ({self.controller}):"]
            for f in failures:
                parts.append(f"--- rank {f.rank}: {f.error}\n{f.traceback}")
            if any(f.error == NOT_REACHED for f in failures):
                parts.append("--- end of the launch output:\n"
                             + "".join(self.log.splitlines(True)[-40:]))
            raise AssertionError("\n".join(parts))
        return values


def _horovodrun() -> str:
    candidate = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if os.path.exists(candidate):
        return candidate
    found = shutil.which("horovodrun")
    if not found:
        raise LaunchError(
            "horovodrun not found: install Horovod (scripts/setup.sh builds it; see README.md)"
        )
    return found


def kill_tree(pid: int) -> None:
    """Kill process ``pid`` and all its descendants (SIGKILL), and reap them."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil ships with Horovod
        os.killpg(pid, signal.SIGKILL)
        return
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = parent.children(recursive=True) + [parent]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _wait(proc: subprocess.Popen, timeout: float, log_path: str, what: str) -> int:
    """``proc``'s exit status. Past ``timeout`` seconds every process of the launch is killed and
    :class:`LaunchError` names ``what`` with the log's tail; a caller interrupted while it waits
    (Ctrl-C, pytest-timeout's signal) kills them too before the exception goes on, since the
    ranks run in their own session and would outlive it, spinning in a collective."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        raise LaunchError(f"{what} exceeded {timeout:.0f}s and was killed; last output:\n"
                          f"{_tail(log_path)}") from None
    except BaseException:
        kill_tree(proc.pid)
        raise


def run_local(
    checks: Sequence[Check],
    *,
    np: int = 2,
    controller: str = "gloo",
    timeout: float = 600,
    env: dict[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> LaunchResult:
    """Run ``checks`` in order on ``np`` local ranks under ``controller`` ("gloo" or "mpi").

    Returns a :class:`LaunchResult`; raises :class:`LaunchError` if the launch times out after
    ``timeout`` seconds (every process is killed first) or a rank exits without reporting.
    """
    if controller not in ("gloo", "mpi"):
        raise ValueError(f"controller must be 'gloo' or 'mpi', got {controller!r}")
    if np < 1:
        raise ValueError(f"np must be >= 1, got {np}")
    import cloudpickle

    for check in checks:
        module = sys.modules.get((check[0] if isinstance(check, tuple) else check).__module__)
        if module is not None and not module.__name__.startswith("horovod_aq"):
            cloudpickle.register_pickle_by_value(module)
    names = [check_name(c) for c in checks]
    if len(set(names)) != len(names):
        raise ValueError(f"check names must be unique within one launch: {names}")

    job = tempfile.mkdtemp(prefix="horovod_aq_launch_")
    try:
        with open(os.path.join(job, "job.pkl"), "wb") as f:
            cloudpickle.dump([(check_name(c), c) for c in checks], f)
        cmd = [
            _horovodrun(), "-np", str(np), "-H", f"localhost:{np}", f"--{controller}",
            "--start-timeout", str(START_TIMEOUT_S),
        ]
        if controller == "gloo":
            cmd += ["--gloo-timeout-seconds", str(GLOO_TIMEOUT_S)]
        cmd += list(extra_args)
        cmd += [sys.executable, "-m", "horovod_aq.tools.launcher", job]
        run_env = _rank_env(env)
        log_path = os.path.join(job, "launch.log")
        t0 = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env, start_new_session=True
            )
            rc = _wait(proc, timeout, log_path, f"{np}-rank {controller} launch")
        logger.debug("launch of %d checks on %d ranks took %.1fs", len(checks), np,
                     time.monotonic() - t0)
        outcomes: dict[str, list[Any]] = {n: [None] * np for n in names}
        durations: dict[str, list[float | None]] = {n: [None] * np for n in names}
        missing = []
        for rank in range(np):
            path = os.path.join(job, f"rank{rank}.pkl")
            if not os.path.exists(path):
                missing.append(rank)
                continue
            with open(path, "rb") as f:
                per_rank = pickle.load(f)
            for n, seconds in per_rank.pop(_DURATIONS, {}).items():
                durations[n][rank] = seconds
            for n in names:
                outcomes[n][rank] = per_rank.get(
                    n, RankFailure(rank, NOT_REACHED, "the rank stopped (crashed or was killed) "
                                   "before finishing this check")
                )
        if missing:
            raise LaunchError(
                f"ranks {missing} exited without reporting (horovodrun exit code {rc}); "
                f"output:\n{_tail(log_path)}"
            )
        with open(log_path, encoding="utf-8", errors="replace") as f:
            log_text = f.read()
        return LaunchResult(np=np, controller=controller, outcomes=outcomes, log=log_text,
                            durations=durations)
    finally:
        shutil.rmtree(job, ignore_errors=True)


@dataclasses.dataclass
class ElasticRun:
    """What an elastic launch left: horovodrun's exit code and the whole output."""

    returncode: int
    log: str

    def tail(self, lines: int = 60) -> str:
        return "".join(self.log.splitlines(True)[-lines:])


def run_elastic(
    command: Sequence[str],
    *,
    discovery_script: str,
    np: int,
    min_np: int,
    max_np: int,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> ElasticRun:
    """Run ``command`` (an argument list, e.g. ``[sys.executable, "train.py", ...]``) under
    elastic ``horovodrun`` on this host: Gloo, ``--network-interface lo`` (on one host elastic
    horovodrun otherwise waits for a second host to agree on an interface), the host list from
    ``discovery_script``, and :data:`GLOO_TIMEOUT_S` for the rendezvous of a joining worker.

    Returns an :class:`ElasticRun`; raises :class:`LaunchError` with the output's tail if the
    launch exceeds ``timeout`` seconds (every process is killed first).
    """
    cmd = [_horovodrun(), "-np", str(np), "--min-np", str(min_np), "--max-np", str(max_np),
           "--host-discovery-script", discovery_script, "--network-interface", "lo",
           "--start-timeout", str(START_TIMEOUT_S), "--gloo-timeout-seconds",
           str(GLOO_TIMEOUT_S), *command]
    run_env = _rank_env(env)
    with tempfile.TemporaryDirectory(prefix="horovod_aq_elastic_") as job:
        log_path = os.path.join(job, "launch.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env,
                                    start_new_session=True)
            rc = _wait(proc, timeout, log_path, f"elastic launch ({min_np}..{max_np} ranks)")
        with open(log_path, encoding="utf-8", errors="replace") as f:
            return ElasticRun(rc, f.read())


def _rank_env(env: dict[str, str] | None) -> dict[str, str]:
    """This process's environment with :data:`RANK_ENV`, ``env``, and this ``horovod_aq`` first
    on ``PYTHONPATH`` (the ranks must import the same package as the caller)."""
    run_env = dict(os.environ)
    run_env.update(RANK_ENV)
    run_env.update(env or {})
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run_env["PYTHONPATH"] = os.pathsep.join(
        [pkg_root] + [p for p in run_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    return run_env


def _tail(path: str, lines: int = 60) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no output)"


def _rank_main(job: str) -> int:
    """Entry point inside each rank: run every check, record value or traceback, report."""
    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    with open(os.path.join(job, "job.pkl"), "rb") as f:
        checks = pickle.load(f)
    results: dict[str, Any] = {_DURATIONS: {}}
    out_path = os.path.join(job, f"rank{rank}.pkl")

    def flush() -> None:
        tmp = out_path + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(results, f)
        os.replace(tmp, out_path)

    for name, check in checks:
        fn, kwargs = (check if isinstance(check, tuple) else (check, {}))
        started = time.monotonic()
        try:
            value = fn(**kwargs)
            pickle.dumps(value)  # fail here, attributed to the check, if it cannot travel
            results[name] = value
        except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
            results[name] = RankFailure(rank, f"{type(exc).__name__}: {exc}",
                                        traceback.format_exc())
        results[_DURATIONS][name] = time.monotonic() - started
        flush()
    flush()
    return 0


if __name__ == "__main__":
    # Import through the package so pickled RankFailure objects name horovod_aq.tools.launcher,
    # not __main__, and unpickle in the caller.
    from horovod_aq.tools.launcher import _rank_main as rank_main

    sys.exit(rank_main(sys.argv[1]))
