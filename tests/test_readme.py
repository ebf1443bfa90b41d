"""The README's shell commands, and the one `make wheel` prints, as a user types them into bash.

Each command in a ```sh block is checked as far as it can be here, without a network, a GPU or a
vLLM: it is valid bash; a `kvbridge` command names a subcommand whose `--help` (run through the
installed entry point) lists every option it uses, and parses with those values; a `make` target
exists; a glob matches the file it is written for (in a directory holding such a file, with `pip`
a shell function that prints what it was given); a JSON argument is JSON. The subcommand and
options of every `kvbridge ...` the README quotes inline. And the rules the "Index" section gives
for block sizes and windows, each as the README words it, held against the index."""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from kvbridge import AllBlocksCleared, BlockStored, Index, KVEventBatch
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


# --- the Index section's block-size and window rules ---------------------------------------------
# Each check's docstring is the claim as the README words it: rewording one is changing the other.

# The section with its lines joined: a claim may wrap anywhere.
INDEX_SECTION = " ".join(README.split("\n## Index", 1)[1].split("\n## ", 1)[0].split())
PROMPT = list(range(64))  # four blocks of the index's 16 tokens


def _stored(hashes: list[int], n_tokens: int, block_size: int, **group: object) -> BlockStored:
    return BlockStored(hashes, None, list(range(n_tokens)), block_size, None, "GPU", None, **group)


def _index(*events: object, key: str = "tokens") -> Index:
    idx = Index(block_size=16, key=key)
    idx.apply("v", KVEventBatch(0.0, list(events)))
    return idx


def _claim(check: object) -> str:
    return " ".join(check.__doc__.split())  # type: ignore[union-attr]


def multiples_are_read_at_their_own_size() -> None:
    """A `block_size` that is a multiple m of the index's, up to 4096 of its blocks (a group of larger
    blocks, as hybrid models have), is read at its own size: its block i is the index's block
    (i + 1) * m - 1"""
    idx = _index(_stored([31, 32], 64, 32))
    assert idx.stats["block_size_mismatches"] == 0 and idx.find_matches(PROMPT) == {"v": 4}
    # Its hashes stand at the index's blocks 1 and 3, whatever a query has at 0 and 2.
    assert _index(_stored([31, 32], 64, 32), key="engine").find_matches(block_hashes=[5, 31, 6, 32]) == {"v": 4}
    assert _index(_stored([7], 16 * 4096, 16 * 4096)).stats["block_size_mismatches"] == 0


def hits_are_multiples_of_the_lcm() -> None:
    """a hit is a multiple of the lcm of the m of the worker's groups"""
    idx = _index(_stored([1, 2, 3, 4], 64, 16, group_idx=0), _stored([2, 4], 64, 32, group_idx=1))
    assert idx.find_matches(PROMPT[:48]) == {"v": 2}  # three blocks held in both groups


def clearing_forgets_kinds_and_sizes() -> None:
    """`AllBlocksCleared` clears that worker in every medium and group (and forgets the groups'
    kinds and block sizes)"""
    idx = _index(_stored([1, 2, 3, 4], 64, 16, group_idx=0, kv_cache_spec_kind="full_attention"),
                 _stored([2, 4], 64, 32, group_idx=1, kv_cache_spec_kind="sliding_window",
                         kv_cache_spec_sliding_window=32))  # fmt: skip
    idx.apply("v", KVEventBatch(0.0, [AllBlocksCleared(), _stored([1, 2, 3], 48, 16, group_idx=0),
                                      _stored([1], 16, 16, group_idx=1)]))  # fmt: skip
    # A window group of 32-token blocks would cut this to 2; a group without a kind is not scored.
    assert idx.find_matches(PROMPT[:48]) == {"v": 3}


