"""napkin: neural circuit diagrams as GPU kernels.

Write an algorithm as a textual diagram, relabel its axes into groups (tiling) and streams
(online accumulation), and napkin checks it, elaborates the paper's pseudocode, predicts its
cost on a GPU and runs it.

>>> import napkin_dsl as napkin
>>> kernels = napkin.load("examples/attention.napkin")  # doctest: +SKIP

The public names below load their modules on first use (PEP 562), so that ``import
napkin_dsl`` stays cheap: the dtypes bring NumPy, and a command needs only
its own stages.
"""

import sys as _sys
from types import ModuleType as _ModuleType

from .errors import NapkinError, NapkinErrors, NapkinSyntaxError, NapkinTypeError, RelabelError
from .hardware import hardware_names, load_hardware

__version__ = "0.1.0"

__all__ = [
    "Kernel", "kernel", "load",
    "NapkinError", "NapkinErrors", "NapkinSyntaxError", "NapkinTypeError", "RelabelError",
    "hardware_names", "load_hardware",
    "bf16", "f16", "f32", "f64", "fp8", "fp8e4m3", "fp8e5m2", "i32", "i64",
]

# Public name -> the module that defines it, imported when the name is first read.
_LAZY = {
    "Kernel": "kernel", "kernel": "kernel", "load": "kernel",
    **{dtype: "types" for dtype in ("bf16", "f16", "f32", "f64", "fp8", "fp8e4m3", "fp8e5m2", "i32", "i64")},
}


class _Package(_ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Importing the submodule napkin_dsl.kernel binds it as this package's attribute
        # `kernel`, which is the public decorator: keep the decorator (the submodule stays
        # in sys.modules).
        if name in _LAZY and isinstance(value, _ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'napkin_dsl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
