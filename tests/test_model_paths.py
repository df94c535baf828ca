"""The model prices what is built: instruction paths, occupancy from the compiled kernel,
fixed costs, and the register level's capacity (issue: a model that predicts real kernels).

Compiles with NVRTC (no GPU). The occupancy limits below are recomputed from the CUDA
programming guide's rules for compute capability 9.0, not from napkin's own function.
"""

from __future__ import annotations

import pytest

import napkin_dsl as napkin
from napkin_dsl.cost import cost_of
from napkin_dsl.errors import NapkinError

from .test_cuda_codegen import SIZES, kernel_of

ATTENTION = """\
kernel attention(Q: f16[b h q d], K: f16[b h x d], V: f16[b h x d]) -> O: f16[b h q d]:
    S[b h q x] = Q[b h q d] * K[b h x d] * d^-0.5
    P[b h q x] = softmax[x](S)
    O[b h q d] = P[b h q x] * V[b h x d]

relabel attention on H100:
    smem: group b 1, h 1, q {rows}; stream x {chunk}
    registers: group q {warp_rows}
"""
SIZES_H100 = dict(b=1, h=16, q=8192, x=8192, d=128)

# CUDA C Programming Guide, compute capability 9.0: 65,536 registers, 2,048 threads, 32 blocks
# and 228 KB of shared memory per SM, 1 KB of it reserved per resident block; registers are
# allocated per warp in units of 256.
SM90 = {"registers": 65536, "threads": 2048, "blocks": 32, "shared": 228 * 1024, "reserved": 1024, "unit": 256}


