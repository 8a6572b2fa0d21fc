"""The canonical decode harness: ``max serve`` + ``max benchmark`` at concurrency 1 (and others on request).

``python bench/harness/serve_benchmark.py --model DIR --cells CELL ... --sessions 2
--trials 3 --out results.jsonl`` runs, for each server session, one server per
cell (the first alone, then the rest at once), then one server at a time, ``--trials``
runs of ``max benchmark`` (``/v1/chat/completions``, random 128 in / 128 out,
``--num-prompts`` prompts, temperature 0; at each ``--concurrency``, default 1,
with ``--num-prompts`` times that many prompts); ``--rounds`` times over the cells in
turn, the order rotated each round, all of it in one process
(``bench/harness/max_benchmark_inprocess.py --plan``: MAX's benchmark, MAX imported
once); it appends one JSON line per trial,
stops every server, and starts the next session. It prints a table of the
median output tok/s and median TPOT over every trial of a cell, and compares
each cell's greedy 48-token completion with the first cell's and with its
capture twin's (the same cell with capture flipped; its arena size may
differ) and, for a cell with ``+--FLAG`` items or ``ATTNQUANT_LAYER_SUBGRAPHS``,
with the same cell compiled plainly, when that cell is run.

``--image`` also sends each cell one chat request with an image (a text +
vision model's vision tower runs) and prints MAX's answer or its refusal.

``--gpu-lock FILE`` lets several harnesses share one GPU: each holds an
exclusive lock on FILE while it measures a session's cells, so measurements never overlap
(servers of the other harness may still be compiling or loading meanwhile).

A cell is ``VARIANT:on|off[+ENV=VALUE...][+--FLAG...]``: the capture flag is
always passed explicitly (``--device-graph-capture`` /
``--no-device-graph-capture``), ``+ENV=VALUE`` items add environment variables
(e.g. ``attnquant-bf16:off+ATTNQUANT_BLOCKS=13``) and ``+--FLAG`` items add a
value-less flag to the server's command line (e.g. ``+--no-use-subgraphs``). A cell whose server fails to
start is reported with the tail of its log; the others go on.

Variants:
  builtin-bf16          MAX's own architecture for the checkpoint, bf16
  attnquant-bf16        ours, passthrough weights, bf16
  attnquant-nvfp4       ours, every projection NVFP4
  attnquant-nvfp4-mlp   ours, NVFP4 except attention (ATTNQUANT_QUANT_IGNORE=self_attn)
  attnquant-nvfp4-mtp3  ours, every projection NVFP4, with the Gemma 4 assistant
                        ``--draft-model`` drafting 3 tokens (MAX's MTP speculative
                        decoding); served from ``--mtp-target`` (the checkpoint
                        named Gemma4ForConditionalGeneration, which MAX pairs
                        with an assistant: bench/checkpoints/make_random_gemma4_assistant.py)
  attnquant-bf16-mtp3   the same with passthrough weights: whether what the MTP
                        path serves depends on NVFP4
  attnquant-modelopt    ours serving ``--export``, an NVFP4 checkpoint in ModelOpt's
                        layout (``attnquant quantize``), as stored, no ATTNQUANT_* set
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import json
import math
import os
import re
import signal
import statistics
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpu_clocks import ClockSampler  # this directory
from max_benchmark_inprocess import trial_results  # this directory; imports no MAX

REPO = Path(__file__).resolve().parents[2]
MAX_CLI = "import sys; from max._entrypoints.pipelines import main; sys.argv[0] = 'max'; sys.exit(main())"
OURS = [sys.executable, str(REPO / "run_max.py")]
VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "builtin-bf16": ([sys.executable, "-c", MAX_CLI], {}),
    "attnquant-bf16": (OURS, {"ATTNQUANT_QUANT": "none"}),
    "attnquant-nvfp4": (OURS, {"ATTNQUANT_QUANT": "nvfp4"}),
    "attnquant-nvfp4-mlp": (OURS, {"ATTNQUANT_QUANT": "nvfp4", "ATTNQUANT_QUANT_IGNORE": "self_attn"}),
    "attnquant-modelopt": (OURS, {}),
}
EXPORTED = "attnquant-modelopt"  # served from --export, an NVFP4 checkpoint, with no ATTNQUANT_* set
DRAFTED = "-mtp3"  # a variant so suffixed is its base served with the assistant drafting 3 tokens
VARIANTS |= {f"{name}{DRAFTED}": VARIANTS[name] for name in ("attnquant-nvfp4", "attnquant-bf16")}
LOAD_LINE = re.compile(r"attnquant load: .*")


@dataclass
class Cell:
    spec: str
    variant: str
    capture: bool
    env: dict[str, str] = field(default_factory=dict)
    flags: tuple[str, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> Cell:
        head, *extra = spec.split("+")
        variant, _, capture = head.partition(":")
        flags = tuple(item for item in extra if item.startswith("--"))
        settings = [item for item in extra if not item.startswith("--")]
        if variant not in VARIANTS or capture not in ("on", "off") or not all("=" in item for item in settings):
            raise SystemExit(
                f"bad cell {spec!r}: want VARIANT:on|off[+ENV=VALUE...][+--FLAG...], VARIANT in {sorted(VARIANTS)}"
            )
        return cls(spec, variant, capture == "on", dict(item.split("=", 1) for item in settings), flags)

    @property
    def drafted_tokens(self) -> int:
        return 3 if self.variant.endswith(DRAFTED) else 0

    @property
    def label(self) -> str:
        """The spec without the items that only place its memory (``PLACEMENT_ENV``)."""
        return "+".join(item for item in self.spec.split("+") if item.split("=", 1)[0] not in PLACEMENT_ENV)

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.spec)


def served_model(cell: Cell, args: argparse.Namespace) -> Path:
    """The checkpoint a cell serves (also the model name its requests use)."""
    if cell.variant == EXPORTED:
        return args.export
    return args.mtp_target if cell.drafted_tokens else args.model


def speculative_args(cell: Cell, args: argparse.Namespace) -> list[str]:
    if not cell.drafted_tokens:
        return []
    return ["--draft-model-path", str(args.draft_model), "--speculative-method", "mtp",
            "--num-speculative-tokens", str(cell.drafted_tokens)]  # fmt: skip


ARENA = "MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT"
ARENA_GIB = "ARENA_GIB"
"""A cell's ``+ARENA_GIB=N``: its arena as N GiB, turned into MAX's percentage
of the memory free on GPU 0 when the server starts (a percentage fixed in
advance gives servers started later less than planned)."""
PLACEMENT_ENV = (ARENA, ARENA_GIB)
"""Where a server's memory goes, not what it computes: twins may differ in it."""


