"""The command line's arguments: where FILE may go, and what is refused rather than ignored.

A new user writes ``napkin cost --set q=512 ... FILE`` (the order the usage line shows), binds a
name the kernel does not have, binds one twice, asks for ``--top 0`` or for an architecture the
GPU cannot run. Each is either done or refused with exit 2 and a message naming what is valid;
none is silently accepted. The tuner's "multiples" line says what its search keeps.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

import napkin_dsl as napkin
from napkin_dsl.cli import build_parser, main, parse_args
from napkin_dsl.errors import NapkinError
from napkin_dsl.hardware import gpu_for_arch, hardware_names, load_hardware

from .conftest import EXAMPLES, ROOT

ATTENTION = str(EXAMPLES / "attention.napkin")
MATMUL = str(EXAMPLES / "matmul.napkin")
SIZES = ["b=1", "h=2", "q=512", "x=512", "d=64"]
# Every command with both a FILE and --set, and one option of its own that must survive the move.
WITH_SET = {"pseudo": ["--format", "markdown"], "cost": ["--json"], "tune": ["--top", "2"], "report": [],
            "run": ["--seed", "3"], "cuda": ["--ptx"], "draw": ["--costs"], "compare": ["--json"]}


def napkin_cli(*argv: str) -> tuple[int, str, str]:
    """Run one command in-process: its exit code (argparse's SystemExit included), stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


# ---- FILE before or after --set -----------------------------------------------------------------


@pytest.mark.parametrize("command", sorted(WITH_SET))
def test_file_may_follow_set_for_every_command(command):
    """``--set`` takes several values, so it used to take FILE as one more: "the following
    arguments are required: FILE". Both orders now parse to the same arguments."""
    options = WITH_SET[command]
    after = parse_args([command, ATTENTION, *options, "--set", *SIZES])
    before = parse_args([command, *options, "--set", *SIZES, ATTENTION])
    assert vars(before) == vars(after)
    assert (before.files if command == "compare" else before.file) in (ATTENTION, [ATTENTION])
    assert before.set == [SIZES]


def test_cost_with_the_file_last_runs():
    code, out, err = napkin_cli("cost", "--set", *SIZES, ATTENTION)
    assert code == 0, err
    assert out.startswith("cost of attention on H100 with b=1 h=2 q=512 x=512 d=64")


def test_compare_takes_several_files_after_set():
    code, out, err = napkin_cli("compare", "--set", "m=256", "n=256", "k=256", MATMUL, MATMUL, "--json")
    assert code == 0, err
    assert len(json.loads(out)["columns"]) == 2


def test_several_bindings_and_repeated_set_keep_working():
    args = parse_args(["cost", ATTENTION, "--set", "q=4", "x=4", "--set", "d=8"])
    assert args.file == ATTENTION and args.set == [["q=4", "x=4"], ["d=8"]]
    # A value that is no NAME=INT and names no file stays with --set, which says what it expects.
    code, _, err = napkin_cli("cost", "--set", "q", "4", ATTENTION)
    assert code == 2
    assert "--set expects NAME=INT, got 'q'" in err


def test_usage_line_shows_file_after_the_options_and_help_says_either_order():
    text = build_parser()._subparsers._group_actions[0].choices["cost"].format_help()
    usage = " ".join(text.split("\n\n")[0].split())
    assert usage.index("[--set NAME=INT [NAME=INT ...]]") < usage.index("FILE")  # the order that now works
    assert "before or after FILE" in " ".join(text.split())


# ---- --set names a size symbol of the kernel, once ----------------------------------------------


def test_set_of_a_name_the_kernel_does_not_have_is_refused_naming_its_symbols():
    code, out, err = napkin_cli("cost", ATTENTION, "--set", *SIZES, "zz=5")
    assert code == 2, out
    assert "zz is no size symbol of attention (its symbols: b h q d x)" in err
    assert "with zz=5" not in out
    assert "Traceback" not in err


def test_set_suggests_a_close_symbol():
    code, _, err = napkin_cli("cost", ATTENTION, "--set", "qq=5")
    assert code == 2
    assert "did you mean q?" in err


@pytest.mark.parametrize("command", ["pseudo", "tune", "run", "draw", "report", "compare"])
def test_unknown_symbols_are_refused_by_every_command(command):
    extra = ["--costs"] if command == "draw" else []
    code, _, err = napkin_cli(command, ATTENTION, *extra, "--set", "zz=5")
    assert code == 2
    assert "zz is no size symbol of attention" in err


def test_symbolic_partition_sizes_and_profile_symbols_may_be_bound():
    """fig11 partitions a by g_a on two_level, whose capacity is M and bandwidth B_l1."""
    code, out, err = napkin_cli("cost", EXAMPLES / "paper" / "fig11.napkin", "--set", "g_a=4", "M=1000", "B_l1=2")
    assert code == 0, err
    assert "with g_a=4 M=1000 B_l1=2" in out


def test_a_symbol_of_any_kernel_of_the_file_may_be_bound(tmp_path):
    """One --set serves every kernel of a file: a name one of them has is not an error."""
    path = tmp_path / "two.napkin"
    path.write_text("kernel a(X: f32[n]) -> Y: f32[n]:\n    Y[n] = X * 2\n\n"
                    "kernel b(X: f32[m]) -> Y: f32[m]:\n    Y[m] = X * 3\n")
    code, out, err = napkin_cli("cost", path, "--set", "n=8", "m=4")
    assert code == 0, err
    code, _, err = napkin_cli("cost", path, "--set", "k=8")
    assert code == 2
    # Without a relabel block they plan on two_level, whose capacity M and bandwidth B_l1 are symbols.
    assert "k is no size symbol of a or b (its symbols: n m B_l1 M)" in err


@pytest.mark.parametrize("sets", [["--set", "q=5", "q=6"], ["--set", "q=5", "--set", "q=6"]], ids=["one", "two"])
def test_a_name_bound_twice_is_refused(sets):
    code, out, err = napkin_cli("cost", ATTENTION, *sets)
    assert code == 2, out
    assert "--set binds q twice: q=5 and q=6" in err


# ---- --top is a positive count ----------------------------------------------------------------


@pytest.mark.parametrize("top", ["0", "-3", "two"])
def test_top_must_be_a_positive_count(top):
    code, out, err = napkin_cli("tune", ATTENTION, "--set", *SIZES, "--top", top)
    assert code == 2, out
    assert out == ""
    assert "argument --top:" in err and "positive count" in err


# ---- --arch is one the profile runs -------------------------------------------------------------


def test_each_gpu_profile_lists_the_architectures_it_runs_and_its_default_is_one():
    archs = {name: load_hardware(name).archs for name in hardware_names()}
    hopper = ("sm_80", "sm_90", "sm_90a")
    assert archs == {"A100": ("sm_80",), "H100": hopper, "H200": hopper, "H100x8": hopper, "H200x8": hopper,
                     "L40S": ("sm_80", "sm_89"), "three_level": (), "two_level": ()}
    for name in ("A100", "H100", "H200", "L40S"):
        assert load_hardware(name).arch in archs[name]
    assert (gpu_for_arch("sm_80"), gpu_for_arch("sm_89"), gpu_for_arch("sm_90")) == ("A100", "L40S", "H100")
    with pytest.raises(NapkinError, match="no hardware profile runs 'sm_100'"):
        gpu_for_arch("sm_100")


def test_a_profile_whose_default_arch_it_does_not_run_is_malformed(tmp_path):
    text = (ROOT / "napkin_dsl" / "hardware" / "A100.toml").read_text().replace('name = "A100"', 'name = "odd"')
    path = tmp_path / "odd.toml"
    path.write_text(text.replace('archs = ["sm_80"]', 'archs = ["sm_90"]'))
    with pytest.raises(NapkinError, match="arch 'sm_80' is not among its archs"):
        load_hardware(str(path))


def test_cuda_refuses_an_arch_the_hardware_cannot_run_naming_its_archs():
    code, out, err = napkin_cli("cuda", ATTENTION, "--arch", "sm_100", "--hardware", "H100", "--set", *SIZES)
    assert code == 2, out[:500]
    assert out == ""
    assert "H100 cannot run sm_100: it runs sm_80, sm_90" in err


def test_cuda_help_lists_the_archs_of_each_profile():
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["cuda"].format_help().split())
    assert "A100: sm_80; H100: sm_80, sm_90, sm_90a;" in text and "H200: sm_80, sm_90, sm_90a" in text
    assert "sm_80 or sm_90" not in text


