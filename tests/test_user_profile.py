"""A GPU napkin does not ship is a file (issue 21, "Targets as data"): a user's .toml for an
L40S-like GPU (sm_89) prices attention and matmul from its own rates and compiles them through
NVRTC for sm_89, with no code change.

The profile is written here, in the test. Its figures are illustrative, after NVIDIA's L40S
datasheet (142 SMs, 864 GB/s GDDR6, 362 TFLOP/s dense bf16, 733 TFLOP/s dense fp8, 91.6 TFLOP/s
f32) and the CUDA C Programming Guide's compute capability 8.9 table (99 KB shared memory per
block, 1536 threads and 24 blocks per SM); nothing below depends on their exact values: every
expected time is computed from the numbers the profile was written with.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import napkin_dsl as napkin
from napkin_dsl.errors import NapkinError
from napkin_dsl.hardware import load_hardware

from .conftest import EXAMPLES

L40S = dict(
    sms=142, clock_hz=2.52e9, hbm=864e9, l2_bw=5.0e12, smem_bw=23.3e12,
    tensor_bf16=362e12, mma_bf16=362e12, mma_fp8=733e12, fma_f32=91.6e12, special=2.9e12,
)


def profile_text(name: str = "L40S_like", **over) -> str:
    v = {**L40S, **over}
    return f"""\
# An L40S-like GPU (Ada, sm_89), written by a user: illustrative figures after NVIDIA's L40S datasheet.
name = "{name}"
description = "an L40S-like GPU (sm_89)"
arch = "sm_89"
archs = ["sm_80", "sm_89"]
counts = "bytes"
clock_hz = {v['clock_hz']}

[[level]]
name = "gmem"
per = "device"
capacity = 51_539_607_552

[[level]]
name = "l2"
per = "device"
capacity = 100_663_296
bandwidth = {v['hbm']}

[[level]]
name = "smem"
per = "block"
units = {v['sms']}
capacity = 101_376
bandwidth = {v['l2_bw']}
reserved_per_block = 1024
compute = true

[[level]]
name = "registers"
per = "thread"
capacity = 1020
bandwidth = {v['smem_bw']}
threads_per_unit = 1536
registers_per_unit = 65536
blocks_per_unit = 24

[peak_flops]
tensor = {{ bf16 = {v['tensor_bf16']}, f16 = {v['tensor_bf16']}, fp8e4m3 = {v['mma_fp8']}, fp8e5m2 = {v['mma_fp8']}, f32 = {v['tensor_bf16'] / 2} }}
fma = {{ f32 = {v['fma_f32']}, bf16 = {v['fma_f32']}, f16 = {v['fma_f32']} }}
special = {v['special']}

[path.mma_sync]
instruction = "mma.sync"
shape = "m16n8k16"
dtypes = ["bf16", "f16"]
archs = ["sm_80", "sm_89"]
rates = {{ bf16 = {v['mma_bf16']}, f16 = {v['mma_bf16']}, f32 = {v['mma_bf16'] / 2} }}

