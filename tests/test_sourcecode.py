"""The source passes ruff and mypy --strict, and never deserializes code."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "kvd"
# mypy over the whole package takes ~30 s cold on 2 cores; its cache makes
# later runs seconds. 600 s is a hang, not a slow machine.
TOOL_TIMEOUT_S = 600

# Modules that turn bytes into code or arbitrary objects.
FORBIDDEN_MODULES = frozenset(
    {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle"}
)
FORBIDDEN_CALLS = frozenset({"eval", "exec"})


def run_tool(*args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"


def test_ruff() -> None:
    run_tool("ruff", "check", "kvd", "tests")


def test_mypy() -> None:
    run_tool("mypy")  # files and strictness come from pyproject.toml


def _python_files() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if not path.name.endswith("_pb2.py"))


def _violations(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module in FORBIDDEN_MODULES:
            found.append(node.module)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in FORBIDDEN_CALLS and not isinstance(func, ast.Attribute):
                found.append(f"{name}()")
            if isinstance(func, ast.Attribute) and name in FORBIDDEN_CALLS:
                owner = func.value
                if isinstance(owner, ast.Name) and owner.id == "builtins":
                    found.append(f"builtins.{name}()")
            for keyword in node.keywords:
                if keyword.arg == "allow_pickle" and not (
                    isinstance(keyword.value, ast.Constant) and keyword.value.value is False
                ):
                    found.append("allow_pickle=")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_MODULES:
            found.append(node.id)
    return found


def test_no_pickle_eval_or_exec() -> None:
    files = _python_files()
    assert files, "no sources found"
    offenders = {}
    for path in files:
        found = _violations(ast.parse(path.read_text(), filename=str(path)))
        if found:
            offenders[str(path.relative_to(REPO))] = found
    assert not offenders, f"forbidden deserialization or code execution: {offenders}"


@pytest.mark.parametrize(
    "source",
    [
        "import pickle",
        "from pickle import loads",
        "import marshal as m",
        "eval('1')",
        "exec('x = 1')",
        "import builtins\nbuiltins.eval('1')",
        "import numpy as np\nnp.load('f', allow_pickle=True)",
    ],
)
def test_the_check_catches(source: str) -> None:
    assert _violations(ast.parse(source))


def test_the_check_allows_prose_and_methods() -> None:
    source = '"""No pickle, no eval( anywhere."""\nre.compile("x")\nnp.load("f")\ncursor.exec("x")'
    assert _violations(ast.parse(source)) == []
