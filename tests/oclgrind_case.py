"""Run one tensor-core kernel through the OpenCL backend and compare it with the reference.

Run under ``oclgrind --data-races`` by tests/test_tensorcore.py (a subprocess: oclgrind
replaces the OpenCL platform of the whole process). ``--drop-staging-barrier`` removes the
barrier between the epilogue's shared-memory writes and its reads, so the test can show that
oclgrind reports the race that barrier prevents.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("example")
    parser.add_argument("sizes", nargs="+")
    parser.add_argument("--drop-staging-barrier", action="store_true")
    parser.add_argument("--arch", help="emulate the code built for this architecture (sm_90a: wgmma)")
    args = parser.parse_args()
    import napkin_dsl as napkin
    from napkin_dsl.backends import opencl, tensorcore
    from napkin_dsl.reference import evaluate
    from tests.test_opencl import random_inputs

    if args.drop_staging_barrier:
        emit = tensorcore.TensorPrinter.emit

        def without_barrier(self, line=""):
            if not line.startswith("NK_SYNC();  // the staged tile is whole"):
                emit(self, line)

        tensorcore.TensorPrinter.emit = without_barrier
    (kernel,) = napkin.load(args.example).values()
    sizes = {k: int(v) for k, v in (item.split("=") for item in args.sizes)}
    inputs, scalars = random_inputs(kernel.diagram, sizes)
    outputs = opencl.run(kernel.gpu_program(None, **sizes), inputs, scalars, arch=args.arch)
    expected = evaluate(kernel.diagram, inputs, scalars, sizes)
    for name, want in expected.items():
        error = float(np.max(np.abs(outputs[name].astype(np.float64) - want))) / max(1.0, float(np.max(np.abs(want))))
        print(f"{name} error {error:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