def test_compile_refuses_an_arch_its_profile_cannot_run():
    """Kernel.compile looks the GPU of an arch up in the profiles; none is hard-coded."""
    kernel = napkin.load(MATMUL)["matmul"]  # relabelled on H100
    with pytest.raises(NapkinError, match="H100 cannot run sm_100: it runs sm_80, sm_90"):
        kernel.compile("sm_100", m=64, n=64, k=64)
    with pytest.raises(NapkinError, match="A100 cannot run sm_90: it runs sm_80"):
        kernel.compile("sm_90", hardware="A100", m=64, n=64, k=64)
    with pytest.raises(NapkinError, match="two_level is no GPU"):
        kernel.compile(hardware="two_level", m=64, n=64, k=64)
    plain = napkin.load("kernel scale(X: f32[n]) -> Y: f32[n]:\n    Y[n] = X * 2\n")["scale"]  # no relabel block
    with pytest.raises(NapkinError, match="no hardware profile runs 'sm_100'"):
        plain.compile("sm_100", n=64)


def test_cuda_on_a100_compiles_for_a100s_own_arch():
    """Without --arch the profile's own architecture: A100's sm_80, not H100's sm_90."""
    code, out, err = napkin_cli("cuda", MATMUL, "--hardware", "A100", "--set", "m=64", "n=64", "k=64", "--resources")
    assert code == 0, err
    assert out.startswith("compiled matmul for sm_80")


