"""attnquant.formats.nvfp4 against MAX's host reference, bit for bit."""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnquant.formats import nvfp4
from attnquant.formats.nvfp4 import NVFP4Weight, ScalePolicy

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(params=["direct", "tabulated"])
def encoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with 16-bit inputs encoded directly, then through tables
    (quantize picks tables only for big tensors; these force either)."""
    monkeypatch.setattr(nvfp4, "_TABLE_PAYOFF", math.inf if request.param == "direct" else 0)
    return request.param


def reference(ref: ModuleType, weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """MAX's (packed, scale bits, decode scale) for a weight (as float32, exact)."""
    with np.errstate(all="ignore"):  # it divides by zero on all-zero input
        packed, scales, decode = ref.quantize_nvfp4(weight.float().numpy(), ref.FP4Format.NVFP4)
    return packed, scales.reshape(scales.shape[:-1]), np.float32(decode)


def assert_matches_reference(ref: ModuleType, weight: torch.Tensor, **kwargs) -> NVFP4Weight:
    q = nvfp4.quantize(weight, **kwargs)
    packed, scale_bits, decode = reference(ref, weight)
    np.testing.assert_array_equal(q.packed.numpy(), packed, err_msg="packed codes differ")
    np.testing.assert_array_equal(
        q.block_scale_bits().numpy(), scale_bits, err_msg="scale bits differ"
    )
    assert q.global_scale.numpy().view(np.uint32) == decode.view(
        np.uint32
    ), f"global scale {q.global_scale.item()!r} != reference {decode!r}"
    return q


def gaussian(rows: int, cols: int, scale: float, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * scale


def edge_cases(rows: int = 32, cols: int = 128) -> torch.Tensor:
    """Zero blocks, -0.0, blocks far below the tensor's amax (E4M3 subnormal
    and zero scales), an outlier, exact E2M1 grid values and ties."""
    w = gaussian(rows, cols, 1.0)
    w[0] = 0.0
    w[1, :16] = -0.0
    w[2, :16] = 1e-6  # scale underflows to E4M3 zero
    w[3] *= 2.0**-12  # E4M3 subnormal scales
    w[4, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2) * torch.tensor(
        [1.0, -1.0] * 8
    )
    w[5, :16] = -1e-3  # negatives that round to zero keep their sign bit
    w[6, 5] = 300.0  # outlier sets the global scale
    return w


def outliers() -> torch.Tensor:
    """About 1% of the elements 1000x larger than the rest."""
    return gaussian(64, 256, 1.0) * (1 + 1000 * (gaussian(64, 256, 1.0, seed=1) > 2.4))


def heavy_tail() -> torch.Tensor:
    """Gaussian over squared uniform: magnitudes spread over six decades."""
    uniform = torch.rand(64, 256, generator=torch.Generator().manual_seed(2))
    return gaussian(64, 256, 1.0) / uniform.clamp_min(1e-3).square()


KINDS = {
    "gaussian": lambda: gaussian(64, 256, 0.02),
    "outliers": outliers,
    "heavy_tail": heavy_tail,
    "all_zero": lambda: torch.zeros(16, 64),
    "edge_cases": edge_cases,
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(
    max_fp4_reference: ModuleType, kind: str, dtype: torch.dtype, encoder: str
) -> None:
    weight = KINDS[kind]()
    if dtype == torch.float16:
        weight = weight.clamp(-60000, 60000)
    assert_matches_reference(max_fp4_reference, weight.to(dtype))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("magnitude", (1e-30, 1e-20, 1e-8, 1e30, 1e36))
def test_matches_reference_at_extreme_magnitudes(
    max_fp4_reference: ModuleType, magnitude: float, dtype: torch.dtype, encoder: str
) -> None:
    assert_matches_reference(max_fp4_reference, (edge_cases() * magnitude).to(dtype))


def test_matches_reference_when_global_scale_saturates(max_fp4_reference: ModuleType) -> None:
    # amax ~1e-39 (float32 subnormal): 2688 / amax overflows to FLT_MAX.
    assert_matches_reference(max_fp4_reference, edge_cases() * 1e-40)


def test_matches_reference_on_a_large_bfloat16_tensor(max_fp4_reference: ModuleType) -> None:
    weight = gaussian(2048, 1024, 0.02).bfloat16()
    assert isinstance(
        nvfp4._encoder_for(weight, torch.tensor(1e-5), torch.arange(16, dtype=torch.uint8)),
        nvfp4._TabulatedEncoder,
    )
    assert_matches_reference(max_fp4_reference, weight)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_tabulated_encoder_agrees_with_direct_on_every_16bit_input(dtype: torch.dtype) -> None:
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    values = values[torch.isfinite(values)][: 4096 * 16].view(-1, 1, 16)  # one block per row
    global_decode = torch.tensor(3.7e-4)
    codes = torch.tensor([0, 1, 7, 8, 50, 100, 125, 126], dtype=torch.uint8)
    table = nvfp4._TabulatedEncoder(dtype, global_decode, codes)
    direct = nvfp4._DirectEncoder(global_decode)
    window = nvfp4._SEARCH_WINDOWS[ScalePolicy.WEIGHTED]
    table_errors = nvfp4._TabulatedErrors(dtype, global_decode, (0, 126), window)
    direct_errors = nvfp4._DirectErrors(global_decode, window)
    for code in codes:
        scale_codes = torch.full(values.shape[:2], int(code), dtype=torch.uint8)
        assert torch.equal(table.codes(values, scale_codes), direct.codes(values, scale_codes))
        assert torch.equal(table_errors.errors(values, scale_codes), direct_errors.errors(values, scale_codes))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    blocks=st.integers(1, 4),
    data=st.data(),
)
def test_matches_reference_on_arbitrary_float32(
    max_fp4_reference: ModuleType, rows: int, blocks: int, data: st.DataObject
) -> None:
    values = data.draw(
        st.lists(
            st.floats(width=32, allow_nan=False, allow_infinity=False),
            min_size=rows * blocks * 16,
            max_size=rows * blocks * 16,
        )
    )
    weight = torch.tensor(values, dtype=torch.float32).view(rows, blocks * 16)
    assert_matches_reference(max_fp4_reference, weight)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), blocks=st.integers(1, 4), data=st.data())
