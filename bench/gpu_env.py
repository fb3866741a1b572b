"""GPU node check, setup: a venv over the node's own Python stack, the carried wheels, grpod.

A GPU node brings its own torch (and CUDA, transformers, ...) and no network. The venv reads
the node's packages through a `.pth` file (`site.addsitedir`, so their own `.pth` files work
too), installs from the carried wheel directory only what is missing or older there, and
makes grpod importable from this checkout the way pyproject.toml's package-dir maps it
(a finder in the venv's start-up module: no build, no setuptools needed). `grpod`, `pytest`
and `torchrun` are scripts beside the venv's python, where the tests look for `grpod`.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[1]
IMPORT_NAMES = {"prometheus-client": "prometheus_client", "pyyaml": "yaml"}
NOT_NEEDED = {"ruff", "import-linter", "tomli", "pytest-xdist"}  # lint; 3.11 has tomllib; xdist


def pip_install(python: str) -> list[str]:
    """The pip command that installs carried wheels into `python`'s venv, offline."""
    return [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]


BOOT = "_grpod_gpu_check"
# the venv's start-up module: the node's site directories (their .pth files too, except an
# editable grpod's), then grpod from this checkout as pyproject.toml's package-dir maps it
BOOT_MODULE = '''"""Written by bench/gpu_env.py for the GPU node check."""
import importlib.util, os, site, sys

for directory in {outer!r}:
    if directory not in sys.path:
        sys.path.append(directory)
    for name in sorted(os.listdir(directory)):
        if name.endswith(".pth") and not name.startswith(("__editable__.grpod", "_grpod_gpu")):
            site.addpackage(directory, name, set(sys.path))

PACKAGES = {mapping!r}


class GrpodFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        where = PACKAGES.get(name)
        if where is None:
            return None
        init = os.path.join(where, "__init__.py")
        return importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[where]
        )


sys.meta_path.insert(0, GrpodFinder)
'''
SCRIPTS = {
    "grpod": "from grpod.daemon.cli import main",
    "pytest": "from pytest import console_main as main",
    "torchrun": "from torch.distributed.run import main",
}


def required() -> dict[str, str]:
    """`{distribution: import name}` of grpod's dependencies and its `dev` extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {}
    for spec in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        name = canonical(re.match(r"[A-Za-z0-9_.-]+", spec).group(0))
        if name not in NOT_NEEDED:
            out[name] = IMPORT_NAMES.get(name, name.replace("-", "_"))
    return out


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheels_in(directory: Path) -> dict[str, tuple[str, Path]]:
    """`{distribution: (version, file)}` of the wheels in `directory` (none if it is absent)."""
    found = {}
    for path in sorted(directory.glob("*.whl")) if directory.is_dir() else []:
        name, version = path.name.split("-")[:2]
        found[canonical(name)] = (version, path)
    return found


def missing_imports(python: str) -> list[str]:
    """The required distributions whose import fails under `python`."""
    names = required()
    probe = (
        "import importlib.util, sys; "
        "print(' '.join(n for n in sys.argv[1:] if importlib.util.find_spec(n) is None))"
    )
    out = subprocess.run(
        [python, "-c", probe, *names.values()], capture_output=True, text=True, check=True
    ).stdout.split()
    return [dist for dist, module in names.items() if module in out]


def to_install(python: str, wheels: dict[str, tuple[str, Path]]) -> list[Path]:
    """Carried wheels whose distribution `python` lacks, or holds in an older version."""
    probe = (
        "import sys; from importlib import metadata\n"
        "for n in sys.argv[1:]:\n"
        "    try: print(n, metadata.version(n))\n"
        "    except metadata.PackageNotFoundError: print(n, '-')\n"
    )
    out = subprocess.run(
        [python, "-c", probe, *wheels], capture_output=True, text=True, check=True
    ).stdout
    have = dict(line.split() for line in out.splitlines())
    return [
        path
        for name, (version, path) in wheels.items()
        if have.get(name, "-") == "-" or _older(have[name], version)
    ]


def _older(installed: str, carried: str) -> bool:
    try:
        from packaging.version import Version
    except ImportError:  # no way to compare: keep the node's
        return False
    return Version(installed) < Version(carried)


def setup_venv(venv: Path, wheel_dir: Path) -> dict[str, Any]:
    """Make `venv` (replacing it), install what is missing from `wheel_dir`; the report."""
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    purelib = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    outer = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = {name: str(ROOT / d) for name, d in dirs["package-dir"].items()}
    (purelib / f"{BOOT}.py").write_text(BOOT_MODULE.format(outer=outer, mapping=mapping))
    (purelib / f"{BOOT}.pth").write_text(f"import {BOOT}\n")
    for script, line in SCRIPTS.items():
        path = venv / "bin" / script
        path.write_text(f"#!{python}\nimport sys\n{line}\nsys.exit(main())\n")
        path.chmod(0o755)
    missing = missing_imports(python)
    wheels = wheels_in(wheel_dir)
    installed: list[str] = []
    failed: dict[str, str] = {}
    for path in to_install(python, wheels) if missing else []:
        # one at a time: a wheel this Python cannot take must not stop the others
        proc = subprocess.run([*pip_install(python), str(path)], capture_output=True, text=True)
        if proc.returncode == 0:
            installed.append(path.name)
        else:
            failed[path.name] = ((proc.stdout + proc.stderr).strip().splitlines() or ["?"])[-1]
    still = missing_imports(python)
    report: dict[str, Any] = {
        "status": "ok" if not still else "missing",
        "python": python,
        "outer_python": sys.executable,
        "wheels_dir": str(wheel_dir),
        "wheels_carried": sorted(f"{n}=={v}" for n, (v, _) in wheels.items()),
        "missing_before": missing,
        "installed": installed,
        "install_failed": failed,
        "missing_after": still,
    }
    if still:
        report["reason"] = (
            f"{', '.join(still)} not importable and not installed from {wheel_dir} "
            f"({len(failed)} carried wheels failed to install; scripts/gpu_wheels.sh fetches them)"
        )
    return report


def flashinfer_status() -> dict[str, Any]:
    """Whether flashinfer imports here, and what stopped it if not."""
    if importlib.util.find_spec("flashinfer") is None:
        carried = wheels_in(ROOT / ".whl").get("flashinfer-python")
        why = "not carried" if carried is None else f"carried {carried[1].name} but not found"
        return {"importable": False, "reason": f"flashinfer not importable ({why})"}
    try:
        import flashinfer
    except Exception as exc:  # a broken install says why in its exception
        return {"importable": False, "reason": f"import flashinfer: {type(exc).__name__}: {exc}"}
    return {"importable": True, "version": getattr(flashinfer, "__version__", None)}
