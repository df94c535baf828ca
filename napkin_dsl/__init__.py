"""napkin: neural circuit diagrams as GPU kernels.

Write an algorithm as a textual diagram, relabel its axes into groups (tiling) and streams
(online accumulation), and napkin checks it, elaborates the paper's pseudocode, predicts its
cost on a GPU and runs it.

>>> import napkin_dsl as napkin
>>> kernels = napkin.load("examples/attention.napkin")  # doctest: +SKIP
"""

from .errors import NapkinError, NapkinErrors, NapkinSyntaxError, NapkinTypeError, RelabelError
from .hardware import hardware_names, load_hardware
from .kernel import Kernel, kernel, load
from .types import bf16, f16, f32, f64, fp8, fp8e4m3, fp8e5m2, i32, i64

__version__ = "0.1.0"

__all__ = [
    "Kernel", "kernel", "load",
    "NapkinError", "NapkinErrors", "NapkinSyntaxError", "NapkinTypeError", "RelabelError",
    "hardware_names", "load_hardware",
    "bf16", "f16", "f32", "f64", "fp8", "fp8e4m3", "fp8e5m2", "i32", "i64",
]
