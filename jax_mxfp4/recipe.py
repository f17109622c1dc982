"""``Recipe``: how ``dot_general`` quantizes its float operands and which backend runs the GEMM."""

from __future__ import annotations

import dataclasses
import numbers

from . import checks
from .hadamard import check_block

BACKENDS = ("auto", "xla", "ffi-cpu", "hipblaslt", "scaled_dot", "pallas", "fp8")
PASS_PRECISIONS = ("mxfp4", "bf16")
GRAD_ROUNDINGS = ("stochastic", "nearest")
PASSES = ("fprop", "dgrad", "wgrad")


def _hadamard_passes(value) -> tuple[str, ...]:
    """``Recipe.hadamard`` normalized: the rotated passes as a tuple in ``PASSES`` order."""
    if value is None or value is False or value == "none":
        return ()
    if value is True:  # the original boolean option: the wgrad operands only
        return ("wgrad",)
    if isinstance(value, str):
        value = PASSES if value == "all" else (value,)
    elif not isinstance(value, (tuple, list, set, frozenset)):
        raise TypeError(
            f"Recipe.hadamard must be a bool, a pass name, 'all' or a tuple of pass names from {PASSES}, "
            f"got {value!r}"
        )
    unknown = [v for v in value if v not in PASSES]
    if unknown:
        raise ValueError(f"Recipe.hadamard: unknown pass name(s) {unknown!r}; the passes are {PASSES} (or 'all')")
    return tuple(p for p in PASSES if p in value)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Frozen, hashable options for :func:`jax_mxfp4.dot_general` (usable as a static argument).

    Attributes:
      scale_mode: E8M0 shared-scale rule for float operands quantized on the fly: "floor" (OCP MX
        v1.0 §6.3), "ceil", "even" (default; AMD ecosystem) or "rceil" (NVIDIA ecosystem).
      scale_layout: "plain" or "swizzled" (hipBLASLt 32x8 pre-swizzled scales).
      backend: "auto" (default; :func:`jax_mxfp4.explain` tells what it picks and why) or one of
        "xla", "ffi-cpu", "hipblaslt", "scaled_dot", "pallas", "fp8". The environment variable
        ``JAX_MXFP4_BACKEND`` overrides "auto". Naming a backend that cannot run raises an error.
      fprop, dgrad, wgrad: precision of each GEMM of a linear layer's training step, "mxfp4"
        (default) or "bf16" (used by the custom VJP of :func:`jax_mxfp4.dot_general`).
      grad_rounding: element rounding of the gradient operand dY in dgrad and wgrad,
        "stochastic" (default, as in the published FP4 training recipes) or "nearest";
        activations and weights always use "nearest".
      hadamard: which MXFP4 passes rotate both of their operands along their contraction axis
        with a blockwise random Hadamard transform before quantizing them (the exact product is
        unchanged; outliers are spread before 4-bit quantization; :mod:`jax_mxfp4.hadamard`).
        A pass name ("fprop", "dgrad", "wgrad"), "all", or a tuple/list/set of pass names;
        False/None/() for none; True keeps its original meaning, wgrad only. Booleans are
        stored as given, anything else as a tuple in pass order; :attr:`hadamard_passes` is the
        normalized tuple (``Recipe(hadamard=True).hadamard_passes == ("wgrad",)``). A pass in
        "bf16" is not rotated. One sign vector per call site, shared by both operands: fprop's
        depends only on the weight (rhs) shape and dims, so that
        :func:`jax_mxfp4.flax.quantize_params` can rotate kernels as training did. With a
        pre-quantized :class:`MXFP4Array` operand the array's own record
        (``MXFP4Array.hadamard``) decides the forward rotation, not this option; the Flax layers
        and the Qwix serving provider refuse a weight whose record is not the rotation this
        option gives (:func:`jax_mxfp4.weight_record.check_against_recipe`).
      hadamard_block: size of the Hadamard blocks, 32 (default), 64, 128 or 256; every rotated
        contraction (K for fprop, N for dgrad, the token axis M for wgrad, after zero-padding to a
        multiple of 32) must be a multiple of it, else ``dot_general`` raises ValueError.
      quantize_activations: True (default, "a4w4"): float operands are quantized on the fly.
        False ("w4a16"): a float operand multiplied by an MXFP4Array keeps its own dtype; with
        two float operands, lhs (the activation) stays float and rhs (the weight) is quantized.
      precision: the numerics contract of every GEMM this recipe runs (fprop, dgrad, wgrad):
        "default" (may use FP8 tensor cores with hardware accumulation: backend "fp8"),
        "high" (FP8 with fast accumulation off) or "highest" (exact block products with float32
        accumulation, the contract of every other backend). The ``precision`` argument of
        ``dot_general`` can only tighten it: the stricter of the two counts. See README "FP8 path".
      ragged_capacity: rows per group for :func:`jax_mxfp4.ragged_dot`: None (default, no limit) or
        an int >= 1. Set, every ``group_sizes`` entry must be at most it (ValueError when concrete,
        an all-NaN result under ``jit``, on every platform), and the hipBLASLt route on ROCm pads
        each group to it instead of to all M rows (:mod:`jax_mxfp4.backends.hipblaslt_ragged`).

    Raises:
      ValueError: an unknown ``scale_mode``, ``scale_layout``, ``backend``, ``precision`` or
        ``hadamard`` pass name; a ``hadamard_block`` other than 32, 64, 128, 256; a
        ``ragged_capacity`` below 1.
      TypeError: ``hadamard`` neither a bool, a pass name nor a collection of pass names;
        ``ragged_capacity`` neither None nor an int.
    """

    scale_mode: str = "even"
    scale_layout: str = "plain"
    backend: str = "auto"
    fprop: str = "mxfp4"
    dgrad: str = "mxfp4"
    wgrad: str = "mxfp4"
    grad_rounding: str = "stochastic"
    hadamard: bool | str | tuple = False
    quantize_activations: bool = True
    precision: str = "default"
    hadamard_block: int = 32
    ragged_capacity: int | None = None

    def __post_init__(self):
        checks.check_scale_mode(self.scale_mode, "Recipe.scale_mode")
        checks.check_scale_layout(self.scale_layout, "Recipe.scale_layout")
        if self.backend not in BACKENDS:
            raise ValueError(f"Recipe.backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("fprop", "dgrad", "wgrad"):
            if getattr(self, name) not in PASS_PRECISIONS:
                raise ValueError(f"Recipe.{name} must be one of {PASS_PRECISIONS}, got {getattr(self, name)!r}")
        if self.grad_rounding not in GRAD_ROUNDINGS:
            raise ValueError(f"Recipe.grad_rounding must be one of {GRAD_ROUNDINGS}, got {self.grad_rounding!r}")
        if self.precision not in checks.PRECISIONS:  # the forms dot_general takes, normalized
            object.__setattr__(self, "precision", checks.canonical_precision(self.precision, "Recipe.precision"))
        if not isinstance(self.quantize_activations, bool):
            raise TypeError(f"Recipe.quantize_activations must be a bool, got {self.quantize_activations!r}")
        passes = _hadamard_passes(self.hadamard)
        if not isinstance(self.hadamard, bool):
            object.__setattr__(self, "hadamard", passes)
        object.__setattr__(self, "hadamard_block", check_block(self.hadamard_block, "Recipe.hadamard_block"))
        cap = self.ragged_capacity
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, numbers.Integral):
                raise TypeError(f"Recipe.ragged_capacity must be None or an int >= 1 (rows per group), got {cap!r}")
            if cap < 1:
                raise ValueError(f"Recipe.ragged_capacity must be >= 1 (rows per group), got {cap}")
            object.__setattr__(self, "ragged_capacity", int(cap))

    @property
    def hadamard_passes(self) -> tuple[str, ...]:
        """The passes named by ``hadamard`` as a tuple in ("fprop", "dgrad", "wgrad") order."""
        return _hadamard_passes(self.hadamard)

    def replace(self, **changes) -> "Recipe":
        return dataclasses.replace(self, **changes)
