"""Kernel objects, the ``@napkin.kernel`` decorator and ``napkin.load``.

A :class:`Kernel` is a checked diagram plus what the user said about running it (the
relabel block, the hardware). It is the entry point to every later stage: pseudocode,
cost, tuning, running.

Two ways in, one checker:

* ``napkin.load("examples/attention.napkin")`` (or the text itself) returns the kernels of a
  file by name;
* ``@napkin.kernel`` turns a Python function into a kernel: its annotations give the
  parameters and outputs, its docstring the statements (and optionally a relabel block).
  Mistakes raise :class:`~napkin_dsl.errors.NapkinError` when the function is defined, with
  line numbers in the Python file.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import itertools
import sys
import textwrap
import typing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from . import syntax as syn
from .check import CheckedKernel, check_module, check_sizes
from .errors import NapkinError, NapkinSyntaxError, RelabelError, Span
from .hardware import hardware_names
from .progress import Progress, wanted


class Kernel:
    """A checked napkin kernel.

    ``diagram`` is the typed diagram, ``source`` the text it came from, ``relabel`` the
    relabel block (syntax) or None, ``hardware`` the profile name it targets.
    """

    def __init__(self, checked: CheckedKernel, hardware: str | None = None, function: Callable | None = None):
        self._checked = checked
        self.diagram = checked.diagram
        self.name = checked.diagram.name
        self.source = checked.source
        self.file = checked.file
        self.relabel = checked.relabel
        self.hardware = checked.relabel.hardware if checked.relabel is not None else hardware
        self.function = function
        self._cache: dict = {}
        if self.relabel is not None:
            # The legality of each group and stream partition needs no sizes: check it now, so
            # that `napkin check`, `napkin.load` and the decorator refuse an illegal relabelling.
            from .relabel import make_schedule

            make_schedule(self.diagram, self.relabel.hardware, self.relabel)
        if function is not None:
            self.__doc__ = function.__doc__
            self.__wrapped__ = function

    def signature(self) -> str:
        return self.diagram.signature()

    def retyped(self, dtypes: dict[str, str]) -> Kernel:
        """The same kernel with each dtype named in ``dtypes`` replaced by its value (fp8 ->
        bf16: the comparison a quantized run reports): its definition's parameter, output and
        storage types retyped and checked again, relabel block included, whether it came from a
        file or a decorated function. Raises NapkinError where the retyped kernel does not check
        (a kernel with opaque boxes, whose declarations are not kept)."""
        import dataclasses as dc

        def param(p):
            return dc.replace(p, type=dc.replace(p.type, dtype=dtypes.get(p.type.dtype, p.type.dtype)))

        definition = self._checked.definition
        definition = dc.replace(definition, params=tuple(map(param, definition.params)),
                                outputs=tuple(map(param, definition.outputs)),
                                statements=tuple(dc.replace(s, dtype=dtypes.get(s.dtype, s.dtype)) for s in definition.statements))
        module = syn.Module(self.file, self.source, kernels=(definition,),
                            relabels=(self.relabel,) if self.relabel is not None else ())
        checked = check_module(module, hardware=self.hardware)
        return Kernel(checked[self.name], self.hardware, self.function)

    def relabel_text(self) -> str:
        if self.relabel is None:
            return "no relabelling"
        clauses = []
        for level in self.relabel.levels:
            kinds: dict[str, list[str]] = {}
            for p in level.partitions:
                kinds.setdefault(p.kind, []).append(f"{p.axis} {p.size}")
            scope = next((f" for {', '.join(p.targets)}" for p in level.partitions if p.targets), "")
            clauses.append(f"{level.level}{scope}: " + "; ".join(f"{k} {', '.join(v)}" for k, v in kinds.items()))
        if self.relabel.overlap is not None:
            clauses.append(f"overlap: {self.relabel.overlap}")
        return f"on {self.relabel.hardware}" + (": " + " | ".join(clauses) if clauses else "")

    # -- later stages
    def _target(self, hardware: str | None) -> str:
        """The hardware to plan for: given, else the relabel block's, else the first profile
        (``hardware.profile_preference``: the paper's two_level first, then the GPUs) that has every
        ``@level`` the kernel names."""
        if hardware or self.hardware:
            return hardware or self.hardware
        from .hardware import DEFAULT_MODEL, load_hardware, profile_preference

        named = {s.level for s in self.diagram.statements if s.level}
        for candidate in profile_preference():
            if named <= set(load_hardware(candidate).level_names()):
                return candidate
        return DEFAULT_MODEL

    def program(self, hardware: str | None = None, **sizes: int):
        """The elaborated pseudocode (:class:`~napkin_dsl.pseudocode.Program`) on a hardware profile."""
        from .plan import plan

        target = self._target(hardware)
        key = ("program", target, tuple(sorted(sizes.items())))
        if key not in self._cache:
            diagram, block, note = self._refit(target, sizes) or (self.diagram, self.relabel, None)
            self._cache[key] = _noted(plan(diagram, target, block, check_sizes(sizes)), note)
        return self._cache[key]

    def _selection(self, hardware: str | None, program, **sizes: int):
        """Instruction selection of :meth:`program`'s Program for the profile's own target, once
        per Program (what the NumPy backend's counts follow): a repeated call selects nothing."""
        from .isel import select_program

        key = ("selection", self._target(hardware), tuple(sorted(sizes.items())))
        if key not in self._cache:
            self._cache[key] = select_program(program)
        return self._cache[key]

    def pseudocode(self, format: str = "text", hardware: str | None = None, arch: str | None = None,
                   **sizes: int) -> str:
        """The paper's looped pseudocode as text (``format="text"``) or a Markdown table of columns,
        with the register level of the code built for ``arch`` (default: the profile's own)."""
        from .cost import columns
        from .isel import select_program, thread_line, warp_line
        from .pseudocode import render_markdown, render_text

        program = self.program(hardware, **sizes)
        selected = select_program(program, arch)
        if format == "markdown":
            return render_markdown(program, columns(program, selected))
        if format == "text":
            lines = {index: warp_line(chosen.plan) for index, chosen in selected.tensor().items()}
            for launch in program.launches:  # FMA launches: where their accumulators live
                chosen = selected[launch.index]
                line = thread_line(chosen.kept, chosen.refused)
                if launch.index not in lines and line is not None:
                    lines[launch.index] = line
            return render_text(program, lines)
        raise NapkinError(f"unknown pseudocode format {format!r}", hint="use 'text' or 'markdown'")

    def cost(self, hardware: str | None = None, relabel=None, path: str | None = None, arch: str | None = None,
             overlap: str | None = None, **sizes: int):
        """The :class:`~napkin_dsl.cost.CostReport` read off the pseudocode; raises if a level overflows.

        ``relabel`` (a :class:`~napkin_dsl.tune.TuneResult` or relabel text) costs that relabelling
        instead of the kernel's own: ``kernel.cost(relabel=kernel.tune(...))``. ``path``
        ("mma.sync", "wgmma") prices the tensor-core launches on that instruction, a what-if.
        ``arch`` prices the code built for that architecture (``sm_90a``: wgmma where isel takes
        it), default the profile's own. ``overlap`` prices the wgmma warpgroups under another
        schedule (``cost.OVERLAPS``, "pingpong+pipelined": FlashAttention-3's), a what-if."""
        from .cost import cost_of

        if relabel is not None:
            return self.relabelled(relabel).cost(hardware, path=path, arch=arch, overlap=overlap, **sizes)
        return cost_of(self.program(hardware, **sizes), path=path, arch=arch, overlap=overlap)

    @property
    def partition_symbols(self) -> set[str]:
        """The symbolic group, stream and split sizes of the relabel block (``group q g``): sizes a
        call or ``--set`` binds beside the axes."""
        levels = self.relabel.levels if self.relabel is not None else ()
        return {p.size for level in levels for p in level.partitions if isinstance(p.size, str)}

    def relabelled(self, relabel) -> Kernel:
        """A new Kernel, relabelled: by a :class:`~napkin_dsl.tune.TuneResult` (its best
        configuration, with the intermediates it materialises) or by relabel text (a whole
        ``relabel K on HW:`` block, or its clause lines for this kernel's hardware). This kernel
        is not changed; the new one's ``source`` has the relabelling written in (for .napkin sources)."""
        import dataclasses

        from .hardware import load_hardware
        from .tune import TuneResult, parse_relabel, rewrite_source

        top_of = load_hardware(self.hardware).top.name if self.hardware else "gmem"
        own = (self.relabel,) if self.relabel is not None and self.relabel.span is not None else ()
        if isinstance(relabel, TuneResult):
            if relabel.kernel != self.name:
                raise NapkinError(f"the tuning result is for kernel {relabel.kernel!r}, not {self.name!r}")
            profile = load_hardware(relabel.hardware)
            diagram = relabel.best.diagram or self.diagram
            block = relabel.block(diagram, profile)
            top = profile.top.name
            source = relabel.source_text(self.source, self.diagram, own) if self.function is None else self.source
        elif isinstance(relabel, str):
            block = parse_relabel(relabel, self.name, self.hardware)
            diagram, top = self.diagram, top_of
            source = self.source
            if self.function is None:
                written = {s.target for s in self.diagram.statements if s.level is not None}
                source = rewrite_source(self.source, self.diagram, top, written, written, own,
                                        relabel.strip() + "\n" if relabel.strip().startswith("relabel") else
                                        _block_text(block, self.name))
        else:
            raise NapkinError(f"relabelled() takes a TuneResult or relabel text, not {type(relabel).__name__}",
                              hint='kernel.relabelled(kernel.tune("H100", ...)) or kernel.relabelled("smem: group q 128")')
        levels = {s.target: s.level for s in diagram.statements}
        definition = self._checked.definition
        definition = dataclasses.replace(definition, statements=tuple(
            dataclasses.replace(s, level=levels.get(s.target, s.level)) for s in definition.statements))
        checked = CheckedKernel(diagram, block, source, self.file, definition)
        return Kernel(checked, block.hardware, self.function)

    def _gpu_target(self, hardware: str | None) -> str:
        """The profile code generation plans on: ``hardware``, else the relabel block's GPU, else
        ``hardware.DEFAULT_GPU`` (H100)."""
        from .hardware import DEFAULT_GPU, load_hardware

        return hardware or (self.hardware if self.hardware and not load_hardware(self.hardware).symbolic else DEFAULT_GPU)

    def gpu_program(self, hardware: str | None = None, **sizes: int):
        """The Program code generation uses on a GPU profile: the relabel block's, or, for a kernel
        without one (or relabelled for an abstract model), the tuner's best configuration, as for a
        block written for another GPU that does not fit this one (:meth:`_refit`, noted)."""
        from .hardware import load_hardware
        from .plan import plan

        target = self._gpu_target(hardware)
        key = ("gpu_program", target, tuple(sorted(sizes.items())))
        if key in self._cache:
            return self._cache[key]
        opaque = [s for s in self.diagram.statements if s.box.kind == "opaque"]
        if opaque:
            from .backends.lowering import LoweringError

            raise LoweringError(f"box {opaque[0].box.box.name} is opaque: it has no body to compile", opaque[0].span,
                                "opaque boxes are for the cost model; run them with the NumPy backend and impls=")
        block = self.relabel
        refit = self._refit(target, sizes)
        if refit is not None:
            diagram, block, note = refit
        elif block is None or load_hardware(block.hardware).symbolic:
            from .tune import tune

            best = tune(self.diagram, target, None, check_sizes(sizes), top=1, keep_written=True)
            block = best.block(self.diagram, load_hardware(target))
            # The tuner may materialise intermediates the source fuses (never fuse what it materialises).
            diagram, note = best.best.diagram or self.diagram, None
        else:
            diagram, note = self.diagram, None
        self._cache[key] = _noted(plan(diagram, target, block, check_sizes(sizes)), note)
        return self._cache[key]

    def _refit(self, target: str, sizes: dict):
        """Where this kernel's relabel block was written for another GPU than ``target`` and does not
        fit it at ``sizes`` (every axis bound): the tuner's schedule there, the written block among its
        candidates, as (diagram, block, the note that says why); None where the written block stands."""
        from .hardware import load_hardware

        block = self.relabel
        profile = load_hardware(target)
        if (block is None or block.hardware == profile.name or profile.symbolic or load_hardware(block.hardware).symbolic
                or not set(self.diagram.axes) <= set(sizes)):
            return None
        key = ("refit", profile.name, tuple(sorted(sizes.items())))
        if key not in self._cache:
            from .cost import cost_of
            from .plan import plan
            from .tune import retarget, tune

            try:
                cost_of(plan(self.diagram, target, block, check_sizes(sizes)))
                self._cache[key] = None
            except RelabelError as error:
                best = tune(self.diagram, target, retarget(block, profile), check_sizes(sizes), top=1, keep_written=True)
                tuned = best.block(self.diagram, profile)
                note = (f"the relabel block written for {block.hardware} does not fit {profile.name} "
                        f"({str(error.message).splitlines()[0]}): the tuner's schedule for {profile.name} runs "
                        f"({self._block_line(tuned)})")
                self._cache[key] = (best.best.diagram or self.diagram, tuned, note)
        return self._cache[key]

    @staticmethod
    def _block_line(block) -> str:
        return "; ".join(line.strip() for line in _block_text(block, "").splitlines()[1:])

    def compile(self, arch: str | None = None, hardware: str | None = None, ptx: bool = False, synchronous: bool = False,
                overlap: str | None = None, **sizes: int):
        """Generate CUDA C++ and compile it with NVRTC (a :class:`~napkin_dsl.backends.cuda.CompiledKernel`).

        Every size must be bound. The hardware defaults to the relabel block's GPU, else the GPU
        of ``arch`` (``hardware.gpu_for_arch``: sm_80: A100, sm_90: H100); ``arch`` defaults to
        the hardware's own (its profile's ``arch``), else ``DEFAULT_GPU``'s. An ``arch`` the hardware's
        profile does not list in its ``archs`` is a :class:`NapkinError` naming those it does.
        ``synchronous``: sm_90a's wgmma launches on the synchronous ring, without the producer and
        consumer warpgroups (the build to compare the roles with). ``overlap``: the warpgroup
        schedule to build (``cost.build_schedule``): "serial" (the default), "pipelined"
        (FlashAttention-3's intra-warpgroup order), "pingpong" (its consumer warpgroups' turns)
        or both, each where a launch takes it.
        """
        from .backends.compiled import compile_cached
        from .cost import build_schedule
        from .hardware import DEFAULT_GPU, gpu_for_arch, load_hardware

        own = self.hardware if self.hardware and load_hardware(self.hardware).archs else None  # the relabel block's GPU
        if arch is None:
            arch = load_hardware(hardware or own or DEFAULT_GPU).arch
        target = hardware or (None if own else gpu_for_arch(arch))
        load_hardware(target or own).check_arch(arch)
        order = build_schedule(overlap)  # an unknown schedule is refused here, before any work
        key = ("compile", arch, target, ptx, synchronous, order, tuple(sorted(sizes.items())))
        if key in self._cache:
            return self._cache[key]

        def compile_now():
            from .backends.cuda import compile_program

            return compile_program(self.gpu_program(target, **sizes), arch, ptx, synchronous=synchronous, overlap=order)

        def planned():  # after a disk-cache hit: the Program, selection and report, when first asked for
            from .backends.cuda import compiled_cost
            from .isel import select_program

            program = self.gpu_program(target, **sizes)
            selected = select_program(program, arch, synchronous=synchronous, schedule=order)
            return program, compiled_cost(program, arch, compiled.launches, compiled.resources, selected=selected), selected

        # The disk cache's key is what the source is made from, so that a hit lowers nothing.
        identity = {"kernel": self.name, "signature": self.signature(), "source": self.source,
                    "relabel": self.relabel_text(), "levels": [[s.target, s.level] for s in self.diagram.statements],
                    "hardware": repr(load_hardware(self._gpu_target(target))), "sizes": sorted(sizes.items()),
                    "arch": arch, "ptx": ptx, **({"synchronous": True} if synchronous else {}),
                    **({"order": order} if order is not None else {})}
        compiled = compile_cached(identity, compile_now, planned)
        self._cache[key] = compiled
        return compiled

    def tune(self, hardware: str | None = None, top: int = 5, progress=None, **sizes: int):
        """Group/stream sizes minimising predicted time on ``hardware`` (a :class:`~napkin_dsl.tune.TuneResult`)."""
        from .hardware import load_hardware
        from .tune import retarget, tune

        # The relabelling written in the file is a candidate on any GPU whose levels it names.
        target = self._target(hardware)
        return tune(self.diagram, target, retarget(self.relabel, load_hardware(target)), check_sizes(sizes), top=top,
                    progress=progress)

    def render(self, relabelled: bool = False, costs: bool = False) -> str:
        """The kernel's neural circuit diagram as SVG text (see :func:`napkin_dsl.render.render`)."""
        from .render import render

        return render(self, relabelled=relabelled, costs=costs)

    def _repr_svg_(self) -> str:
        return self.render()

    def _repr_html_(self) -> str:
        """For Jupyter, which shows this rather than :meth:`_repr_svg_` when both exist: the
        signature, the relabelling, the symbolic cost table, and the diagram itself (the SVG,
        inline), so that nothing the drawing showed is lost."""
        import html

        try:
            cost = self.cost()._repr_html_()
        except NapkinError as error:  # the view shows why there is no cost rather than failing
            cost = f"<p>no cost: {html.escape(error.message)}</p>"
        try:
            drawing = self.render()
        except NapkinError as error:
            drawing = f"<p>no drawing: {html.escape(error.message)}</p>"
        relabelling = self.relabel_text() if self.relabel is None else "relabelled " + self.relabel_text()
        return (f"<div><p><code>{html.escape(self.signature())}</code></p>"
                f"<p>{html.escape(relabelling)}</p>{cost}"
                f'<div style="max-width: 100%; overflow-x: auto">{drawing}</div></div>')

    def lse_forward(self) -> Kernel | None:
        """This kernel with an lse output added for each softmax that has none (``grad.lse_forward``):
        the forward a backward with ``save_lse`` runs, which returns the same outputs and L; None
        when every softmax has its lse already or the kernel has an opaque box."""
        if "lse forward" not in self._cache:
            from .grad import lse_forward

            made = lse_forward(self.diagram, _block_text(self.relabel, self.name) if self.relabel is not None else "")
            self._cache["lse forward"] = None if made is None else load(made[0], hardware=self.hardware)[self.name]
        return self._cache["lse forward"]

    def grad(self, rewrite_d: bool | None = None, save: tuple[str, ...] = (), hardware: str | None = None,
             key_stream: int | None = None, save_lse: bool | None = None, sum_dq: bool | None = None,
             key_group: int | None = None, **sizes: int) -> Kernel:
        """The backward kernel, derived from the diagram (``grad.py``): a Kernel of its own, parsed
        back from its text (``.source``) through the normal front end. Its parameters are the
        forward's inputs it reads, the forward outputs it reads (saved) and one cotangent per
        output (``dO``); its outputs, ``dX`` per float input.

        ``rewrite_d``: FA2's ``D = sum[d](dO * O)`` for a softmax contracted into an output (True),
        or ``sum[x](dP * P)`` (False). None (the default) is the model's pick: with every axis
        bound in ``sizes``, both backward kernels are priced (:meth:`backward_options`) and the
        cheaper is returned; without sizes, the rewrite (which never costs more FLOPs, and lets
        dK and dV group the keys). ``save``: forward intermediates read from device memory
        rather than recomputed (``("P",)``). ``key_stream``: the query chunk of FA2's key launch
        (default: the forward's stream, or with sizes the model's pick, as for ``rewrite_d``).
        ``save_lse``: the backward of :meth:`lse_forward`, which reads each softmax's lse and
        recomputes P from it, as FA2 does (default: not, or with sizes the model's pick); the
        returned kernel's ``derivation.auxiliary`` names the outputs the forward adds.
        ``sum_dq``: FA2's key launch computes dQ as well, each key group adding its part into an
        f32 sum in device memory atomically (True: five products, not deterministic), or dQ has a
        launch of its own that recomputes what it reads (False: seven products, deterministic);
        default True, or with sizes the model's pick. ``key_group``: the key launch's group of keys
        (default: the forward's group of queries, or with sizes the model's pick)."""
        undecided = (rewrite_d is None or key_stream is None or save_lse is None or sum_dq is None
                     or key_group is None)
        if sizes and set(self.diagram.axes) <= set(sizes) and undecided:
            choice = ("grad choice", rewrite_d, tuple(save), key_stream, save_lse, sum_dq, key_group, hardware,
                      tuple(sorted(sizes.items())))
            if choice not in self._cache:  # priced once per shape (an autograd call asks every step)
                best = self.backward_options(hardware, saves=(tuple(save),), rewrite_d=rewrite_d,
                                             key_stream=key_stream, save_lse=save_lse, sum_dq=sum_dq,
                                             key_group=key_group, **sizes)[0]
                self._cache[choice] = (best.rewrite_d, best.key_stream, best.save_lse, best.sum_dq, best.key_group)
            rewrite_d, key_stream, save_lse, sum_dq, key_group = self._cache[choice]
        rewrite_d = True if rewrite_d is None else rewrite_d
        sum_dq = True if sum_dq is None else sum_dq
        forward = self.lse_forward() if save_lse else None
        if save_lse and forward is None:
            raise NapkinError(f"save_lse: {self.name} has no softmax without an lse output to add one for")
        key = ("grad", rewrite_d, tuple(save), key_stream, bool(save_lse), sum_dq, key_group)
        if key not in self._cache:
            from .grad import backward_with_relabel

            source = forward or self
            added = tuple(o for o in source.diagram.outputs if o not in self.diagram.outputs)
            derived = backward_with_relabel(source.diagram, source.relabel, source.hardware, rewrite_d, tuple(save),
                                            key_stream, added, sum_dq, key_group)
            kernel = load(derived.text, hardware=self.hardware)[derived.name]
            kernel.derivation = derived
            self._cache[key] = kernel
        return self._cache[key]

    def backward_options(self, hardware: str | None = None, saves=None, rewrite_d: bool | None = None,
                         key_stream: int | None = None, save_lse: bool | None = None, sum_dq: bool | None = None,
                         key_group: int | None = None, **sizes: int) -> list[BackwardOption]:
        """The backward's choices priced by the model at ``sizes``, cheapest first:

        * FA2's D rewrite or not (``rewrite_d`` fixes it);
        * what the forward saves: intermediates (``saves``: tuples of them; default: nothing
          beyond the outputs, or each softmax's probabilities), and whether it adds an lse output
          per softmax that has none (``save_lse`` fixes it; :meth:`lse_forward`), from which the
          backward recomputes P without a max or sum over the softmax's axis;
        * the query chunk of FA2's key launch (``key_stream`` fixes it; else the forward's stream
          and its halvings down to 16, the mma k: the key launch holds dK and dV whole, so a
          shorter chunk is what lets the rest of its fragments fit the registers and the launch
          run on tensor cores);
        * dQ summed over the key groups in the key launch by atomic adds, or computed in a launch of
          its own, deterministically (``sum_dq`` fixes it; the second is listed only where the
          first is built);
        * the key launch's group of keys (``key_group`` fixes it; else the forward's group of
          queries and 64, one wgmma warpgroup: a summed dQ on wgmma takes d on the key group's
          rows, so d = 64 needs 64 keys).

        Each saved value costs the forward its write to device memory at the bandwidth into the
        level below (a lower bound: the forward's own schedule may also change) on top of the
        backward's predicted time; a backward the front end cannot fit (a level overflows) is
        priced at infinity."""
        from .dtypes import DTYPE_BYTES
        from .diagram import Softmax
        from .hardware import DEFAULT_GPU, load_hardware

        if saves is None:
            saves = [()] + [(s.target,) for s in self.diagram.statements if isinstance(s.box, Softmax)]
        hardware = hardware or self.hardware or DEFAULT_GPU  # a kernel with no relabelling is priced there too
        bandwidth = load_hardware(hardware).levels[1].bandwidth
        bandwidth = float(bandwidth) if isinstance(bandwidth, (int, float)) else None  # None: a symbolic profile
        with_lse = self.lse_forward()
        lse_choices = (False, True) if save_lse is None and with_lse is not None else (bool(save_lse),)

        def written_s(diagram, names) -> float:  # the forward's extra writes to device memory
            total = 0.0
            if bandwidth is None:
                return total  # unpriced, as the backward's time is there
            for name in names:
                array = diagram.arrays[name]
                count = 1
                for axis in array.axes:
                    count *= sizes[axis]
                total += count * DTYPE_BYTES[array.dtype] / bandwidth
            return total

        options = []
        for save, lse in itertools.product(saves, lse_choices):
            forward_s = written_s(self.diagram, save)
            if lse:
                forward_s += written_s(with_lse.diagram, [o for o in with_lse.diagram.outputs if o not in self.diagram.outputs])
            variant = {"save": tuple(save), "save_lse": lse}
            for rewrite, summing in itertools.product((True, False) if rewrite_d is None else (rewrite_d,),
                                                      (True, False) if sum_dq is None else (sum_dq,)):
                variant = dict(variant, sum_dq=summing)
                plain = self.grad(rewrite_d=rewrite, key_stream=key_stream, **variant)
                if (rewrite_d is None and not rewrite
                        and plain.source == self.grad(rewrite_d=True, key_stream=key_stream, **variant).source):
                    continue  # no softmax to rewrite: one kernel
                keyed = plain.derivation.schedule
                if sum_dq is None and not summing and (keyed is None or not self.grad(
                        rewrite_d=rewrite, key_stream=key_stream, **dict(variant, sum_dq=True)).derivation.schedule.summed):
                    continue  # no dQ summed over key groups: the same kernel
                chunks = [key_stream] if key_stream is not None or keyed is None else _halvings(keyed.key_stream)
                groups = ([key_group] if key_group is not None or keyed is None
                          else [keyed.key_group] + ([KEY_GROUP] if keyed.key_group > KEY_GROUP else []))
                for chunk, group in itertools.product(chunks, groups):
                    backward = (plain if keyed is None or (chunk, group) == (keyed.key_stream, keyed.key_group)
                                else self.grad(rewrite_d=rewrite, key_stream=chunk, key_group=group, **variant))
                    try:
                        predicted = backward.cost(hardware, **{a: sizes[a] for a in backward.diagram.axes}).time["overlapped_s"]
                    except NapkinError as error:
                        seconds, why = float("inf"), error.message
                    else:  # a profile with no bandwidths prices no time: the defaults then stand
                        seconds, why = ((float(predicted), "") if predicted is not None
                                        else (float("inf"), "no time: the profile has no rates"))
                    summed = bool(keyed is not None and backward.derivation.schedule.summed)
                    options.append(BackwardOption(seconds + forward_s, seconds, forward_s, rewrite, tuple(save), why,
                                                  chunk, lse, summed, group if keyed is not None else None))
        return sorted(options, key=lambda o: (o.seconds, not o.rewrite_d, len(o.save), o.save_lse,
                                              -(o.key_stream if isinstance(o.key_stream, int) else 0), not o.sum_dq,
                                              -(o.key_group if isinstance(o.key_group, int) else 0)))

    def __call__(self, *arrays, backend: str = "numpy", cast: bool = False, hardware: str | None = None,
                 impls: dict | None = None, sizes: dict | None = None, **named):
        """Run the kernel on NumPy arrays; return the output array (a dict of them for several outputs).

        Arguments follow the parameters in signature order, or by name. Sizes are read off the
        shapes (``sizes=`` gives axes no input carries, and symbolic group/stream sizes); the
        Program is ``self.program(hardware, **sizes)``, cached per binding. ``backend``:
        ``"numpy"`` (any machine), ``"cuda"``, ``"opencl"``, or ``"auto"`` (CUDA when a GPU is
        present, else NumPy). ``cast=True`` converts arrays of other dtypes and array-likes.
        ``impls`` implements opaque boxes (NumPy backend). Inputs are copied, never kept or written.
        """
        return _call(self, arrays, named, backend, cast, hardware, impls, sizes)

    def torch_op(self, *, backend: str = "numpy", hardware: str | None = None, save_lse: bool | None = None,
                 grad: bool = True, **sizes: int):
        """This kernel as torch custom ops (``torch.library.custom_op``), forward and derived
        backward, with a fake implementation for tracing: a callable that ``torch.compile`` traces
        with no graph break (``napkin_dsl/torch_op.py``). ``backend`` runs CPU tensors (numpy or
        opencl); ``sizes`` binds axes no input carries and, all axes bound, picks the model's
        backward there. The same text and options give the same op."""
        from .torch_op import torch_op

        return torch_op(self, backend=backend, hardware=hardware, save_lse=save_lse, grad=grad, **sizes)

    def distributed(self, hardware: str | None = None, seed: int = 0, backend: str = "numpy", group=None,
                    **sizes: int) -> dict | None:
        """Run this kernel across the processes of an initialised torch.distributed group (inside a
        torchrun job: gloo on CPUs, NCCL on GPUs), each rank one GPU of a node profile
        (``hardware="H100x8"``), as ``napkin run --devices N`` does: the relabel block's ``gmem``
        clause, else napkin's best partition for the group's size. Every rank calls it; rank 0
        gets the result (errors against the reference, bytes sent against the model's NVLink H),
        the others None (backends/distributed.py)."""
        from .backends.distributed import run_rank

        return run_rank(self, hardware, sizes, seed, backend, group)

    def __repr__(self) -> str:
        n = len(self.diagram.statements)
        return f"<napkin kernel {self.signature()}, {n} statement{'s' if n != 1 else ''}, {self.relabel_text()}>"


@dataclass(frozen=True)
class BackwardOption:
    """One priced choice of :meth:`Kernel.backward_options`: the predicted seconds (backward plus
    the forward's extra saves), the D rewrite, what the forward saves, and why it does not fit."""

    seconds: float
    backward_s: float
    forward_s: float
    rewrite_d: bool
    save: tuple[str, ...]
    refused: str = ""
    key_stream: int | None = None  # the query chunk of FA2's key launch (None: no key launch)
    save_lse: bool = False  # the forward adds an lse output per softmax (Kernel.lse_forward)
    sum_dq: bool = False  # dQ summed over the key groups in the key launch, atomically (not deterministic)
    key_group: int | None = None  # the key launch's group of keys (None: no key launch)


# The other group of keys the backward's options price beside the forward's group of queries: one
# wgmma warpgroup's rows, which a summed dQ computed transposed needs at d = 64
# (paths.wgmma.swapped_products).
KEY_GROUP = 64


def _halvings(size: int, least: int = 16) -> list[int]:
    """``size`` and its halvings while they stay whole multiples of ``least`` (64: 64, 32, 16);
    a symbolic size alone (its binding sizes it)."""
    found = [size]
    if not isinstance(size, int):
        return found
    while found[-1] % 2 == 0 and found[-1] // 2 >= least and (found[-1] // 2) % least == 0:
        found.append(found[-1] // 2)
    return found


def _noted(program, note: str | None):
    """``program`` with ``note`` among its schedule's notes (which the cost report prints)."""
    if note is None:
        return program
    return replace(program, schedule=replace(program.schedule, notes=program.schedule.notes + (note,)))


def _block_text(block: syn.RelabelBlock, kernel: str) -> str:
    """A relabel block (syntax) as source text: every clause (group, split, stream), in the order
    written, so that parsing the text back gives the same block (tests/test_relabel_round_trip.py)."""
    lines = []
    for clauses in block.levels:
        scopes = dict.fromkeys(p.targets for p in clauses.partitions)
        for targets in scopes:
            runs: list[tuple[str, list[str]]] = []  # consecutive partitions of one kind: one list
            for p in clauses.partitions:
                if p.targets != targets:
                    continue
                if runs and runs[-1][0] == p.kind:
                    runs[-1][1].append(f"{p.axis} {p.size}")
                else:
                    runs.append((p.kind, [f"{p.axis} {p.size}"]))
            scope = f" for {', '.join(targets)}" if targets else ""
            lines.append(f"    {clauses.level}{scope}: {'; '.join(f'{kind} ' + ', '.join(items) for kind, items in runs)}\n")
    if block.overlap is not None:
        lines.append(f"    overlap: {block.overlap}\n")
    return f"relabel {kernel} on {block.hardware}:\n" + "".join(lines)


# ---- loading files ---------------------------------------------------------------------------


def _names_a_file(text: str) -> bool:
    """Whether a string given to ``load`` is a path rather than napkin text.

    Napkin text worth loading spans lines (a kernel is a header and statements), so only a
    one-line string can be a path: one that ends in .napkin, names something that exists,
    or holds a path separator and does not begin like napkin text.
    """
    stripped = text.strip()
    if "\n" in text or not stripped:
        return False
    try:
        if stripped.endswith(".napkin") or Path(text).exists():
            return True
    except (OSError, ValueError):  # a name too long for the file system, or with a NUL in it
        return False
    return not stripped.startswith(("kernel", "box", "relabel", "#")) and ("/" in text or "\\" in text)


def _read_file(path: Path) -> str:
    """The text of a napkin file, or a NapkinError that says why it cannot be read."""
    try:
        if not path.exists():
            raise NapkinError(f"no such file: {path}", hint="check the path; napkin files end in .napkin")
        if path.is_dir():
            inside = next(iter(sorted(path.glob("*.napkin"))), None)
            raise NapkinError(f"{path} is a directory, not a napkin file",
                              hint=f"name a file in it, e.g. {inside}" if inside else "name a .napkin file")
        if not path.is_file():
            raise NapkinError(f"{path} is not a regular file", hint="napkin reads .napkin text files")
        # Refuse before reading: a huge file (or a log named by mistake) would only be refused later.
        size = path.stat().st_size
        if size > 4 * syn.MAX_SOURCE_CHARS:
            raise NapkinSyntaxError(
                f"{path}: file is {size:,} bytes; napkin reads at most {syn.MAX_SOURCE_CHARS:,} characters",
                hint="a diagram is a few hundred lines: is this the right file?",
            )
        data = path.read_bytes()
    except OSError as exc:
        raise NapkinError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise NapkinSyntaxError(
            f"not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x})",
            Span(str(path), line, column),
            "napkin files are UTF-8 text; is this the right file?",
        ) from None


def _read_source(path_or_text: str | Path) -> tuple[str, str]:
    """(text, file name) for a path or for source text itself."""
    if isinstance(path_or_text, Path) or _names_a_file(path_or_text):
        path = Path(path_or_text)
        return _read_file(path), str(path)
    return path_or_text, "<string>"


def _expect(function: str, argument: str, value, types: tuple, wanted: str) -> None:
    """Refuse an argument of the wrong Python type with a napkin error naming it.

    The public entry points check their arguments here rather than with typeguard's
    ``@typechecked``, whose import (asyncio, unittest.mock) would be most of ``napkin check``'s start."""
    if not isinstance(value, types) or isinstance(value, bool):
        raise NapkinError(f"{function}(): {argument} must be {wanted}, not {type(value).__name__}")


def load(path_or_text: str | Path, *, hardware: str | None = None) -> dict[str, Kernel]:
    """The kernels of a napkin file (or of napkin text), by name, in file order.

    >>> kernels = load("kernel twice(X: f32[n]) -> Y: f32[n]:\\n    Y[n] = X * 2\\n")
    >>> kernels["twice"]
    <napkin kernel twice(X: f32[n]) -> Y: f32[n], 1 statement, no relabelling>
    """
    _expect("load", "the path or text", path_or_text, (str, Path), "a path or napkin text")
    _expect("load", "hardware", hardware, (str, type(None)), "a profile name or .toml path")
    text, file = _read_source(path_or_text)
    module = syn.parse(text, file)
    checked = check_module(module, hardware=hardware)
    if not checked:
        # An empty file is a mistake (a wrong path, an unsaved editor), not an empty library.
        where = ("this file", Span(file, 1, 1)) if file != "<string>" else ("the napkin text", None)
        raise NapkinError(f"{where[0]} defines no kernel", where[1],
                          "declare one: kernel NAME(X: f32[i]) -> Y: f32[i]:  then its statements, indented")
    return {name: Kernel(kernel, hardware) for name, kernel in checked.items()}


# ---- the decorator -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _FunctionSource:
    """Where a decorated function's parts sit in its Python file, for errors that point there.

    ``doc`` is the docstring as written (Python 3.13 strips the indentation of ``__doc__``,
    which would shift every column); ``line_offset`` and ``column_offset`` map its lines and
    first-line columns into the file; ``spans`` maps each parameter name, and "return", to
    where it is written.
    """

    file: str
    def_span: Span
    doc: str | None
    line_offset: int
    column_offset: int
    spans: dict


def _function_source(function: Callable) -> _FunctionSource:
    """Locate a function's def, docstring and parameters in its source file (if it has one)."""
    unknown = _FunctionSource("<unknown>", Span("<unknown>", 1, 1), function.__doc__, 0, 0, {})
    try:
        file = inspect.getsourcefile(function) or "<unknown>"
        lines, first_line = inspect.getsourcelines(function)
        # An indented def (a method, a nested function) parses inside an `if 1:` block, which
        # keeps every line and column as in the file (dedent would change the docstring).
        shift = 1 if lines[0][:1].isspace() else 0
        tree = ast.parse("if 1:\n" * shift + "".join(lines))
    except (OSError, TypeError, SyntaxError):  # defined in a REPL or exec, or a lambda mid-expression
        return unknown
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    node = next((n for n in functions if n.name == function.__name__), functions[0] if functions else None)
    if node is None:
        return unknown

    def span_at(lineno: int, col_offset: int) -> Span:
        # ast counts columns in UTF-8 bytes; spans count characters.
        original = lines[lineno - 1 - shift].rstrip("\r\n")
        column = len(original.encode()[:col_offset].decode(errors="ignore"))
        return Span(file, first_line + lineno - 1 - shift, column + 1, original)

    arguments = node.args
    spans = {a.arg: span_at(a.lineno, a.col_offset)
             for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs + [arguments.vararg, arguments.kwarg] if a}
    def_span = span_at(node.lineno, node.col_offset)
    spans["return"] = span_at(node.returns.lineno, node.returns.col_offset) if node.returns else def_span
    first = node.body[0] if node.body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)):
        return _FunctionSource(file, def_span, function.__doc__, def_span.line - 1, 0, spans)
    doc = first.value
    quote = span_at(doc.lineno, doc.col_offset)
    # The docstring's text starts after its prefix letters and opening quotes.
    after = quote.source_line[quote.column - 1 :]
    prefix = len(after) - len(after.lstrip("rRuU"))
    quotes = 3 if after[prefix:].startswith(('"""', "'''")) else 1
    return _FunctionSource(file, def_span, doc.value, quote.line - 1, quote.column - 1 + prefix + quotes, spans)


def _annotation_type(annotation: Any, name: str, role: str, span: Span) -> syn.TypeSyntax:
    """The napkin type of a parameter or output annotation, or an error naming it."""
    from .types import ArrayTypeMeta, DTypeMeta  # NumPy: loaded for Python kernels, not for .napkin files

    if isinstance(annotation, ArrayTypeMeta):
        return syn.TypeSyntax(annotation.dtype, tuple(annotation.axes), span)
    if isinstance(annotation, DTypeMeta):
        return syn.TypeSyntax(annotation.dtype, None, span)
    what = "the return value" if role == "return" else f"{role} {name!r}"
    written = name if role != "return" else "-> "
    got = "has no annotation" if annotation is inspect.Parameter.empty else f"is annotated {annotation!r}, not a napkin type"
    raise NapkinError(
        f"{what} {got}",
        span,
        f'annotate it like {written}{": " if role != "return" else ""}napkin.f32["q d"] (an array)'
        + (f" or {name}: napkin.f32 (a scalar)" if role == "parameter" else ""),
    )


def _signature(function: Callable, source: _FunctionSource, namespace: dict | None) -> inspect.Signature:
    """The function's signature with its annotations evaluated.

    eval_str resolves annotations written under ``from __future__ import annotations``;
    ``namespace`` (the decorating scope's locals) lets them name local type aliases too.
    """
    try:
        signature = inspect.signature(function, eval_str=True, locals=namespace)
        return signature.replace(
            parameters=[p.replace(annotation=_unquote(p.annotation, function, namespace)) for p in signature.parameters.values()],
            return_annotation=_unquote(signature.return_annotation, function, namespace),
        )
    except Exception as exc:  # any error of the user's annotation expressions
        raise NapkinError(
            f"cannot evaluate the annotations of {function.__name__!r}: {type(exc).__name__}: {exc}", source.def_span,
            'annotations must be napkin types such as napkin.f32["q d"]; is every name they use imported?',
        ) from None


def _unquote(annotation: Any, function: Callable, namespace: dict | None) -> Any:
    """Evaluate what eval_str left a string: a quoted annotation under `from __future__
    import annotations` is a string twice over, and a dict of outputs may quote its values."""
    if isinstance(annotation, str):
        return eval(annotation, function.__globals__, namespace)  # noqa: S307 - the user's own annotation
    if isinstance(annotation, dict):
        return {name: _unquote(value, function, namespace) for name, value in annotation.items()}
    return annotation


def _parameters(function: Callable, signature: inspect.Signature, source: _FunctionSource) -> tuple[syn.Param, ...]:
    params = []
    for name, parameter in signature.parameters.items():
        span = source.spans.get(name, source.def_span)
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            stars = "*" if parameter.kind is inspect.Parameter.VAR_POSITIONAL else "**"
            raise NapkinError(f"kernel {function.__name__!r} cannot take {stars}{name}", span,
                              "name each array a kernel takes as a parameter of its own")
        params.append(syn.Param(name, _annotation_type(parameter.annotation, name, "parameter", span), span))
    return tuple(params)


def _outputs(function: Callable, returned: Any, body: syn.Module, source: _FunctionSource) -> tuple[syn.Param, ...]:
    """Outputs from the return annotation: one array (the last statement's) or a dict of named ones."""
    span = source.spans.get("return", source.def_span)
    if returned is inspect.Signature.empty:
        raise NapkinError(f"kernel {function.__name__!r} needs a return annotation", span,
                          'annotate the result, e.g. -> napkin.f32["q d"], or name several: -> {"O": ..., "L": ...}')
    if isinstance(returned, dict):
        if not returned:
            raise NapkinError(f"kernel {function.__name__!r} returns an empty dict of outputs", span, "name at least one output")
        for name in returned:
            if not (isinstance(name, str) and name.isidentifier()):
                raise NapkinError(f"output name {name!r} is not an identifier", span, 'name outputs like {"O": napkin.f32["q d"]}')
        return tuple(syn.Param(n, _annotation_type(a, n, "output", span), span) for n, a in returned.items())
    if not body.statements:
        raise NapkinError(f"kernel {function.__name__!r} has no statements", source.def_span, "write them in the docstring")
    if typing.get_origin(returned) is tuple:
        # tuple[T1, T2]: the outputs are the targets of the last statements, in order, as a
        # single annotation names the last statement's (docs/notation.md, Kernels)
        members = typing.get_args(returned)
        if not members or Ellipsis in members or len(members) > len(body.statements):
            raise NapkinError(f"kernel {function.__name__!r} returns {returned!r}: a tuple names one type per output, "
                              f"the targets of the last {len(members)} statements", span,
                              'write tuple[T1, T2] for the last two statements, or name them: -> {"O": ..., "L": ...}')
        targets = [s.target for s in body.statements[-len(members):]]
        if len(set(targets)) != len(targets):
            raise NapkinError(f"kernel {function.__name__!r}: the last statements assign {', '.join(targets)} more than once",
                              span, 'name the outputs instead: -> {"O": ..., "L": ...}')
        return tuple(syn.Param(t, _annotation_type(a, t, "output", span), span) for t, a in zip(targets, members, strict=False))
    last = body.statements[-1].target
    return (syn.Param(last, _annotation_type(returned, last, "return", span), span),)


def _check_hardware(hardware: str | None, source: _FunctionSource) -> None:
    """Refuse an unknown hardware= at the def, where the user wrote it, not deep in the checker."""
    if hardware is not None and hardware not in hardware_names():
        close = difflib.get_close_matches(hardware, hardware_names(), n=1)
        raise NapkinError(f"unknown hardware {hardware!r} in @napkin.kernel(hardware=...)", source.def_span,
                          f"did you mean {close[0]!r}?" if close else f"known hardware: {', '.join(hardware_names())}")


def _build(function: Callable, hardware: str | None, relabel: str | None, namespace: dict | None = None) -> Kernel:
    source = _function_source(function)
    file, def_span, doc = source.file, source.def_span, source.doc
    if not doc or not doc.strip():
        raise NapkinError(f"kernel {function.__name__!r} has no docstring", def_span,
                          "write the diagram's statements in the function's docstring")
    _check_hardware(hardware, source)
    body = syn.parse(doc, file, start="body", line_offset=source.line_offset, first_column_offset=source.column_offset)
    signature = _signature(function, source, namespace)
    params = _parameters(function, signature, source)
    outputs = _outputs(function, signature.return_annotation, body, source)
    kdef = syn.KernelDef(function.__name__, params, outputs, body.statements, def_span)
    relabels = tuple(body.relabels)
    if relabel is not None:
        if relabels:
            raise NapkinError(f"kernel {function.__name__!r} has a relabel block in its docstring and a relabel= argument",
                              def_span, "keep one of them")
        if hardware is None:
            raise NapkinError("relabel= needs hardware= to say which levels it names", def_span, 'add hardware="H100"')
        text = f"relabel {function.__name__} on {hardware}:\n" + textwrap.indent(textwrap.dedent(relabel).strip(), "    ") + "\n"
        relabels = syn.parse(text, f"{file} (relabel= of {function.__name__})").relabels
    module = syn.Module(file, doc, (), (kdef,), relabels)
    checked = check_module(module, hardware=hardware)
    return Kernel(checked[function.__name__], hardware, function)


def kernel(function: Callable | None = None, *, hardware: str | None = None, relabel: str | None = None):
    """Make a napkin kernel of a Python function whose docstring holds the diagram.

    Use it bare (``@napkin.kernel``) or with arguments
    (``@napkin.kernel(hardware="H100", relabel="smem: group q 128; stream x 64")``).

    >>> import napkin_dsl as napkin
    >>> @napkin.kernel
    ... def scale(X: napkin.f32["n"], alpha: napkin.f32) -> napkin.f32["n"]:
    ...     '''Y[n] = X * alpha'''
    >>> scale.diagram.statements[0].target
    'Y'
    """
    # The decorating scope's locals, so that string annotations may name local aliases.
    if function is not None and not callable(function):
        raise NapkinError(f"kernel(): decorates a function, not {type(function).__name__}")
    _expect("kernel", "hardware", hardware, (str, type(None)), "a profile name or .toml path")
    _expect("kernel", "relabel", relabel, (str, type(None)), "relabel clause text")
    namespace = sys._getframe(1).f_locals
    if function is None:
        return lambda f: _build(f, hardware, relabel, namespace)
    return _build(function, hardware, relabel, namespace)


# ---- calling a kernel --------------------------------------------------------------------------


def _sizes_from_shapes(diagram, arrays: dict, sizes: dict) -> dict | None:
    """Axis sizes read off the shapes without checking or copying anything; None when they do
    not bind every axis consistently (``binding.bind`` then says what is wrong)."""
    found = dict(sizes)
    for name, value in arrays.items():
        array = diagram.arrays.get(name)
        shape = getattr(value, "shape", None)
        if array is None or shape is None or len(shape) != len(array.axes):
            return None
        for axis, size in zip(array.axes, shape, strict=False):
            if size <= 0 or found.setdefault(axis, int(size)) != size:
                return None
    return found if all(axis in found for axis in diagram.axes) else None


def _call(kernel: Kernel, arrays: tuple, named: dict, backend: str, cast: bool, hardware, impls, sizes) -> Any:
    from .backends.driver import cuda_available
    from .backends.numpy import check_memory, run_program
    from .binding import arguments, bind

    diagram = kernel.diagram
    if backend not in ("numpy", "cuda", "opencl", "auto"):
        raise NapkinError(f"unknown backend {backend!r}", hint="use numpy, cuda, opencl or auto")
    array_args, scalar_args = arguments(diagram, arrays, named)
    if _records_grad(array_args, scalar_args):
        return _call_with_autograd(kernel, array_args, scalar_args, backend, cast, hardware, impls, sizes)
    # sizes= may bind axes (checked by bind) and the relabel block's symbolic group/stream sizes.
    symbols = kernel.partition_symbols
    sizes = dict(sizes or {})
    partition_sizes = {k: v for k, v in sizes.items() if k in symbols and k not in diagram.axes}
    axis_sizes = {k: v for k, v in sizes.items() if k not in partition_sizes}
    if backend == "auto":
        backend = "cuda" if cuda_available() else "numpy"
    # Refuse sizes that would not fit in memory before bind copies anything.
    guessed = _sizes_from_shapes(diagram, array_args, {k: v for k, v in axis_sizes.items() if isinstance(v, int) and v > 0})
    if guessed is not None:
        check_memory(kernel.program(hardware, **guessed, **partition_sizes), tiles=backend == "numpy")
    # The CUDA backend reads the caller's CUDA arrays in place; the outputs go back as the caller's array type.
    binding = bind(diagram, array_args, scalar_args, cast, sizes=axis_sizes, keep_on_device=backend == "cuda")
    if backend == "cuda":
        return _call_cuda(kernel, binding, partition_sizes, hardware)
    program = kernel.program(hardware, **binding.sizes, **partition_sizes)
    selected = kernel._selection(hardware, program, **binding.sizes, **partition_sizes) if backend == "numpy" else None
    # As `napkin run` shows it: on a terminal's stderr after about a second, never into a pipe,
    # a notebook or captured output (progress.wanted); a bar of blocks done on NumPy.
    with Progress(f"run {kernel.name} on {backend}", enabled=wanted()) as progress:
        outputs, _ = run_program(backend, program, binding.inputs, binding.scalars, impls, progress, selected=selected)
    outputs = binding.deliver(outputs)
    return outputs[diagram.outputs[0]] if len(diagram.outputs) == 1 else outputs


def _call_cuda(kernel: Kernel, binding, partition_sizes: dict, hardware):
    """A call on the GPU runs what :meth:`Kernel.compile` builds (one road): planned and tuned
    on the profile of the GPU it runs on (``hardware``, else the driver's name for the device,
    ``hardware.profile_for_device``), for the arch the model priced there, cached per kernel,
    sizes, arch and profile, so that a repeated call binds and launches only."""
    from .backends.cuda import current_device, launch
    from .hardware import load_hardware, profile_for_device

    device = current_device()
    target = hardware or profile_for_device(device.name)
    arch = load_hardware(target).arch_for_device(device.arch)
    compiled = kernel.compile(arch, target, **binding.sizes, **partition_sizes)
    outputs = binding.deliver(launch(compiled, binding.inputs, binding.scalars))
    return outputs[kernel.diagram.outputs[0]] if len(kernel.diagram.outputs) == 1 else outputs


# ---- torch.autograd ------------------------------------------------------------------------------


def _requires_grad(value) -> bool:
    return getattr(value, "requires_grad", False) is True


def _records_grad(array_args: dict, scalar_args: dict) -> bool:
    """Whether this call is recorded for torch.autograd: a torch tensor that requires grad, with
    gradients enabled (under ``torch.no_grad()`` the call just runs, on the tensors' values)."""
    if not any(_requires_grad(v) for v in (*array_args.values(), *scalar_args.values())):
        return False
    import torch

    return torch.is_grad_enabled()


def _call_with_autograd(kernel: Kernel, array_args: dict, scalar_args: dict, backend, cast, hardware, impls, sizes):
    """Run the kernel inside a ``torch.autograd.Function`` whose backward runs the derived
    backward kernel (:meth:`Kernel.grad`) on the same backend, from the inputs, the saved
    outputs it reads and the output cotangents. Gradients come back in the inputs' dtypes; the
    backward kernel accumulates in f32 (every napkin intermediate is f32 on chip)."""
    import torch

    from .torch_op import backward_arguments, input_gradients

    diagram = kernel.diagram
    for name, value in scalar_args.items():
        if _requires_grad(value):
            raise NotImplementedError(f"scalar {name} requires grad: napkin derives no gradient for scalar parameters; "
                                      f"pass {name}.item() or {name}.detach()")
    names = list(array_args)
    carried = {axis: int(extent) for name, value in array_args.items() if name in diagram.arrays
               for axis, extent in zip(diagram.arrays[name].axes, getattr(value, "shape", ()), strict=False)}
    forward_sizes = {**carried, **(sizes or {})}
    # the model's backward at these shapes (priced once per shape): FA2's D, the key launch's chunk
    backward_kernel = kernel.grad(hardware=hardware, **{a: forward_sizes[a] for a in diagram.axes if a in forward_sizes})
    derivation = backward_kernel.derivation
    # the forward that runs: this kernel, or with the lse outputs the chosen backward reads added
    running = kernel.lse_forward() if derivation.auxiliary else kernel
    options = {"backend": backend, "cast": cast, "hardware": hardware, "impls": impls, "sizes": sizes}
    # The backward's sizes: an axis its inputs may not carry (an input's axis reaches it only
    # through a gradient output) comes from the forward's shapes; of the forward's partition
    # sizes, only those of the groups it keeps (grad.py keeps the groups on axes that all its
    # statements share).
    known = set(backward_kernel.diagram.axes) | backward_kernel.partition_symbols
    backward_sizes = {k: v for k, v in forward_sizes.items() if k in known}
    backward_options = {**options, "sizes": backward_sizes or None}

    class NapkinCall(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *tensors):
            detached = {name: t.detach() if isinstance(t, torch.Tensor) else t for name, t in zip(names, tensors, strict=True)}
            result = _call(running, (), {**detached, **scalar_args}, **options)
            outputs = result if len(running.diagram.outputs) > 1 else {running.diagram.outputs[0]: result}
            ctx.save_for_backward(*tensors, *(outputs[o] for o in running.diagram.outputs))
            return tuple(outputs[o] for o in diagram.outputs)  # the caller's outputs; an added lse stays saved

        @staticmethod
        def backward(ctx, *cotangents):
            saved = [t.detach() for t in ctx.saved_tensors]
            inputs = dict(zip(names, saved[:len(names)], strict=True))
            outputs = dict(zip(running.diagram.outputs, saved[len(names):], strict=True))
            call = backward_arguments(derivation, backward_kernel.diagram.params, inputs, scalar_args, outputs,
                                      dict(zip(diagram.outputs, cotangents, strict=True)))
            result = _call(backward_kernel, (), call, **backward_options)
            result = result if len(backward_kernel.diagram.outputs) > 1 else {backward_kernel.diagram.outputs[0]: result}
            return input_gradients(derivation, names, inputs, result, ctx.needs_input_grad)

    tensors = [value for value in array_args.values()]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        foreign = [n for n, t in array_args.items() if not isinstance(t, torch.Tensor)]
        raise NapkinError(f"a call recorded for torch.autograd takes torch tensors only; {', '.join(foreign)} "
                          f"{'is' if len(foreign) == 1 else 'are'} not", hint="pass torch.as_tensor(...) of them")
    outputs = NapkinCall.apply(*tensors)
    return outputs[0] if len(diagram.outputs) == 1 else dict(zip(diagram.outputs, outputs, strict=True))
