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


@pytest.mark.parametrize("arch, path", [("sm_90", "mma.sync"), ("sm_90a", "wgmma")])
@pytest.mark.parametrize("name, sizes", [("attention.napkin", dict(b=1, h=1, q=64, x=192, d=32)),
                                         ("matmul.napkin", dict(m=128, n=128, k=96))])
def test_a_stream_of_whole_chunks_the_stages_do_not_divide_stops_at_its_last_chunk(name, sizes, arch, path, opencl_device):
    """Three whole chunks (x = 3 x 64, k = 3 x 32) through a two-stage pipeline: the loop unrolled
    by the stages runs one chunk too many unless its second body is guarded, and with no ragged
    tail no mask would hide that chunk's stale buffer. On mma.sync (sm_90) and on wgmma (sm_90a,
    the H100 profile's own arch, whose printer unrolls its ring by the stages too)."""
    program, _ = run_on_pocl((EXAMPLES / name).read_text(), name, [path], arch=arch, **sizes)
    assert isel.selection(program, program.launches[0], arch).plan.stages == 2
