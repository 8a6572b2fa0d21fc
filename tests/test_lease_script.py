"""The H200 lease script's Python calls use only options their scripts accept.

A lease is the one chance a session has to run these commands, and an option
a script no longer takes ends that phase at its first line (argparse exits
with code 2), minutes into a lease and unseen until the files come back.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEASE = ROOT / "bench" / "harness" / "h200_lease.sh"
HERE = LEASE.parent

# Where a command's own arguments end (redirections, pipes, the next command).
_END = re.compile(r"^(\d?>|>|<|\||;|&|&&|\|\||\))")


def _logical_lines(text: str) -> list[str]:
    return text.replace("\\\n", " ").splitlines()


def python_calls(text: str) -> list[tuple[list[str], list[str]]]:
    """(how to ask for --help, options passed) for every python3 call."""
    calls = []
    for line in _logical_lines(text):
        for match in re.finditer(r"python3 (\"\$HERE/[^\"]+\.py\"|-m attnquant \w[\w-]*)", line):
            target = match.group(1)
            if target.startswith("-m"):
                command = [sys.executable, "-m", "attnquant", target.split()[-1]]
            else:
                command = [sys.executable, str((HERE / target.strip('"').removeprefix("$HERE/")).resolve())]
            options = []
            for token in shlex.split(line[match.end():], posix=False):
                if _END.match(token):
                    break
                if token.startswith("--"):
                    options.append(token.split("=", 1)[0])
            calls.append((command, options))
    return calls


def test_the_script_has_python_calls() -> None:
    calls = python_calls(LEASE.read_text())
    scripts = {Path(c[1]).name if len(c) == 2 else " ".join(c[2:]) for c, _ in calls}
    assert {"batch_invariance.py", "serve_benchmark.py", "make_random_gemma3.py", "kernels_h200.py"} <= scripts
    assert sum(len(options) for _, options in calls) > 40


def test_a_removed_option_is_caught() -> None:
    calls = python_calls('  python3 "$HERE/../checkpoints/make_random_gemma3.py" "$W/x" --layers 2 \\\n'
                         '    --device cuda:0 2>&1 | tail -1\n')
    assert calls[0][1] == ["--layers", "--device"]
    assert calls[0][0][-1].endswith("bench/checkpoints/make_random_gemma3.py")


@pytest.mark.parametrize("command, options", python_calls(LEASE.read_text()),
                         ids=lambda v: Path(v[-1]).name if isinstance(v, list) and v and v[0] == sys.executable else "")
def test_every_option_is_accepted(command: list[str], options: list[str]) -> None:
    assert Path(command[1]).exists() or command[1] == "-m", command
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    accepted = set(re.findall(r"--[\w-]+", done.stdout))
    unknown = [o for o in options if o not in accepted]
    assert not unknown, f"{' '.join(command[1:])} does not accept {unknown}"