def a_window_needs_one_block_at_least() -> None:
    """a sliding-window group of W tokens only the last cdiv(W - 1, block_size) blocks of its own
    size (at least one) before the hit's end"""

    def hit(window: int, holds: list[int]) -> dict[str, int]:
        # key="engine": the window group lists only the blocks it retains, as vLLM's do.
        window_group = _stored([[1, 2, 3, 4][b] for b in holds], 64, 16, group_idx=1,
                               kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=window)  # fmt: skip
        full = _stored([1, 2, 3, 4], 64, 16, group_idx=0, kv_cache_spec_kind="full_attention")
        return _index(full, window_group, key="engine").find_matches(block_hashes=[1, 2, 3, 4])

    assert hit(window=1, holds=[0]) == {"v": 1}  # cdiv(0, 16) = 0, yet the hit's last block is needed
    assert hit(window=17, holds=[3]) == {"v": 4}
    assert hit(window=18, holds=[3]) == {}  # two blocks before the hit's end
    assert hit(window=18, holds=[2, 3]) == {"v": 4}


@pytest.mark.parametrize("check", [
    multiples_are_read_at_their_own_size, hits_are_multiples_of_the_lcm, clearing_forgets_kinds_and_sizes,
    a_window_needs_one_block_at_least,
], ids=lambda check: check.__name__)  # fmt: skip
def test_readme_index_rule(check):
    assert _claim(check) in INDEX_SECTION, "the README no longer says this: change the check with it"
    check()


@pytest.mark.parametrize("hashes, n_tokens, block_size", [
    pytest.param([31, 32], 48, 24, id="not-a-multiple"),
    pytest.param([31, 32], 32, 0, id="0-with-token-ids"),
    pytest.param([31, 32], 32, -16, id="negative"),
    pytest.param([7], 16 * 4097, 16 * 4097, id="over-4096-blocks"),
    pytest.param([31, 32], 48, 32, id="token-ids-not-block_size-per-block"),
])  # fmt: skip
def test_readme_index_rule_other_block_sizes(hashes, n_tokens, block_size):
    """Any other `block_size` (0 on a store with token ids, negative, not a multiple, or over 4096
    blocks), or token ids not `block_size` per block, is counted (`block_size_mismatches`) and
    skipped"""
    assert _claim(test_readme_index_rule_other_block_sizes) in INDEX_SECTION
    idx = _index(_stored(hashes, n_tokens, block_size))
    assert idx.stats["block_size_mismatches"] == 1 and len(idx) == 0


# --- What the demo shows ---------------------------------------------------------------------------

DEMO_SECTION = " ".join(README.split("\n## What the demo shows", 1)[1].split("\n## ", 1)[0].split())


def _demo_claim(pattern: str) -> tuple[str, ...]:
    """The groups of ``pattern`` in the demo section, as the README words it."""
    found = re.search(pattern, DEMO_SECTION)
    assert found is not None, f"the README's demo section no longer says {pattern!r}: change this test with it"
    return found.groups()


def _demo_table(out: str, head: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(head + " "))
    return {line.split()[0]: line.split() for line in lines[at + 1 : at + 4]}


