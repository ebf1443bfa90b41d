"""The typed contract: the package ships py.typed, type-checks under the repository's mypy
settings (pyproject.toml [tool.mypy]: every def typed), and kvbridge._native's .pyi matches the
native module, as mypy's stubtest sees it (the check pydantic-core runs on its core)."""

import os
import subprocess
import sys
from pathlib import Path

import kvbridge

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(kvbridge.__file__).resolve().parent


def _run(args: list[str], tmp_path: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    # MYPY_CACHE_DIR (mypy) and cwd=tmp_path (stubtest, which writes .mypy_cache where it runs):
    # nothing left in the checkout.
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent), "MYPY_CACHE_DIR": str(tmp_path / "mypy-cache")}
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_package_ships_its_types():
    assert (PACKAGE / "py.typed").is_file()
    assert (PACKAGE / "_native.pyi").is_file()


def test_native_stub_matches_the_module(tmp_path):
    proc = _run(
        ["mypy.stubtest", "kvbridge._native", "--mypy-config-file", str(ROOT / "pyproject.toml"),
         "--allowlist", str(ROOT / "tests" / "stubtest-allowlist.txt")],
        tmp_path, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_package_type_checks(tmp_path):
    proc = _run(["mypy", "--config-file", "pyproject.toml"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success" in proc.stdout
