"""The layering and size contracts of docs/ARCHITECTURE.md, checked by the tools that own them.

- Imports: import-linter's contracts in pyproject.toml (layers, no cycles, no torch in the core).
- Complexity: ruff's C901 / PLR0912 / PLR0915 with the thresholds in pyproject.toml.
- Size: no module over 800 lines of code, no class over 400, no function over 80 (tests and
  generated code excepted), which no ruff rule measures. Code, not prose: docstrings (every
  string that stands alone as a statement, attribute docstrings included), comments and blank
  lines do not count, so a limit never pushes a method out of its class for its documentation.
  A class whose concept does not split may exceed the class limit by a named, reasoned
  exemption (:data:`CLASS_EXEMPTIONS`): its own cap and why.
"""

from __future__ import annotations

import ast
import io
import shutil
import subprocess
import sys
import tokenize
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("varuna", "manager", "profiler", "simulator", "scripts", "examples")
MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80

#: Classes allowed over MAX_CLASS_LINES: ``"path/to/module.py::Class": (cap in lines of code,
#: reason)``. The reason says why the class is one concept that splitting would blur; an entry
#: without one, one for a class now under the limit, or a class over its cap fails the test.
CLASS_EXEMPTIONS: dict[str, tuple[int, str]] = {}

_NOT_CODE = {
    tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER,
}


def _code_lines(text: str, tree: ast.Module) -> set[int]:
    """Line numbers that hold code: not blank, not only a comment, not inside a docstring (a
    string constant standing alone as a statement: a module's, class's or function's docstring,
    or an attribute docstring under a field)."""
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in _NOT_CODE:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    for node in ast.walk(tree):
        prose = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if prose and isinstance(node.value.value, str):
            lines.difference_update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def _oversized(path: Path, exemptions: Mapping[str, tuple[int, str]] | None = None) -> list[str]:
    """What in ``path`` is over the size limits, in lines of code; exempt classes against their caps."""
    exemptions = CLASS_EXEMPTIONS if exemptions is None else exemptions
    text = path.read_text()
    rel = path.relative_to(ROOT).as_posix()
    tree = ast.parse(text)
    code = _code_lines(text, tree)
    found = []
    if len(code) > MAX_MODULE_LINES:
        found.append(f"{rel}: module of {len(code)} lines of code > {MAX_MODULE_LINES}")
    for node in ast.walk(tree):
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        n = sum(1 for line in code if node.lineno <= line <= (node.end_lineno or node.lineno))
        if isinstance(node, ast.ClassDef):
            cap, _ = exemptions.get(f"{rel}::{node.name}", (MAX_CLASS_LINES, ""))
            if n > cap:
                found.append(f"{rel}:{node.lineno}: class {node.name} of {n} lines of code > {cap}")
        elif n > MAX_FUNCTION_LINES:
            limit = MAX_FUNCTION_LINES
            found.append(f"{rel}:{node.lineno}: function {node.name} of {n} lines of code > {limit}")
    return found