[path.mma_sync_fp8]
instruction = "mma.sync"
shape = "m16n8k32"
dtypes = ["fp8e4m3", "fp8e5m2"]
archs = ["sm_89"]
rates = {{ fp8e4m3 = {v['mma_fp8']}, fp8e5m2 = {v['mma_fp8']} }}
"""


@pytest.fixture
def l40s(tmp_path) -> Path:
    path = tmp_path / "L40S_like.toml"
    path.write_text(profile_text())
    return path


def kernel(name: str):
    (found,) = napkin.load(EXAMPLES / name).values()
    return found


def test_a_user_profile_loads_by_path_with_its_paths_as_data(l40s):
    hw = load_hardware(l40s)  # a Path, as well as its str
    assert hw is load_hardware(str(l40s))
    assert (hw.arch, hw.archs) == ("sm_89", ("sm_80", "sm_89"))
    fp8 = hw.find_path("mma.sync", "fp8e4m3", "sm_89")
    assert (fp8.shape, fp8.dtypes) == ("m16n8k32", ("fp8e4m3", "fp8e5m2"))
    assert hw.find_path("mma.sync", "fp8e4m3", "sm_80") is None  # the 8-bit shape is sm_89's
    assert hw.find_path("mma.sync", "bf16", "sm_80", "m16n8k16").name == "mma_sync"
    assert hw.find_path("wgmma", "bf16", "sm_89") is None
    assert hw.peak("mma.sync", "bf16") == L40S["mma_bf16"] and hw.peak("mma.sync", "fp8e5m2") == L40S["mma_fp8"]
    assert hw.tensor_paths() == ["mma.sync"]


MATMUL_SIZES = dict(m=128 * L40S["sms"], n=128, k=1024)  # one 128 x 128 block per SM: one full wave
ATTENTION_SIZES = dict(b=1, h=L40S["sms"], q=128, x=1024, d=64)  # one 128-query block per SM


def test_matmul_is_priced_at_the_user_profiles_mma_sync_rate(l40s):
    report = kernel("matmul.napkin").cost(l40s, **MATMUL_SIZES)
    m, n, k = MATMUL_SIZES.values()
    assert report.hardware == "L40S_like"
    assert report.levels["smem"].N == L40S["sms"]  # the full wave the sizes were chosen for
    # A matmul is its products only: 2 m n k FLOPs, on mma.sync at the profile's bf16 rate.
    assert report.time["compute_s"] == pytest.approx(2 * m * n * k / L40S["mma_bf16"], rel=1e-12)


def test_attention_is_priced_at_the_user_profiles_rates(l40s):
    report = kernel("attention.napkin").cost(l40s, **ATTENTION_SIZES)
    b, h, q, x, d = ATTENTION_SIZES.values()
    products = 4 * b * h * q * x * d  # S = Q K^T and O = P V
    assert report.flops["tensor"] == products
    assert report.levels["smem"].N == L40S["sms"]
    # Each unit's FLOPs at the rate the profile gives it: products on mma.sync, the softmax's
    # arithmetic in f32 FMA, its exponentials on the special-function units.
    want = (products / L40S["mma_bf16"] + int(report.flops["fma"]) / L40S["fma_f32"]
            + int(report.flops["special"]) / L40S["special"])
    assert report.time["compute_s"] == pytest.approx(want, rel=1e-12)


def test_the_products_move_with_the_path_rate_not_the_datasheet_tensor_peak(tmp_path):
    """Halving the mma.sync path's rate (the datasheet's tensor row unchanged) doubles the
    products' time: the model prices the path the launch selected, read off the profile."""
    times = []
    for factor in (1.0, 0.5):
        path = tmp_path / f"half{factor}.toml"
        path.write_text(profile_text(f"half{factor}", mma_bf16=L40S["mma_bf16"] * factor))
        times.append(kernel("matmul.napkin").cost(path, **MATMUL_SIZES).time["compute_s"])
    assert times[1] == pytest.approx(2 * times[0], rel=1e-12)


@pytest.mark.parametrize("name, sizes", [("matmul.napkin", dict(m=1024, n=1024, k=1024)),
                                         ("attention.napkin", dict(b=2, h=4, q=1024, x=1024, d=64))])
def test_attention_and_matmul_compile_for_sm_89_on_the_user_profile(l40s, name, sizes):
    from napkin_dsl.backends import nvrtc

    if 89 not in nvrtc.supported_archs():
        pytest.skip("this NVRTC does not compile for sm_89")
    compiled = kernel(name).compile(arch="sm_89", hardware=l40s, **sizes)
    assert compiled.image[:4] == b"\x7fELF"
    assert compiled.program.hardware.name == "L40S_like"
    table = compiled.launch_table()
    assert table and all(row["spill_bytes"] == 0 for row in table), table
    assert all(row["path"] == "mma.sync" for row in table), table  # the profile's mma.sync path, on sm_89
    # Shared memory within the user's 99 KB per block, not H100's 227 KB.
    assert max(row["shared_bytes"] for row in table) <= load_hardware(l40s).level("smem").capacity


def test_the_user_profile_refuses_an_arch_it_does_not_list(l40s):
    with pytest.raises(NapkinError, match="L40S_like cannot run sm_90: it runs sm_80, sm_89"):
        kernel("matmul.napkin").compile(arch="sm_90", hardware=l40s, m=64, n=64, k=64)
    with pytest.raises(NapkinError, match="L40S_like has no 'wgmma' tensor-core path to price"):
        kernel("matmul.napkin").cost(l40s, path="wgmma", **MATMUL_SIZES)


def test_a_path_on_an_arch_the_profile_does_not_run_is_malformed(tmp_path):
    path = tmp_path / "odd.toml"
    path.write_text(profile_text("odd").replace('archs = ["sm_89"]\nrates = { fp8', 'archs = ["sm_100"]\nrates = { fp8'))
    with pytest.raises(NapkinError, match=r"path.mma_sync_fp8's archs \(sm_100\) must be some the profile runs"):
        load_hardware(path)
    path.write_text(profile_text("odd2").replace('dtypes = ["bf16", "f16"]', 'dtypes = ["bf16", "f16", "tf32"]'))
    with pytest.raises(NapkinError, match="path.mma_sync has no rate for tf32"):
        load_hardware(path)


def test_a_user_profile_moves_bytes_at_its_own_bandwidths(l40s):
    report = kernel("attention.napkin").cost(l40s, **ATTENTION_SIZES)
    for level, bandwidth in (("l2", L40S["hbm"]), ("smem", L40S["l2_bw"])):
        assert report.time["transfer_s"][level] == pytest.approx(int(report.levels[level].H_bytes) / bandwidth, rel=1e-12)
    assert math.isfinite(report.time["overlapped_s"]) and report.time["overlapped_s"] >= report.time["compute_s"]
