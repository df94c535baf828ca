"""The device level (issue 28): a node of GPUs (H100x8), what crosses NVLink, the ring condition,
and execution over real processes (torch.distributed on gloo, two and four ranks)."""

import pytest

import napkin_dsl as napkin
from napkin_dsl.hardware import load_hardware

ATTENTION = """
kernel attention(Q: bf16[b h q d], K: bf16[b h x d], V: bf16[b h x d]) -> O: bf16[b h q d]:
    S[b h q x] = Q * K * d^-0.5
    P[b h q x] = softmax[x](S)
    O[b h q d] = P * V

relabel attention on H100x8:
    gmem: {device}
    smem: group b 1, h 1, q 32; stream x 16
"""
SIZES = dict(b=1, h=4, q=48, x=100, d=16)


def test_profile_device_level():
    node = load_hardware("H100x8")
    assert node.device is not None and node.device.units == 8
    assert node.device.bandwidth == 18 * 25e9  # 18 NVLink 4 links x 25 GB/s each way
    assert node.level_names() == load_hardware("H100").level_names()  # each GPU's chain is one H100's
    assert load_hardware("H200x8").device.bandwidth == 450e9


def test_ring_condition_from_the_profile():
    """s F h_kv / (2 BW h) query tokens per GPU: computed here from the profile, not from the model."""
    node = load_hardware("H100x8")
    s, peak, bandwidth = 2, node.peak("tensor", "bf16"), node.device.bandwidth
    want = s * peak * 1 / (2 * bandwidth * 1)  # MHA: h_kv = h
    kernel = napkin.load(ATTENTION.format(device="split x 4096"))["attention"]
    report = kernel.cost("H100x8", b=1, h=32, q=4096, x=32768, d=128)
    assert report.ring["rows_needed"] == pytest.approx(want)
    assert 2150 < want < 2250
    assert "hidden under compute" in report.table() and "2,198 per GPU" in report.table()
    assert report.ring["held"] == 4096


def test_refused_device_clauses():
    from napkin_dsl.errors import NapkinError

    with pytest.raises(NapkinError, match="in sequence"):
        napkin.load(ATTENTION.format(device="stream x 16"))["attention"].cost("H100x8", **SIZES)
    with pytest.raises(NapkinError, match="top level"):
        napkin.load(ATTENTION.replace("H100x8", "H100").format(device="split x 64"))["attention"].cost("H100", **SIZES)


@pytest.mark.parametrize("ranks, device", [(2, "split x 64"), (2, "group h 2"), (4, "split x 32"), (4, "group h 1")])
def test_processes_match_the_reference_and_the_model(ranks, device):
    from napkin_dsl.backends import distributed

    kernel = napkin.load(ATTENTION.format(device=device))["attention"]
    result = distributed.launch(kernel, ranks, "H100x8", SIZES)
    assert result["partition"] == f"gmem: {device}" and result["parts"] == ranks
    assert result["max_rel_error"] <= result["tolerance"]
    # The bytes the processes sent one another (inputs out from rank 0; states or outputs back),
    # counted by hand here for the ranks 1.. that are not rank 0.
    q, x, h, d = SIZES["q"], SIZES["x"], SIZES["h"], SIZES["d"]
    others = ranks - 1
    size = int(device.split()[-1])
    if device.startswith("split"):
        # Q whole to each; K and V rows from rank 0's part on; O.acc, max and sum back in f32
        assert (ranks - 1) * size < x <= ranks * size  # every rank holds rows of x
        want = others * 2 * (h * q * d) + 2 * 2 * (h * (x - size) * d) + others * 4 * (h * q * d + 2 * h * q)
    else:  # each rank's heads: Q K V out, O back
        want = others * (2 * size * (q * d + 2 * x * d) + 2 * size * q * d)
    assert result["transfers"] == result["received"] == want == result["predicted_transfers"]
    assert result["counted"]["smem"] == result["predicted"]["smem"]
    assert result["counted"]["registers"] == result["predicted"]["registers"]


def test_kernel_distributed_inside_a_process_group(tmp_path):
    """kernel.distributed() in a process group of one (gloo): no device clause, so napkin takes
    its best partition for 1 GPU and says which; nothing crosses a link."""
    import torch.distributed as dist

    kernel = napkin.load(ATTENTION.replace("    gmem: {device}\n", ""))["attention"]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        result = kernel.distributed("H100x8", **SIZES)
    finally:
        dist.destroy_process_group()
    assert result["chosen"].startswith("the relabel block has no gmem clause: napkin takes gmem:")
    assert result["transfers"] == result["predicted_transfers"] == 0
    assert result["max_rel_error"] <= result["tolerance"]


def test_pseudocode_and_ring_under_a_group():
    kernel = napkin.load(ATTENTION.format(device="group h 2"))["attention"]
    assert "parallel for h in groups of 2 @node (8 GPUs, 450 GB/s each way)" in kernel.pseudocode(hardware="H100x8", **SIZES)
    ring = kernel.cost("H100x8", **SIZES).ring
    assert ring["axis"] == "x" and ring["rows_axes"] == ["q"]  # the keys pass; the queries stay