def _class_sizes(exemptions: Mapping[str, tuple[int, str]]) -> dict[str, int]:
    """Lines of code of each exempted class that exists."""
    out = {}
    for key in exemptions:
        rel, _, name = key.partition("::")
        path = ROOT / rel
        if not path.is_file():
            continue
        text = path.read_text()
        tree = ast.parse(text)
        code = _code_lines(text, tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == name:
                out[key] = sum(1 for line in code if node.lineno <= line <= (node.end_lineno or node.lineno))
    return out


def _exemption_problems(exemptions: Mapping[str, tuple[int, str]]) -> list[str]:
    """Exemptions without a reason, for a class that is gone or now fits the limit."""
    sizes = _class_sizes(exemptions)
    problems = []
    for key, (cap, reason) in exemptions.items():
        if not isinstance(reason, str) or len(reason.split()) < 3:
            problems.append(f"{key}: an exemption needs a reason (why the class does not split)")
        if key not in sizes:
            problems.append(f"{key}: no such class (remove the exemption)")
        elif sizes[key] <= MAX_CLASS_LINES:
            problems.append(f"{key}: {sizes[key]} lines of code fit the limit (remove the exemption)")
        elif cap < sizes[key]:
            problems.append(f"{key}: {sizes[key]} lines of code > its cap {cap}")
    return problems


def _product_files() -> list[Path]:
    out = []
    for pkg in PACKAGES:
        out += [p for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name]
    return sorted(out)


def test_no_module_class_or_function_over_the_size_limits():
    found = [line for path in _product_files() for line in _oversized(path)]
    why = "over the size limits (split by concept, or exempt a class with a reason):\n"
    assert not found, why + "\n".join(found)


def test_every_class_exemption_is_reasoned_and_needed():
    problems = _exemption_problems(CLASS_EXEMPTIONS)
    assert not problems, "\n".join(problems)


def _probe(tmp_name: str, text: str) -> Path:
    path = ROOT / "tests" / tmp_name
    path.write_text(text)
    return path


def test_size_check_counts_code_not_prose():
    # Negative control: the checker must see a long function and a long module, and only code.
    code = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    prose = "\n".join(f"    # comment {i}\n\n" for i in range(MAX_FUNCTION_LINES))
    doc = '    """' + "\n".join(f"    doc {i}" for i in range(MAX_FUNCTION_LINES)) + '"""\n'
    field = '    y: int = 0\n    """' + "\n".join(f"    on y {i}" for i in range(MAX_CLASS_LINES)) + '"""\n'
    path = _probe("_oversized_probe.py", (
        "def long():\n" + code + "\n\n"
        "def documented():\n" + doc + prose + "    return 1\n\n"
        "class Fields:\n" + field + "\n"
        + "\n".join(f"z{i} = {i}" for i in range(MAX_MODULE_LINES)) + "\n"
    ))
    try:
        found = _oversized(path, {})
    finally:
        path.unlink()
    assert any("function long " in line for line in found), found
    assert any("module of" in line for line in found), found
    assert not any("documented" in line or "Fields" in line for line in found), found


def test_a_class_exemption_needs_a_reason_and_holds_its_cap():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES + 10))
    path = _probe("_exempt_probe.py", "class Big:\n" + body + "\n")
    key = "tests/_exempt_probe.py::Big"
    try:
        assert any("class Big of 411 lines of code > 400" in line for line in _oversized(path, {}))
        assert _oversized(path, {key: (420, "one table of constants that reads as one")}) == []
        assert any("> 405" in line for line in _oversized(path, {key: (405, "too tight a cap here")}))
        assert _exemption_problems({key: (420, "one table of constants that reads as one")}) == []
        assert any("needs a reason" in p for p in _exemption_problems({key: (420, "")}))
        gone = {"tests/_exempt_probe.py::Gone": (9, "a class that left")}
        assert any("no such class" in p for p in _exemption_problems(gone))
    finally:
        path.unlink()


def _lint_imports() -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    return subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    run = _lint_imports()
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "BROKEN" not in run.stdout and "KEPT" in run.stdout


def test_import_contracts_catch_an_upward_import():
    # Negative control: a core module importing the runtime must break the layers contract.
    probe = ROOT / "varuna" / "core" / "_upward_probe.py"
    try:
        probe.write_text("import varuna.runtime.engine  # noqa: F401\n")
        run = _lint_imports()
    finally:
        probe.unlink()
    assert run.returncode != 0 and "varuna.core._upward_probe" in run.stdout, run.stdout[-3000:]


@pytest.mark.parametrize(
    "probe, code, needle",
    [
        # The domain speaks dataclasses: a domain module importing grpc (or the generated modules)
        # must break the domain contract...
        ("manager/domain/_wire_probe.py", "import grpc  # noqa: F401\n",
         "manager.domain._wire_probe -> grpc"),
        ("manager/domain/_pb_probe.py", "from manager.transport import varuna_manager_pb2  # noqa: F401\n",
         "manager.domain._pb_probe -> manager.transport.varuna_manager_pb2"),
        # ... and what runs on a VM must not reach into the daemon.
        ("manager/agent/_daemon_probe.py", "import manager.domain.store  # noqa: F401\n",
         "manager.agent._daemon_probe -> manager.domain.store"),
    ],
)
def test_manager_contracts_catch_the_wire_in_the_domain_and_the_daemon_on_a_vm(probe, code, needle):
    # Negative controls for the manager's contracts in pyproject.toml (docs/ARCHITECTURE.md).
    path = ROOT / probe
    try:
        path.write_text(code)
        run = _lint_imports()
    finally:
        path.unlink()
    assert run.returncode != 0 and needle in run.stdout, run.stdout[-3000:]


def test_import_depth_counts_the_longest_chain_and_a_cycle_once():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from import_depth import depths, longest_chain
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    edges = {"top": {"mid", "leaf"}, "mid": {"a"}, "a": {"b"}, "b": {"a", "leaf"}, "leaf": set()}
    depth, nxt, cycles = depths(edges)
    # top -> mid -> {a <-> b} -> leaf: the cycle is one level.
    assert longest_chain(depth, nxt)[:2] == ["top", "mid"] and depth["top"] == 4
    assert cycles == [["a", "b"]] and depth["leaf"] == 1


def test_ruff_complexity_rules_are_clean():
    exe = shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    run = subprocess.run(
        [exe, "check", "--select", "C901,PLR0912,PLR0915", *PACKAGES, "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:]


def test_core_imports_without_torch():
    code = (
        "import sys, varuna.core.schedule, varuna.core.partition, varuna.core.calibration, "
        "varuna.core.batching, varuna.core.env, varuna.core.timeline, simulator.engine, "
        "simulator.autoconfig; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
