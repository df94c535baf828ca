"""The FMA lowering's unstreamed softmax and its results that wait in registers.

* The softmax evaluates its operand once per element, as the cost model and the NumPy backend
  count it: the first pass keeps each value (in the target, or in the per-thread ``stage``
  where the result is staged), and the sum and the normalisation read it back. The operands
  below carry a literal found nowhere else in the kernel, so its number of occurrences is the
  number of evaluations printed.
* Every step whose result takes bytes an input still being read occupies (a map, a reduction,
  a blocked and a scalar contraction, the unstreamed and the online softmax) prints one shape:
  one ``stage`` array, one barrier, one write-out.
* The kernels run on PoCL against the float64 reference: in place, staged (an operand in
  another axis order, or an f16 one narrower than the f32 result), f64, an f32 result of a
  double step, rows longer than the stage's counted loops (a running index rewound each pass),
  and masks that leave whole rows empty (0, not NaN).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import opencl
from napkin_dsl.backends.lowering import CudaDialect, OpenCLDialect
from napkin_dsl.backends.translate import lower
from napkin_dsl.cost import cost_of
from napkin_dsl.reference import evaluate

from .conftest import EXAMPLES, assert_matches_reference
from .test_opencl import random_inputs


def printed(program, dialect) -> str:
    """The translation unit of ``program`` in ``dialect``, its report at its head."""
    return lower(program, dialect, cost_of(program)).source


def kernel_of(signature: str, body: str, relabel: str):
    text = f"kernel k{signature}:\n" + "".join(f"    {line}\n" for line in body.split("\n"))
    (kernel,) = napkin.load(text + f"\nrelabel k on H100:\n    {relabel}\n").values()
    return kernel


def kernels_only(source: str) -> str:
    """The printed kernels, without the header comment (which repeats the diagram's text)."""
    return source.split("*/", 1)[1]


def steps(source: str) -> dict[str, str]:
    """Each step's printed block, by its comment line (`// TEXT`), up to its closing brace."""
    blocks, lines = {}, source.split("\n")
    for i, line in enumerate(lines):
        if line.strip().startswith("// ") and i + 1 < len(lines) and lines[i + 1].strip() == "{":
            indent = lines[i + 1][: len(lines[i + 1]) - len(lines[i + 1].lstrip())]
            end = lines.index(indent + "}", i + 1)
            blocks[line.strip()[3:]] = "\n".join(lines[i + 2:end])
    return blocks


# ---- the operand once per element -----------------------------------------------------------

# softmax operands with arithmetic, each carrying the literal 3.25 once
ARITHMETIC = {
    "in place": ("(S: f32[q x]) -> P: f32[q x]", "P[q x] = softmax[x](exp(S) * 3.25 + S)", dict(q=37, x=100)),
    "staged": ("(S: f32[x q]) -> P: f32[q x]", "P[q x] = softmax[x](exp(S) * 3.25 + S)", dict(q=37, x=50)),
    "f16 operand, staged": ("(S: f16[q x]) -> P: f16[q x]", "P[q x] = softmax[x](S * 3.25 + 1)", dict(q=37, x=100)),
    "f64": ("(S: f64[q x]) -> P: f64[q x]", "P[q x] = softmax[x](exp(S) * 3.25 + S)", dict(q=37, x=100)),
    "f32 result of a double step": ("(S: f64[q x]) -> P: f32[q x]", "P[q x] = softmax[x](S * 3.25 + 1)", dict(q=37, x=100)),
    "masked": ("(S: f32[q x]) -> P: f32[q x]", "P[q x] = softmax[x](where(x < q, S * 3.25, -inf))", dict(q=37, x=50)),
    # more of a row than the stage's loops count, on either dialect: a running index, rewound
    "long rows": ("(S: f32[x q]) -> P: f32[q x]", "P[q x] = softmax[x](exp(S) * 3.25 + S)", dict(q=9, x=3000)),
}


@pytest.mark.parametrize("dialect", [CudaDialect(), OpenCLDialect()], ids=lambda d: d.name)
@pytest.mark.parametrize("case", sorted(ARITHMETIC))
def test_the_unstreamed_softmax_prints_its_operand_once(case, dialect):
    signature, statement, sizes = ARITHMETIC[case]
    kernel = kernel_of(signature, statement, "smem: group q 16")
    source = kernels_only(printed(kernel.gpu_program(None, **sizes), dialect))
    assert "3.25" in statement and len(re.findall(r"3\.25", source)) == 1, source


def test_every_arithmetic_operand_compiles_for_the_gpu_without_spills():
    for signature, statement, sizes in ARITHMETIC.values():
        compiled = kernel_of(signature, statement, "smem: group q 16").compile("sm_90", **sizes)
        assert [row["spill_bytes"] for row in compiled.launch_table()] == [0] * len(compiled.launch_table()), statement


# ---- one shape for every staged result ------------------------------------------------------

# Each of these stages the result of the named step: its target takes bytes of an input that
# other threads may still read (an operand in another axis order, a released operand).
STAGED = {
    "map": ("(S: f32[x q]) -> P: f32[q x]", "T[q x] = S * 2\nP[q x] = T + 1", "smem: group q 16",
            dict(q=37, x=50), "T[q x] = (S[x q] * 2)"),
    "reduction": ("(S: f32[q x]) -> L: f32[x]", "T[q x] = S * 2\nL[x] = max[q](T)", "smem: group x 16",
                  dict(q=37, x=50), "L[x] = max[q](T[q x])"),
    "blocked contraction": ("(A: f32[m k], B: f32[k n]) -> D: f32[m n]", "C[m n] = A * B\nD[m n] = C + 1",
                            "smem: group m 32, n 32", dict(m=70, n=50, k=64), "C[m n] = A[m k] * B[k n]"),
    "scalar contraction": ("(A: f32[m k], B: f32[k]) -> D: f32[m]", "A2[m k] = A * 2\nC[m] = A2 * B\nD[m] = C + 1",
                           "smem: group m 32", dict(m=70, k=32), "C[m] = A2[m k] * B[k]"),
    "softmax": ("(S: f32[x q]) -> P: f32[q x]", "P[q x] = softmax[x](S * 2)", "smem: group q 16",
                dict(q=37, x=50), "P[q x] = softmax[x]((S[x q] * 2))"),
    "long softmax": ("(S: f32[x q]) -> P: f32[q x]", "P[q x] = softmax[x](exp(S) * 2 + S)", "smem: group q 4",
                     dict(q=9, x=300), "P[q x] = softmax[x](((exp(S[x q]) * 2) + S[x q]))"),
    "online softmax": ("(S: f32[x q], V: f32[x d]) -> O: f32[q d]", "P[q x] = softmax[x](S)\nO[q d] = P * V",
                       "smem: group q 16; stream x 16", dict(q=37, x=50, d=8),
                       "P[q x] = exp(S[x q] - P.max); P.sum = P.sum * P.scale + sum[x](P)"),
}


@pytest.mark.parametrize("dialect", [CudaDialect(), OpenCLDialect()], ids=lambda d: d.name)
@pytest.mark.parametrize("case", sorted(STAGED))
def test_a_staged_result_prints_one_stage_one_barrier_one_write_out(case, dialect):
    signature, body, relabel, sizes, step = STAGED[case]
    source = printed(kernel_of(signature, body, relabel).gpu_program(None, **sizes), dialect)
    block = steps(kernels_only(source))[step]
    assert len(re.findall(r"\b(?:float|double) stage\[\d+\];", block)) == 1, block
    assert block.count("int k = 0;") == 1 and block.count(dialect.barrier) == 1, block
    # the write-out restarts the running count after the barrier and marks it used at the end
    after = block.split(dialect.barrier, 1)[1]
    assert after.lstrip().startswith("k = 0;") and block.rstrip().endswith("(void)k;"), block


# ---- the results on PoCL --------------------------------------------------------------------


def assert_matches(kernel, sizes, context):
    """Run on PoCL; every output within the Program's tolerance of the reference
    (conftest.assert_matches_reference: numpy.tolerance, read off the Program)."""
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    program = kernel.gpu_program(None, **sizes)
    outputs = opencl.run(program, inputs, scalars)
    expected = evaluate(kernel.diagram, inputs, scalars, sizes)
    assert_matches_reference(program, outputs, expected, context)
    return outputs, expected


@pytest.mark.parametrize("case", sorted(ARITHMETIC))
def test_softmax_with_arithmetic_matches_the_reference(case, opencl_device):
    signature, statement, sizes = ARITHMETIC[case]
    assert_matches(kernel_of(signature, statement, "smem: group q 16"), sizes, case)


@pytest.mark.parametrize("case", sorted(STAGED))
def test_staged_results_match_the_reference(case, opencl_device):
    signature, body, relabel, sizes, _ = STAGED[case]
    assert_matches(kernel_of(signature, body, relabel), sizes, case)


MASKS = {
    # queries before the first key they may see: the first rows are fully masked
    "in place": ("(S: f32[q x]) -> P: f32[q x]", "P[q x] = softmax[x](where(x + 3 <= q, S, -inf))"),
    "arithmetic": ("(S: f32[q x]) -> P: f32[q x]", "P[q x] = softmax[x](where(x + 3 <= q, exp(S) * 2 - S, -inf))"),
    "staged": ("(S: f32[x q]) -> P: f32[q x]", "P[q x] = softmax[x](where(x + 3 <= q, S * 2, -inf))"),
    "f16": ("(S: f16[q x]) -> P: f16[q x]", "P[q x] = softmax[x](where(x + 3 <= q, S * 2, -inf))"),
}


@pytest.mark.parametrize("case", sorted(MASKS))
def test_a_fully_masked_row_is_zero(case, opencl_device):
    signature, statement = MASKS[case]
    sizes = dict(q=37, x=90)  # more keys than queries
    outputs, expected = assert_matches(kernel_of(signature, statement, "smem: group q 16"), sizes, case)
    got = outputs["P"].astype(np.float64)
    assert not np.isnan(got).any()
    assert np.all(expected["P"][:3] == 0) and np.all(got[:3] == 0)  # rows 0-2 see no key
    np.testing.assert_allclose(got[3:].sum(axis=1), 1.0, rtol=1e-2 if case == "f16" else 1e-5)


def test_the_softmax_example_still_matches_the_reference(opencl_device):
    (kernel,) = napkin.load(EXAMPLES / "softmax.napkin").values()
    assert_matches(kernel, dict(r=37, c=200), "softmax.napkin")
