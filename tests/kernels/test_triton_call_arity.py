"""Every call from one Triton kernel to a @triton.jit helper matches the helper's parameters.

Triton reports a call with a missing or extra argument only when it compiles the caller, which the
CPU tests never do (no Triton there, and the interpreter runs only some kernels). Round 14 gave
gemv.py's `_fma` a parameter the batch-1 LoRA GEMV did not pass: every LoRA request on a GPU
would have failed, and only a GPU run saw it. This reads the kernels' source (no Triton needed)
and checks each call to a jit function, in its module or imported from another kernels module:
the positional count, the keyword names, and every parameter without a default given."""

from __future__ import annotations

import ast
from pathlib import Path

import tokenforge.kernels

KERNELS = Path(tokenforge.kernels.__file__).parent


def _is_jit(node: ast.FunctionDef) -> bool:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _jit_functions() -> dict[str, dict[str, ast.FunctionDef]]:
    """module name -> {function name: its def}, for the @triton.jit functions of each kernels module."""
    out = {}
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        out[path.stem] = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and _is_jit(n)}
    return out


def _imports(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """local name -> (module, name) for `from .module import name` / `from tokenforge.kernels.module import name`."""
    names = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            module = node.module.rsplit(".", 1)[-1] if node.level or node.module.startswith("tokenforge.kernels") else None
            for alias in node.names:
                if module:
                    names[alias.asname or alias.name] = (module, alias.name)
    return names


def _problem(call: ast.Call, callee: ast.FunctionDef) -> str | None:
    args = callee.args
    params = [a.arg for a in args.posonlyargs + args.args]
    if args.vararg or args.kwarg or any(isinstance(a, ast.Starred) for a in call.args) \
            or any(k.arg is None for k in call.keywords):
        return None                                  # *args / **kwargs: not checked
    required = params[:len(params) - len(args.defaults)]
    given = params[:len(call.args)]
    if len(call.args) > len(params):
        return f"{len(call.args)} positional arguments for {len(params)} parameters"
    keywords = [k.arg for k in call.keywords]
    unknown = [k for k in keywords if k not in params]
    if unknown:
        return f"unknown keyword(s) {unknown}"
    missing = [p for p in required if p not in given and p not in keywords]
    return f"missing {missing}" if missing else None


def test_every_call_to_a_jit_helper_matches_its_parameters():
    jit = _jit_functions()
    checked, problems = 0, []
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        imported = _imports(tree)
        for fn in jit[path.stem].values():
            for node in ast.walk(fn):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                    continue
                name = node.func.id
                module, real = imported.get(name, (path.stem, name))
                callee = jit.get(module, {}).get(real)
                if callee is None:
                    continue
                checked += 1
                problem = _problem(node, callee)
                if problem:
                    problems.append(f"{path.name}:{node.lineno} {fn.name} -> {module}.{real}: {problem}")
    assert checked > 50, checked            # the kernels' helper calls were found
    assert not problems, "\n".join(problems)
