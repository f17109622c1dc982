"""Argument validation shared by every public entry point (one place per rule).

Each check raises ``ValueError`` or ``TypeError`` naming the argument and the rule it breaks.
All checks run at trace time on static shapes and dtypes; none touches array values.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .layout import SCALE_LAYOUTS, scale_view_2d, swizzled_shape
from .mx_format import BLOCK_SIZE, ROUNDING_MODES, SCALE_MODES

INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
OUTPUT_DTYPES = INPUT_DTYPES


def check_scale_mode(scale_mode, name="scale_mode"):
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"{name} must be one of {SCALE_MODES}, got {scale_mode!r}")


def check_rounding(rounding, key, name="rounding"):
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"{name} must be one of {ROUNDING_MODES}, got {rounding!r}")
    if rounding == "stochastic":
        if key is None:
            raise ValueError(f'{name}="stochastic" needs a PRNG key: pass key=jax.random.key(...)')
        import jax

        kd = getattr(key, "dtype", None)
        typed = kd is not None and jax.dtypes.issubdtype(kd, jax.dtypes.prng_key) and jnp.ndim(key) == 0
        # a legacy raw key has the shape of the default implementation's key data
        raw_shape = RAW_KEY_SHAPES.get(str(jax.config.jax_default_prng_impl), (2,))
        raw = not typed and str(kd) == "uint32" and tuple(jnp.shape(key)) == raw_shape
        if not (typed or raw):
            raise TypeError(
                f"key must be one PRNG key (jax.random.key(seed), or a legacy uint32{list(raw_shape)} "
                f"jax.random.PRNGKey of the default implementation {jax.config.jax_default_prng_impl}), got "
                f"{type(key).__name__} with dtype {kd} and shape {jnp.shape(key)}"
            )


RAW_KEY_SHAPES = {"threefry2x32": (2,), "rbg": (4,), "unsafe_rbg": (4,)}
"""Shape of a legacy raw key (``jax.random.PRNGKey``) per ``jax_default_prng_impl``."""


def check_interpret(interpret, fn):
    """A kernel's ``interpret`` flag must be a bool (a truthy string would silently choose the
    interpreter); TypeError naming ``fn``."""
    if not isinstance(interpret, bool):
        raise TypeError(f"{fn}: interpret must be a bool, got {interpret!r}")


def power_of_two(v, name, most=None) -> int:
    """``v`` (an int or a NumPy integer: tile sizes may come from NumPy) as an int, if a power of
    two >= 1 (and <= ``most``); ValueError naming ``name`` otherwise."""
    ok = isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and v >= 1 and not v & (v - 1)
    if not ok or (most is not None and v > most):
        bound = f" at most {most}" if most is not None else ""
        raise ValueError(f"{name} must be a power of two >= 1{bound} (an int), got {v!r}")
    return int(v)


def check_static_shape(x, fn):
    """A Pallas kernel's grid needs concrete dims: ValueError naming ``fn`` for a symbolic one
    (``jax.export`` shape polymorphism; the jnp paths take those)."""
    if any(is_symbolic(d) for d in x.shape):
        raise ValueError(f"{fn}: x has symbolic dims {tuple(x.shape)} (jax.export shape polymorphism); the kernel's "
                         "grid needs concrete dims: use jax_mxfp4.quantize, which takes the jnp path there")


def check_scale_layout(scale_layout, name="scale_layout"):
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"{name} must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")


def check_float_input(x, name="x"):
    # MXFP4Array marks itself (checks sits below jax_mxfp4.array and does not import it).
    if getattr(type(x), "_IS_MXFP4_ARRAY", False):
        raise TypeError(f"{name} is already an MXFP4Array; pass the float array (or dequantize it first)")
    dtype = getattr(x, "dtype", None)
    if dtype is None or jnp.dtype(dtype) not in INPUT_DTYPES:
        raise TypeError(
            f"{name} must be a float32, bfloat16 or float16 array to quantize to MXFP4, got dtype {dtype}"
        )


def normalize_axis(axis, ndim, name="axis"):
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"{name} must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis} is out of range for an array of rank {ndim}")
    return int(axis) % ndim


def is_symbolic(d) -> bool:
    """Whether ``d`` is a symbolic dimension (``jax.export`` shape polymorphism)."""
    import jax

    return jax.export.is_symbolic_dim(d)


def is_dim(d) -> bool:
    """A non-negative int, or a symbolic dimension (``jax.export.symbolic_shape``)."""
    if is_symbolic(d):
        return True
    return isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0


def resolve_symbolic(shape, axis, child, packed: bool, axis_last: bool):
    """``shape`` (a static logical shape) with its symbolic dims replaced by the concrete sizes
    of ``child``: the data child, the logical shape with ``axis`` halved (``packed`` bytes) or
    not, in place or moved last (``axis_last``). For the result of a shape-polymorphic export
    called with concrete sizes; otherwise (no symbolic dim, a child without a concrete shape of
    the same rank) ``shape`` unchanged."""
    cs = getattr(child, "shape", None)
    if (not any(is_symbolic(d) for d in shape) or cs is None or len(cs) != len(shape)
            or any(is_symbolic(d) for d in cs) or not 0 <= axis < len(shape)):
        return shape
    cs = tuple(int(d) for d in cs)
    if axis_last:
        cs = cs[:axis] + cs[-1:] + cs[axis:-1]
    return cs[:axis] + (cs[axis] * (2 if packed else 1),) + cs[axis + 1:]


def check_concrete_block_dim(length, what: str):
    """ValueError naming shape polymorphism if ``length`` (a quantized or contracting length) is a
    symbolic dimension: the 32-element blocks, the packed bytes and the scales are laid out from
    it, so it must be a concrete multiple of 32 in an export; the other dims may be symbolic."""
    if is_symbolic(length):
        raise ValueError(
            f"{what} has the symbolic length {length}: under shape polymorphism (jax.export with symbolic "
            f"shapes) the quantized / contracting dim must be a concrete multiple of the MXFP4 block size "
            f"{BLOCK_SIZE} (OCP MX v1.0 §5.1: one E8M0 scale per 32 elements); only the other dims (batch, "
            "rows, columns) may be symbolic"
        )


def check_block_multiple(length, axis, name="x"):
    check_concrete_block_dim(length, f"{name}: the quantized axis {axis}")
    if length % BLOCK_SIZE:
        raise ValueError(
            f"{name}: the quantized axis {axis} has length {length}, which is not a multiple of the "
            f"MXFP4 block size {BLOCK_SIZE} (OCP MX v1.0 §5.1: one E8M0 scale per 32 elements)"
        )


def check_mx_dtype(dtype, name="MXFP4Array dtype"):
    """The logical dtype of an MXFP4Array: the float dtype it was quantized from."""
    try:
        ok = dtype is not None and jnp.dtype(dtype) in INPUT_DTYPES
    except TypeError:
        ok = False
    if not ok:
        raise TypeError(f"{name} must be float32, bfloat16 or float16 (the quantized input's dtype), got {dtype!r}")


def check_output_dtype(dtype, name="preferred_element_type"):
    if dtype is None:
        return jnp.dtype(jnp.float32)
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {dtype!r}") from None
    if dt not in OUTPUT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {dt}")
    return dt


def dot_output_dtype(preferred_element_type, lhs_dtype, rhs_dtype, name="preferred_element_type"):
    """Output dtype of an MXFP4 ``dot_general``: ``preferred_element_type`` if given (float32,
    bfloat16 or float16), else what ``jax.lax.dot_general`` returns for operands of these
    (logical) dtypes, e.g. bfloat16 x bfloat16 -> bfloat16, bfloat16 x float32 -> float32.
    Accumulation stays float32 either way. Raises ValueError for an unsupported dtype."""
    if preferred_element_type is not None:
        return check_output_dtype(preferred_element_type, name)
    import jax
    from jax import lax

    one = lambda dt: jax.ShapeDtypeStruct((1, 1), jnp.dtype(dt))  # noqa: E731
    dn = (((1,), (0,)), ((), ()))
    out = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dn), one(lhs_dtype), one(rhs_dtype))
    return check_output_dtype(out.dtype, name)


def check_mx_array_parts(data, scales, axis, shape, scale_layout):
    """Shape and dtype contract of an ``MXFP4Array``'s children (see its docstring)."""
    ndim = len(shape)
    if not all(is_dim(d) for d in shape):
        raise TypeError(f"MXFP4Array shape must be a tuple of non-negative ints (or symbolic dims), got {shape!r}")
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not 0 <= axis < ndim:
        raise ValueError(f"MXFP4Array axis must be an int in [0, {ndim}), got {axis!r}")
    check_block_multiple(shape[axis], axis, "MXFP4Array shape")
    if not hasattr(data, "dtype") or not hasattr(scales, "dtype"):
        raise TypeError(
            f"MXFP4Array data and scales must be arrays, got {type(data).__name__} and {type(scales).__name__}"
        )
    if jnp.dtype(data.dtype) != jnp.uint8:
        raise TypeError(f"MXFP4Array data must be uint8 (packed E2M1 pairs), got {data.dtype}")
    if jnp.dtype(scales.dtype) != jnp.dtype(jnp.float8_e8m0fnu):
        raise TypeError(f"MXFP4Array scales must be float8_e8m0fnu, got {scales.dtype}")
    want_data = tuple(d // 2 if i == axis else d for i, d in enumerate(shape))
    if tuple(data.shape) != want_data:
        raise ValueError(
            f"MXFP4Array data shape {tuple(data.shape)} does not match logical shape {shape} with "
            f"axis {axis} packed two elements per byte (expected {want_data})"
        )
    if scale_layout == "plain":
        want = tuple(d // BLOCK_SIZE if i == axis else d for i, d in enumerate(shape))
    else:
        want = swizzled_shape(*scale_view_2d(shape, axis))
    if tuple(scales.shape) != tuple(want):
        raise ValueError(
            f"MXFP4Array scales shape {tuple(scales.shape)} does not match the {scale_layout!r} "
            f"layout for logical shape {shape}, axis {axis} (expected {tuple(want)})"
        )


PRECISIONS = ("default", "high", "highest")
_PRECISION_NAMES = {  # jax.lax.Precision's names and string aliases (jax/_src/lax/lax.py)
    "default": "default", "fastest": "default", "bfloat16": "default",
    "high": "high", "tensorfloat32": "high",
    "highest": "highest", "float32": "highest",
}


def canonical_precision(precision, name="precision") -> str:
    """"default" | "high" | "highest" from a ``lax.dot_general`` ``precision`` argument.

    Accepts None (-> "default"), a ``jax.lax.Precision``, its string names ("default",
    "high", "highest", "fastest", "bfloat16", "tensorfloat32", "float32") or a pair (lhs, rhs), of
    which the stricter counts. Raises ValueError for anything else (e.g. a DotAlgorithmPreset).
    """
    if precision is None:
        return "default"
    if isinstance(precision, (tuple, list)) and len(precision) == 2:
        both = [canonical_precision(p, name) for p in precision]
        return max(both, key=PRECISIONS.index)
    from jax import lax

    if isinstance(precision, lax.Precision):
        return _PRECISION_NAMES[precision.name.lower()]
    if isinstance(precision, str) and precision.lower() in _PRECISION_NAMES:
        return _PRECISION_NAMES[precision.lower()]
    raise ValueError(
        f"{name} must be None, a jax.lax.Precision, one of {sorted(_PRECISION_NAMES)} or a pair of "
        f"those, got {precision!r}"
    )


def stricter_precision(*precisions: str) -> str:
    """The strictest of canonical precision names ("default" < "high" < "highest")."""
    return max(precisions, key=PRECISIONS.index)
