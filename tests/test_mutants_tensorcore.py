"""tensorcore.py (the mma.sync printer): what mutation testing found unchecked
(benchmarks/mutation.md).

Each test holds the printed kernel to a behaviour, not to its text: a run of the tensor-core
path on PoCL (the OpenCL emulation of mma, ldmatrix and cp.async) against the float64
reference, or a property of the SASS that NVRTC and nvdisasm make of the CUDA kernel.
"""

from __future__ import annotations

import pytest

from napkin_dsl import isel

from .conftest import EXAMPLES
from .test_opencl import run_on_pocl


def test_an_epilogue_reads_a_shared_tile_and_the_index_of_an_axis_grouped_by_one(opencl_device):
    """A dense layer per head: the bias tile bias[h n] sits in shared memory with h grouped by 1
    (its element is the fragment's column along n and 0 along h), and the map reads the index
    h, which every lane of a block holds at the block's origin."""
    source = """kernel heads(X: bf16[h b k], W: bf16[h k n], bias: bf16[h n]) -> Y: bf16[h b n]:
    H[h b n] = X * W
    Y[h b n] = gelu(H + bias) + h

relabel heads on H100:
    smem: group h 1, b 64, n 64; stream k 32
"""
    run_on_pocl(source, "heads", ["mma.sync"], arch="sm_90", h=3, b=64, k=32, n=64)


@pytest.mark.parametrize("name, sizes, stages", [("attention.napkin", dict(b=1, h=1, q=128, x=192, d=64), 2),
                                                 ("matmul.napkin", dict(m=128, n=256, k=96), 2),
                                                 ("matmul.napkin", dict(m=128, n=128, k=128), 3)])
def test_a_stream_of_whole_chunks_the_stages_do_not_divide_stops_at_its_last_chunk(name, sizes, stages, opencl_device):
    """Whole chunks the stages do not divide (x = 3 x 64 and k = 3 x 32 at 2 stages, k = 4 x 32
    at 3): the loop unrolled by the stages runs a chunk too many unless its later bodies are
    guarded (2 stages) or the chunks after its whole groups are counted (3), and with no ragged
    tail no mask would hide that chunk's stale buffer."""
    source = (EXAMPLES / name).read_text()
    if stages == 2 and name == "matmul.napkin":  # 128 x 256 x 32 chunks: 1024 clocks, two stages (isel.stage_count)
        source = source.replace("group m 128, n 128; stream k 32", "group m 128, n 256; stream k 32")
    program, _ = run_on_pocl(source, name, ["mma.sync"], arch="sm_90", **sizes)
    plan = isel.selection(program, program.launches[0], "sm_90").plan
    assert plan.stages == stages
    chunks = -(-sizes[plan.stream] // isel.launch_tiles(program.launches[0])[0][plan.stream])
    assert chunks % plan.stages


@pytest.mark.parametrize("arch, path", [("sm_90a", "wgmma")])
@pytest.mark.parametrize("name, sizes", [("attention.napkin", dict(b=1, h=1, q=64, x=192, d=32)),
                                         ("matmul.napkin", dict(m=128, n=128, k=96))])
def test_a_ring_of_whole_chunks_the_stages_do_not_divide_stops_at_its_last_chunk(name, sizes, arch, path, opencl_device,
                                                                                 monkeypatch):
    """Three whole chunks (x = 3 x 64, k = 3 x 32) through a two-stage ring: the loops must stop at
    the last chunk, and with no ragged tail no mask would hide a chunk too many. On wgmma (sm_90a,
    the H100 profile's own arch): the roles' ring, its depth set to 2 (mma.sync's is the test above)."""
    monkeypatch.setattr(isel, "ring_stages", lambda *args: 2)
    program, _ = run_on_pocl((EXAMPLES / name).read_text(), name, [path], arch=arch, **sizes)
    assert isel.selection(program, program.launches[0], arch).plan.stages == 2