# ---- napkin tune: the multiples it prints are those its search keeps ------------------------------


def _multiples(table: str) -> dict[str, set[int]]:
    line = next(line for line in table.splitlines() if line.strip().startswith("multiples"))
    found = re.findall(r"(\w+) of ((?:\d+(?:, | or ))*\d+)", line.split(":", 1)[1])
    return {axis: {int(m) for m in re.findall(r"\d+", ms)} for axis, ms in found}


def _tiles(line: str) -> dict[str, int]:
    return {axis: int(size) for axis, size in re.findall(r"\b([a-z]\w*) (\d+)\b", line.split("predicted")[0])}


@pytest.mark.parametrize("path, sizes", [(ATTENTION, dict(b=1, h=2, q=512, x=512, d=64)),
                                         (MATMUL, dict(m=512, n=512, k=512))], ids=["attention", "matmul"])
def test_every_tile_tune_shows_keeps_a_multiple_it_prints(path, sizes):
    """The old line said "x of 64" (the last launch scored) above "stream x 16"; matmul's said
    "k of 64" above the written "stream k 32" without saying it was the file's own."""
    (kernel,) = napkin.load(path).values()
    table = kernel.tune("H100", top=5, **sizes).table()
    multiples = _multiples(table)
    assert multiples
    listed = [line for line in table.splitlines() if re.match(r"\s+\d+\. ", line)]
    assert listed
    for line in listed:
        for axis, size in _tiles(line).items():
            keeps = size == sizes[axis] or any(size % m == 0 for m in multiples.get(axis, {1}))
            assert keeps or line.endswith("(as written)"), f"{axis} {size} keeps none of {multiples.get(axis)}:\n{table}"


def test_tune_json_lists_the_multiples_of_each_axis():
    code, out, err = napkin_cli("tune", ATTENTION, "--set", *SIZES, "--top", "1", "--json")
    assert code == 0, err
    multiples = json.loads(out)["kernels"]["attention"]["multiples"]
    assert multiples["x"] == [8, 16, 64]  # a score's N fragment, the fused launch's K, a loaded P's coalescing
    assert multiples["d"] == [64]


# ---- the README -----------------------------------------------------------------------------------


def test_readme_says_how_to_set_up_a_bare_image_and_read_the_docs():
    text = (ROOT / "README.md").read_text()
    install = next(line for line in text.splitlines() if "apt-get install -y" in line)
    assert install.startswith("apt-get update && apt-get install")  # a bare image has no package lists
    assert "mkdocs serve" in text and "mkdocs build" in text
    # The commands it names are the CLI's.
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    named = set(re.findall(r"`(\w+)`", text.split("lists the commands:", 1)[1].split(".", 1)[0]))
    assert named == commands
