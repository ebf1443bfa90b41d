"""The README's shell commands, and the one `make wheel` prints, as a user types them into bash.

Each command in a ```sh block is checked as far as it can be here, without a network, a GPU or a
vLLM: it is valid bash; a `kvbridge` command names a subcommand whose `--help` (run through the
installed entry point) lists every option it uses, and parses with those values; a `make` target
exists; a glob matches the file it is written for (in a directory holding such a file, with `pip`
a shell function that prints what it was given); a JSON argument is JSON. The subcommand and
options of every `kvbridge ...` the README quotes inline."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from kvbridge.tools.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
KVBRIDGE = Path(sys.executable).with_name("kvbridge")  # the console script, as installed


def _sh_commands() -> list[str]:
    """Every command in the README's ```sh blocks, continuation lines joined, comments kept."""
    commands = []
    for block in re.findall(r"^```sh\n(.*?)^```", README, flags=re.S | re.M):
        for command in block.replace("\\\n", " ").splitlines():
            if command.strip():
                commands.append(command.strip())
    return commands


def _inline_kvbridge() -> list[str]:
    return sorted(set(re.findall(r"`(kvbridge [a-z][^`]*)`", README)))


def _words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


@cache
def _help(*sub: str) -> str:
    proc = subprocess.run([str(KVBRIDGE), *sub, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _check_kvbridge(words: list[str], *, whole: bool = True) -> None:
    """``whole``: a command to run as written (an inline mention may name a command and some of
    its options only)."""
    assert words[0] == "kvbridge"
    sub = words[1]
    assert re.search(rf"\{{[a-z,-]*\b{re.escape(sub)}\b[a-z,-]*\}}", _help()), f"no subcommand {sub!r}"
    text = _help(sub)
    for word in words[2:]:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"kvbridge {sub} --help lacks {flag}"
    if whole and "--help" not in words:
        build_parser().parse_args(words[1:])  # the values too (argparse exits on a bad one)


def _pip_args(command: str, cwd: Path) -> list[str]:
    """What ``pip`` receives when bash runs ``command`` in ``cwd``."""
    script = f'pip() {{ printf "%s\\n" "$@"; }}\n{command}'
    proc = subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


_ARCH = subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout.strip()
_WHEEL = f"kvbridge-0.1.0-cp311-abi3-manylinux_2_28_{_ARCH}.whl"


def _check_wheel_install(command: str, tmp_path: Path) -> None:
    """A wheel install line, run where `make wheel` leaves its wheel: pip gets one path that
    exists, with the extra attached."""
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / _WHEEL).touch()
    (tmp_path / "dist" / "kvbridge-0.1.0.tar.gz").touch()
    args = _pip_args(command, tmp_path)
    assert args[0] == "install" and len(args) == 2, args
    path, _, extra = args[1].partition("[")
    assert (tmp_path / path).is_file(), f"{command!r} gives pip {args[1]!r}: the glob did not expand"
    assert extra == "demo]", args


def test_the_readme_has_the_commands_this_file_checks():
    commands = _sh_commands()
    assert any(c.startswith("kvbridge relay") for c in commands) and any(c.startswith("make test") for c in commands)
    assert any("dist/kvbridge-" in c for c in commands)
    assert "kvbridge demo --help" in _inline_kvbridge()


@pytest.mark.parametrize("command", _sh_commands(), ids=lambda c: " ".join(c.split()[:3]))
def test_readme_command(command, tmp_path):
    assert subprocess.run(["bash", "-n", "-c", command], capture_output=True, timeout=30).returncode == 0, command
    words = _words(command)
    for word in words:
        if word.startswith("{") and "..." not in word:  # a JSON argument, not an elided example
            json.loads(word)
    # What runs after an environment assignment (VAR=value command ...).
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    if words[0] == "kvbridge":
        _check_kvbridge(words)
    elif words[0] == "make":
        for target in words[1:]:
            assert re.search(rf"^{re.escape(target)}:", (ROOT / "Makefile").read_text(), re.M), f"no make target {target}"
    elif words[:2] == ["pip", "install"] and "dist/" in command:
        _check_wheel_install(command, tmp_path)
    else:
        # Needs a network, a GPU or a tool not installed here (pip from the registry, vllm, nats,
        # curl): valid bash, with valid JSON, is what can be said.
        assert words[0] in {"pip", "export", "vllm", "nats", "curl"}, f"a command this test does not know: {command}"


@pytest.mark.parametrize("command", _inline_kvbridge())
def test_readme_inline_kvbridge_command(command):
    _check_kvbridge(_words(command), whole=False)


def test_the_install_line_make_wheel_prints_works(tmp_path):
    # `make -n` prints the recipe without running it; its last line is the echo a user reads.
    proc = subprocess.run(["make", "-n", "--no-print-directory", "wheel"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    echo = next(line for line in proc.stdout.splitlines() if line.startswith("echo ") and "pip install" in line)
    shown = subprocess.run(["bash", "-c", echo], capture_output=True, text=True, timeout=30).stdout.strip()
    command = shown.split("dist/: ", 1)[1]
    assert command.startswith("pip install "), shown
    _check_wheel_install(command, tmp_path)