def test_matches_reference_on_arbitrary_bfloat16_bits(
    max_fp4_reference: ModuleType, rows: int, blocks: int, data: st.DataObject
) -> None:
    # Every finite bfloat16 bit pattern is fair game: subnormals, -0.0, huge.
    finite_bits = st.integers(-32768, 32767).filter(lambda b: (b & 0x7F80) != 0x7F80)
    bits = data.draw(
        st.lists(finite_bits, min_size=rows * blocks * 16, max_size=rows * blocks * 16)
    )
    weight = torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16).view(rows, blocks * 16)
    assert_matches_reference(max_fp4_reference, weight)


@pytest.mark.parametrize("chunk_rows", (1, 3, 1000))
def test_chunking_does_not_change_the_result(chunk_rows: int) -> None:
    weight = edge_cases(rows=20).bfloat16()
    whole, chunked = nvfp4.quantize(weight), nvfp4.quantize(weight, chunk_rows=chunk_rows)
    assert torch.equal(whole.packed, chunked.packed)
    assert torch.equal(whole.block_scale_bits(), chunked.block_scale_bits())


def test_e2m1_encoder_matches_reference_at_every_threshold(max_fp4_reference: ModuleType) -> None:
    # The whole [-16, 16] float32 range was checked exhaustively once; here the
    # rounding thresholds, one ulp either side, and the special values.
    points = torch.tensor(
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 1e30]
    )
    values = torch.cat(
        [
            points,
            torch.nextafter(points, torch.tensor(-1.0)),
            torch.nextafter(points, torch.tensor(100.0)),
        ]
    )
    values = torch.cat([values, -values, torch.tensor([1e-45, -1e-45, math.inf, -math.inf])])
    ref_codes = max_fp4_reference.pack_pairs_e2m1_uint8(
        max_fp4_reference.round_to_e2m1(values.numpy())
    )
    expected = np.stack([ref_codes & 0xF, ref_codes >> 4], axis=1).reshape(-1)[: len(values)]
    np.testing.assert_array_equal(nvfp4._e2m1_codes(values).numpy(), expected)