def occupancy_limit(threads: int, registers: int, shared: int) -> int:
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // SM90["unit"]) * SM90["unit"]
    return min(SM90["registers"] // (per_warp * warps), SM90["threads"] // threads, SM90["blocks"],
               SM90["shared"] // (shared + SM90["reserved"]))


@pytest.mark.parametrize("name", sorted(SIZES))
def test_predicted_blocks_per_sm_are_the_limit_of_the_compiled_kernel(name):
    compiled = kernel_of(name).compile("sm_90", **SIZES[name][0])
    table = compiled.launch_table()
    expected = min(occupancy_limit(row["block"][0], row["registers"], row["shared_bytes"]) for row in table)
    assert compiled.cost.time["blocks_per_sm"] == expected, table


def test_a_kernel_on_the_fma_path_is_not_predicted_above_the_fma_peak():
    (kernel,) = napkin.load("""
kernel mm(A: f32[m k], B: f32[k n]) -> C: f32[m n]:
    C[m n] = A[m k] * B[k n]

relabel mm on H100:
    smem: group m 64, n 64; stream k 32
""").values()
    compiled = kernel.compile("sm_90", m=4096, n=4096, k=4096)
    assert [row["path"] for row in compiled.launch_table()] == ["fma"]
    report = compiled.cost
    assert set(report.flops) == {"fma"}
    achieved = float(report.total_flops) / report.time["overlapped_s"]
    assert achieved <= napkin.load_hardware("H100").peak("fma", "f32")


@pytest.mark.parametrize("name", sorted(SIZES))
def test_the_kernel_header_names_the_path_of_every_statement(name):
    compiled = kernel_of(name).compile("sm_90", **SIZES[name][0])
    header = compiled.source.split("*/", 1)[0]
    paths = header.split("instruction paths:", 1)[1]
    for launch in compiled.program.launches:
        for statement in launch.launch.statements:
            lines = [line for line in paths.splitlines() if line.lstrip(" *").startswith(f"{statement.target}:")]
            assert lines and any(word in lines[0] for word in ("mma.sync", "fma")), (statement.target, paths)


def test_fa3_tile_fits_h100_with_s_p_and_o_in_registers():
    """FlashAttention-3 at d = 128: 128 queries per block, keys in chunks of 176, two warpgroups
    of 64 rows (warps of 16), priced as wgmma; its fragments fit 255 registers per thread."""
    (kernel,) = napkin.load(ATTENTION.format(rows=128, chunk=176, warp_rows=16)).values()
    program = kernel.program("H100", **SIZES_H100)
    report = cost_of(program, path="wgmma")  # check=True: raises when any level is over capacity
    registers = report.levels["registers"]
    assert 0 < registers.M_bytes <= registers.capacity
    from napkin_dsl.cost import columns
    from napkin_dsl.isel import select_program

    held = {b.name for row in columns(program, select_program(program, path="wgmma")) for b in row["buffers"].get("registers", [])}
    assert {"S", "P", "O"} <= held
    assert not any("FMA path" in note for note in report.notes)


def test_wgmma_reads_k_and_v_once_per_warpgroup_where_mma_sync_reads_them_once_per_warp():
    (kernel,) = napkin.load(ATTENTION.format(rows=128, chunk=64, warp_rows=16)).values()
    program = kernel.program("H100", **SIZES_H100)
    sync = cost_of(program, path="mma.sync").levels["registers"].H
    group = cost_of(program, path="wgmma").levels["registers"].H
    b, h, q, x, d = (SIZES_H100[a] for a in "bhqxd")
    blocks_reading = b * h * (q // 128)
    # Each warp reads its rows of Q for every chunk of 64 keys; K and V are read once per warp
    # (8 of them) on mma.sync, once per warpgroup (2) on wgmma.
    q_reads = b * h * q * d * (x // 64)
    assert sync == q_reads + 8 * 2 * blocks_reading * x * d
    assert group == q_reads + 2 * 2 * blocks_reading * x * d


def test_a_tile_over_the_register_file_stays_on_the_fma_path_and_says_why():
    (kernel,) = napkin.load(ATTENTION.format(rows=256, chunk=128, warp_rows=64)).values()
    report = cost_of(kernel.program("H100", **SIZES_H100), path="wgmma", check=False)
    assert any("stays on the FMA path under wgmma" in note and "255 registers" in note for note in report.notes)


def test_a_path_the_architecture_lacks_is_a_clear_error():
    (kernel,) = napkin.load(ATTENTION.format(rows=128, chunk=64, warp_rows=16).replace("on H100", "on A100")).values()
    with pytest.raises(NapkinError, match="A100 has no 'wgmma'"):
        cost_of(kernel.program("A100", **SIZES_H100), path="wgmma")


def test_fixed_costs_are_part_of_the_time_and_shrink_in_relative_terms_with_the_work():
    (kernel,) = napkin.load(ATTENTION.format(rows=128, chunk=64, warp_rows=16)).values()
    short = cost_of(kernel.program("H100", **dict(SIZES_H100, q=512, x=512, h=512)))
    long = cost_of(kernel.program("H100", **SIZES_H100))
    for report in (short, long):
        fixed = sum(report.time["fixed_s"].values())
        assert report.time["fixed_s"]["launch"] == napkin.load_hardware("H100").launch_s
        assert report.time["overlapped_s"] == pytest.approx(
            max([report.time["compute_s"], *report.time["transfer_s"].values()]) + fixed)
    assert (sum(short.time["fixed_s"].values()) / short.time["overlapped_s"]
            > sum(long.time["fixed_s"].values()) / long.time["overlapped_s"])


def test_napkin_cost_prices_a_what_if_path(capsys):
    from napkin_dsl.cli import main

    from .conftest import EXAMPLES

    args = ["cost", str(EXAMPLES / "attention.napkin"), "--set", "b=1", "h=16", "q=8192", "x=8192", "d=128"]
    assert main(args) == 0
    built = capsys.readouterr().out
    assert main(args + ["--path", "wgmma"]) == 0
    what_if = capsys.readouterr().out
    assert "priced as if the contractions ran on wgmma" in what_if and "priced as if" not in built
    assert main(args + ["--path", "wgmma", "--hardware", "A100"]) == 2
    assert "A100 has no 'wgmma'" in capsys.readouterr().err


# ---- which GPU has which path is the profile's to say (issue 21, "Targets as data") ----------


def _h100_variant(tmp_path, name: str, *edits: tuple[str, str]):
    """The bundled H100 profile under another name, with text edits: a GPU that differs in data only."""
    from .conftest import ROOT

    text = (ROOT / "napkin_dsl" / "hardware" / "H100.toml").read_text().replace('name = "H100"', f'name = "{name}"')
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return str(path)


def _selection(hardware: str, arch: str, path: str | None = None):
    from napkin_dsl.isel import selection

    (kernel,) = napkin.load(ATTENTION.format(rows=128, chunk=64, warp_rows=16)).values()
    program = kernel.program(hardware, **SIZES_H100)
    return selection(program, program.launches[0], arch, path)


def test_an_arch_the_profile_gives_no_path_stays_on_the_fma_path_naming_the_paths_it_has(tmp_path):
    """An arch numerically above sm_90 gets neither mma.sync nor wgmma unless the profile lists it
    for that path: wgmma is sm_90a's (PTX ISA), priced as a what-if on sm_90 only."""
    hw = _h100_variant(tmp_path, "H100_plus", ('archs = ["sm_80", "sm_90", "sm_90a"]\ncounts', 'archs = ["sm_80", "sm_90", "sm_90a", "sm_100"]\ncounts'))
    assert _selection(hw, "sm_90").path == "mma.sync"
    assert _selection(hw, "sm_90", "wgmma").path == "wgmma"
    for path, instruction in ((None, "mma.sync m16n8k16"), ("wgmma", "wgmma")):
        chosen = _selection(hw, "sm_100", path)
        assert chosen.plan is None
        assert f"H100_plus has no {instruction} on sm_100" in chosen.reason
        assert "mma.sync m16n8k16 (bf16, f16) on sm_80, sm_90" in chosen.reason
        assert "wgmma m64nNk16 (bf16, f16) on sm_90a" in chosen.reason
    assert _selection(hw, "sm_80", "wgmma").plan is None  # sm_80 code on the same GPU has no wgmma


def test_selection_asks_the_profile_for_a_path_of_the_operands_dtype(tmp_path):
    """A GPU whose mma.sync takes bf16 only keeps f16 products on the FMA path, and prices them so."""
    hw = _h100_variant(tmp_path, "bf16_only", ('dtypes = ["bf16", "f16"]\narchs = ["sm_80", "sm_90"]',
                                                'dtypes = ["bf16"]\narchs = ["sm_80", "sm_90"]'))
    chosen = _selection(hw, "sm_90")
    assert chosen.plan is None and "bf16_only has no mma.sync m16n8k16 for f16 on sm_90" in chosen.reason
    (kernel,) = napkin.load(ATTENTION.format(rows=128, chunk=64, warp_rows=16)).values()
    assert "fma" in cost_of(kernel.program(hw, **SIZES_H100)).flops
    assert _selection("H100", "sm_90").path == "mma.sync"  # the bundled profile takes f16


def test_a_path_table_is_data_that_the_rates_are_read_from(tmp_path):
    """The what-if's products are priced at the wgmma path's rate: halve it in the file and the
    products' time doubles (the datasheet tensor row untouched)."""
    half = _h100_variant(tmp_path, "slow_wgmma", ("rates = { bf16 = 989e12, f16 = 989e12, f32 = 494e12 }",
                                                  "rates = { bf16 = 494.5e12, f16 = 494.5e12, f32 = 247e12 }"))
    (kernel,) = napkin.load(ATTENTION.format(rows=128, chunk=64, warp_rows=16)).values()
    fast, slow = (cost_of(kernel.program(hw, **SIZES_H100), path="wgmma") for hw in ("H100", half))
    b, h, q, x, d = SIZES_H100.values()
    products = 4 * b * h * q * x * d
    # 128-query blocks spread over the SMs: the busiest SM runs ceil(blocks / SMs) of them.
    blocks, sms = b * h * q // 128, napkin.load_hardware("H100").level("smem").units
    busy = blocks / (-(-blocks // sms) * sms)
    assert slow.time["compute_s"] - fast.time["compute_s"] == pytest.approx(
        (products / 494.5e12 - products / 989e12) / busy, rel=1e-9)


def test_cost_of_an_arch_the_profile_does_not_run_names_the_archs_it_runs():
    (kernel,) = napkin.load(ATTENTION.format(rows=128, chunk=64, warp_rows=16)).values()
    with pytest.raises(NapkinError, match="H100 cannot run sm_100: it runs sm_80, sm_90"):
        cost_of(kernel.program("H100", **SIZES_H100), arch="sm_100")


def test_napkin_cost_path_is_any_instruction_the_profile_lists(capsys):
    from napkin_dsl.cli import main

    from .conftest import EXAMPLES

    args = ["cost", str(EXAMPLES / "matmul.napkin"), "--set", "m=1024", "n=1024", "k=1024"]
    assert main(args + ["--path", "mma.sync"]) == 0
    assert main(args + ["--path", "tcgen05"]) == 2
    err = capsys.readouterr().err
    assert "H100 has no 'tcgen05' tensor-core path to price (its paths: mma.sync, wgmma)" in err
    assert "A100: mma.sync; H100: mma.sync, wgmma" in err  # the hint: each profile's paths


def test_the_defaults_are_a_profile_and_its_arch():
    from napkin_dsl.hardware import DEFAULT_ARCH, DEFAULT_GPU, DEFAULT_MODEL, load_hardware, profile_preference

    assert load_hardware(DEFAULT_GPU).arch == DEFAULT_ARCH
    assert load_hardware(DEFAULT_MODEL).symbolic
    assert profile_preference()[:2] == [DEFAULT_MODEL, DEFAULT_GPU]


def test_hopper_profiles_default_to_sm_90a_and_a100_to_sm_80():
    """The default target of H100 and H200 (and their nodes) is what napkin builds for them:
    sm_90a, wgmma where isel takes it; sm_90 (mma.sync) stays one they run. A100 stays sm_80."""
    from napkin_dsl.hardware import load_hardware

    for name in ("H100", "H200", "H100x8", "H200x8"):
        hardware = load_hardware(name)
        assert hardware.arch == "sm_90a" and {"sm_90", "sm_90a"} <= set(hardware.archs), name
    assert load_hardware("A100").arch == "sm_80" and load_hardware("A100").archs == ("sm_80",)


def test_a_gpu_compiles_its_profiles_arch_where_it_runs_it():
    """A driver reports sm_90 for an H100: the CUDA backend then compiles the profile's sm_90a (the
    code the model priced), and a GPU's own arch where the profile's is another GPU's."""
    from napkin_dsl.hardware import load_hardware

    assert load_hardware("H100").arch_for_device("sm_90") == "sm_90a"
    assert load_hardware("H200").arch_for_device("sm_90") == "sm_90a"
    assert load_hardware("H100").arch_for_device("sm_80") == "sm_80"  # an H100 program on an A100
    assert load_hardware("A100").arch_for_device("sm_80") == "sm_80"
    assert load_hardware("A100").arch_for_device("sm_90") == "sm_90"  # an A100 program on an H100: mma.sync


def test_code_names_no_gpu_and_no_arch_but_the_defaults():
    """Which GPU exists and which arch it runs is the profiles' to say: no string in napkin's code
    (docstrings, comments and example text in messages aside) is a profile name or an arch, but the
    defaults of hardware.py (NVRTC's compiler takes DEFAULT_ARCH too)."""
    import ast
    import re

    from napkin_dsl.hardware import hardware_names

    from .conftest import ROOT

    package = ROOT / "napkin_dsl"
    allowed = {("hardware.py", "H100"), ("hardware.py", "sm_90a"), ("hardware.py", "two_level")}
    found = set()
    for file in package.rglob("*.py"):
        tree = ast.parse(file.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and (node.value in hardware_names() or re.fullmatch(r"sm_\d+a?", node.value))):
                found.add((file.relative_to(package).as_posix(), node.value))
    assert found == allowed
