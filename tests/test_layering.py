"""The import-direction rules of DESIGN.md, checked by walking every module's imports with ast.

Every `tokenforge.*` import (absolute, relative, or a constant `importlib.import_module` string,
at any depth, including inside functions and TYPE_CHECKING blocks) is mapped to its top-level
package, the "layer", and checked against ALLOWED. A new top-level package needs a rule here and
a line in DESIGN.md.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "tokenforge"
EVERYTHING = "*"
ROOT = "<root>"     # tokenforge/__init__.py, the public facade
EVERYTHING_BUT_CLI = {"config", "messages", "sampling_params", "logs", "envs", "source", "core", "model", "kernels",
                      "distributed", "executor", "engine", "server", "router", "train", "planning", "eval", "webui", ROOT}

# importer layer -> layers (or "layer.module" for a single module) it may import; itself is implicit
# envs (every environment variable) and source (where a model comes from) are the shared leaves
# every layer may read; they import nothing from tokenforge but envs.
SHARED = {"envs", "source"}
ALLOWED: dict[str, set[str]] = {
    "envs": set(),
    "source": {"envs"},
    "config": {"source"},
    "sampling_params": set(),
    "messages": set(),
    "logs": set(),                # the one log format of every process
    "core": {"config", "messages", "sampling_params"},
    "model": {"config", "distributed", "kernels", *SHARED},
    "kernels": {"config", "distributed", *SHARED},
    "distributed": {"config", *SHARED},
    "executor": {"model", "kernels", "distributed", "core.outputs", "config", "messages",
                 "sampling_params", *SHARED},
    "engine": {"core", "executor", "config", "messages", "sampling_params", "logs", "planning.fit", *SHARED},
    "server": {"engine", "messages", "config", "sampling_params", "logs", "webui", *SHARED},
    "router": {"engine", "messages", "config", "sampling_params", "webui", *SHARED},
    "webui": set(),               # the browser UI's static files, served by server and router
    "train": {"model", "distributed", "config", *SHARED},
    "planning": {"config", "model.arch_config", "model.loader", *SHARED},   # fit arithmetic, layouts
    "eval": {"engine", "model", "config", "sampling_params", "messages", *SHARED},
    "bench": EVERYTHING_BUT_CLI,
    "cli": {EVERYTHING},          # torch-free to build; imported only by the entry points below
    "__main__": {"cli"},
    ROOT: {EVERYTHING},
}
# The modules that may import cli: the entry points (`python -m tokenforge`, `-m tokenforge.bench`,
# and the bench's own server process, which serves with the CLI's flags around a paced fake core).
CLI_ENTRY_POINTS = {"tokenforge.__main__", "tokenforge.bench.__main__", "tokenforge.bench.serving.frontend_cpu"}
# Third-party packages a layer must never import, at any depth. core imports messages and
# sampling_params, so they stay torch-free too. (config may import torch inside a function to
# resolve "auto" devices; tests/core/test_core_torch_free.py checks that core still imports.)
FORBIDDEN_THIRD_PARTY: dict[str, set[str]] = {
    "core": {"torch", "numpy", "triton"},
    "messages": {"torch", "numpy", "triton"},
    "sampling_params": {"torch", "numpy", "triton"},
}


def module_name(path: Path, package_dir: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def imports_of(path: Path, module: str, known: set[str]) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in the file; relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    yield node.lineno, sub
                elif not (base == "tokenforge" and alias.name.startswith("__")):
                    yield node.lineno, base      # metadata such as __version__ couples nothing
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")):
            yield node.lineno, node.args[0].value


def is_allowed(importer_layer: str, target: str, importer: str = "") -> bool:
    target_layer = layer_of(target)
    if target_layer == "cli" and importer in CLI_ENTRY_POINTS:
        return True
    if target_layer == importer_layer:
        return True
    allowed = ALLOWED[importer_layer]
    if EVERYTHING in allowed or target_layer in allowed:
        return True
    rest = target.removeprefix("tokenforge.")
    return any("." in rule and (rest == rule or rest.startswith(rule + ".")) for rule in allowed)


def find_violations(package_dir: Path = PACKAGE_DIR) -> list[str]:
    files = sorted(package_dir.rglob("*.py"))
    known = {module_name(f, package_dir) for f in files}
    violations = []
    for path in files:
        module = module_name(path, package_dir)
        layer = layer_of(module)
        where = path.relative_to(package_dir.parent)
        if layer not in ALLOWED:
            violations.append(f"{where}: no layering rule for package {layer!r} "
                              "(add one to DESIGN.md and tests/test_layering.py)")
            continue
        for line, target in imports_of(path, module, known):
            top = target.split(".")[0]
            if top == "tokenforge" and not is_allowed(layer, target, module):
                hint = " (the facade: import the module that defines the name)" if target == "tokenforge" else ""
                violations.append(f"{where}:{line}: {layer} must not import {target}{hint}")
            elif top in FORBIDDEN_THIRD_PARTY.get(layer, ()):
                violations.append(f"{where}:{line}: {layer} must not import {top}")
    return violations


def module_imports(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """module -> the tokenforge modules it imports (at any depth; a package's name means its __init__)."""
    files = sorted(package_dir.rglob("*.py"))
    known = {module_name(f, package_dir) for f in files}
    graph = {}
    for path in files:
        module = module_name(path, package_dir)
        targets = {t for _, t in imports_of(path, module, known) if t.split(".")[0] == "tokenforge"}
        targets |= set(_from_packages(path, module))      # `from pkg import sub` runs pkg's __init__ too
        graph[module] = {_known_prefix(t, known) for t in targets} - {None, module}
    return graph


def _from_packages(path: Path, module: str) -> Iterator[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tokenforge."):
            yield node.module
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            yield ".".join(base + ([node.module] if node.module else []))


def _known_prefix(target: str, known: set[str]) -> str | None:
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def mutual_imports(package_dir: Path = PACKAGE_DIR) -> list[str]:
    graph = module_imports(package_dir)
    return sorted(f"{a} <-> {b}" for a, targets in graph.items() for b in targets if a < b and a in graph.get(b, ()))


def test_the_package_follows_the_import_rules():
    violations = find_violations()
    assert not violations, "layering violations (see DESIGN.md):\n  " + "\n  ".join(violations)


def test_no_two_modules_import_each_other():
    pairs = mutual_imports()
    assert not pairs, "modules that import each other (split out what both need):\n  " + "\n  ".join(pairs)


def test_the_command_line_builds_without_torch():
    """`tokenforge --help` builds every subcommand's parser: cli imports no torch at module level."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = ("import sys\nfrom tokenforge.cli import build_parser\nbuild_parser([])\n"
            "print(sorted(m for m in ('torch', 'numpy', 'triton', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE_DIR.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_rule_table_matches_design():
    assert is_allowed("executor", "tokenforge.messages")
    assert is_allowed("executor", "tokenforge.core.outputs")
    assert not is_allowed("executor", "tokenforge.core.scheduler")
    assert not is_allowed("executor", "tokenforge.core")
    assert not is_allowed("core", "tokenforge.executor.model_runner")
    assert not is_allowed("train", "tokenforge.engine.llm")
    assert not is_allowed("server", "tokenforge.core.scheduler")
    assert is_allowed("cli", "tokenforge.server.app")
    for leaf in ("config", "messages", "sampling_params", "envs", "source"):
        assert not is_allowed(leaf, "tokenforge.core")
    for layer in ("server", "router", "engine", "executor", "model", "bench", "planning", "eval", "train"):
        assert not is_allowed(layer, "tokenforge.cli.main"), layer      # nothing imports cli ...
    assert is_allowed("bench", "tokenforge.cli.main", "tokenforge.bench.__main__")   # ... but an entry point
    assert not is_allowed("planning", "tokenforge.engine.llm") and is_allowed("planning", "tokenforge.model.arch_config")


def test_the_checker_catches_violations(tmp_path):
    pkg = tmp_path / "tokenforge"
    files = {
        "__init__.py": "",
        "messages.py": "from .config import X\n",
        "config.py": "",
        "core/__init__.py": "",
        "core/outputs.py": "from tokenforge.messages import M\n",
        "core/scheduler.py": "import numpy as np\ndef f():\n    import torch\n    from ..engine import llm\n",
        "engine/__init__.py": "",
        "engine/llm.py": "from tokenforge.core import scheduler\n",
        "executor/__init__.py": "",
        "executor/runner.py": ("from tokenforge.core.outputs import SchedulerOutput\n"
                               "from ..core import scheduler\nimport importlib\n"
                               "importlib.import_module('tokenforge.server.app')\n"),
        "server/__init__.py": "",
        "server/app.py": ("from tokenforge.engine import llm\nfrom tokenforge import messages\n"
                          "from tokenforge import __version__\nfrom tokenforge import LLM\n"),
        "utils/__init__.py": "",
        "router/__init__.py": "",
        "router/app.py": "from tokenforge.cli import main\nfrom tokenforge.router import settings\n",
        "router/settings.py": "def f():\n    from tokenforge.router import app\n",
        "core/block_pool.py": "from tokenforge.core import outputs\n",     # core/__init__ imports nothing: fine
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    assert sorted(find_violations(pkg)) == sorted([
        "tokenforge/messages.py:1: messages must not import tokenforge.config",
        "tokenforge/core/scheduler.py:1: core must not import numpy",
        "tokenforge/core/scheduler.py:3: core must not import torch",
        "tokenforge/core/scheduler.py:4: core must not import tokenforge.engine.llm",
        "tokenforge/executor/runner.py:2: executor must not import tokenforge.core.scheduler",
        "tokenforge/executor/runner.py:4: executor must not import tokenforge.server.app",
        "tokenforge/server/app.py:4: server must not import tokenforge "
        "(the facade: import the module that defines the name)",
        "tokenforge/utils/__init__.py: no layering rule for package 'utils' "
        "(add one to DESIGN.md and tests/test_layering.py)",
        "tokenforge/router/app.py:1: router must not import tokenforge.cli",
    ])
    assert mutual_imports(pkg) == ["tokenforge.core.scheduler <-> tokenforge.engine.llm",
                                   "tokenforge.router.app <-> tokenforge.router.settings"]
