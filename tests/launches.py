"""Which launch each multi-process test runs in, decided at collection, so that a (test, launch)
pair whose launch does not run the test's check is not collected (it is not a test, so it is not
a skip either).

A test module whose checks run in module-scoped launch fixtures declares what every launch runs:

    LAUNCHES = {"launch": {("gloo", 2): TWO_RANK_CHECKS, ("mpi", 2): TWO_RANK_CHECKS, ...}}

(fixture name -> {fixture param: the checks that launch runs}); the fixture takes its params from
it (``params=list(LAUNCHES["launch"])``) and launches ``LAUNCHES["launch"][request.param]``, so
the declaration is the launch. The params, their order and so pytest's grouping stay those of a
plain parametrized fixture: each launch still runs once. A test says what ties it to launches:

* ``@pytest.mark.reads("check_name", ...)``: the checks it reads, by name (a lone function
  argument would make pytest mark that function instead); a parametrize argument named ``check``
  is read too. It runs in every launch that runs all of them.
* ``@pytest.mark.launches(param, ...)``: the launches it runs in, for a reason other than its
  checks (a formula written for 2 ranks, a one-seed smoke run under MPI).

:func:`deselect` (``pytest_collection_modifyitems``) removes the other pairs and fails the
collection when a test would run in no launch, when ``launches`` names a launch the fixture does
not have or one that does not run a check the test reads, or when a marker sits on a test that
uses no declared launch fixture. While a test runs, its module's ``_get`` calls :func:`read`;
:func:`verify` (after the test body) fails a test that did not read every check it declares, so a
declaration cannot narrow a test to fewer launches than what it reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

_reading: set[str] | None = None


def name(check: Any) -> str:
    """A check's name: a function, a ``(function or name, kwargs)`` pair, or the name itself."""
    if isinstance(check, tuple):
        check = check[0]
    return check if isinstance(check, str) else check.__name__


def read(check: Any) -> str:
    """Record that the running test reads ``check``; return its name."""
    if _reading is not None:
        _reading.add(name(check))
    return name(check)


def _declared_reads(item) -> set[str]:
    mark = item.get_closest_marker("reads")
    reads = {name(c) for c in (mark.args if mark else ())}
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "check" in params:
        reads.add(name(params["check"]))
    return reads


def _launch_fixture(item) -> tuple[str | None, dict]:
    """(the declared launch fixture the test uses, its {param: checks}) or (None, {})."""
    declared = getattr(getattr(item, "module", None), "LAUNCHES", {})
    used = [f for f in declared if f in getattr(item, "fixturenames", ())]
    if len(used) > 1:
        raise pytest.UsageError(f"{item.nodeid}: uses the launch fixtures {used}; use one")
    return (used[0], declared[used[0]]) if used else (None, {})


def _runs_in(item) -> Any:
    """Whether ``item`` runs in the launch of its param (True when it uses no launch fixture);
    a string says why its declaration is wrong."""
    fixture, launches = _launch_fixture(item)
    only = item.get_closest_marker("launches")
    if fixture is None:
        if only or item.get_closest_marker("reads"):
            return "has @reads/@launches but uses no launch fixture declared in LAUNCHES"
        return True
    reads = _declared_reads(item)
    runs = {p: {name(c) for c in checks} for p, checks in launches.items()}
    for p in only.args if only else ():
        if p not in runs:
            return f"@launches names {p!r}, which is not a param of {fixture} ({list(runs)})"
        if not reads <= runs[p]:
            return f"@launches names {p!r}, whose launch does not run {sorted(reads - runs[p])}"
    allowed = [p for p, checks in runs.items() if reads <= checks and (not only or p in only.args)]
    if not allowed:
        return f"runs in no launch of {fixture}: no launch runs all of {sorted(reads)}"
    param = item.callspec.params[fixture]
    if param not in runs:
        return f"{fixture} param {param!r} is not declared in LAUNCHES"
    return param in allowed


def deselect(items: list, config) -> None:
    """Remove each (test, launch) pair whose launch does not run the test; fail on a wrong
    declaration (the module docstring lists them)."""
    kept, dropped, errors = [], [], []
    for item in items:
        verdict = _runs_in(item)
        if isinstance(verdict, str):
            errors.append(f"{item.nodeid}: {verdict}")
        (kept if verdict is True else dropped).append(item)
    if errors:
        raise pytest.UsageError("wrong launch declarations:\n  " + "\n  ".join(errors))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def params(values: Iterable, *, slow: Iterable = ()) -> list:
    """A launch fixture's params, those in ``slow`` marked ``slow``: the slow matrix, the second
    controller or world size of a launch whose checks the default run already makes under
    another one (``make test`` leaves it out; ``make test-slow`` and CI run it; README.md)."""
    slow = list(slow)
    return [pytest.param(v, marks=pytest.mark.slow) if v in slow else v for v in values]


def begin() -> None:
    global _reading
    _reading = set()


def verify(item) -> None:
    """After a test body that passed: it read every check it declares (``@reads``)."""
    global _reading
    reading, _reading = _reading or set(), None
    unread = _declared_reads(item) - reading if _launch_fixture(item)[0] else set()
    if unread:
        pytest.fail(f"{item.name} declares @pytest.mark.reads of {sorted(unread)} but never "
                    "read them through _get: declare what the test reads", pytrace=False)
