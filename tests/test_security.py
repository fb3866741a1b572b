"""Nothing in the package unpickles (docs/SECURITY.md): read from the source, no module imported.

A run dir, an incident or a blob may be someone else's; every reader takes them as data
(JSON, SQLite, safetensors). Refused anywhere in the package: importing a pickle-family
module (pickle, dill, cloudpickle, joblib, shelve, marshal), `torch.load` without
`weights_only=True`, `numpy.load(..., allow_pickle=True)`, and the plain strings
`weights_only=False` / `allow_pickle=True` in code.
"""

from __future__ import annotations

import ast
import re

from tests.test_structure import ROOT, project_modules

PICKLERS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
UNSAFE_TEXT = re.compile(r"weights_only\s*=\s*False|allow_pickle\s*=\s*True")


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def unpickling(source: str) -> list[str]:
    """Each line of `source` that imports a pickler or loads without refusing pickles."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module or "").split(".")[0]]
        else:
            names = []
        if PICKLERS.intersection(names):
            found.append(f"line {node.lineno}: imports {sorted(PICKLERS.intersection(names))}")
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        owner_name = owner.id if isinstance(owner, ast.Name) else ""
        weights_only = _keyword(node, "weights_only")
        if node.func.attr == "load" and owner_name == "torch" and not _is_const(weights_only, True):
            found.append(f"line {node.lineno}: torch.load without weights_only=True")
        allow = _keyword(node, "allow_pickle")
        numpy_load = node.func.attr == "load" and owner_name in ("np", "numpy")
        if numpy_load and allow is not None and not _is_const(allow, False):
            found.append(f"line {node.lineno}: numpy.load with allow_pickle")
        if node.func.attr == "read_pickle":
            found.append(f"line {node.lineno}: read_pickle")
    for number, line in enumerate(source.splitlines(), 1):
        code = line.split("#", 1)[0]
        if UNSAFE_TEXT.search(code) and not code.lstrip().startswith(('"', "'", "`")):
            found.append(f"line {number}: {code.strip()}")
    return found


def test_nothing_in_the_package_unpickles() -> None:
    offenders = {
        str(path.relative_to(ROOT)): lines
        for path in sorted(set(project_modules().values()))
        if (lines := unpickling(path.read_text()))
    }
    assert not offenders, offenders


def test_the_check_finds_each_way_to_unpickle() -> None:
    bad = [
        "import pickle",
        "from joblib import load",
        "import torch\ntorch.load('args.bin', weights_only=False)",
        "import torch\ntorch.load('optimizer.pt')",
        "import numpy as np\nnp.load('a.npy', allow_pickle=True)",
        "import pandas as pd\npd.read_pickle('x')",
        "kwargs = dict(weights_only=False)",
    ]
    for source in bad:
        assert unpickling(source), source
    good = [
        "import torch\ntorch.load('optimizer.pt', weights_only=True)",
        "import numpy as np\nnp.load('a.npy')",
        "import json\njson.load(open('run.json'))",
        '"""a docstring that names training_args.bin, a pickle"""',
    ]
    for source in good:
        assert not unpickling(source), source
