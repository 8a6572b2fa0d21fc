"""The quantized-weight cache with real files and real processes, and the
checkpoint identity its keys are made of."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from attnquant.max_compat import child_environment
import torch
from safetensors.torch import load_file, save_file

from attnquant.load.cache import CacheEntry, CacheKey, QuantizedWeightCache
from attnquant.load.checkpoint import checkpoint_identity
from attnquant.config import AttnQuantConfig

REPO = Path(__file__).resolve().parents[1]
KEY = CacheKey.for_model("checkpoint-1", AttnQuantConfig(quant="nvfp4"))


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "layers.0.mlp.up_proj.weight": torch.randint(
            0, 256, (64, 32), dtype=torch.uint8, generator=generator
        ),
        "layers.0.mlp.up_proj.weight_scale": torch.rand(64, 4, generator=generator).to(
            torch.float8_e4m3fn
        ),
        "layers.0.mlp.up_proj.weight_scale_2": torch.tensor(1e-3),
        "norm.weight": torch.randn(64, generator=generator).bfloat16(),
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)) if a[
            name
        ].dim() else torch.equal(a[name], b[name])


class CountingBuild:
    def __init__(self, seed: int = 0) -> None:
        self.calls, self.seed = 0, seed

    def __call__(self) -> CacheEntry:
        self.calls += 1
        return CacheEntry(tensors(self.seed), {"seed": self.seed, "layer_errors": {"0": 0.5}})


def test_miss_then_hit_round_trips_every_dtype(tmp_path: Path) -> None:
    cache, build = QuantizedWeightCache(tmp_path / "cache"), CountingBuild()
    built, hit = cache.load_or_build(KEY, build)
    assert not hit and build.calls == 1
    loaded, hit = cache.load_or_build(KEY, build)
    assert hit and build.calls == 1
    assert_same(loaded.tensors, tensors())
    assert loaded.info == built.info == {"seed": 0, "layer_errors": {"0": 0.5}}
    assert loaded.tensors["layers.0.mlp.up_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")) == [
        f"{KEY.digest}.json", f"{KEY.digest}.safetensors"
    ]


def test_changed_config_or_checkpoint_is_a_miss(tmp_path: Path) -> None:
    cache = QuantizedWeightCache(tmp_path)
    cache.load_or_build(KEY, CountingBuild())
    for key in (
        CacheKey.for_model("checkpoint-1", AttnQuantConfig(quant="nvfp4", scale_search="mse")),
        CacheKey.for_model("checkpoint-1", AttnQuantConfig(quant="nvfp4", quant_ignore=("mlp",))),
        CacheKey.for_model("checkpoint-2", AttnQuantConfig(quant="nvfp4")),
        CacheKey("checkpoint-1", KEY.weight_settings, format_version=KEY.format_version + 1),
    ):
        build = CountingBuild(seed=1)
        result, hit = cache.load_or_build(key, build)
        assert not hit and build.calls == 1
        assert_same(result.tensors, tensors(1))
    # A setting that does not change the weights shares the entry.
    same = CacheKey.for_model(
        "checkpoint-1", AttnQuantConfig(quant="nvfp4", gemm=False, qkv_fuse=False)
    )
    assert cache.load_or_build(same, CountingBuild())[1]
    # Five entries built, one lock file: locks do not pile up.
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".lock")] == [".lock"]


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        lambda data, manifest: flip_byte(data, data.stat().st_size // 2),
        lambda data, manifest: flip_byte(data, 3),  # the header length
        lambda data, manifest: os.truncate(data, data.stat().st_size - 100),
        lambda data, manifest: data.unlink(),
        lambda data, manifest: manifest.write_text("{not json"),
    ],
    ids=["flipped-data", "flipped-header", "truncated", "data-missing", "bad-manifest"],
)
def test_corrupt_entry_is_detected_logged_and_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage
) -> None:
    cache = QuantizedWeightCache(tmp_path)
    cache.load_or_build(KEY, CountingBuild())
    damage(cache.data_path(KEY), cache.manifest_path(KEY))
    build = CountingBuild()
    with caplog.at_level(logging.WARNING, logger="max.pipelines.attnquant"):
        result, hit = cache.load_or_build(KEY, build)
    assert not hit and build.calls == 1
    assert_same(result.tensors, tensors())
    assert [
        r.message for r in caplog.records if "is corrupt" in r.message and "rebuilding" in r.message
    ]
    assert cache.load_or_build(KEY, CountingBuild())[1], "the rebuilt entry is served next time"


def test_unwritable_cache_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=rf"{blocker}/cache is not writable.*ATTNQUANT_CACHE_DIR"):
        QuantizedWeightCache(blocker / "cache")


WORKER = textwrap.dedent(
    """
    import os, sys, time
    import torch
    sys.path.insert(0, {repo!r})
    from attnquant.load.cache import CacheEntry, CacheKey, QuantizedWeightCache
    from attnquant.config import AttnQuantConfig

    root, mode, marker = sys.argv[1], sys.argv[2], sys.argv[3]
    replace = os.replace
    renames = []

    def dying_replace(src, dst):
        # Die (like kill -9: no cleanup) right before the Nth rename.
        renames.append(dst)
        if len(renames) == {{"die_before_data": 1, "die_before_manifest": 2}}[mode]:
            os._exit(17)
        replace(src, dst)

    if mode.startswith("die"):
        os.replace = dying_replace

    def build():
        with open(marker, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        time.sleep(60 if mode == "hang" else 0.5)
        return CacheEntry({{"w": torch.arange(4096, dtype=torch.float32).view(64, 64) + len(mode)}})

    key = CacheKey.for_model("checkpoint-1", AttnQuantConfig(quant="nvfp4"))
    entry, hit = QuantizedWeightCache(root).load_or_build(key, build)
    print("hit" if hit else "miss", float(entry.tensors["w"].sum()))
    """
)


def start_worker(tmp_path: Path, mode: str) -> subprocess.Popen[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(repo=str(REPO)))
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "cache"), mode, str(tmp_path / "builds")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_environment(),
    )  # fmt: skip


def builds(tmp_path: Path) -> int:
    marker = tmp_path / "builds"
    return len(marker.read_text().split()) if marker.exists() else 0


def expected_sum(mode: str) -> float:
    return float((torch.arange(4096, dtype=torch.float32) + len(mode)).sum())


@pytest.mark.parametrize("mode", ["die_before_data", "die_before_manifest"])
def test_process_killed_mid_write_leaves_nothing_that_is_served(tmp_path: Path, mode: str) -> None:
    worker = start_worker(tmp_path, mode)
    assert worker.wait(timeout=120) == 17, worker.stderr.read()
    cache = QuantizedWeightCache(tmp_path / "cache")
    build = CountingBuild()
    result, hit = cache.load_or_build(KEY, build)
    assert not hit and build.calls == 1
    assert_same(result.tensors, tensors())
    assert not list((tmp_path / "cache").glob(".*.tmp")), "stale temporaries are cleaned up"


def test_process_killed_while_building_releases_the_lock(tmp_path: Path) -> None:
    worker = start_worker(tmp_path, "hang")
    deadline = time.monotonic() + 120
    while builds(tmp_path) == 0:  # wait until it holds the lock and builds
        assert worker.poll() is None and time.monotonic() < deadline, (
            worker.stderr.read() if worker.poll() is not None else "timeout"
        )
        time.sleep(0.05)
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=30)
    result, hit = QuantizedWeightCache(tmp_path / "cache").load_or_build(KEY, CountingBuild())
    assert not hit
    assert_same(result.tensors, tensors())


def test_two_processes_building_the_same_key_build_once_and_agree(tmp_path: Path) -> None:
    workers = [start_worker(tmp_path, "both") for _ in range(2)]
    outputs = []
    for worker in workers:
        stdout, stderr = worker.communicate(timeout=120)
        assert worker.returncode == 0, stderr
        outputs.append(stdout.split())
    assert sorted(kind for kind, _ in outputs) == ["hit", "miss"]
    assert all(float(total) == expected_sum("both") for _, total in outputs)
    assert builds(tmp_path) == 1
    # A third process, and this one, are hits on what they wrote.
    loaded, hit = QuantizedWeightCache(tmp_path / "cache").load_or_build(KEY, CountingBuild())
    assert hit and float(loaded.tensors["w"].sum()) == expected_sum("both")


def test_checkpoint_identity_tracks_content_not_location(
    tmp_path: Path, tiny_gemma3_dir: Path
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_gemma3_dir, copy)
    assert checkpoint_identity(copy) == checkpoint_identity(tiny_gemma3_dir)
    weights = load_file(str(copy / "model.safetensors"))
    # Same names, shapes and dtypes (same header and size), other values.
    weights = {name: t + 1 if t.is_floating_point() else t for name, t in weights.items()}
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert checkpoint_identity(copy) != checkpoint_identity(tiny_gemma3_dir)


def test_checkpoint_identity_rejects_bad_directories(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        checkpoint_identity(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        checkpoint_identity(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        checkpoint_identity(tmp_path)
