"""Messages of device-side assertions fit CUDA's limit.

``torch._assert_async(cond, msg)`` and ``torch._check*(cond, msg)`` inside a compiled graph
become a CUDA device assertion, whose message must be shorter than 255 characters: a longer
one fails when the graph is compiled for a GPU ("Message length must be smaller than 255"),
which a CPU run never shows. Every such call in course_lib is found in the source and its
message measured."""
import ast
import importlib
from pathlib import Path

import course_lib

ROOT = Path(course_lib.__file__).parent
LIMIT = 255
ASSERTS = {"_assert_async", "_assert_async_msg", "_check", "_check_is_size", "_check_value",
           "_check_index", "_check_with"}


def _calls():
    """(module name, line, message AST node) of every device-side assertion in course_lib."""
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ASSERTS and len(node.args) >= 2):
                yield module, node.lineno, node.args[-1]


def _message(module: str, node) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        value = getattr(importlib.import_module(module), node.id)
        assert isinstance(value, str), f"{module}: {node.id} is not a string"
        return value
    raise AssertionError(f"{module}: a message this test cannot read ({ast.dump(node)[:80]})")


def test_device_assert_messages_fit_cuda():
    calls = list(_calls())
    assert calls, "no device-side assertion found: has the search gone stale?"
    for module, line, node in calls:
        msg = _message(module, node)
        assert len(msg) < LIMIT, f"{module}:{line}: message of {len(msg)} characters: {msg!r}"
