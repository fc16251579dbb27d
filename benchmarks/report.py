"""What every benchmark writes next to its numbers: the command, date, machine and versions.

``write(name, title, body)`` saves ``benchmarks/results/<name>.md``; quick runs (CI) go to
``benchmarks/results/quick/`` (not committed) so they never overwrite measured results.
"""

from __future__ import annotations

import datetime as dt
import importlib
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
VERSION_MODULES = ("numpy", "scipy", "torch", "tensorflow", "horovod", "mpi4py")


def machine() -> str:
    """CPU model, logical CPUs, RAM and kernel of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs{mem}, {platform.system()} {platform.release()}"


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def versions(modules: Sequence[str] = VERSION_MODULES) -> str:
    """Python and the versions of the given modules that are already imported or importable."""
    parts = [f"Python {platform.python_version()}"]
    for name in modules:
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - absent is fine
                continue
        parts.append(f"{name} {getattr(mod, '__version__', '?')}")
    return ", ".join(parts)


def command() -> str:
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    return shlex.join(["python", script] + sys.argv[1:])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(str(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def header(title: str, notes: Sequence[str] = (), modules: Sequence[str] = VERSION_MODULES) -> str:
    lines = [f"# {title}", "",
             f"- Command: `{command()}`",
             f"- Date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
             f"- Machine: {machine()}; load average {loadavg()}",
             f"- Versions: {versions(modules)}"]
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write(name: str, title: str, body: str, *, quick: bool = False,
          notes: Sequence[str] = (), extension: str = "md") -> Path:
    """Write the report (header + body) and return its path."""
    folder = RESULTS / "quick" if quick else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.{extension}"
    path.write_text(header(title, notes) + "\n" + body.rstrip() + "\n")
    return path


def figure_path(name: str, *, quick: bool = False) -> Path:
    folder = RESULTS / "quick" if quick else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}.png"
