"""Window reads: the arithmetic of ``X[b c (2*p + i)]`` at bound sizes.

A window read (``diagram.Window``) reads a kernel parameter through affine indices: a strided,
dilated or padded convolution's input, a pooling's. The checker turns it into a **view**, an
array over the axes the indices use (``X_win[b c p i]``), which every later stage reads as an
input. This module holds what needs the sizes: the range each index reads (and whether it
stays inside the array), the size of an axis that only a window read implies (a convolution's
output length), the gather of a view from its parameter (the reference's, and the NumPy
backend's), and what loading a tile of a view moves from device memory: the box of the
parameter its indices span, halo included (the model's count and the NumPy backend's).
"""

from __future__ import annotations

from . import algebra
from .diagram import AffineIndex, Array, Diagram
from .errors import NapkinTypeError, Span, raise_collected


def _value(expr, sizes: dict) -> int | None:
    """An integer expression of sizes at ``sizes``, or None while one of its sizes is unbound."""
    expr = algebra.as_expr(expr)
    symbols = expr.free_symbols
    if any(s.name not in sizes for s in symbols):
        return None
    value = expr.subs({s: sizes[s.name] for s in symbols}) if symbols else expr
    return int(value)


def integer_at(expr, sizes: dict) -> int:
    """A window's coefficient or offset (an integer, or a size expression: ``len(c)``) at ``sizes``."""
    value = _value(expr, sizes)
    if value is None:
        raise ValueError(f"napkin bug: {expr} is asked for before its sizes are bound")
    return value


def index_bounds(index: AffineIndex, sizes: dict) -> tuple[int, int] | None:
    """(lowest, highest) value ``index`` takes over its axes at ``sizes``; None while unbound."""
    low = high = _value(index.offset, sizes)
    if low is None:
        return None
    for axis, coefficient in index.terms:
        c, n = _value(coefficient, sizes), sizes.get(axis)
        if c is None or n is None:
            return None
        low, high = low + min(0, c * (n - 1)), high + max(0, c * (n - 1))
    return low, high


def padding_below(view: Array, dim: int, sizes: dict) -> int:
    """How far below 0 a padded view's index ``dim`` reaches: the padding at the array's start,
    taken as the padding at its end too (a convolution's symmetric padding)."""
    bounds = index_bounds(view.window.indices[dim], sizes)
    return 0 if bounds is None or view.window.pad is None else max(0, -bounds[0])


def inferred_sizes(diagram: Diagram, bound: dict) -> dict[str, tuple[int, str]]:
    """Sizes of axes no argument binds, read off the window reads that use them: the largest
    size whose reads stay inside the array (a valid convolution's output length), padded by
    as much past the end as the index reaches before the start (torch's ``padding``).

    ``bound``: axis -> size, for the axes bound so far. Returns axis -> (size, the read)."""
    sizes, found = dict(bound), {}
    changed = True
    while changed:
        changed = False
        for view in diagram.views:
            source = diagram.arrays[view.window.source]
            for dim, index in enumerate(view.window.indices):
                unbound = [(a, c) for a, c in index.terms if a not in sizes]
                n = sizes.get(source.axes[dim])
                if len(unbound) != 1 or n is None:
                    continue
                axis, coefficient = unbound[0]
                step = _value(coefficient, sizes)
                rest = index_bounds(AffineIndex(tuple(t for t in index.terms if t[0] != axis), index.offset), sizes)
                if step is None or step <= 0 or rest is None:
                    continue
                below = max(0, -rest[0]) if view.window.pad is not None else 0
                size = (n - 1 + below - rest[1]) // step + 1
                if size >= 1:
                    sizes[axis] = size
                    found[axis] = (size, f"the window read {view.window.text(source.axes)}")
                    changed = True
    return found


def window_problems(diagram: Diagram, sizes: dict) -> list[tuple[str, Span | None]]:
    """Why a window read at ``sizes`` would read outside its array: each unpadded index whose
    range leaves 0 to the axis's size - 1, with the range it reads, and where the read is."""
    problems = []
    for view in diagram.views:
        source = diagram.arrays[view.window.source]
        for axis, index in zip(source.axes, view.window.indices, strict=True):
            bounds, n = index_bounds(index, sizes), sizes.get(axis)
            if bounds is None or n is None or view.window.pad is not None or (bounds[0] >= 0 and bounds[1] < n):
                continue
            shown = ", ".join(f"{a}={sizes[a]}" for a in index.axes)
            fix = "or raise its offset" if bounds[0] < 0 else f"or bind smaller sizes of {', '.join(index.axes)}"
            problems.append((
                f"the window read {view.window.text(source.axes)} reads {source.name}'s axis {axis} at {index} from "
                f"{bounds[0]} to {bounds[1]} ({shown}), outside 0 to {n - 1}; pad it, pad({view.window.text(source.axes)}, 0), "
                f"{fix}", view.span))
    return problems


def completed_sizes(diagram: Diagram, sizes: dict) -> dict:
    """``sizes`` with the sizes a window read implies (:func:`inferred_sizes`) for the axes it
    leaves unbound; raises :class:`NapkinTypeError`, with a caret at the read, where an
    unpadded read would leave its array."""
    if not diagram.views:
        return sizes
    bound = {axis: value for axis, value in sizes.items() if isinstance(value, int)}
    completed = dict(sizes)
    for axis, (size, _) in inferred_sizes(diagram, bound).items():
        completed.setdefault(axis, size)
    problems = window_problems(diagram, {a: v for a, v in completed.items() if isinstance(v, int)})
    raise_collected([NapkinTypeError(message, span, "a window read stays inside its array unless it is padded")
                     for message, span in problems])
    return completed


