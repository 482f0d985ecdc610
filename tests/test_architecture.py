"""The layering and size contracts of docs/ARCHITECTURE.md, checked by the tools that own them.

- Imports: import-linter's contracts in pyproject.toml (layers, no cycles, no torch in the core).
- Complexity: ruff's C901 / PLR0912 / PLR0915 with the thresholds in pyproject.toml.
- Size: no module over 800 lines, no class over 400, no function over 80 (tests and generated
  code excepted), which no ruff rule measures.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("varuna", "manager", "profiler", "simulator", "scripts", "examples")
MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80


def _product_files() -> list[Path]:
    out = []
    for pkg in PACKAGES:
        out += [p for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name]
    return sorted(out)


def _oversized(path: Path) -> list[str]:
    text = path.read_text()
    rel = path.relative_to(ROOT)
    found = []
    n_lines = len(text.splitlines())
    if n_lines > MAX_MODULE_LINES:
        found.append(f"{rel}: module of {n_lines} lines > {MAX_MODULE_LINES}")
    for node in ast.walk(ast.parse(text)):
        length = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
        if isinstance(node, ast.ClassDef) and length > MAX_CLASS_LINES:
            found.append(f"{rel}:{node.lineno}: class {node.name} of {length} lines > {MAX_CLASS_LINES}")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and length > MAX_FUNCTION_LINES:
            found.append(
                f"{rel}:{node.lineno}: function {node.name} of {length} lines > {MAX_FUNCTION_LINES}"
            )
    return found


def test_no_module_class_or_function_over_the_size_limits():
    found = [line for path in _product_files() for line in _oversized(path)]
    assert not found, "over the size limits (split by role):\n" + "\n".join(found)


def test_size_check_catches_an_oversized_function(tmp_path):
    # Negative control: the checker must see a long function and a long module.
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    path = ROOT / "tests" / "_oversized_probe.py"
    try:
        path.write_text("def f():\n" + body + "\n" + "\n" * MAX_MODULE_LINES)
        found = _oversized(path)
    finally:
        path.unlink()
    assert any("function f" in line for line in found) and any("module of" in line for line in found)


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