def test_e4m3_scale_encoding_matches_reference(max_fp4_reference: ModuleType) -> None:
    # Every E4M3 value, the midpoints between neighbours, one float32 ulp
    # either side, and values past the 448 saturation point.
    grid = nvfp4.e4m3_decode_table()[:0x7F]
    midpoints = (grid[:-1] + grid[1:]) / 2
    values = torch.cat([grid, midpoints, torch.tensor([449.0, 464.0, 480.0, 1e30, math.inf])])
    values = torch.cat(
        [
            values,
            torch.nextafter(values, torch.tensor(0.0)),
            torch.nextafter(values, torch.tensor(math.inf)),
        ]
    )
    with np.errstate(all="ignore"):
        expected = max_fp4_reference.encode_f32_to_e4m3(values.numpy())
    np.testing.assert_array_equal(nvfp4._e4m3_codes(values).numpy(), expected)


def test_decode_tables_match_reference(max_fp4_reference: ModuleType) -> None:
    ref = max_fp4_reference
    np.testing.assert_array_equal(
        np.array(nvfp4.E2M1_VALUES, dtype=np.float32), ref.e2m1_decode_table(ref.FP4Format.NVFP4)
    )
    table = nvfp4.e4m3_decode_table()
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    np.testing.assert_array_equal(table.numpy()[finite], ref.unpack_e4m3_uint8_to_fp32(finite))
    assert torch.isnan(table[[0x7F, 0xFF]]).all()
    pairs = ref.unpack_pairs_e2m1_to_fp32(np.arange(256, dtype=np.uint8)).reshape(256, 2)
    np.testing.assert_array_equal(nvfp4.packed_byte_decode_table().numpy(), pairs)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_matches_reference(
    max_fp4_reference: ModuleType, kind: str, encoder: str
) -> None:
    weight = KINDS[kind]().bfloat16()
    q = nvfp4.quantize(weight)
    with np.errstate(all="ignore"):
        expected = max_fp4_reference.dequantize_nvfp4(
            q.packed.numpy(),
            q.block_scale_bits().numpy()[..., None],
            np.float32(q.global_scale.item()),
            max_fp4_reference.FP4Format.NVFP4,
        )  # fmt: skip
    np.testing.assert_array_equal(nvfp4.dequantize(q).numpy(), expected)
    assert nvfp4.dequantize(q, torch.bfloat16).dtype == torch.bfloat16


def block_view(weight: torch.Tensor) -> torch.Tensor:
    return weight.float().reshape(weight.shape[0], -1, 16)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_error_is_bounded_by_block_amax(kind: str) -> None:
    weight = KINDS[kind]()
    q = nvfp4.quantize(weight)
    error = block_view(weight - nvfp4.dequantize(q)).abs().amax(-1)
    block_amax = block_view(weight).abs().amax(-1)
    # Half the widest E2M1 gap (4 -> 6) is 1/6 of the block max; the E4M3
    # scale can round down by up to 1/16, and a block too small for any
    # E4M3 scale loses at most half the smallest subnormal step per unit.
    bound = block_amax * (1 / 6) * (1 + 1 / 16) + 6 * 2.0**-10 * q.global_scale
    assert (error <= bound * (1 + 1e-6)).all(), f"worst excess {(error - bound).max().item()}"


def test_typical_relative_error() -> None:
    weight = gaussian(256, 1024, 0.02)
    relative = (weight - nvfp4.dequantize(nvfp4.quantize(weight))).norm() / weight.norm()
    assert 0.05 < relative < 0.15  # NVFP4 on Gaussian data is ~0.1


