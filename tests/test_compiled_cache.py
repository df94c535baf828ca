"""The disk cache keyed before lowering (backends/compiled.py): a fresh process that compiles a
kernel it compiled before reads the cubin back without planning, lowering or cuda-python.

Compiling needs NVRTC (no GPU); without it these tests skip.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import compiled as compiled_cache

ROOT = Path(__file__).resolve().parent.parent
MATMUL = ROOT / "examples" / "matmul.napkin"
SIZES = {"m": 128, "n": 128, "k": 64}


def _nvrtc() -> bool:
    try:
        from napkin_dsl.backends.nvrtc import nvrtc_version

        nvrtc_version()
    except napkin.NapkinError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _nvrtc(), reason="NVRTC is not available")

FRESH = f"""
import json, sys
import napkin_dsl as napkin
compiled = napkin.load({str(MATMUL)!r})["matmul"].compile("sm_90", **{SIZES!r})
loaded = [m for m in ("cuda", "napkin_dsl.backends.cuda", "napkin_dsl.backends.lowering", "napkin_dsl.plan") if m in sys.modules]
print(json.dumps({{"loaded": loaded, "image": compiled.image.hex()[:64], "registers": compiled.launch_table()[0]["registers"]}}))
"""


def fresh_compile(cache: Path) -> dict:
    env = {"NAPKIN_CACHE_DIR": str(cache), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_fresh_process_hits_the_cache_without_lowering(tmp_path):
    first = fresh_compile(tmp_path)
    assert "napkin_dsl.backends.lowering" in first["loaded"]  # the miss compiled
    second = fresh_compile(tmp_path)
    assert second["loaded"] == []  # the hit planned, lowered and imported nothing of the kind
    assert second["image"] == first["image"] and second["registers"] == first["registers"]


def test_a_hit_builds_the_program_and_cost_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("NAPKIN_CACHE_DIR", str(tmp_path))
    made = napkin.load(MATMUL)["matmul"].compile("sm_90", **SIZES)
    hit = napkin.load(MATMUL)["matmul"].compile("sm_90", **SIZES)  # a new Kernel: no memory cache
    assert hit is not made and hit.image == made.image and hit.source == made.source
    assert hit.launches == made.launches
    assert hit.cost.to_dict() == made.cost.to_dict()
    assert len(hit.program.launches) == len(made.program.launches)


def test_the_key_holds_sizes_arch_and_relabelling(tmp_path, monkeypatch):
    monkeypatch.setenv("NAPKIN_CACHE_DIR", str(tmp_path))
    kernel = napkin.load(MATMUL)["matmul"]
    kernel.compile("sm_90", **SIZES)
    napkin.load(MATMUL)["matmul"].compile("sm_90", **{**SIZES, "k": 96})
    napkin.load(MATMUL)["matmul"].compile("sm_80", **SIZES)
    kernel.relabelled("smem: group m 64, n 64; stream k 32").compile("sm_90", **SIZES)
    assert len(list(compiled_cache.cache_dir().glob("*.json"))) == 4


def test_an_unreadable_entry_is_a_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("NAPKIN_CACHE_DIR", str(tmp_path))
    made = napkin.load(MATMUL)["matmul"].compile("sm_90", **SIZES)
    (entry,) = compiled_cache.cache_dir().glob("*.json")
    entry.write_text("{not json")
    again = napkin.load(MATMUL)["matmul"].compile("sm_90", **SIZES)
    assert again.image == made.image
    assert json.loads(entry.read_text())["name"] == "matmul"  # rewritten by the recompile


def test_cache_clear_removes_the_entries(tmp_path, monkeypatch):
    from napkin_dsl.cli import main

    monkeypatch.setenv("NAPKIN_CACHE_DIR", str(tmp_path))
    napkin.load(MATMUL)["matmul"].compile("sm_90", **SIZES)
    assert list(compiled_cache.cache_dir().glob("*.json"))
    assert main(["cache", "clear"]) == 0
    assert not list(compiled_cache.cache_dir().glob("*.json"))
