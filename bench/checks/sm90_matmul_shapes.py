"""Which bf16 matmul shapes MAX compiles for the H200 (sm_90a), without a GPU.

    python bench/checks/sm90_matmul_shapes.py 5376x21504 43008x5376 [--m 1] [--via attnquant]

Compiles, for each W shape NxK, one graph ``y = x @ W.T`` (x [M, K] bf16, M
symbolic unless --m is given) for a virtual sm_90a device (MAX's
virtual-device mode: the real compiler, no GPU), and prints OK or FAIL with
the compiler's constraint message and the compile time. ``--via max`` uses
``max.graph.ops.matmul`` directly; ``--via attnquant`` uses
``attnquant.graph.matmul.linear`` (what our models call). Each compile takes 4 to 10
minutes on 2 cores. With ``--device gpu`` it compiles for the GPU present.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse_shape(text: str) -> tuple[int, int]:
    n, _, k = text.partition("x")
    return int(n), int(k)


def compile_max(session, n: int, k: int, m: int | str) -> None:
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType, ops

    dev = DeviceRef.GPU(0)
    types = [TensorType(DType.bfloat16, [m, k], dev), TensorType(DType.bfloat16, [n, k], dev)]
    with Graph(f"matmul_{n}x{k}", input_types=types) as graph:
        x, w = (value.tensor for value in graph.inputs)
        graph.output(ops.matmul(x, ops.transpose(w, 0, 1)))
    session.load(graph)


def compile_attnquant(session, n: int, k: int, m: int | str) -> None:
    from max.driver import Accelerator
    from max.dtype import DType
    from max.experimental import compilation
    from max.experimental.sharding import TensorLayout

    from attnquant.graph import matmul

    dev = Accelerator()
    types = [TensorLayout(DType.bfloat16, [m, k], dev), TensorLayout(DType.bfloat16, [n, k], dev)]
    compilation.compile(matmul.linear, session=session)(*types)


def error_text(error: BaseException) -> str:
    """The error and its causes (MAX wraps the compiler's message)."""
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        parts.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return "\n  caused by ".join(parts)


def constraint(error: BaseException) -> str:
    """The compiler's constraint message, with its context, or the error's end."""
    text = error_text(error)
    at = text.find("constraint")
    return text[max(0, at - 600) : at + 900] if at >= 0 else text[-1500:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shapes", nargs="+", type=parse_shape, help="W shapes as NxK")
    parser.add_argument("--m", type=int, help="static token count (default: symbolic)")
    parser.add_argument("--via", choices=("max", "attnquant"), default="max")
    parser.add_argument("--device", choices=("virtual-sm90a", "gpu"), default="virtual-sm90a")
    args = parser.parse_args()

    from max import driver

    if args.device == "virtual-sm90a":
        driver.set_virtual_device_api("cuda")
        driver.set_virtual_device_target_arch("sm_90a")
        driver.set_virtual_device_count(1)
    from max.engine import InferenceSession

    session = InferenceSession(devices=[driver.CPU(), driver.Accelerator()])
    build = compile_max if args.via == "max" else compile_attnquant
    m = args.m if args.m is not None else "m"
    for n, k in args.shapes:
        start = time.time()
        try:
            build(session, n, k, m)
            print(f"OK   [{n}, {k}] M={m} via {args.via}: {time.time() - start:.0f} s", flush=True)
        except Exception as error:  # noqa: BLE001 - report every shape
            print(f"FAIL [{n}, {k}] M={m} via {args.via}: {time.time() - start:.0f} s: {constraint(error)}", flush=True)


if __name__ == "__main__":
    main()