def free_gpu_bytes() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout.split()[0]) << 20


def arena_env(cell_env: dict[str, str], free_bytes: int | None = None) -> dict[str, str]:
    """``cell_env`` with ``ARENA_GIB`` replaced by MAX's arena percentage (at
    most 95: a server given less than it asked stops at MAX's memory check,
    which names the sizes)."""
    if ARENA_GIB not in cell_env:
        return dict(cell_env)
    env = {k: v for k, v in cell_env.items() if k != ARENA_GIB}
    free = free_gpu_bytes() if free_bytes is None else free_bytes
    wanted = float(cell_env[ARENA_GIB]) * 2**30
    env[ARENA] = str(min(95, math.ceil(100 * wanted / max(free, 1))))
    return env


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """How servers start (this harness and batch_invariance.py)."""
    parser.add_argument("--launch-lock", type=Path,
                        help="lock file shared by every harness starting servers on this GPU: one start at a "
                             "time, each given --settle seconds to take its arena before the next computes its "
                             "own from the memory then free; the servers' compiles still overlap")
    parser.add_argument("--settle", type=float, default=45.0, help="seconds a start holds --launch-lock")


@contextlib.contextmanager
def launch_slot(args: argparse.Namespace) -> Iterator[None]:
    """Holds ``--launch-lock`` (if given) for one server start and its settling."""
    if args.launch_lock is None:
        yield
        return
    with open(args.launch_lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
            time.sleep(args.settle)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def launch(cell: Cell, args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    with launch_slot(args):
        return _start_server(cell, args, port, log)


def _start_server(cell: Cell, args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    command, env = VARIANTS[cell.variant]
    cell_env = arena_env(cell.env)
    if ARENA in cell_env:
        with log.open("a") as f:
            f.write(f"harness: {ARENA}={cell_env[ARENA]} ({cell.env.get(ARENA_GIB, '-')} GiB asked)\n")
    server_args = [
        *command, "serve", "--model-path", str(served_model(cell, args)), "--port", str(port),
        "--max-length", "2048", "--max-batch-size", str(args.max_batch_size), "--enable-in-flight-batching",
        "--device-memory-utilization", str(args.memory_fraction),
        "--device-graph-capture" if cell.capture else "--no-device-graph-capture",
        *speculative_args(cell, args), *cell.flags,
    ]  # fmt: skip
    return subprocess.Popen(
        # Host threads per server: several servers on one host each sizing
        # torch/OpenMP pools to every core thrash (theta builds ran 30x slower).
        server_args, env={**os.environ, "OMP_NUM_THREADS": str(args.threads), **env, **cell_env}, stdout=log.open("ab"),
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def wait_ready(process: subprocess.Popen, port: int, log: Path, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"server exited ({process.returncode}):\n{log.read_text()[-2500:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return time.monotonic() - start
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"not ready in {timeout_s:.0f}s:\n{log.read_text()[-2500:]}")


BENCHMARK = [sys.executable, str(Path(__file__).resolve().parent / "max_benchmark_inprocess.py")]


def benchmark_args(model: Path, port: int, num_prompts: int, concurrency: int, log_dir: Path) -> list[str]:
    """``max benchmark``'s arguments for one measurement of one server."""
    return [
        "--model", str(model), "--backend", "modular-chat", "--endpoint", "/v1/chat/completions",
        "--host", "127.0.0.1", "--port", str(port), "--max-concurrency", str(concurrency),
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "128",
        "--num-prompts", str(num_prompts), "--temperature", "0", "--log-dir", str(log_dir),
    ]  # fmt: skip


@dataclass(frozen=True)
class Measurement:
    """One cell at one concurrency in one round: ``trials`` runs of MAX's benchmark."""

    cell: Cell
    round: int
    concurrency: int
    result: Path  # run i writes trial_results(result, trials)[i]


def measurement_plan(cells: list[Cell], session: int, args: argparse.Namespace) -> list[Measurement]:
    """Every round's cells in turn (``round_order``), each at every concurrency."""
    plan = []
    for rnd in range(args.rounds):
        for cell in round_order(cells, rnd):
            for concurrency in args.concurrency:
                suffix = ("" if concurrency == 1 else f"-c{concurrency}") + (f"-r{rnd}" if rnd else "")
                result = args.out.parent / f"bench-{cell.slug}-{session}{suffix}.json"
                plan.append(Measurement(cell, rnd, concurrency, result))
    return plan


def run_plan(plan: list[Measurement], ports: dict[str, int], args: argparse.Namespace) -> list[list[dict]]:
    """Runs the plan in one process (through ``max_benchmark_inprocess.py``:
    MAX's benchmark, one import of MAX for all of it); each measurement's
    trials, in order (fewer than asked where a run failed, with the error
    printed). Result files of an earlier run are removed first, so none is
    read as this one's."""
    entries = []
    for m in plan:
        for stale in trial_results(m.result, args.trials):
            stale.unlink(missing_ok=True)
        model = served_model(m.cell, args)
        log_dir = m.result.parent / "benchmark-logs"
        entries.append({
            "args": benchmark_args(model, ports[m.cell.spec], args.num_prompts * m.concurrency, m.concurrency, log_dir),
            "result": str(m.result), "repeat": args.trials,
        })  # fmt: skip
    plan_file = args.out.parent / f"plan-{plan[0].result.stem}.json"
    plan_file.write_text(json.dumps(entries, indent=1))
    done = subprocess.run([*BENCHMARK, "--plan", str(plan_file)], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"FAILED max benchmark ({done.returncode}):\n{done.stderr[-2500:]}", flush=True)
    return [read_trials(m.result, args.trials) for m in plan]


def read_trials(result: Path, trials: int) -> list[dict]:
    files = [f for f in trial_results(result, trials) if f.exists()]
    return [{**json.loads(f.read_text()), "unix_time": round(f.stat().st_mtime, 1)} for f in files]


@dataclass
class Greedy:
    """One greedy completion: its text and what the sampler committed."""

    text: str
    token_ids: list[int]
    finish_reason: str | None

    def note(self) -> str:
        """Why a text is empty though tokens were generated (an MTP cell has
        returned 128 tokens and no text): the ids say which tokens they were."""
        if self.text or not self.token_ids:
            return ""
        return f"empty text from {len(self.token_ids)} tokens ({self.finish_reason}): ids {self.token_ids[:12]}"


def greedy_completion(port: int, model: Path, prompt: str, tokens: int, timeout_s: float = 300) -> Greedy:
    body = {"model": str(model), "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "return_token_ids": True}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
        {"content-type": "application/json"},
    )  # fmt: skip
    choice = json.loads(urllib.request.urlopen(request, timeout=timeout_s).read())["choices"][0]
    return Greedy(choice["text"], choice.get("token_ids") or [], choice.get("finish_reason"))


def solid_png(rgb: tuple[int, int, int], size: int = 64) -> bytes:
    """A ``size`` x ``size`` PNG of one colour (the standard library only)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\0" + bytes(rgb) * size for _ in range(size))  # filter 0 per row
    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def image_chat(port: int, model: Path, tokens: int = 16) -> str:
    """One chat request with an image (a text + vision model's vision tower
    runs): "HTTP 200: <text>" or "HTTP <code>: <MAX's reason>"."""
    image = "data:image/png;base64," + base64.b64encode(solid_png((200, 30, 30))).decode()
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What colour is this?"}]
    body = {"model": str(model), "messages": [{"role": "user", "content": content}],
            "max_tokens": tokens, "temperature": 0.0}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        reply = json.loads(urllib.request.urlopen(request, timeout=300).read())
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}: {error.read().decode(errors='replace')[:300]}"
    return f"HTTP 200: {reply['choices'][0]['message']['content']!r}"


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@contextlib.contextmanager
def measuring(lock: Path | None):
    """Exclusive use of the GPU for a session's measurements when harnesses share it."""
    if lock is None:
        yield
        return
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_session(
    session: int, cells: list[Cell], args: argparse.Namespace, rows: list[dict], texts: dict[str, list[str]]
) -> None:
    """One server per cell; adds each started cell's greedy text to ``texts``."""
    logs = args.out.parent
    servers: dict[str, tuple[subprocess.Popen, int, Path]] = {}
    started: set[str] = set()
    try:
        for i, cell in enumerate(cells):
            log = logs / f"serve-{cell.slug}.log"
            port = args.port_base + i
            servers[cell.spec] = (launch(cell, args, port, log), port, log)
            if i == 0 and len(cells) > 1 and args.launch_lock is None:
                # The first server alone fills MAX's kernel caches (two first
                # compiles of one kernel library race: "file too short"), and
                # in every session, because MAX sizes a server's memory arena
                # (MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT) from the
                # memory free when it starts: one start order, one plan.
                with contextlib.suppress(RuntimeError, TimeoutError):
                    wait_ready(servers[cell.spec][0], port, log, args.ready_timeout)
        for cell in cells:
            server, port, log = servers[cell.spec]
            try:
                ready_s = wait_ready(server, port, log, args.ready_timeout)
            except (RuntimeError, TimeoutError) as error:
                print(f"FAILED to start {cell.spec} (session {session}): {error}", flush=True)
                continue
            load = LOAD_LINE.findall(log.read_text(errors="replace"))
            print(f"ready: {cell.spec} session {session} ({ready_s:.0f}s) {load[-1] if load else ''}", flush=True)
            greedy = greedy_completion(port, served_model(cell, args), "w100 w200 w300", 48)
            texts.setdefault(cell.spec, []).append(greedy.text)
            if greedy.note():
                print(f"greedy {cell.spec} session {session}: {greedy.note()}", flush=True)
            if args.image:
                print(f"image {cell.spec} session {session}: {image_chat(port, served_model(cell, args))}", flush=True)
            started.add(cell.spec)
        # Before the trials, not at the end: a run the lease cuts short still
        # says whether capture changed the output.
        (logs / "greedy_texts.json").write_text(json.dumps(texts, indent=1))
        print_greedy_identity(cells, texts)
        measured = [cell for cell in cells if cell.spec in started]
        if measured:
            ports = {spec: port for spec, (_, port, _) in servers.items()}
            plan = measurement_plan(measured, session, args)
            with measuring(args.gpu_lock), ClockSampler() as clocks:
                results = run_plan(plan, ports, args)
            for m, trials in zip(plan, results, strict=True):
                record_trials(m.cell, session, m.concurrency, trials, clocks, args.out, rows, m.round)
        for cell in measured:
            for concurrency in args.concurrency:
                print(summary(rows, cell.spec, concurrency=concurrency), flush=True)
    finally:
        for server, _, _ in servers.values():
            stop(server)


def round_order(cells: list[Cell], rnd: int) -> list[Cell]:
    """The cells of round ``rnd``, rotated by one a round: over the rounds each
    cell takes each place in the order in turn, so drift within a session (a
    host still busy after the last start, clocks) falls on every cell alike."""
    k = rnd % len(cells) if cells else 0
    return cells[k:] + cells[:k]


def record_trials(
    cell: Cell, session: int, concurrency: int, trials: list[dict], clocks: ClockSampler, out: Path, rows: list[dict],
    rnd: int = 0,
) -> None:  # fmt: skip
    for i, r in enumerate(trials):
        trial = rnd * len(trials) + i
        row = {
            "cell": cell.spec, "session": session, "round": rnd, "trial": trial, "concurrency": concurrency,
            # Generated tokens (of every request) over the trial's wall time.
            "output_tok_s": r["total_output_tokens"] / r["duration"],
            "mean_tpot_ms": r.get("mean_tpot_ms"),
            "mean_ttft_ms": r.get("mean_ttft_ms"),
            "unix_time": r["unix_time"],
            # The trial ended when its result file was written.
            **clocks.during(r["unix_time"] - r["duration"], r["unix_time"]),
        }  # fmt: skip
        rows.append(row)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


def summary(rows: list[dict], spec: str, markdown: bool = False, concurrency: int = 1) -> str:
    cell = [r for r in rows if r["cell"] == spec and r.get("concurrency", 1) == concurrency]
    if concurrency != 1:
        spec = f"{spec} c={concurrency}"
    if not cell:
        return f"| {spec} | 0 | - | - | - |" if markdown else f"{spec}: no trials"
    tok_s = [r["output_tok_s"] for r in cell]
    tpot = statistics.median(r["mean_tpot_ms"] for r in cell)
    sessions = len({r["session"] for r in cell})
    if markdown:
        return (
            f"| {spec} | {len(cell)} ({sessions} sessions) | {statistics.median(tok_s):.1f} "
            f"| {min(tok_s):.1f}–{max(tok_s):.1f} | {tpot:.2f} |"
        )
    return f"{spec}: median {statistics.median(tok_s):.1f} tok/s, TPOT {tpot:.2f} ms over {len(cell)} trials"


def _settings(cell: Cell) -> list[tuple[str, str]]:
    """A cell's environment items that change what it computes."""
    return sorted((k, v) for k, v in cell.env.items() if k not in PLACEMENT_ENV)


def capture_twin(cell: Cell, cells: list[Cell]) -> Cell | None:
    """The cell that differs from ``cell`` only in capture (and memory placement)."""
    same = (cell.variant, _settings(cell), cell.flags)
    return next((c for c in cells if c.capture != cell.capture and (c.variant, _settings(c), c.flags) == same), None)


COMPILE_ENV = ("ATTNQUANT_LAYER_SUBGRAPHS",)
"""How a server's graph is compiled, not what it computes (as ``+--FLAG`` items are)."""


def compile_twin(cell: Cell, cells: list[Cell]) -> Cell | None:
    """The cell that is ``cell`` without its ``+--FLAG`` items and ``COMPILE_ENV``
    settings (memory placement aside): e.g. layers as shared subgraphs or inlined
    change how the graph is compiled, not what it computes, so the two must give
    the same greedy text."""

    def computes(c: Cell) -> tuple:
        return c.variant, c.capture, [(k, v) for k, v in _settings(c) if k not in COMPILE_ENV]

    def compiled_plainly(c: Cell) -> bool:
        return not c.flags and not any(k in c.env for k in COMPILE_ENV)

    if compiled_plainly(cell):
        return None
    return next((c for c in cells if compiled_plainly(c) and computes(c) == computes(cell)), None)


def print_greedy_identity(cells: list[Cell], texts: dict[str, list[str]]) -> None:
    """Per cell: its greedy text the same in every session so far, the same as
    the first cell's, the same as its capture twin's (capture on vs off) and
    the same as its compile twin's (:func:`compile_twin`)."""
    first = texts.get(cells[0].spec, [None])[0]
    for cell in cells:
        seen = texts.get(cell.spec)
        if not seen:
            continue
        line = f"greedy text {cell.spec}: same across sessions={len(set(seen)) == 1}, same as {cells[0].spec}={seen[0] == first}"
        twin_cell = capture_twin(cell, cells)
        twin = texts.get(twin_cell.spec) if twin_cell else None
        if twin:
            line += f", same as capture twin={seen[0] == twin[0]}"
        plain_cell = compile_twin(cell, cells)
        plain = texts.get(plain_cell.spec) if plain_cell else None
        if plain:
            line += f", same as compiled plainly={seen[0] == plain[0]}"
        print(line, flush=True)


def paired(rows: list[dict], base: str, spec: str, concurrency: int = 1) -> str:
    """``spec`` against ``base`` round by round (same session and round: minutes
    apart on one machine): each round's TPOT difference, their median, and in how
    many rounds ``spec`` stepped faster."""
    def tpot(cell: str) -> dict[tuple[int, int], float]:
        by_round: dict[tuple[int, int], list[float]] = {}
        for r in rows:
            if r["cell"] == cell and r.get("concurrency", 1) == concurrency:
                by_round.setdefault((r["session"], r.get("round", 0)), []).append(r["mean_tpot_ms"])
        return {k: statistics.median(v) for k, v in by_round.items()}

    a, b = tpot(base), tpot(spec)
    diffs = [b[k] - a[k] for k in sorted(a.keys() & b.keys())]
    label = f"{Cell.parse(spec).label} - {Cell.parse(base).label}" + ("" if concurrency == 1 else f" c={concurrency}")
    if not diffs:
        return f"{label}: no common rounds"
    faster = sum(d < 0 for d in diffs)
    per_round = " ".join(f"{d:+.2f}" for d in diffs)
    return (
        f"{label}: TPOT {statistics.median(diffs):+.2f} ms median over {len(diffs)} rounds "
        f"({per_round}); faster in {faster} of {len(diffs)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="max serve + max benchmark, c=1")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--cells", nargs="+", required=True, help="VARIANT:on|off[+ENV=VALUE...]")
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3, help="per cell per session and round")
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="measure every cell this many times per session, in turn, the order rotated each round",
    )  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=8, help="per trial, times the concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1], help="requests in flight (each measured)")
    parser.add_argument("--memory-fraction", type=float, default=0.18)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--port-base", type=int, default=8100)
    parser.add_argument("--ready-timeout", type=float, default=1200)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=4, help="OMP_NUM_THREADS of each server")
    parser.add_argument("--gpu-lock", type=Path, help="lock file shared by harnesses measuring on one GPU")
    parser.add_argument("--draft-model", type=Path, help="the Gemma 4 assistant of *-mtp3 cells")
    parser.add_argument("--mtp-target", type=Path, help="what *-mtp3 cells serve (default: --model)")
    parser.add_argument("--export", type=Path, help=f"the NVFP4 checkpoint {EXPORTED} cells serve (attnquant quantize)")
    parser.add_argument("--image", action="store_true", help="also send each cell one chat request with an image")
    add_launch_args(parser)
    args = parser.parse_args()
    args.mtp_target = args.mtp_target or args.model
    if args.rounds < 1 or args.trials < 1:
        parser.error(f"--rounds and --trials must be at least 1, got {args.rounds} and {args.trials}")
    args.out.parent.mkdir(parents=True, exist_ok=True)  # the servers' logs go there too
    if any(Cell.parse(spec).variant == EXPORTED for spec in args.cells) and not args.export:
        parser.error(f"a {EXPORTED} cell needs --export (attnquant quantize writes one)")
    # SIGTERM (h200_lease.sh stop) unwinds through run_session's finally,
    # which stops every server's process group (model workers included).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cells = [Cell.parse(spec) for spec in args.cells]
    if any(cell.drafted_tokens for cell in cells) and not args.draft_model:
        parser.error("a *-mtp3 cell needs --draft-model (bench/checkpoints/make_random_gemma4_assistant.py writes one)")
    rows: list[dict] = []
    texts: dict[str, list[str]] = {}
    for session in range(args.sessions):
        run_session(session, cells, args, rows, texts)
    print("\n| cell | trials | median tok/s | range tok/s | median TPOT ms |\n|---|---|---|---|---|")
    for concurrency in args.concurrency:
        for cell in cells:
            print(summary(rows, cell.spec, markdown=True, concurrency=concurrency))
    if args.rounds > 1:
        print("\nPaired by round, each cell against each earlier one:")
        for concurrency in args.concurrency:
            for i, cell in enumerate(cells):
                for base in cells[:i]:
                    print(paired(rows, base.spec, cell.spec, concurrency))


if __name__ == "__main__":
    main()