def gather(view: Array, source, sizes: dict, ranges: dict | None = None):
    """The view's values, C-contiguous in its axes' order and the source's dtype: each element
    the source at the window's indices, or the pad value outside it (NumPy arrays). ``ranges``:
    view axis -> (start, stop) of one tile of the view (default: the whole view)."""
    import numpy as np  # here, not at the top: `napkin check` plans without NumPy

    axes = view.axes
    rank = len(axes)
    ranges = ranges or {a: (0, sizes[a]) for a in axes}
    positions, inside = [], np.ones((1,) * rank, dtype=bool)
    for dim, index in enumerate(view.window.indices):
        at = np.full((1,) * rank, _value(index.offset, sizes), dtype=np.int64)
        for axis, coefficient in index.terms:
            shape = [1] * rank
            start, stop = ranges[axis]
            shape[axes.index(axis)] = stop - start
            at = at + (np.arange(start, stop, dtype=np.int64) * _value(coefficient, sizes)).reshape(shape)
        n = source.shape[dim]
        inside = inside & (at >= 0) & (at < n)
        positions.append(np.clip(at, 0, n - 1))
    values = source[tuple(positions)]
    values = np.broadcast_to(values, tuple(ranges[a][1] - ranges[a][0] for a in axes))
    if view.window.pad is not None:
        values = np.where(inside, values, np.array(view.window.pad).astype(source.dtype))
    return np.ascontiguousarray(values)


# ---- what a load of a view moves from device memory -----------------------------------------------


def tile_footprint(view: Array, ranges: dict, source_shape: tuple, sizes: dict) -> int:
    """Elements of the view's parameter that a load of one tile of the view reads from device
    memory: the box its indices span inside the array (a load reads whole rows of it), found
    from the indices themselves. ``ranges``: view axis -> (start, stop) of the tile."""
    total = 1
    for dim, index in enumerate(view.window.indices):
        total *= inside_span(index, ranges, source_shape[dim], sizes)
    return total


def inside_span(index: AffineIndex, ranges: dict, length: int, sizes: dict) -> int:
    """How many values of an array's dimension of ``length`` lie between the least and the
    greatest value ``index`` takes inside it over ``ranges`` (axis -> (start, stop)): the box a
    tile reads along that dimension, found from the values themselves (a strided index skips
    some, and the first and last inside need not be the span's clipped ends)."""
    offset = _value(index.offset, sizes)
    terms = sorted(((abs(_value(c, sizes)), c, ranges[axis]) for axis, c in index.terms), key=lambda term: term[0])
    low = high = offset
    reach, contiguous = 0, True
    for magnitude, coefficient, (start, stop) in terms:
        c = _value(coefficient, sizes)
        low, high = low + min(c * start, c * (stop - 1)), high + max(c * start, c * (stop - 1))
        if stop - start > 1:
            contiguous = contiguous and magnitude <= reach + 1  # no value between is skipped
            reach += magnitude * (stop - start - 1)
    if contiguous:  # every value of [low, high] is taken: the clipped span (the model's hot path)
        return max(0, min(high, length - 1) - max(low, 0) + 1)
    import numpy as np

    at = np.array([_value(index.offset, sizes)], dtype=np.int64)
    for axis, coefficient in index.terms:
        start, stop = ranges[axis]
        at = np.add.outer(at, np.arange(start, stop, dtype=np.int64) * _value(coefficient, sizes)).ravel()
    inside = at[(at >= 0) & (at < length)]
    return int(inside.max() - inside.min() + 1) if inside.size else 0


def index_span(index: AffineIndex, tiles: dict):
    """How many values an index spans over a tile (``tiles``: its axes' extents), unclipped:
    ``1 + sum(|c| (t - 1))``; a size coefficient (``len(c)``) is positive."""
    return 1 + sum((abs(c) if algebra.as_expr(c).is_number else c) * (tiles[a] - 1) for a, c in index.terms)


def load_footprint(view: Array, sizes: dict, tiles: dict, source_sizes: tuple):
    """The model's count of what the loads of ``view`` from device memory move in a launch, its
    tiles' boxes in the parameter summed over the tiles (:func:`tile_footprint` finds one by
    its indices). ``tiles``: view axis -> its tile extent (the axis's size where it is whole);
    ``sizes``: axis -> size. Exact, clipped to the array, at bound sizes; with a symbolic size,
    a tile's box unclipped times the number of tiles."""
    if not all(isinstance(sizes.get(a), int) and isinstance(tiles.get(a), int) for a in view.axes) \
            or not all(isinstance(n, int) for n in source_sizes):
        span = algebra.Integer(1)
        for index in view.window.indices:
            span *= index_span(index, tiles)
        count = algebra.Integer(1)
        for axis in view.axes:
            count *= algebra.as_expr(sizes[axis]) / tiles[axis]
        return span * count
    total = 1
    for dim, index in enumerate(view.window.indices):  # each axis indexes one dim: the sum factors
        starts = [range(0, sizes[a], tiles[a]) for a in index.axes]
        summed = 0
        for origin in _product(starts):
            ranges = {axis: (start, min(start + tiles[axis], sizes[axis])) for axis, start in zip(index.axes, origin, strict=True)}
            summed += inside_span(index, ranges, source_sizes[dim], sizes)
        total *= summed
    return algebra.Integer(total)


def _product(ranges: list) -> list[tuple]:
    """Every combination of one value from each of ``ranges`` (itertools.product, as a list)."""
    import itertools

    return list(itertools.product(*ranges))
