"""``attnquant demo``: the embedded real Gemma 3 270M, NVFP4 on every projection.

Runs ``max generate`` through attnquant's wrapper with one chat prompt (MAX
applies the model's chat template), then prints the answer, the load path,
the coverage, the bytes before -> after and the decode speed MAX measured.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence

from attnquant.loading import SUMMARY_PREFIX

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."
_THROUGHPUT = re.compile(r"Eval throughput \(token-generation\): ([\d.]+)")


def run_generate(prompt: str, max_new_tokens: int, env: dict[str, str]) -> tuple[str, str]:
    args = [
        sys.executable, "-m", "attnquant.max_cli", "generate",
        "--prompt", prompt, "--max-new-tokens", str(max_new_tokens),
        "--top-k", "1",
    ]  # fmt: skip
    result = subprocess.run(args, env=env, capture_output=True, text=True)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise SystemExit(f"max generate failed ({result.returncode}):\n{output[-4000:]}")
    return result.stdout, output


def answer_text(stdout: str) -> str:
    """The generated text: what MAX printed before its statistics."""
    return stdout.split("Prompt size:", 1)[0].strip()


def main(argv: Sequence[str] = ()) -> int:
    prompt = " ".join(argv) or DEFAULT_PROMPT
    env = {**os.environ, "ATTNQUANT_QUANT": os.environ.get("ATTNQUANT_QUANT", "nvfp4")}
    print(f"attnquant demo: Gemma 3 270M, ATTNQUANT_QUANT={env['ATTNQUANT_QUANT']}, CPU")
    print("(the first run builds the model and compiles MAX graphs: minutes; later runs: seconds)")
    stdout, output = run_generate(prompt, 96, env)
    print(f"\nuser: {prompt}\nmodel: {answer_text(stdout)}\n")
    for line in output.splitlines():
        if SUMMARY_PREFIX in line:
            print(line[line.index(SUMMARY_PREFIX) :])
    if match := _THROUGHPUT.search(output):
        print(f"decode: {float(match.group(1)):.1f} tok/s (MAX's own measurement)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
