"""``attnquant demo``: the embedded real Gemma 3 270M, NVFP4 on every projection.

Runs ``max generate`` through attnquant's wrapper with one chat prompt, then
prints the answer, the load path, the coverage, the bytes before -> after and
the decode speed MAX measured.

The embedded model is the *pretrained* Gemma 3 270M (the only one on PyPI),
which continues text well but was never taught Gemma's chat turns. So the
demo's chat template renders the message as plain text, in a
question/answer frame the pretrained model completes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from attnquant.tools.cli import register_subcommand
from attnquant.tools.demo_model import ensure_demo_model
from attnquant.load.report import LOAD_PREFIX

DEFAULT_PROMPT = "What is the capital of France?"
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}Question: {{ m['content'] }}\nAnswer:{% endfor %}"
)
STOP = "\nQuestion:"  # the pretrained model goes on to ask itself the next question
_THROUGHPUT = re.compile(r"Eval throughput \(token-generation\): ([\d.]+)")


def run_generate(prompt: str, max_new_tokens: int, env: dict[str, str]) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile("w", suffix=".jinja") as template:
        template.write(PLAIN_TEMPLATE)
        template.flush()
        args = [
            sys.executable, "-m", "attnquant.tools.max_cli", "generate",
            "--prompt", prompt, "--max-new-tokens", str(max_new_tokens),
            "--top-k", "1", "--chat-template", template.name,
            "--stop", STOP,
        ]  # fmt: skip
        result = subprocess.run(args, env=env, capture_output=True, text=True)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise SystemExit(f"max generate failed ({result.returncode}):\n{output[-4000:]}")
    return result.stdout, output


def answer_text(stdout: str) -> str:
    """The generated text: what MAX printed before its statistics."""
    text = stdout.split("Prompt size:", 1)[0]
    return text.split(STOP, 1)[0].strip()  # MAX prints the stop string too


def main(argv: Sequence[str] = ()) -> int:
    prompt = " ".join(argv) or DEFAULT_PROMPT
    ensure_demo_model()  # before MAX starts, so its progress message shows
    env = {**os.environ, "ATTNQUANT_QUANT": os.environ.get("ATTNQUANT_QUANT", "nvfp4")}
    print(f"attnquant demo: Gemma 3 270M, ATTNQUANT_QUANT={env['ATTNQUANT_QUANT']}, CPU")
    print("(the first run builds the model and compiles MAX graphs: minutes; later runs: seconds)")
    stdout, output = run_generate(prompt, 32, env)
    print(f"\nuser: {prompt}\nmodel: {answer_text(stdout)}\n")
    for line in output.splitlines():
        if LOAD_PREFIX in line:
            print(line[line.index(LOAD_PREFIX) :])
    if match := _THROUGHPUT.search(output):
        print(f"decode: {float(match.group(1)):.1f} tok/s (MAX's own measurement)")
    return 0


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="*", help=f"the question (default: {DEFAULT_PROMPT!r})")


def _print_demo_model_path(args: argparse.Namespace) -> int:
    print(ensure_demo_model())
    return 0


register_subcommand(
    "demo", "Answer one prompt with the embedded Gemma 3 270M, NVFP4 on CPU/GPU.",
    _add_demo_arguments, lambda args: main(args.prompt),
)  # fmt: skip
register_subcommand(
    "demo-model", "Build (once) the embedded real Gemma 3 270M checkpoint and print its path.",
    lambda parser: None, _print_demo_model_path,
)  # fmt: skip
