"""Run single statements of an engine's function, taken from its installed source: helpers for rules-engine
adapters (SGLang's, :mod:`conformance.adapters.sglang.rules`). ``conformance.rules._source`` re-exports them.

Some SGLang rules are inline statements of methods that need a loaded GPU layer or a distributed model
(``DeepseekV2MoE.__init__``, ``ModelOptNvFp4FusedMoEMethod.apply``). Rather than re-typing those
conditions, we parse the installed source, pick out the one statement (located by text that only it
contains), and execute it against the function's module globals plus the names the case provides. If the
statement is edited upstream, these checks follow it; if it disappears, they fail loudly (LookupError).
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from typing import Any


@functools.lru_cache(maxsize=None)
def _tree(func) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(func))))


def _globals(module: types.ModuleType, namespace: dict[str, Any]) -> dict[str, Any]:
    scope = dict(vars(module))
    scope.update(namespace)
    return scope


def _only(nodes: list, what: str, func) -> ast.AST:
    if len(nodes) != 1:
        raise LookupError(f"expected exactly one {what} in {func.__qualname__}, found {len(nodes)}")
    return nodes[0]


def eval_if_test(func, module, *, marker: str, namespace: dict[str, Any]) -> Any:
    """Evaluate the test of the innermost ``if`` of ``func`` whose body contains ``marker`` (source text)."""
    tree = _tree(func)
    ifs = [n for n in ast.walk(tree) if isinstance(n, ast.If)
           and any(marker in ast.unparse(s) for s in n.body)
           and not any(isinstance(c, ast.If) and any(marker in ast.unparse(s) for s in c.body) for c in ast.walk(n) if c is not n)]
    node = _only(ifs, f"if-statement guarding {marker!r}", func)
    return eval(compile(ast.Expression(node.test), f"<{func.__qualname__}>", "eval"), _globals(module, namespace))


def run_nested_if(func, module, *, outer: str, marker: str, namespace: dict[str, Any]) -> None:
    """Execute (test and body) each ``if`` directly inside the ``if <outer>:`` block whose body contains ``marker``."""
    tree = _tree(func)
    outers = [n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == outer]
    node = _only(outers, f"'if {outer}:' block", func)
    inner = [s for s in node.body if isinstance(s, ast.If) and marker in ast.unparse(s)]
    stmt = _only(inner, f"if-statement containing {marker!r} inside 'if {outer}:'", func)
    code = compile(ast.Module(body=[stmt], type_ignores=[]), f"<{func.__qualname__}>", "exec")
    exec(code, _globals(module, namespace))  # noqa: S102 - the engine's own statement


def eval_assignment(func, module, target: str, namespace: dict[str, Any]) -> Any:
    """Evaluate the right-hand side of the single ``<target> = ...`` assignment in ``func``."""
    tree = _tree(func)
    assigns = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == target for t in n.targets)]
    node = _only(assigns, f"assignment to {target!r}", func)
    return eval(compile(ast.Expression(node.value), f"<{func.__qualname__}>", "eval"), _globals(module, namespace))
