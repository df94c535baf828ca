"""A napkin kernel as a torch custom op (``torch.library.custom_op``), so that torch sees one
operator where it saw a Python function: ``torch.compile`` traces a model through a napkin call
with no graph break, forward and backward (issue 45).

``Kernel.torch_op()`` registers, once per kernel text and options:

* the **forward** op, ``napkin::<kernel>_<digest>``: its schema is the kernel's signature (an array
  is a ``Tensor``, a scalar a ``float`` or an ``int``), and its outputs the outputs of the forward
  that runs, which for a backward that reads the softmax's lse (``save_lse``) is
  ``Kernel.lse_forward()``'s, the lse included;
* a **fake** implementation, the outputs' shapes read off the inputs' (each axis is the extent an
  input carries along it, or a size given when the op was made) and dtypes off the diagram, so
  that FakeTensor tracing and dynamic shapes need no run;
* a **CPU** implementation (the kernel on ``backend``: NumPy or OpenCL) and a **CUDA** one (the
  compiled kernel, reading the tensors in place);
* the **backward**: the derived backward kernel (``Kernel.grad``, chosen by the model at the sizes
  given, else its default) registered as an op of its own the same way, and wired to the forward
  with ``torch.library.register_autograd``: what the forward saves is what the derivation reads.

:class:`TorchOp` calls the forward op and returns the kernel's own outputs (an added lse stays
saved). Deliberately not here: a gradient of a scalar parameter (napkin derives none), and a
second derivative (the backward op has no autograd of its own).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from . import windows
from .dtypes import INTEGER_DTYPES
from .errors import NapkinError
from .types import numpy_dtype

NAMESPACE = "napkin"
_REGISTERED: dict[tuple, TorchOp] = {}  # (kernel text, options) -> the op made for it: torch.library names are global


@dataclass(frozen=True)
class TorchOp:
    """A kernel registered as torch custom ops. Call it like the kernel, with torch tensors (and
    scalars), positionally in signature order or by name: the kernel's output, or a tuple of its
    outputs in order. ``forward`` (and ``backward``, None without one) is the registered
    operator itself, for ``torch.library.opcheck`` and for reading its schema."""

    kernel: object
    name: str
    forward: object
    outputs: tuple[str, ...]  # the kernel's own outputs: what a call returns
    returned: tuple[str, ...]  # what the forward op returns (an lse the backward reads added)
    backward: TorchOp | None = None

    def __call__(self, *args, **named):
        params = self.kernel.diagram.params
        if len(args) > len(params):
            raise NapkinError(f"{self.kernel.name} takes {len(params)} arguments ({', '.join(params)}), got {len(args)}")
        given = dict(zip(params, args, strict=False))
        twice = sorted(set(given) & set(named))
        unknown = sorted(set(named) - set(params))
        missing = [p for p in params if p not in given and p not in named]
        if twice or unknown or missing:
            problem = (f"{', '.join(twice)} given twice" if twice else f"no parameter {', '.join(unknown)}" if unknown
                       else f"{', '.join(missing)} missing")
            raise NapkinError(f"{self.kernel.name}({', '.join(params)}): {problem}")
        result = self.forward(*(given[p] if p in given else named[p] for p in params))
        result = result if isinstance(result, tuple) else (result,)
        mine = tuple(result[self.returned.index(o)] for o in self.outputs)
        return mine[0] if len(mine) == 1 else mine

    def __repr__(self) -> str:
        return f"<TorchOp {NAMESPACE}::{self.name}: {self.kernel.diagram.signature()}>"


def torch_op(kernel, *, backend: str = "numpy", hardware: str | None = None, save_lse: bool | None = None,
             grad: bool = True, **sizes: int) -> TorchOp:
    """Register ``kernel`` as torch custom ops (see the module's docstring) and return the callable.
    ``backend`` runs the CPU implementation (``"numpy"`` or ``"opencl"``); CUDA tensors run the
    compiled kernel. ``sizes`` binds axes no input carries, and with every axis bound picks the
    backward the model prices cheapest there (as ``Kernel.grad`` does); ``save_lse`` decides that
    choice by hand. ``grad=False`` registers no backward. The same kernel text and options give
    the same op."""
    try:
        import torch  # noqa: F401 - each registration below imports it too
    except ImportError as missing:
        raise NapkinError("Kernel.torch_op needs torch", hint="pip install torch (napkin's extra: pip install 'napkin-dsl[torch]')") from missing
    if backend not in ("numpy", "opencl"):
        raise NapkinError(f"a torch op runs CPU tensors on the numpy or opencl backend, not {backend!r}",
                          hint="CUDA tensors run the compiled kernel whatever this says")
    diagram = kernel.diagram
    key = (kernel.source, kernel.name, backend, hardware, save_lse, grad, tuple(sorted(sizes.items())))
    if key in _REGISTERED:
        return _REGISTERED[key]
    for name in diagram.params:
        if not name.isidentifier() or name.startswith("_"):
            raise NapkinError(f"parameter {name!r} cannot name a torch schema argument")
    backward_kernel = None
    running = kernel
    if grad and any(diagram.arrays[p].dtype not in INTEGER_DTYPES for p in diagram.params if p in diagram.arrays):
        bound = {a: n for a, n in sizes.items() if a in diagram.axes}
        try:
            backward_kernel = kernel.grad(hardware=hardware, save_lse=save_lse, **bound)
        except NotImplementedError as missing:  # a box with no derived backward yet (a window read, a scan)
            raise NotImplementedError(f"{missing}; Kernel.torch_op(grad=False) registers the forward alone") from None
        if backward_kernel.derivation.auxiliary:
            running = kernel.lse_forward()
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:10]
    name = f"{kernel.name}_{digest}"
    forward = _register(running, name, backend, hardware, sizes)
    backward = None
    if backward_kernel is not None:
        backward = TorchOp(backward_kernel, f"{name}_backward",
                           _register(backward_kernel, f"{name}_backward", backend, hardware, sizes),
                           backward_kernel.diagram.outputs, backward_kernel.diagram.outputs)
        _register_autograd(forward, running, backward)
    made = TorchOp(kernel, name, forward, diagram.outputs, running.diagram.outputs, backward)
    _REGISTERED[key] = made
    return made


def _schema(diagram) -> str:
    args = []
    for p in diagram.params:
        if p in diagram.arrays:
            args.append(f"Tensor {p}")
        else:
            args.append(f"{'int' if diagram.scalars[p].dtype.startswith(('i', 'u')) else 'float'} {p}")
    outputs = diagram.outputs
    returns = "Tensor" if len(outputs) == 1 else "(" + ", ".join("Tensor" for _ in outputs) + ")"
    return f"({', '.join(args)}) -> {returns}"


def _output_axes(diagram, sizes: dict) -> None:
    """Refuse an output axis that no input carries and no size binds: the fake implementation
    could not give its extent."""
    carried = {a for p in diagram.params if p in diagram.arrays for a in diagram.arrays[p].axes}
    carried |= {a for view in diagram.views for a in view.axes}  # a convolution's output length: windows.inferred_sizes
    for o in diagram.outputs:
        free = [a for a in diagram.arrays[o].axes if a not in carried and a not in sizes]
        if free:
            raise NapkinError(f"output {o}'s axis {', '.join(free)} is carried by no input: torch_op needs its size",
                              hint=f"kernel.torch_op({', '.join(f'{a}=...' for a in free)})")


def _register(kernel, name: str, backend: str, hardware, sizes: dict):
    """The op of one kernel (forward or backward): schema, CPU and CUDA implementations, fake."""
    import torch

    diagram = kernel.diagram
    _output_axes(diagram, sizes)
    params, outputs = diagram.params, diagram.outputs
    # torch names its dtypes as NumPy and ml_dtypes do (bfloat16, float8_e4m3fn), as binding.py reads them
    dtypes = {o: getattr(torch, numpy_dtype(diagram.arrays[o].dtype).name) for o in outputs}
    given = {a: n for a, n in sizes.items() if a in diagram.axes}

    def run(run_backend):
        def implementation(*args):
            call = {p: (a.detach().contiguous() if isinstance(a, torch.Tensor) else a) for p, a in zip(params, args, strict=True)}
            result = kernel(backend=run_backend, hardware=hardware, sizes=given or None, **call)
            result = result if isinstance(result, dict) else {outputs[0]: result}
            # fresh tensors of the declared dtypes (a NumPy-backed result owns its memory)
            done = tuple(torch.as_tensor(result[o]).to(dtypes[o]).clone() for o in outputs)
            return done[0] if len(done) == 1 else done
        return implementation

    op = torch.library.custom_op(f"{NAMESPACE}::{name}", run(backend), mutates_args=(), device_types="cpu",
                                 schema=_schema(diagram))
    op.register_kernel("cuda", run("cuda"))

    @op.register_fake
    def _fake(*args):
        extents = dict(given)
        device = None
        for p, a in zip(params, args, strict=True):
            if p in diagram.arrays:
                device = device or a.device
                for axis, n in zip(diagram.arrays[p].axes, a.shape, strict=True):
                    extents.setdefault(axis, n)
        for axis, (n, _) in windows.inferred_sizes(diagram, extents).items():  # what a window read implies
            extents.setdefault(axis, n)
        made = tuple(torch.empty([extents[a] for a in diagram.arrays[o].axes], dtype=dtypes[o], device=device) for o in outputs)
        return made[0] if len(made) == 1 else made

    return op


def backward_arguments(derivation, wanted, inputs: dict, scalars: dict, outputs: dict, cotangents: dict) -> dict:
    """The derived backward kernel's arguments (``wanted``: its parameters): the forward's inputs
    and scalars it reads, the forward outputs it reads (``derivation.saved``), and each output's
    cotangent in the output's dtype, zeros where torch gives none (an output the loss does not
    read)."""
    import torch

    call = {name: value for name, value in {**inputs, **scalars}.items() if name in wanted}
    call.update({name: outputs[name] for name in derivation.saved})
    for output, cotangent in cotangents.items():
        parameter = derivation.cotangents.get(output)
        if parameter is not None:
            call[parameter] = (torch.zeros_like(outputs[output]) if cotangent is None
                               else cotangent.detach().to(outputs[output].dtype).contiguous())
    return call


def input_gradients(derivation, params, inputs: dict, result: dict, needed=None) -> tuple:
    """Each forward parameter's gradient from the backward kernel's ``result``, in its input's
    dtype: None for a scalar, an input with no gradient, or one ``needed`` (a mask) leaves out."""
    import torch

    grads = []
    for index, name in enumerate(params):
        gradient = derivation.gradients.get(name)
        wanted = name in inputs and gradient is not None and (needed is None or needed[index])
        # torch.as_tensor: a backward that reads no torch tensor (its cotangent unread) returns NumPy
        grads.append(torch.as_tensor(result[gradient]).to(inputs[name].dtype) if wanted else None)
    return tuple(grads)


def _register_autograd(forward, running, backward: TorchOp) -> None:
    """The forward op's backward: the derived backward op, on what the derivation reads."""
    diagram = running.diagram
    derivation = backward.kernel.derivation
    arrays = [p for p in diagram.params if p in diagram.arrays]
    wanted = backward.kernel.diagram.params

    def setup_context(ctx, inputs, output):
        output = output if isinstance(output, tuple) else (output,)
        values = dict(zip(diagram.params, inputs, strict=True))
        ctx.scalars = {p: values[p] for p in diagram.params if p not in diagram.arrays}
        ctx.save_for_backward(*(values[p] for p in arrays), *output)

    def backward_fn(ctx, *cotangents):
        saved = ctx.saved_tensors
        inputs = dict(zip(arrays, saved[:len(arrays)], strict=True))
        outputs = dict(zip(diagram.outputs, saved[len(arrays):], strict=True))
        call = backward_arguments(derivation, wanted, inputs, ctx.scalars, outputs,
                                  dict(zip(diagram.outputs, cotangents, strict=True)))
        result = backward.forward(*(call[p] for p in wanted))
        result = dict(zip(backward.kernel.diagram.outputs, result if isinstance(result, tuple) else (result,), strict=True))
        return input_gradients(derivation, diagram.params, inputs, result)

    forward.register_autograd(backward_fn, setup_context=setup_context)
