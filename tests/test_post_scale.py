"""A contraction's factor over its output's axes alone (a per-head scale sV[b h], as in FA3's
fp8 attention, O = P * V * sV) is a post-scale: it leaves the product, whose operands stay two,
and multiplies the result in a step of its own (check.py, pseudocode._expand_contract_scales).
Here: its FLOPs in the model and the NumPy backend's count, the case where it must stay an
operand, a split that applies it in its combine launch, and every instruction path printing it
(wgmma, mma.sync, the FMA path) on PoCL against the reference. fp8 attention's own cases are in
tests/test_fp8.py and tests/test_fp8_tensorcore.py; its gradient in tests/test_grad.py."""

from __future__ import annotations

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl import isel
from napkin_dsl.backends import opencl
from napkin_dsl.backends.numpy import check_run
from napkin_dsl.diagram import reads
from napkin_dsl.pseudocode import walk
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES, assert_matches_reference
from .test_opencl import random_inputs


def test_a_post_scale_is_counted_by_the_model_and_the_numpy_backend_alike():
    """C = A B s / 2 with s[m]: per output one multiplication onto C and one inside the factor
    (s * 1/2 on an array), in the model's FLOPs and the NumPy backend's count, and the run within
    tolerance of the reference; the product's own FLOPs stay 2 per multiply-add."""
    text = "kernel scaled(A: f32[m k], B: f32[k n], s: f32[m]) -> C: f32[m n]:\n    C[m n] = A * B * s / 2\n"
    (kernel,) = napkin.load(text).values()
    sizes = dict(m=7, n=5, k=9)
    flops = kernel.diagram.statements[0].flops
    assert {unit: int(n.subs(sizes)) for unit, n in flops.items()} == {"tensor": 2 * 7 * 5 * 9, "fma": 2 * 7 * 5}
    result = check_run(kernel, sizes=sizes, seed=4)
    assert result["ok"] and not result["count_differences"], result


def test_a_factor_stays_an_operand_where_the_others_lack_an_axis_of_the_target():
    """C[i] = 2 X[j] Y[j] A[i] (the fuzzer's case): without A the product would have no i, so A
    stays an operand, and the run matches the reference with the model's counts."""
    text = "kernel k(A: f32[i], X: f32[j], Y: f32[j]) -> C: f32[i]:\n    C[i] = 2 * X * Y * A\n"
    (kernel,) = napkin.load(text).values()
    (statement,) = kernel.diagram.statements
    assert [r.array for r in statement.box.operands] == ["X", "Y", "A"] and not reads(statement.box.scale)
    result = check_run(kernel, sizes=dict(i=3, j=5), seed=1)
    assert result["ok"] and not result["count_differences"], result


def test_a_split_applies_the_post_scale_in_its_combine_launch(opencl_device):
    """Split-x decode with V per kv head: the parts save O's unscaled partial sums (they neither
    load nor read sV), the combine loads sV and scales the merged output; the NumPy backend counts
    what the model prices, and PoCL matches the reference for the parts on tensor cores."""
    text = ((EXAMPLES / "decode.napkin").read_text().replace("V: bf16[b kv x d])", "V: bf16[b kv x d], sV: f32[b kv])")
            .replace("O[b kv r d] = P * V", "O[b kv r d] = P * V * sV"))
    (kernel,) = napkin.load(text).values()
    sizes = dict(b=1, kv=2, r=16, x=3000, d=64)
    program = kernel.gpu_program(None, **sizes)
    parts, combine = program.launches
    assert combine.combine == "x"
    assert not any(step.array == "sV" or ("smem", "sV") in step.reads for step, _ in walk(parts.body))
    texts = [step.text for step, _ in walk(combine.body)]
    assert texts.index("load sV[b kv] l2 -> smem") < texts.index("O = O.acc / P.sum") < texts.index("O *= sV[b kv]")
    assert isel.select_program(program, "sm_90").paths[0] == "mma.sync"
    result = check_run(kernel, sizes=sizes, seed=6)
    assert result["ok"] and not result["count_differences"], result
    inputs, scalars = random_inputs(kernel.diagram, sizes, 0)
    outputs = opencl.run(program, inputs, scalars, arch="sm_90")
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), "decode")


ATTENTION = (EXAMPLES / "attention.napkin").read_text()
SCALED_ATTENTION = (ATTENTION.replace("V: bf16[b h x d])", "V: bf16[b h x d], sV: f32[b h])")
                    .replace("O[b h q d] = P[b h q x] * V[b h x d]", "O[b h q d] = P[b h q x] * V[b h x d] * sV[b h]"))


@pytest.mark.parametrize("arch, path", [("sm_90a", "wgmma"), ("sm_90", "mma.sync"), ("sm_80", "mma.sync")])
def test_every_tensor_core_path_prints_the_post_scale_on_pocl(arch, path, opencl_device):
    """bf16 attention with O = P * V * sV: each path scales O's accumulator fragments after the
    online softmax's division; per-head scales of 4 and 1/4 make a missing or misplaced one show."""
    assert "sV: f32[b h]" in SCALED_ATTENTION and "* sV[b h]" in SCALED_ATTENTION
    (kernel,) = napkin.load(SCALED_ATTENTION).values()
    sizes = dict(b=1, h=2, q=128, x=150, d=64)
    program = kernel.gpu_program(None, **sizes)
    assert isel.select_program(program, arch).paths == (path,)
    inputs, scalars = random_inputs(kernel.diagram, sizes, 0)
    inputs["sV"] = np.array([[4.0, 0.25]], np.float32)
    outputs = opencl.run(program, inputs, scalars, arch=arch)
    assert_matches_reference(program, outputs, evaluate(kernel.diagram, inputs, scalars, sizes), arch)
