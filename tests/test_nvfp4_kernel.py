"""NVFP4 kernels: the sm90 weight layout, the backend chooser, and the Mojo ops.

The layout tests run in milliseconds and check, bit for bit, that what
``prepare_weights`` stores decodes (the way the GPU kernel decodes it) to the
ModelOpt weight. The MAX tests compile one small graph on CPU (symbolic M,
shared by every case) and compare the Mojo CPU op with a float64 reference
on fresh random inputs. The GPU kernels are checked on the H200 by
bench/kernel_timing/nvfp4_gemv_h200.py; here they are only compiled for sm_90.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from attnquant.max_compat import child_environment
import torch

from max.dtype import DType

from attnquant.graph import nvfp4 as K
from attnquant.graph.nvfp4 import base
from attnquant.graph.ops import custom_extensions_path
from attnquant.graph.runtime import capture_off_advice
from kernels import sm90_layout as L
from tests.mojo_ptx import sm90a_ptx
from tests.virtual_gpu import compile_for_virtual_gpu

E2M1 = torch.tensor(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64
)
E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
ROOT = Path(__file__).resolve().parents[1]


def random_nvfp4(n: int, k: int, seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes (all 16 values) and random valid non-negative E4M3 scale
    bits: normal, subnormal (0x01-0x07) and zero scales all occur."""
    gen = torch.Generator().manual_seed(random.randrange(2**31) if seed is None else seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale_bits = torch.randint(0x20, 0x58, (n, k // 16), dtype=torch.uint8, generator=gen)
    special = torch.rand(n, k // 16, generator=gen)
    scale_bits[special < 0.1] = torch.randint(0, 8, scale_bits[special < 0.1].shape, dtype=torch.uint8, generator=gen)
    return packed, scale_bits


def reference_weight(packed: torch.Tensor, scale_bits: torch.Tensor, global_scale: float = 1.0) -> torch.Tensor:
    """float64 W[N, K] straight from the format description (low nibble = even k)."""
    n, half_k = packed.shape
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(n, 2 * half_k).long()
    scales = E4M3[scale_bits.long()].repeat_interleave(16, dim=1)
    return E2M1[codes] * scales * global_scale


# ---------------------------------------------------------------------------
# sm90 layout (pure torch)
# ---------------------------------------------------------------------------


def test_decode_inverts_the_gf2_encoding() -> None:
    """For random ModelOpt bytes in the four registers of a word, the kernel's
    decode (4 rotations, 4 masks) yields exactly sign -> bit 15 and e1 e0 m ->
    bits 8..6 of each bf16 half."""
    table = L._byte_tables()
    rng = random.Random()
    for _ in range(2000):
        regs = [rng.randrange(256) for _ in range(4)]
        word = 0
        for j, v in enumerate(regs):
            word ^= int(table[j, v])
        decoded = L.decode_word(word)
        for j, v in enumerate(regs):
            for half, code in ((0, v & 15), (1, v >> 4)):
                bits = (decoded[j] >> (16 * half)) & 0xFFFF
                assert bits == ((code >> 3) << 15) | ((code & 7) << 6), (regs, j, half)


@pytest.mark.parametrize("n,k", [(16, 64), (24, 80), (48, 320), (40, 1152), (1, 16)])
def test_prepare_weights_round_trips(n: int, k: int) -> None:
    packed, scale_bits = random_nvfp4(n, k)
    codes, scales = L.prepare_weights(packed, scale_bits)
    n16, k64 = -(-n // 16) * 16, -(-k // 64) * 64
    assert codes.shape == (n16, k64 // 2) and codes.dtype == torch.uint8
    assert scales.shape == (n16, k64 // 16) and scales.dtype == torch.uint8
    decoded = L.sm90_reference_dequant(codes, scales, n, k)
    assert torch.equal(decoded, reference_weight(packed, scale_bits))


def test_prepare_weights_zeroes_codes_of_zero_scale_blocks() -> None:
    packed, scale_bits = random_nvfp4(16, 64)
    scale_bits[3, 1] = 0
    # Its neighbour keeps a normal scale (random_nvfp4 draws zero scales too,
    # which would zero that block's codes as well) and some nonzero code.
    scale_bits[3, 0] = 0x38
    packed[3, 0] = 0x11
    codes, scales = L.prepare_weights(packed, scale_bits)
    # Every bf16 the kernel would feed the tensor core for that block is +-0,
    # whatever scale it applies.
    decoded = L.sm90_reference_dequant(codes, torch.full_like(scales, 0x50), 16, 64)
    assert torch.all(decoded[3, 16:32] == 0)
    assert torch.count_nonzero(decoded[3, :16]) > 0


@pytest.mark.parametrize("bad", [0x81, 0xC8, 0x7F, 0xFF])
def test_prepare_weights_rejects_negative_and_nan_scales(bad: int) -> None:
    packed, scale_bits = random_nvfp4(16, 64)
    scale_bits[5, 2] = bad
    with pytest.raises(ValueError, match=f"0x{bad:02x}"):
        L.prepare_weights(packed, scale_bits)


def test_prepare_weights_rejects_bad_shapes() -> None:
    packed, scale_bits = random_nvfp4(16, 64)
    with pytest.raises(ValueError, match="scale_bits"):
        L.prepare_weights(packed, scale_bits[:, :3])
    with pytest.raises(ValueError, match="multiple of 16"):
        L.prepare_weights(packed[:, :4], scale_bits)


# ---------------------------------------------------------------------------
# Chooser
# ---------------------------------------------------------------------------

BF16, F32 = DType.bfloat16, DType.float32


@pytest.mark.parametrize(
    "config,expected",
    [
        (K.NVFP4LayerConfig(64, 128, F32, "cpu"), "mojo-cpu"),
        (K.NVFP4LayerConfig(64, 128, BF16, "cpu"), "graph-dequant"),
        (K.NVFP4LayerConfig(64, 128, BF16, "cuda", "sm_90a", layout=K.WeightLayout.SM90), "mojo-sm90"),
        (K.NVFP4LayerConfig(64, 128, BF16, "cuda", "sm_90a"), "mojo-sm90"),
        (K.NVFP4LayerConfig(64, 128, BF16, "cuda", "sm_90a", layout=K.WeightLayout.MODELOPT), "mojo-gpu"),
        (K.NVFP4LayerConfig(64, 128, BF16, "cuda", "sm_75", layout=K.WeightLayout.MODELOPT), "mojo-gpu"),
        (K.NVFP4LayerConfig(64, 128, F32, "cuda", "sm_90a"), "mojo-gpu"),
        (K.NVFP4LayerConfig(64, 128, BF16, "hip", "gfx942"), "mojo-gpu"),
        (K.NVFP4LayerConfig(64, 120, F32, "cpu"), None),
        (K.NVFP4LayerConfig(128, 128, BF16, "cuda", "sm_100a"), "max-sm100"),
        (K.NVFP4LayerConfig(128, 128, BF16, "cuda", "sm_100a", layout=K.WeightLayout.SM90), "mojo-sm90"),
        (K.NVFP4LayerConfig(128, 128, BF16, "cuda", "sm_120a"), "mojo-sm90"),
        (K.NVFP4LayerConfig(128, 96, BF16, "cuda", "sm_100a"), "mojo-sm90"),
    ],
)
def test_chooser(config: K.NVFP4LayerConfig, expected: str | None) -> None:
    if expected is None:
        with pytest.raises(ValueError, match="multiple of 16"):
            K.choose_backend(config)
    else:
        assert K.choose_backend(config).name == expected


def test_chooser_logs_its_choice_once(caplog: pytest.LogCaptureFixture) -> None:
    config = K.NVFP4LayerConfig(48, 96, BF16, "cuda", "sm_90a", layout=K.WeightLayout.MODELOPT)
    K.choose_backend.cache_clear()
    with caplog.at_level(logging.INFO, logger=K.logger.name):
        K.choose_backend(config)
        K.choose_backend(config)
    lines = [r.getMessage() for r in caplog.records if r.name == K.logger.name]
    assert len(lines) == 1
    assert "using mojo-gpu" in lines[0] and "mojo-sm90: takes the sm90 layout" in lines[0]
    assert "skipped max-sm100: takes the sm100 layout" in lines[0]


def test_sm90_rejects_fp32_and_old_gpus() -> None:
    ok, why = K.MojoSM90Backend.can_implement(K.NVFP4LayerConfig(64, 128, F32, "cuda", "sm_90a"))
    assert not ok and "bf16" in why
    ok, why = K.MojoSM90Backend.can_implement(K.NVFP4LayerConfig(64, 128, BF16, "cuda", "sm_75"))
    assert not ok and "sm_80" in why


def layer(n: int, k: int, arch: str = "sm_90a", forced: str = "") -> K.NVFP4LayerConfig:
    return K.NVFP4LayerConfig(n, k, BF16, "cuda", arch, sm90_variant=forced)


@pytest.mark.parametrize(
    "forced, config, params, why",
    [
        # nothing measured, nothing forced: the original kernels
        ("", layer(13824, 1152), (), "no variant measured faster"),
        ("3:4:1", layer(1536, 1152), (("variant", 3), ("kw", 4), ("splitk", 1)), "ATTNQUANT_SM90_VARIANT=3:4:1"),
        # -1: the original kernels, even where SM90_TUNED has the shape (an A/B against the table)
        ("-1", layer(1536, 1152), (("variant", -1), ("kw", 0), ("splitk", 0)), "ATTNQUANT_SM90_VARIANT=-1"),
        ("1", layer(1536, 1152, "sm_80"), (("variant", 1), ("kw", 0), ("splitk", 0)), "ATTNQUANT_SM90_VARIANT=1"),
        ("3:4:1:1", layer(1536, 1152), (("variant", 3), ("kw", 4), ("splitk", 1), ("pdl", 1)), "=3:4:1:1"),
        # a fast variant's split left open is pinned to 1: the op's own pick may be a cluster split
        ("5", layer(1536, 1152), (("variant", 5), ("kw", 0), ("splitk", 1)), "ATTNQUANT_SM90_VARIANT=5"),
        # the fast variants cannot take these: the original kernels, and why
        ("3:4:2", layer(1536, 1152), (), "cluster split-K is not offered: it timed slower"),
        ("3:4:1", layer(1536, 1152, "sm_80"), (), "need sm_90"),
        ("3", layer(24, 1152), (), "not whole 16x64 tiles"),
        ("5", layer(1536, 1040), (), "not whole 16x64 tiles"),
        ("7:4:4", layer(64, 128), (), "cluster split-K is not offered"),
        ("9", layer(1536, 1152), (), "variant -1..8"),
        ("3:4:3", layer(1536, 1152), (), "splitk 0/1/2/4"),
        ("7:4:1:1", layer(1536, 1152), (), "needs one of the variants (-1, 0, 2, 3, 4, 5, 6, 8)"),
        # the register kernel with programmatic dependent launch; not below sm_90 (griddepcontrol)
        ("0:0:0:1", layer(1536, 1152), (("variant", 0), ("kw", 0), ("splitk", 0), ("pdl", True)), "=0:0:0:1"),
        ("0:0:0:1", layer(1536, 1152, "sm_80"), (), "programmatic dependent launch needs sm_90+, device is sm_80"),
    ],
)
def test_sm90_variants_fall_back_with_a_reason(
    forced: str, config: K.NVFP4LayerConfig, params: tuple, why: str
) -> None:
    config = dataclasses.replace(config, sm90_variant=forced)
    got, reason = K.MojoSM90Backend.kernel_parameters(config)
    assert got == params and why in reason, (got, reason)


def test_pdl_setting_adds_the_parameter_where_the_device_has_it() -> None:
    """ATTNQUANT_PDL: the layer's kernels (original, measured or forced) launch
    with programmatic dependent launch on sm_90+, and the log reason says so;
    below sm_90 the parameter is left out and the reason says why."""
    config = dataclasses.replace(layer(16384, 5376), pdl=True)
    params, reason = K.MojoSM90Backend.kernel_parameters(config)
    assert params == (("pdl", True),) and "programmatic dependent launch (ATTNQUANT_PDL=1" in reason, reason
    params, reason = K.MojoSM90Backend.kernel_parameters(dataclasses.replace(config, sm90_variant="4:8:1"))
    assert params == (("variant", 4), ("kw", 8), ("splitk", 1), ("pdl", True)), params
    params, reason = K.MojoSM90Backend.kernel_parameters(dataclasses.replace(config, device_arch="sm_86"))
    assert params == () and "ATTNQUANT_PDL=1 not taken: needs sm_90+, device is sm_86" in reason, reason
    params, _ = K.MojoSM90Backend.kernel_parameters(layer(16384, 5376))
    assert params == (), "off by default"


def test_sm90_measured_table_is_used_and_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnquant.graph.nvfp4 import sm90

    monkeypatch.setitem(sm90.SM90_TUNED, (1152, 1024), sm90.SM90Tuned(narrow=(3, 2), wide=(2, 16)))
    params, reason = K.MojoSM90Backend.kernel_parameters(layer(1152, 1024))
    assert params == (("variant", 3), ("kw", 2), ("splitk", 1), ("wide_variant", 2), ("wide_kw", 16))
    assert "measured fastest" in reason and "M<=8: variant 3, kw 2" in reason and "M>8: variant 2, kw 16" in reason
    # measured on the H200: another arch keeps the original kernels, and the log says why
    params, reason = K.MojoSM90Backend.kernel_parameters(layer(1152, 1024, "sm_86"))
    assert params == () and "measured on sm_90, device is sm_86" in reason
    # one range measured: the other keeps its original kernel (0 up to 8 rows, 1 above, kw picked)
    monkeypatch.setitem(sm90.SM90_TUNED, (1152, 1024), sm90.SM90Tuned(wide=(2, 16)))
    params, _ = K.MojoSM90Backend.kernel_parameters(layer(1152, 1024))
    assert params == (("variant", 0), ("kw", 0), ("splitk", 0), ("wide_variant", 2), ("wide_kw", 16))
    # a forced variant overrides the table, at every M
    params, reason = K.MojoSM90Backend.kernel_parameters(layer(1152, 1024, forced="4:8:1"))
    assert params == (("variant", 4), ("kw", 8), ("splitk", 1)) and "ATTNQUANT_SM90_VARIANT" in reason


def test_every_measured_entry_runs_on_sm90a() -> None:
    """Each shape in SM90_TUNED gets its two kernels on the H200's arch (no
    entry names a variant, kw or split the op refuses), and its log reason
    says which kernel runs in which range."""
    from attnquant.graph.nvfp4 import sm90

    assert sm90.SM90_TUNED
    for (n, k), tuned in sm90.SM90_TUNED.items():
        params, reason = K.MojoSM90Backend.kernel_parameters(layer(n, k))
        narrow, wide = tuned.kernels()
        assert dict(params) | {"splitk": 0} == {"variant": narrow[0], "kw": narrow[1], "splitk": 0,
                                                "wide_variant": wide[0], "wide_kw": wide[1]}, ((n, k), params)
        assert "measured fastest" in reason and "not taken" not in reason, reason


def test_chooser_logs_the_fallback_reason(caplog: pytest.LogCaptureFixture) -> None:
    """An sm_100 device with a shape MAX's SM100 kernel cannot take (N not a
    multiple of 128): the log line names the backend taken and why max-sm100
    was skipped."""
    config = K.NVFP4LayerConfig(1000, 1152, BF16, "cuda", "sm_100a")
    K.choose_backend.cache_clear()
    with caplog.at_level(logging.INFO, logger=K.logger.name):
        assert K.choose_backend(config).name == "mojo-sm90"
    line = [r.getMessage() for r in caplog.records if r.name == K.logger.name][0]
    assert "skipped max-sm100: N=1000 is not a multiple of 128" in line


# ---------------------------------------------------------------------------
# The Mojo ops through MAX on CPU (one compiled graph, symbolic M)
# ---------------------------------------------------------------------------

N, KDIM = 24, 80  # K: a multiple of 16 but not of 32 or 64


@pytest.fixture(scope="module")
def cpu_graph():
    from max.driver import CPU
    from max.dtype import DType
    from max.experimental import compilation
    from max.experimental import functional as F
    from max.experimental.sharding import TensorLayout
    from max.graph import DeviceRef, TensorType

    device = CPU()

    def forward(x, packed, scale_bits, global_scale):
        y = K.nvfp4_linear(x, packed, scale_bits, global_scale)
        # Leading dims are flattened and restored.
        y3 = K.nvfp4_linear(F.reshape(x, [1, -1, KDIM]), packed, scale_bits, global_scale)
        (w,) = F.custom(
            "attnquant.nvfp4_dequant",
            device,
            [packed, scale_bits, global_scale],
            [TensorType(DType.float32, [N, KDIM], DeviceRef.CPU())],
            custom_extensions=custom_extensions_path(),
        )
        return y, y3, w

    types = [
        TensorLayout(DType.float32, ["m", KDIM], device),
        TensorLayout(DType.uint8, [N, KDIM // 2], device),
        TensorLayout(DType.uint8, [N, KDIM // 16], device),
        TensorLayout(DType.float32, [1], device),
    ]
    return compilation.compile(forward, custom_extensions=[custom_extensions_path()])(*types)


def _run(graph, x: torch.Tensor, packed: torch.Tensor, scale_bits: torch.Tensor, gs: float):
    from max.experimental.tensor import Tensor

    args = [Tensor.from_dlpack(t.contiguous()) for t in (x, packed, scale_bits, torch.tensor([gs]))]
    return [torch.from_dlpack(o).clone() for o in graph(*args)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.max
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_cpu_op_matches_float64_reference(cpu_graph, m: int) -> None:
    packed, scale_bits = random_nvfp4(N, KDIM)
    gs = random.uniform(0.001, 0.1)
    x = torch.randn(m, KDIM)
    y, y3, w = _run(cpu_graph, x, packed, scale_bits, gs)
    weight = reference_weight(packed, scale_bits, gs)
    ref = x.double() @ weight.T
    assert y.shape == (m, N) and y3.shape == (1, m, N)
    assert rel_err(y, ref) < 1e-5
    assert rel_err(y3[0], ref) < 1e-5
    assert rel_err(w, weight) < 1e-6


@pytest.mark.max
def test_cpu_op_sees_every_input_element(cpu_graph) -> None:
    """Changing one code or one scale of the last block changes exactly the
    output column it feeds (catches a kernel that skips the tail)."""
    packed, scale_bits = random_nvfp4(N, KDIM, seed=7)
    scale_bits[:, -1] = 0x38  # 1.0
    x = torch.randn(2, KDIM)
    (y0, _, _) = _run(cpu_graph, x, packed, scale_bits, 1.0)
    packed2 = packed.clone()
    packed2[N - 1, -1] ^= 0x77  # last byte of the last row
    (y1, _, _) = _run(cpu_graph, x, packed2, scale_bits, 1.0)
    changed = (y0 != y1).any(dim=0)
    assert changed[N - 1] and not changed[: N - 1].any()


# ---------------------------------------------------------------------------
# The GPU kernels compile for sm_90 (no GPU needed)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Every op's GPU path (bench/checks/nvfp4_ops_gpu_harness.mojo: all GEMV
    variants -1..8, every cluster split of 3-8, the gated epilogue of 0, 1, 2,
    3 and 5) compiled for a virtual sm_90a."""
    return sm90a_ptx(ROOT / "bench" / "checks" / "nvfp4_ops_gpu_harness.mojo", tmp_path_factory.mktemp("sm90a"))


@pytest.mark.max
def test_gpu_ops_compile_for_sm90(sm90_ptx: list[Path]) -> None:
    """The PTX of every op's GPU path: tensor-core mma, streaming 16-byte
    weight loads, cp.async (the original kernels), bulk copies on mbarriers
    and compile-time clusters of 2 and 4 with a DSMEM reduction, programmatic
    dependent launch (the fast variants), the gated epilogue's GELU (exp), and
    no local memory. CPU graphs never compile these branches."""
    ptx = [p.read_text() for p in sm90_ptx]
    # 3 original GEMVs (the register ones, 0 and 2, each for K % 64 == 0 and
    # not: + 2) + 6 new variants x 3 splits (the register one, 7, both ways: + 3)
    # + variant 3 with PDL x 3 splits + sm90 dequant + 2 generic kernels
    # + gated: variants 0 (x 2), 1, 2 (x 2) and 3, 5 x 3 splits
    assert len(ptx) == 43, f"expected 43 kernels, got {len(ptx)}"
    gated = [t for t in ptx if "ex2.approx" in t]
    assert len(gated) == 11, "the gated kernels (and only they) compute gelu_tanh"
    assert any("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in t for t in ptx)
    assert any("ld.global.nc.L1::no_allocate.v4.u32" in t for t in ptx)
    assert any("cp.async.cg.shared.global" in t for t in ptx)
    bulk = [t for t in ptx if "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in t]
    assert len(bulk) == 24, "variants 3-6 and 8 (and 3 with PDL, 3 and 5 gated), each with splitk 1, 2 and 4"
    assert all("mbarrier.try_wait.parity.shared::cta.b64" in t for t in bulk)
    for sk in (2, 4):
        clustered = [t for t in ptx if f".reqnctapercluster 1, 1, {sk}" in t]
        assert len(clustered) == 10, f"variants 3-8 (7 both ways; 3 with PDL, 3 and 5 gated) with a (1, 1, {sk}) cluster"
        assert all("mapa.shared::cluster" in t and "barrier.cluster.arrive" in t for t in clustered)
    pdl = [t for t in ptx if "griddepcontrol.wait" in t]
    assert len(pdl) == 3 and all("griddepcontrol.launch_dependents" in t for t in pdl)
    assert not any("local_depot" in t for t in ptx), "a kernel spills to local memory"


@pytest.mark.max
def test_gpu_ops_assemble_for_sm90a(sm90_ptx: list[Path], tmp_path: Path) -> None:
    """ptxas (where installed) assembles every kernel for sm_90a without spills:
    the PTX above is valid for the H200, not only well-formed."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("ptxas not installed")
    for p in sm90_ptx:
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(p), "-o", str(tmp_path / "k.cubin")],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        assert r.returncode == 0, f"{p.name}: {r.stderr[-2000:]}"
        spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
        assert spills and all(s == "0" for s in spills), f"{p.name} spills: {r.stderr[-800:]}"


_SM90_GRAPH = """
import dataclasses
from attnquant.graph import nvfp4 as K
from attnquant.graph.ops import custom_extensions_path

n, k = 1536, 1152
config = K.NVFP4LayerConfig(n, k, DType.bfloat16, "cuda", "sm_90a", gemv_only=True, sm90_variant="3:4:1:1")
backend = K.choose_backend(config)
params, _ = backend.kernel_parameters(config)
assert backend.name == "mojo-sm90" and dict(params) == {"variant": 3, "kw": 4, "splitk": 1, "pdl": 1}, params
config = dataclasses.replace(config, kernel_params=params)

def forward(x, codes, scales, gs):
    return K.apply(backend, x, (codes, scales, gs), config)

types = [TensorLayout(DType.bfloat16, ["m", k], gpu), TensorLayout(DType.uint8, [n, k // 2], gpu),
         TensorLayout(DType.uint8, [n, k // 16], gpu), TensorLayout(DType.float32, [1], gpu)]
compilation.compile(forward, custom_extensions=[custom_extensions_path()], session=session)(*types)
print("COMPILED sm_90a")

from attnquant.graph.nvfp4 import sm90
sm90.SM90_TUNED[(n, k)] = sm90.SM90Tuned(narrow=(3, 2), wide=(2, 16))
config = dataclasses.replace(config, sm90_variant="", kernel_params=())
params, _ = backend.kernel_parameters(config)
assert dict(params) == {"variant": 3, "kw": 2, "splitk": 1, "wide_variant": 2, "wide_kw": 16}, params
config = dataclasses.replace(config, kernel_params=params)
compilation.compile(forward, custom_extensions=[custom_extensions_path()], session=session)(*types)
print("COMPILED sm_90a, one kernel up to 8 rows and another above")

# ATTNQUANT_PDL: the measured pair (a bulk ring, a register kernel) and, at a shape not
# measured, the original kernels (-1: the register kernel up to 8 rows, the cp.async ring above)
config = dataclasses.replace(config, kernel_params=(), pdl=True)
params, _ = backend.kernel_parameters(config)
assert dict(params) == {"variant": 3, "kw": 2, "splitk": 1, "wide_variant": 2, "wide_kw": 16, "pdl": True}, params
config = dataclasses.replace(config, kernel_params=params)
compilation.compile(forward, custom_extensions=[custom_extensions_path()], session=session)(*types)
n = 1024
config = K.NVFP4LayerConfig(n, k, DType.bfloat16, "cuda", "sm_90a", gemv_only=True, pdl=True)
params, _ = backend.kernel_parameters(config)
assert params == (("pdl", True),), params
config = dataclasses.replace(config, kernel_params=params)
types = [TensorLayout(DType.bfloat16, ["m", k], gpu), TensorLayout(DType.uint8, [n, k // 2], gpu),
         TensorLayout(DType.uint8, [n, k // 16], gpu), TensorLayout(DType.float32, [1], gpu)]
compilation.compile(forward, custom_extensions=[custom_extensions_path()], session=session)(*types)
print("COMPILED sm_90a with programmatic dependent launch")
"""


@pytest.mark.max
def test_sm90_fast_variant_graph_compiles_for_virtual_sm90a() -> None:
    """A forced fast variant (bulk ring, programmatic dependent launch), and a
    measured pair (one kernel up to 8 rows, another above), each compile as a
    MAX graph for a virtual sm_90a: the
    parameters the plan records reach the Mojo op (a child process, since the
    virtual device is process-wide)."""
    r = compile_for_virtual_gpu("sm_90a", _SM90_GRAPH)
    assert r.returncode == 0 and "COMPILED sm_90a" in r.stdout, (r.stdout + r.stderr)[-4000:]
    assert "another above" in r.stdout and "with programmatic dependent launch" in r.stdout, (r.stdout + r.stderr)[-4000:]


@pytest.mark.max
def test_measured_kernels_compile_at_their_shapes_for_virtual_sm90a() -> None:
    """Every SM90_TUNED entry, at its own shape and as a served model builds
    it, compiles in one MAX graph for a virtual sm_90a: the CPU twin of
    bench/kernel_timing/sm90_tuned_h200.py, which checks the same graph on the H200.
    With ``--also``, a candidate replaces one range's kernel at its shape, as
    the device check runs it."""
    script = ROOT / "bench" / "kernel_timing" / "sm90_tuned_h200.py"
    r = subprocess.run([__import__("sys").executable, str(script), "--compile-only", "--also", "640x1024:wide=2:8"],
                       capture_output=True, text=True, timeout=1200, env=child_environment(), cwd=ROOT)  # fmt: skip
    from attnquant.graph.nvfp4.sm90 import SM90_TUNED

    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    gated = 4  # the script's GATED_SHAPES: gate|up of 270M (with the large-M route), 1B, 4B, 27B/31B
    guarded = 1  # GUARDED_SHAPES: K % 64 != 0, the original kernels' guarded loop
    assert f"graph with {len(SM90_TUNED) + guarded + gated} projections compiled for sm_90a" in r.stdout, r.stdout[-4000:]
    assert "[1000, 1040]: {} (original kernels" in r.stdout, r.stdout[-4000:]
    assert "gated [4096, 640] (large-M route above 16 rows)" in r.stdout, r.stdout[-4000:]
    assert "[640, 1024]: {'variant': 4, 'kw': 8, 'splitk': 1, 'wide_variant': 2, 'wide_kw': 8}" in r.stdout, r.stdout[-4000:]


# ---------------------------------------------------------------------------
# The M dispatch (F.cond) with weights a module owns, as the model uses it
# ---------------------------------------------------------------------------


def _cpu_dispatched(config: K.NVFP4LayerConfig):
    """A module owning an [n, k] NVFP4 weight (ModelOpt layout) that calls
    ``gemv_or_dequant_matmul`` as the mojo-sm90 backend does, with the CPU
    ops in place of the sm90 ones (build it under ``default_device(CPU())``)."""
    from max.dtype import DType
    from max.experimental.nn import Module
    from max.experimental.tensor import Tensor

    class Dispatched(Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = Tensor.zeros([config.n, config.k // 2], dtype=DType.uint8)
            self.weight_scale = Tensor.zeros([config.n, config.k // 16], dtype=DType.uint8)
            self.weight_scale_2 = Tensor.zeros([1], dtype=DType.float32)

        def forward(self, x):
            return base.gemv_or_dequant_matmul(
                x, [self.weight, self.weight_scale, self.weight_scale_2], config,
                gemv_op="attnquant.nvfp4_matmul", dequant_op="attnquant.nvfp4_dequant",
                weight_dtype=DType.float32,
            )  # fmt: skip

    return Dispatched()


@pytest.mark.max
def test_m_dispatch_with_module_weights() -> None:
    """``_gemv_or_dequant_matmul`` as the mojo-sm90 backend calls it, with the
    CPU ops in its place: symbolic M, weights that are module parameters.

    A ModuleV3 weight enters the graph where it is first used; when that was
    inside one branch of ``F.cond``, the graph failed to build on the H200
    ("operand #0 does not dominate this use"). Both branches run here: M=3
    takes the GEMV op, M=40 decodes W and uses MAX's matmul."""
    from max.driver import CPU
    from max.dtype import DType
    from max.experimental.tensor import Tensor, default_device
    from max.graph import DeviceRef, TensorType

    n, k = 24, 64
    config = K.NVFP4LayerConfig(n, k, DType.float32, "cpu", "")

    packed, scale_bits = random_nvfp4(n, k)
    weights = {"weight": packed, "weight_scale": scale_bits, "weight_scale_2": torch.tensor([0.5])}
    with default_device(CPU()):
        module = _cpu_dispatched(config)
    run = module.compile(TensorType(DType.float32, ["m", k], DeviceRef.CPU()), weights=weights)
    w = reference_weight(packed, scale_bits, 0.5)
    for m in (3, 40):  # GEMV_MAX_M = 16 sits between them
        x = torch.randn(m, k)
        y = torch.from_dlpack(run(Tensor.from_dlpack(x))).double()
        assert rel_err(y, x.double() @ w.T) < 1e-5, f"M={m}"


def gelu_tanh(v: torch.Tensor) -> torch.Tensor:
    return 0.5 * v * (1 + torch.tanh(0.7978845608028654 * (v + 0.044715 * v**3)))


@pytest.mark.max
def test_gated_layer_above_the_gemv_rows_gates_in_max_ops() -> None:
    """A gated gate|up (rows interleaved by 8 for the GEMV's epilogue) on the
    large-M route: decode W, MAX's matmul, then ``gate_interleaved`` undoes
    the interleave and applies gelu_tanh(gate) * up: the CPU twin of what
    the sm90 backend runs above 16 rows (CPU ops in place of the sm90 ones;
    its GEMV epilogue is checked on the H200 by sm90_tuned_h200.py)."""
    from max.driver import CPU
    from max.dtype import DType
    from max.experimental.tensor import Tensor, default_device
    from max.graph import DeviceRef, TensorType

    f, k, m = 32, 64, 40
    config = K.NVFP4LayerConfig(2 * f, k, DType.float32, "cpu", "", gated=True)
    assert config.out_features == f

    packed, scale_bits = random_nvfp4(2 * f, k)
    weights = {"weight": L.interleave_gate_up(packed), "weight_scale": L.interleave_gate_up(scale_bits),
               "weight_scale_2": torch.tensor([0.05])}  # fmt: skip
    with default_device(CPU()):
        module = _cpu_dispatched(config)
    run = module.compile(TensorType(DType.float32, [m, k], DeviceRef.CPU()), weights=weights)
    x = torch.randn(m, k)
    y = torch.from_dlpack(run(Tensor.from_dlpack(x))).double()
    gate, up = (x.double() @ reference_weight(packed, scale_bits, 0.05).T).split(f, dim=1)
    assert y.shape == (m, f)
    assert rel_err(y, gelu_tanh(gate) * up) < 1e-5


def test_interleave_gate_up_puts_each_outputs_gate_and_up_in_one_tile() -> None:
    """Output r's gate row sits at 16 (r // 8) + r % 8 and its up row 8 below,
    for any trailing dims (codes and scales alike); a row count that is not
    whole 16-row tiles is refused."""
    f = 24
    rows = torch.arange(2 * f * 3).view(2 * f, 3)
    out = L.interleave_gate_up(rows)
    for r in range(f):
        tile_row = 16 * (r // 8) + r % 8
        assert torch.equal(out[tile_row], rows[r]) and torch.equal(out[tile_row + 8], rows[f + r])
    with pytest.raises(ValueError, match="not a multiple of 16"):
        L.interleave_gate_up(torch.zeros(40, 2))


def _gate_up_for_device(config, device, activation: str, members=("gate_proj", "up_proj"), per_row_scale=False):
    """runtime.for_device on one NVFP4 gate|up part [2F, K] of random bytes."""
    from attnquant.graph import runtime
    from attnquant.plan import PartPlan

    f, k = 32, 128
    packed, scale_bits = random_nvfp4(2 * f, k, seed=3)
    name = "model.layers.0.mlp.gate_up_proj"
    state = {f"{name}.weight": packed, f"{name}.weight_scale": scale_bits, f"{name}.weight_scale_2": torch.ones(1)}
    part = PartPlan("nvfp4", members, (f, f), k, per_row_scale=per_row_scale)
    plan = runtime.for_device(state, {name: (part,)}, config, dtype=DType.bfloat16, device=device,
                              graph_capture=True, mlp_activation=activation)  # fmt: skip
    return plan[name][0], state[f"{name}.weight"], (packed, scale_bits)


@pytest.mark.parametrize(
    "change, activation, device, gated, reason",
    [
        ({}, "gelu_tanh", "sm_90a", True, "applies gelu_tanh(gate) * up in the GEMV's epilogue"),
        ({}, "gelu_pytorch_tanh", "sm_90a", True, "epilogue"),
        ({"gated_gemv": False}, "gelu_tanh", "sm_90a", False, "ATTNQUANT_GATED_GEMV=0"),
        ({"gated_gemv": None}, "gelu_tanh", "sm_90a", False, "auto: the weight is 0.0 MiB < 100 MiB"),
        ({}, "silu", "sm_90a", False, "activation 'silu' is not the kernels'"),
        ({}, "", "sm_90a", False, "activation '(unknown)'"),
        ({}, "gelu_tanh", "cpu", False, "graph-dequant has no gated epilogue"),
    ],
)
def test_gate_up_is_gated_in_the_kernel_where_it_can_be_and_the_log_says_why(
    change: dict, activation: str, device: str, gated: bool, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    from types import SimpleNamespace

    from max.driver import CPU

    from attnquant.config import AttnQuantConfig
    from attnquant.graph import runtime

    runtime._log_gating.cache_clear()
    config = dataclasses.replace(AttnQuantConfig(quant="nvfp4", gated_gemv=True), **change)
    dev = CPU() if device == "cpu" else SimpleNamespace(api="cuda", architecture_name=device)
    with caplog.at_level(logging.INFO, logger=runtime.logger.name):
        part, stored, (packed, scale_bits) = _gate_up_for_device(config, dev, activation)
    assert part.gated is gated
    lines = [r.getMessage() for r in caplog.records if "gate|up [64, 128]" in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0], lines
    if device == "sm_90a":  # the bytes the kernel reads: interleaved only when gated
        rows = (L.interleave_gate_up(packed), L.interleave_gate_up(scale_bits)) if gated else (packed, scale_bits)
        assert torch.equal(stored, L.prepare_weights(*rows)[0])


@pytest.mark.parametrize(
    "f, k, gated",
    [(21504, 5376, True), (15360, 3840, False), (6912, 1152, False)],  # 27B/31B, 12B, 1B
)
def test_auto_gates_only_gate_up_weights_as_large_as_those_measured_faster(f: int, k: int, gated: bool) -> None:
    """ATTNQUANT_GATED_GEMV=auto (the default): the kernel's epilogue where
    the packed weight is >= GATED_AUTO_MIN_MIB, the activation after the GEMV
    below; either way the reason names the size."""
    from attnquant.config import AttnQuantConfig
    from attnquant.graph import runtime
    from attnquant.plan import PartPlan

    layer = K.NVFP4LayerConfig(2 * f, k, DType.bfloat16, "cuda", "sm_90a")
    part = PartPlan("nvfp4", ("gate_proj", "up_proj"), (f, f), k)
    config = AttnQuantConfig(quant="nvfp4")
    assert config.gated_gemv is None
    ok, why = runtime._gating(part, layer, K.choose_backend(layer), config, "gelu_pytorch_tanh")
    assert ok is gated
    assert f"auto: the weight is {2 * f * k / 2**21:.1f} MiB {'>=' if gated else '<'} 100 MiB" in why, why


def test_only_a_whole_gate_up_with_one_global_scale_is_gated() -> None:
    """A part holding up alone (gate_proj left unquantized) or fused members
    with different global scales keeps the activation after the matmul."""
    from types import SimpleNamespace

    from attnquant.config import AttnQuantConfig

    config, dev = AttnQuantConfig(quant="nvfp4", gated_gemv=True), SimpleNamespace(api="cuda", architecture_name="sm_90a")
    assert _gate_up_for_device(config, dev, "gelu_tanh")[0].gated
    assert not _gate_up_for_device(config, dev, "gelu_tanh", per_row_scale=True)[0].gated
    assert not _gate_up_for_device(config, dev, "gelu_tanh", members=("up_proj", "down_proj"))[0].gated


def test_gemv_only_skips_the_m_branch() -> None:
    """ATTNQUANT_NVFP4_DISPATCH=gemv: the GEMV at every M, no F.cond built
    (M symbolic here; the GEMV kernels are correct at any M)."""
    from types import SimpleNamespace

    from max.dtype import DType

    x = SimpleNamespace(shape=["m", 64])
    calls: list[str] = []

    def branch(name: str):
        return lambda: calls.append(name) or name

    gemv_only = K.NVFP4LayerConfig(24, 64, DType.bfloat16, "cuda", "sm_90a", gemv_only=True)
    assert base.dispatch_on_m(x, gemv_only, branch("gemv"), branch("dequant")) == "gemv"
    static_large = SimpleNamespace(shape=[40, 64])
    assert base.dispatch_on_m(static_large, gemv_only, branch("gemv"), branch("dequant")) == "gemv"
    auto = K.NVFP4LayerConfig(24, 64, DType.bfloat16, "cuda", "sm_90a")
    assert base.dispatch_on_m(static_large, auto, branch("gemv"), branch("dequant")) == "dequant"
    assert calls == ["gemv", "gemv", "dequant"]


@pytest.mark.parametrize(
    "dispatch, api, capture, warns",
    [
        ("auto", "cuda", False, True),  # the measured slow combination
        ("auto", "cuda", True, False),  # captured: the branch is replayed
        ("auto", "cuda", None, False),  # not known: no guess
        ("gemv", "cuda", False, False),  # no branch
        ("auto", "cpu", False, False),  # the CPU kernel has no branch
    ],
)
def test_capture_off_advice(dispatch: str, api: str, capture: bool | None, warns: bool) -> None:
    advice = capture_off_advice(dispatch, api, capture)
    assert (advice is not None) == warns
    if warns:
        assert "--no-device-graph-capture" in advice and "ATTNQUANT_NVFP4_DISPATCH=gemv" in advice