def block_errors(weight: torch.Tensor, q: NVFP4Weight, importance: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [N, K/16]: each block's (importance-weighted) squared error of the decoded weights."""
    errors = (block_view(weight).double() - block_view(nvfp4.dequantize(q)).double()).square()
    if importance is not None:
        errors = errors * importance.double().view(-1, 16)
    return errors.sum(-1)


SEARCHES = (ScalePolicy.MSE, ScalePolicy.WEIGHTED)


def outlier_weights(rows: int, blocks: int, dtype: torch.dtype, scale: float, seed: int, kind: str) -> torch.Tensor:
    """Random [rows, 16 blocks] weights of a kind the searches must survive."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, blocks * 16, generator=generator) * scale
    if kind == "heavy":
        weight = weight * torch.rand(rows, blocks * 16, generator=generator).pow(-2)
    elif kind == "outlier":  # one huge element per block
        weight.view(rows, blocks, 16)[:, :, 0] *= 1e3
    elif kind == "zero-blocks":
        weight.view(rows, blocks, 16)[:, ::2] = 0
    elif kind == "subnormal":  # bf16/fp16 subnormals only (fp32: tiny normals)
        tiny = torch.finfo(dtype).tiny
        weight = torch.randint(-8, 9, weight.shape, generator=generator).float() * tiny / 16
    return weight.clamp(-60000, 60000).to(dtype)  # float16 overflows past 65504


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4),
    blocks=st.integers(1, 3),
    dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from([1e-6, 0.02, 1.0, 1e4]),
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["gaussian", "heavy", "outlier", "zero-blocks", "subnormal"]),
    policy=st.sampled_from(SEARCHES),
    weighted=st.booleans(),
)
def test_a_search_never_increases_a_block_error(
    rows: int, blocks: int, dtype: torch.dtype, scale: float, seed: int, kind: str,
    policy: ScalePolicy, weighted: bool,
) -> None:  # fmt: skip
    weight = outlier_weights(rows, blocks, dtype, scale, seed, kind)
    importance = None
    if weighted and policy is ScalePolicy.WEIGHTED:
        importance = torch.rand(blocks * 16, generator=torch.Generator().manual_seed(seed)).pow(3)
    rtn = nvfp4.quantize(weight)
    searched = nvfp4.quantize(weight, scale_policy=policy, importance=importance)
    assert torch.isfinite(nvfp4.dequantize(searched)).all()
    assert not (searched.block_scale_bits() == 0x7F).any()  # never E4M3's NaN code
    rtn_error, searched_error = block_errors(weight, rtn, importance), block_errors(weight, searched, importance)
    # The search compares float32 block sums; a candidate it prefers by a
    # float32 rounding may be a hair worse in float64: allow that, nothing more.
    assert (searched_error <= rtn_error * (1 + 1e-5) + 1e-300).all()
    assert torch.equal(searched.global_scale, rtn.global_scale)


@pytest.mark.parametrize("policy", SEARCHES, ids=lambda p: p.value)
def test_a_search_lowers_the_error_of_gaussian_weights(encoder: str, policy: ScalePolicy) -> None:
    for dtype in DTYPES:
        weight = gaussian(64, 256, 0.02).to(dtype)
        rtn, searched = nvfp4.quantize(weight), nvfp4.quantize(weight, scale_policy=policy)
        assert block_errors(weight, searched).sum() < 0.97 * block_errors(weight, rtn).sum()
        assert not torch.equal(searched.block_scale_bits(), rtn.block_scale_bits())


def test_weighting_moves_the_error_to_the_columns_that_matter(encoder: str) -> None:
    weight = gaussian(64, 256, 0.02).bfloat16()
    importance = torch.ones(256)
    importance[::16] = 100.0  # the first column of every block counts 100x
    plain = nvfp4.quantize(weight, scale_policy=ScalePolicy.WEIGHTED)
    weighted = nvfp4.quantize(weight, scale_policy=ScalePolicy.WEIGHTED, importance=importance)
    assert block_errors(weight, weighted, importance).sum() < 0.9 * block_errors(weight, plain, importance).sum()
    first_column = lambda q: (weight.float() - nvfp4.dequantize(q))[:, ::16].square().sum()  # noqa: E731
    assert first_column(weighted) < first_column(plain)


@pytest.mark.parametrize("policy", SEARCHES, ids=lambda p: p.value)
def test_a_search_keeps_zero_blocks_identical_to_rtn(policy: ScalePolicy) -> None:
    weight = torch.zeros(4, 64)
    rtn, searched = nvfp4.quantize(weight), nvfp4.quantize(weight, scale_policy=policy)
    assert torch.equal(rtn.packed, searched.packed) and torch.equal(
        rtn.block_scale_bits(), searched.block_scale_bits()
    )


def test_the_weighted_search_decodes_with_maxs_dequantizer(max_fp4_reference: ModuleType) -> None:
    weight = outlier_weights(8, 4, torch.bfloat16, 0.02, 3, "outlier")
    q = nvfp4.quantize(weight, scale_policy=ScalePolicy.WEIGHTED, importance=torch.rand(64) + 0.1)
    assert not torch.equal(q.block_scale_bits(), nvfp4.quantize(weight).block_scale_bits())
    with np.errstate(all="ignore"):
        expected = max_fp4_reference.dequantize_nvfp4(
            q.packed.numpy(), q.block_scale_bits().numpy()[..., None], np.float32(q.global_scale.item()),
            max_fp4_reference.FP4Format.NVFP4,
        )  # fmt: skip
    np.testing.assert_array_equal(nvfp4.dequantize(q).numpy(), expected)


@pytest.mark.parametrize(
    ("importance", "message"),
    [
        (torch.ones(32), r"float \[64\] vector"),
        (torch.ones(64, dtype=torch.int32), r"float \[64\] vector"),
        (torch.tensor([1.0] * 63 + [math.nan]), "finite and non-negative"),
        (torch.tensor([1.0] * 63 + [-1.0]), "finite and non-negative"),
    ],
)
def test_bad_importance_is_a_value_error_naming_the_tensor(importance: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        nvfp4.quantize(torch.ones(2, 64), scale_policy=ScalePolicy.WEIGHTED, importance=importance, name="w.up")
    assert "w.up" in str(error.value)
    with pytest.raises(ValueError, match="only used by the weighted"):
        nvfp4.quantize(torch.ones(2, 64), importance=torch.ones(64))


def test_searches_are_deterministic_across_chunking(encoder: str) -> None:
    weight = outlier_weights(96, 8, torch.bfloat16, 0.02, 5, "heavy")
    importance = torch.rand(128, generator=torch.Generator().manual_seed(1))
    whole = nvfp4.quantize(weight, scale_policy=ScalePolicy.WEIGHTED, importance=importance)
    for chunk_rows in (1, 7, 64):
        part = nvfp4.quantize(weight, scale_policy=ScalePolicy.WEIGHTED, importance=importance, chunk_rows=chunk_rows)
        assert torch.equal(part.packed, whole.packed) and torch.equal(part.block_scale_bits(), whole.block_scale_bits())


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (torch.zeros(4, 40), "K = 40"),
        (torch.zeros(0, 16), "non-empty 2-D"),
        (torch.zeros(16), "non-empty 2-D"),
        (torch.zeros(2, 2, 16), "non-empty 2-D"),
        (torch.zeros(2, 16, dtype=torch.int32), "floating point"),
        (torch.tensor([[1.0] * 15 + [math.nan]]), r"NaN or Inf \(first at \[0, 15\]"),
        (
            torch.tensor([[1.0] * 16, [1.0] * 3 + [-math.inf] + [1.0] * 12]).bfloat16(),
            r"first at \[1, 3\]",
        ),
    ],
)
def test_bad_input_is_a_value_error_naming_the_tensor(weight: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        nvfp4.quantize(weight, name="model.layers.3.mlp.up_proj.weight")
    assert "model.layers.3.mlp.up_proj.weight" in str(error.value)


def test_nvfp4_weight_checks_its_fields() -> None:
    q = nvfp4.quantize(gaussian(8, 64, 1.0))
    assert q.shape == (8, 64) and q.nbytes == 8 * 32 + 8 * 4 + 4
    assert q.block_scale_bits().dtype == torch.uint8
    with pytest.raises(ValueError, match="block_scales"):
        NVFP4Weight(q.packed, q.block_scales[:, :2], q.global_scale)
    with pytest.raises(ValueError, match="global_scale"):
        NVFP4Weight(q.packed, q.block_scales, q.global_scale.view(1))
    with pytest.raises(ValueError, match="packed"):
        NVFP4Weight(q.packed.float(), q.block_scales, q.global_scale)


def test_float64_input_is_rounded_to_float32(max_fp4_reference: ModuleType) -> None:
    weight = gaussian(8, 64, 1.0).double() * (1 + 1e-12)
    q = nvfp4.quantize(weight)
    packed, scale_bits, _ = reference(max_fp4_reference, weight.float())
    np.testing.assert_array_equal(q.packed.numpy(), packed)
    np.testing.assert_array_equal(q.block_scale_bits().numpy(), scale_bits)


def test_a_given_amax_sets_the_global_scale() -> None:
    """Members of a fused group share one global scale: quantized with the
    group's amax. The tensor's own amax gives the default encoding; a larger
    one still decodes within the format's error; a smaller one is refused."""
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    own = weight.abs().max().item()
    default = nvfp4.quantize(weight)
    same = nvfp4.quantize(weight, amax=own)
    assert torch.equal(same.packed, default.packed) and torch.equal(same.global_scale, default.global_scale)
    shared = nvfp4.quantize(weight, amax=4 * own)
    assert torch.equal(shared.global_scale, nvfp4.quantize(weight * 4).global_scale)
    error = (nvfp4.dequantize(shared) - weight).abs().max() / own
    assert error < 0.2, error  # E2M1 step at the top of a block: 1/6 of its amax
    with pytest.raises(ValueError, match="below the tensor's own"):
        nvfp4.quantize(weight, amax=own / 2)


def test_searches_do_not_depend_on_the_thread_count() -> None:
    """The CPU side of "the same bits on every device" (a GPU run:
    bench/checks/scale_search_devices.py): no reduction whose order follows
    the threads decides a scale."""
    weight = outlier_weights(256, 64, torch.bfloat16, 0.02, 11, "heavy")
    importance = torch.rand(1024, generator=torch.Generator().manual_seed(2)).pow(3)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, max(2, threads)):
            torch.set_num_threads(count)
            results.append([
                nvfp4.quantize(weight, scale_policy=ScalePolicy.WEIGHTED, importance=importance),
                nvfp4.quantize(weight, scale_policy=ScalePolicy.MSE),
            ])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    for one, many in zip(*results):
        assert torch.equal(one.packed, many.packed) and torch.equal(one.block_scale_bits(), many.block_scale_bits())