def test_the_demo_shows_what_the_readme_says():
    """`make demo` as the README describes it: the defaults it names, then every claim of "What the
    demo shows" held against a run with those defaults (its figures within a margin: a run's
    figures move with the machine's timing)."""
    turns_per_s, duration = map(float, _demo_claim(r"\((\d+) turns/s for (\d+) s\)"))
    defaults = build_parser().parse_args(["demo"])
    assert (defaults.turns_per_s, defaults.duration, defaults.workers) == (turns_per_s, duration, 3)
    assert _demo_claim(r"(three) fleets of (three) simulated engine workers") == ("three", "three")
    proc = subprocess.run([str(KVBRIDGE), "demo"], capture_output=True, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    # The broker SIGKILLed a third of the way in, restarted 2 s later; every view equal to its pool.
    _demo_claim(r"A third of the way in the broker is SIGKILLed and restarted 2 s later")
    assert "broker SIGKILLed" in out and "broker restarted" in out
    assert "every view equals its pool and every index scores like the pools: yes" in out
    # One simulated ms per wall ms: 8 s of chats and 4 bursts 200 ms apart end 8.8 s in, no sooner
    # (how much later is the machine's: not asserted).
    _demo_claim(r"Simulated time runs with the wall clock, one simulated millisecond per millisecond")
    stopped = float(re.search(r"\[ *(\d+\.\d)s\] traffic stopped", out).group(1))  # type: ignore[union-attr]
    assert stopped >= duration + 0.8, stopped
    workers = [line for line in out.splitlines() if " worker-" in line]
    assert len(workers) == 9 and all(line.endswith("yes") for line in workers), workers
    assert all(int(line.split()[2]) > 0 and int(line.split()[3].replace(",", "")) > 0 for line in workers)
    routing = _demo_table(out, "routing")
    assert set(routing) == {"KV-aware", "round-robin", "random"}
    hit = {name: float(cells[2].rstrip("%")) for name, cells in routing.items()}
    ttft = {name: [float(cells[i]) for i in (3, 5, 7, 9)] for name, cells in routing.items()}  # mean p50 p90 p99
    computed = {name: int(cells[-1].replace(",", "")) for name, cells in routing.items()}
    blind = ("round-robin", "random")
    # "finds more of each prompt cached (about 65% against 48%)"
    kv_hit, blind_hit = map(float, _demo_claim(r"finds more of each prompt cached \(about (\d+)% against (\d+)%\)"))
    assert abs(hit["KV-aware"] - kv_hit) <= 10 and all(abs(hit[b] - blind_hit) <= 10 for b in blind), hit
    assert all(hit["KV-aware"] >= hit[b] + 10 for b in blind), hit
    # "computes about a third fewer prompt tokens"
    _demo_claim(r"computes about a third fewer prompt tokens")
    assert all(0.5 <= computed["KV-aware"] / computed[b] <= 0.8 for b in blind), computed
    # "its TTFT mean and p90 come out below round-robin's and random's (about 75 / 110 ms against 90 / 150 ms ...)"
    _demo_claim(r"its TTFT mean and p90 come out below round-robin's and random's")
    assert all(ttft["KV-aware"][i] < ttft[b][i] for b in blind for i in (0, 2)), ttft
    said = list(map(float, _demo_claim(r"\(about (\d+) / (\d+) ms against (\d+) / (\d+) ms for round-robin\)")))
    seen = [ttft["KV-aware"][0], ttft["KV-aware"][2], ttft["round-robin"][0], ttft["round-robin"][2]]
    assert all(0.7 * s <= x <= 1.3 * s for s, x in zip(said, seen)), (said, seen)
    # "events lost (0)"
    assert all(cells[-1] == "0" for cells in _demo_table(out, "stream").values()), out
    # Bursts: the first worker counted as holding the prefix before its events arrive; the burst kept
    # there, or sent elsewhere only where the router predicted a sooner first token.
    _demo_claim(r"keeps the burst there while queueing behind it costs less than prefilling the prefix on another worker")
    kept = re.search(r"KV-aware kept (\d+) of the (\d+) later requests of a burst on a worker already given its "
                     r"prefix \((\d+) on provisional residency alone", out)  # fmt: skip
    assert kept is not None, out
    n, later, provisional = map(int, kept.groups())
    assert later == 4 * 11 and n >= later // 2 and provisional == n, kept.group(0)
    spread = re.search(r"and sent (\d+) to another worker, where it predicted their first token sooner than queued "
                       r"behind the burst \((\d+\.\d) ms against (\d+\.\d) ms", out)  # fmt: skip
    if n < later:
        assert spread is not None and int(spread.group(1)) == later - n, out
        assert float(spread.group(2)) <= float(spread.group(3)), spread.group(0)
    # the demo's nats-server is gone: nothing listens on its port any more
    port = int(out.split("nats-server started on nats://127.0.0.1:", 1)[1].split()[0])
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))
