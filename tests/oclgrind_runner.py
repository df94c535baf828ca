"""Run napkin kernels through the OpenCL backend, one after another, for oclgrind to watch.

    oclgrind --data-races python -m tests.oclgrind_runner CASES.json
    oclgrind --data-races python -m tests.oclgrind_runner --control

oclgrind replaces the OpenCL platform of the whole process, so tests/test_oclgrind.py runs this
module as a subprocess. ``CASES.json`` is a list of fuzz cases (``tests.fuzz_programs.Case``
as JSON, plus ``"id"``, and ``"gpu": true`` to plan with ``Kernel.gpu_program``, the Program
code generation uses, instead of ``Kernel.program``). For each case it writes to stderr, where
oclgrind writes its reports, so that the two interleave in order:

    @@case ID
    @@paths ID mma.sync,fma      (the instruction path of each launch)
    ... whatever oclgrind reports while the case runs ...
    @@result ID ok | wrong: ... | napkin-error: ... | exception: ...

``wrong`` compares the outputs with the float64 reference within the fuzzer's dtype-derived
tolerance (``fuzz_programs.compare``). ``--control`` runs hand-written kernels that
oclgrind must report (an out-of-bounds write, a data race in local memory, a barrier only some
work-items reach, a branch on uninitialised local memory), so the test can show that its
parsing of the reports sees each of them.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback


def say(line: str) -> None:
    sys.stderr.write(line.replace("\n", " | ") + "\n")
    sys.stderr.flush()


def run_case(data: dict) -> str:
    import napkin_dsl as napkin
    from napkin_dsl.backends import opencl
    from napkin_dsl.errors import NapkinError
    from napkin_dsl.isel import selection
    from napkin_dsl.reference import evaluate

    from .fuzz_programs import Case, compare, error_bounds, fuzz_inputs, kernel_sizes

    case = Case.from_json(json.dumps({k: v for k, v in data.items() if k not in ("id", "gpu")}))
    say(f"@@case {data['id']}")
    try:
        (kernel,) = napkin.load(case.text).values()
        sizes = kernel_sizes(kernel, case)
        if data.get("gpu"):
            program = kernel.gpu_program(case.hardware, **sizes)
        else:
            program = kernel.program(case.hardware, **sizes)
        paths = ",".join(selection(program, launch).path for launch in program.launches)
        say(f"@@paths {data['id']} {paths}")
        axes = {a: sizes[a] for a in kernel.diagram.axes}
        inputs, scalars = fuzz_inputs(kernel.diagram, axes, case.seed)
        outputs = opencl.run(program, inputs, scalars)
        want = evaluate(kernel.diagram, inputs, scalars, axes, keep_float64=True)
        problems = compare(kernel.diagram, outputs, want, error_bounds(kernel.diagram, inputs, scalars, axes))
        return "wrong: " + "; ".join(problems) if problems else "ok"
    except NapkinError as error:
        return f"napkin-error: {type(error).__name__}: {error}"
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        return "exception: " + traceback.format_exc()


CONTROL = """
__kernel void out_of_bounds(__global float *a) { a[get_global_id(0) + 1] = 1.0f; }
__kernel void local_race(__global float *a) {
    __local float t[2];
    t[get_local_id(0) % 2] = (float)get_local_id(0);
    barrier(CLK_LOCAL_MEM_FENCE);
    t[(get_local_id(0) + 1) % 2] += 1.0f;
    barrier(CLK_LOCAL_MEM_FENCE);
    a[get_global_id(0)] = t[0];
}
__kernel void divergent_barrier(__global float *a) {
    if (get_local_id(0) == 0) barrier(CLK_LOCAL_MEM_FENCE);
    a[get_global_id(0)] = 1.0f;
}
__kernel void uninitialized_read(__global float *a) {
    __local float t[4];
    if (t[get_local_id(0)] > 0.0f) a[get_global_id(0)] = 1.0f;
}
"""


CONTROLS = ("out_of_bounds", "local_race", "divergent_barrier", "uninitialized_read")


def control() -> None:
    import numpy as np
    import pyopencl as cl

    from napkin_dsl.backends.opencl import context

    ctx, queue = context()
    program = cl.Program(ctx, CONTROL).build()
    buffer = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, size=4 * 4)
    for name in CONTROLS:
        say(f"@@case {name}")
        getattr(program, name)(queue, (4,), (4,), buffer)
        queue.finish()
        host = np.empty(4, np.float32)
        cl.enqueue_copy(queue, host, buffer)
        say(f"@@result {name} ok")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="?")
    parser.add_argument("--control", action="store_true")
    args = parser.parse_args()
    if args.control:
        control()
        return 0
    with open(args.cases, encoding="utf-8") as handle:
        cases = json.load(handle)
    for data in cases:
        result = run_case(data)
        say(f"@@result {data['id']} {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