class _CudaScalarDivision(torch.overrides.TorchFunctionMode):
    """Divides by a Python number as CUDA does: through the float32 reciprocal
    (``x * (1/d)``), which is not always ``x / d``. Run on the CPU, it is the
    GPU's arithmetic for that one operation and the CPU's for the rest."""

    DIVISIONS = {torch.Tensor.__truediv__, torch.Tensor.div, torch.div, torch.true_divide}
    IN_PLACE = {torch.Tensor.__itruediv__, torch.Tensor.div_}

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in self.DIVISIONS or func in self.IN_PLACE) and len(args) == 2 and isinstance(args[1], (int, float)):
            if not kwargs and args[0].is_floating_point():
                self.seen += 1
                inverse = torch.tensor(1.0) / torch.tensor(float(args[1]))
                result = (args[0].float() * inverse).to(args[0].dtype)
                return args[0].copy_(result) if func in self.IN_PLACE else result
        return func(*args, **kwargs)


@pytest.mark.parametrize("policy", list(ScalePolicy))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scales_do_not_depend_on_how_a_device_divides_by_a_constant(policy: ScalePolicy, dtype: torch.dtype) -> None:
    """The CPU twin of the GPU check (bench/checks/scale_search_devices.py):
    the same bits when every division by a constant is done as CUDA does it."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(1024, 1024, generator=generator) * 0.02
    weight.view(1024, 64, 16)[:, ::3] = 0  # zero blocks, as in the GPU check
    # Block maxima one ulp from 6x an E4M3 rounding tie (with the global
    # scale 1, from an element of 2688): x / 6 and x * (1/6) round apart there.
    weight[0, 0] = 2688.0
    ties = torch.tensor([0.1113281175494194, 0.2226562350988388, 0.4453124701976776, 0.8906249403953552])
    weight[1:5, 16:32] = ties.view(4, 1) * torch.linspace(0.1, 1.0, 16)
    weight = weight.to(dtype)
    extra = {"importance": torch.rand(1024, generator=generator).pow(3)} if policy is ScalePolicy.WEIGHTED else {}
    plain = nvfp4.quantize(weight, scale_policy=policy, **extra)
    with _CudaScalarDivision():
        as_cuda = nvfp4.quantize(weight, scale_policy=policy, **extra)
    assert torch.equal(plain.block_scale_bits(), as_cuda.block_scale_bits())
    assert torch.equal(plain.packed, as_cuda.packed) and torch.equal(plain.global_scale, as_cuda.global_scale)


E2M1_MAGNITUDES = np.array(nvfp4.E2M1_VALUES[:8], dtype=np.float32)


def e2m1_index(y: np.ndarray) -> np.ndarray:
    """Index of the E2M1 magnitude nearest to each float32 y >= 0, ties to the
    even index (the reference's rounding); past 6, saturated to 6."""
    distance = np.abs(np.minimum(y, 6).astype(np.float64)[..., None] - E2M1_MAGNITUDES)
    nearest = distance == distance.min(-1, keepdims=True)
    even_nearest = nearest & (np.arange(8) % 2 == 0)
    return np.where(even_nearest.any(-1), even_nearest.argmax(-1), nearest.argmax(-1))


def e4m3_encode_scales(codes: np.ndarray, global_decode: np.float32) -> np.ndarray:
    """float32 [..., 1]: 1 / (block scale * global), saturated at FLT_MAX."""
    with np.errstate(divide="ignore", over="ignore"):
        encode = np.float32(1) / (E4M3_VALUES[codes] * global_decode)
    return np.minimum(encode, np.finfo(np.float32).max)[..., None]


E4M3_VALUES = nvfp4.e4m3_decode_table().numpy()


def block_error_sums(
    weight: torch.Tensor, codes: np.ndarray, global_decode: np.float32, importance: torch.Tensor | None
) -> np.ndarray:
    """float32 [N, K/16]: each block's squared errors under its E4M3 code,
    times the importance, added in quantize's fixed tree (j + j+8, then
    j + j+4, ...). Each element decodes as the reference does:
    ``(e2m1 * block_scale) * global``."""
    n, k = weight.shape
    magnitude = np.abs(weight.float().numpy().reshape(n, k // 16, 16))
    weights = np.ones(k, np.float32) if importance is None else importance.float().numpy()
    y = magnitude * e4m3_encode_scales(codes, global_decode)
    decoded = E2M1_MAGNITUDES[e2m1_index(y)] * E4M3_VALUES[codes][..., None] * global_decode
    with np.errstate(over="ignore", invalid="ignore"):
        errors = np.square(magnitude - decoded) * weights.reshape(k // 16, 16)
        half = 8
        while half:
            errors = errors[..., :half] + errors[..., half : 2 * half]
            half //= 2
    return errors[..., 0]


def reference_search(
    weight: torch.Tensor, policy: ScalePolicy, importance: torch.Tensor | None
) -> tuple[np.ndarray, np.ndarray]:
    """(packed, scale bits) of a scale search, stated plainly in float32 numpy.

    Per block, each candidate E4M3 code (RTN's and its window, clamped to the
    finite codes) gets :func:`block_error_sums`. RTN is tried first, then the
    others from the lowest code up, and a candidate replaces the best only
    when its sum is strictly smaller.
    """
    rtn = nvfp4.quantize(weight)  # RTN scales and the global scale: MAX's, as tested above
    global_decode = np.float32(rtn.global_scale.item())
    rtn_codes = rtn.block_scale_bits().numpy().astype(np.int64)
    best_codes = rtn_codes
    best_errors = block_error_sums(weight, rtn_codes, global_decode, importance)
    for offset in sorted(o for o in nvfp4._SEARCH_WINDOWS[policy] if o):
        codes = np.clip(rtn_codes + offset, 0, 0x7E)
        errors = block_error_sums(weight, codes, global_decode, importance)
        with np.errstate(invalid="ignore"):
            better = errors < best_errors
        best_codes = np.where(better, codes, best_codes)
        best_errors = np.where(better, errors, best_errors)

    n, k = weight.shape
    w = weight.float().numpy().reshape(n, k // 16, 16)
    with np.errstate(over="ignore"):
        scaled = w * e4m3_encode_scales(best_codes, global_decode)
    element_codes = e2m1_index(np.abs(scaled)) | np.where(scaled < 0, 8, 0)
    element_codes = element_codes.reshape(n, k).astype(np.uint8)
    packed = element_codes[:, 0::2] | (element_codes[:, 1::2] << 4)
    return packed, best_codes.astype(np.uint8)


def search_case(kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A weight, and an importance or None, for the search reference test."""
    if kind == "nan-rtn":
        # Errors near sqrt(FLT_MAX) in columns of zero importance: inf * 0
        # makes some RTN sums NaN while a neighbouring scale's sum is finite.
        weight = gaussian(64, 256, 1e20, seed=7).to(dtype)
        importance = torch.rand(256, generator=torch.Generator().manual_seed(1))
        importance[::3] = 0
        return weight, importance
    base, weighting = kind.split("/")
    weight = outlier_weights(32, 8, dtype, 1.0 if base == "subnormal" else 0.02, 3, base)
    generator = torch.Generator().manual_seed(4)
    importance = None
    if weighting == "random":
        importance = torch.rand(128, generator=generator).pow(3)
    elif weighting == "zeros":
        importance = torch.rand(128, generator=generator) * 1e3
        importance[::5] = 0
    return weight, importance


SEARCH_CASES = [
    f"{base}/{weighting}"
    for base in ("gaussian", "heavy", "outlier", "zero-blocks", "subnormal")
    for weighting in ("none", "random", "zeros")
] + ["nan-rtn"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", SEARCH_CASES)
def test_weighted_search_matches_a_plain_reference(kind: str, dtype: torch.dtype, encoder: str) -> None:
    """The same bits as :func:`reference_search`: the fast search may reorder
    nothing that changes a float32 sum or a tie."""
    if kind == "nan-rtn" and dtype == torch.float16:
        pytest.skip("float16 cannot hold weights whose squared error overflows")
    weight, importance = search_case(kind, dtype)
    q = nvfp4.quantize(weight, scale_policy=ScalePolicy.WEIGHTED, importance=importance)
    packed, scale_bits = reference_search(weight, ScalePolicy.WEIGHTED, importance)
    np.testing.assert_array_equal(q.block_scale_bits().numpy(), scale_bits, err_msg="scale bits differ")
    np.testing.assert_array_equal(q.packed.numpy(), packed, err_msg="packed codes differ")
    if kind.split("/")[0] in ("gaussian", "heavy", "outlier"):  # the search did choose other scales
        assert not torch.equal(q.block_scale_bits(), nvfp4.quantize(weight).block_scale_bits())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["gaussian/none", "heavy/none", "outlier/none", "zero-blocks/none"])
def test_mse_search_matches_a_plain_reference(kind: str, dtype: torch.dtype, encoder: str) -> None:
    weight, _ = search_case(kind, dtype)
    q = nvfp4.quantize(weight, scale_policy=ScalePolicy.MSE)
    packed, scale_bits = reference_search(weight, ScalePolicy.MSE, None)
    np.testing.assert_array_equal(q.block_scale_bits().numpy(), scale_bits, err_msg="scale bits differ")
    np.testing.assert_array_equal(q.packed.numpy(), packed, err_msg="packed codes differ")


def test_the_nan_rtn_case_exercises_the_rule() -> None:
    """In the "nan-rtn" case some blocks have a NaN RTN sum beside a finite
    one: a minimum over the finite sums would pick a finite one there, the
    sequential rule must keep RTN."""
    weight, importance = search_case("nan-rtn", torch.float32)
    rtn = nvfp4.quantize(weight)
    global_decode = np.float32(rtn.global_scale.item())
    rtn_codes = rtn.block_scale_bits().numpy().astype(np.int64)
    rtn_sums = block_error_sums(weight, rtn_codes, global_decode, importance)
    other_sums = [
        block_error_sums(weight, np.clip(rtn_codes + offset, 0, 0x7E), global_decode, importance)
        for offset in nvfp4._SEARCH_WINDOWS[ScalePolicy.WEIGHTED] if offset
    ]
    beatable = np.isnan(rtn_sums) & np.isfinite(other_sums).any(0)
    assert beatable.sum() > 10
    searched = nvfp4.quantize(weight, scale_policy=ScalePolicy.WEIGHTED, importance=importance)
    assert (searched.block_scale_bits().numpy() == rtn_codes)[beatable].all()
