"""max-sm100: MAX's NVFP4 block-scaled matmul on Blackwell (attnquant.graph.nvfp4.sm100).

No Blackwell GPU here: the load-time scale interleave is checked against MAX's
own index formula (``set_scale_factor`` in max/kernels linalg/fp4_utils.mojo),
the chooser's gating is checked, and one graph using the backend is compiled
for a virtual sm_100a device (MAX's virtual-device mode, in a child process
because that mode is process-wide). Numerics (W4A4) and speed are not
measured anywhere yet.
"""

from __future__ import annotations

import pytest
import torch

from max.dtype import DType

from attnquant.graph import nvfp4 as K
from attnquant.graph.nvfp4 import sm100 as S
from tests.virtual_gpu import compile_for_virtual_gpu

BF16 = DType.bfloat16


def test_interleave_matches_max_set_scale_factor() -> None:
    n, kb = 256, 12  # two 128-row groups, three 4-block atoms
    scales = torch.randint(0, 256, (n, kb), dtype=torch.uint8)
    flat = S.interleave_scales(scales).reshape(-1)
    assert flat.shape == (n * kb,)
    for r in range(n):
        for b in range(kb):
            assert flat[S.interleaved_index(r, b, n, kb)] == scales[r, b], (r, b)


def test_prepare_weights_keeps_codes_and_views_scales_as_e4m3() -> None:
    packed = torch.randint(0, 256, (128, 64), dtype=torch.uint8)
    scales = torch.randint(0x20, 0x58, (128, 8), dtype=torch.uint8)
    codes, sf = S.MaxSM100Backend.prepare_weights(packed, scales)
    assert codes is packed
    assert sf.dtype == torch.float8_e4m3fn and sf.shape == (128, 8)
    assert torch.equal(sf.view(torch.uint8), S.interleave_scales(scales))
    assert K.WeightLayout.SM100.scale_dtype == DType.float8_e4m3fn
    assert K.WeightLayout.SM100.shapes(128, 128) == ([128, 64], [128, 8])


@pytest.mark.parametrize(
    "config, reason",
    [
        (K.NVFP4LayerConfig(1536, 1152, BF16, "cuda", "sm_90a"), "sm_100-sm_109"),
        (K.NVFP4LayerConfig(1536, 1152, BF16, "cuda", "sm_120a"), "sm_100-sm_109"),
        (K.NVFP4LayerConfig(1536, 1152, DType.float32, "cuda", "sm_100a"), "bf16"),
        (K.NVFP4LayerConfig(1000, 1152, BF16, "cuda", "sm_100a"), "N=1000"),
        (K.NVFP4LayerConfig(1536, 1040, BF16, "cuda", "sm_100a"), "K=1040"),
        (K.NVFP4LayerConfig(1536, 1152, BF16, "hip", "gfx950"), "NVIDIA"),
    ],
)
def test_sm100_refuses_with_a_reason(config: K.NVFP4LayerConfig, reason: str) -> None:
    ok, why = S.MaxSM100Backend.can_implement(config)
    assert not ok and reason in why


def test_sm100_takes_every_gemma_projection() -> None:
    shapes = [(1536, 1152), (1152, 1024), (13824, 1152), (1152, 6912), (4096, 2560), (2560, 2048),
              (20480, 2560), (2560, 10240), (16384, 5376), (5376, 8192), (43008, 5376), (5376, 21504)]  # fmt: skip
    for n, k in shapes:
        ok, why = S.MaxSM100Backend.can_implement(K.NVFP4LayerConfig(n, k, BF16, "cuda", "sm_100a"))
        assert ok and "W4A4" in why and "not measured" in why, (n, k, why)


_COMPILE = """
    from attnquant.graph import nvfp4 as K
    from attnquant.graph.ops import custom_extensions_path
    from attnquant.max_compat import device_arch

    assert driver.accelerator_architecture_name() == "sm_100a"
    n, k = 1536, 1152  # Gemma 3 1B q|k|v
    config = K.NVFP4LayerConfig(n, k, DType.bfloat16, "cuda", device_arch(gpu))
    assert K.choose_backend(config).name == "max-sm100"

    def forward(x, packed, scales, gs):
        return K.nvfp4_linear(x, packed, scales, gs, layout=K.WeightLayout.SM100, out_features=n)

    types = [TensorLayout(DType.bfloat16, ["m", k], gpu), TensorLayout(DType.uint8, [n, k // 2], gpu),
             TensorLayout(DType.float8_e4m3fn, [n, k // 16], gpu), TensorLayout(DType.float32, [1], gpu)]
    compilation.compile(forward, custom_extensions=[custom_extensions_path()], session=session)(*types)
    print("COMPILED sm_100a")
    """


@pytest.mark.max
def test_sm100_graph_compiles_for_virtual_sm100a() -> None:
    """A graph with the max-sm100 backend (symbolic M: quantize x to NVFP4,
    MAX's SM100 block-scaled matmul, global scale) compiles for sm_100a.
    Compiled, not run: there is no Blackwell GPU here (~90 s on 2 cores)."""
    r = compile_for_virtual_gpu("sm_100a", _COMPILE)
    assert r.returncode == 0 and "COMPILED sm_100a" in r.stdout, (r.stdout + r.stderr)[-4000:]
