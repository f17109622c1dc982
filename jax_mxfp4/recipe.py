"""``Recipe``: how ``dot_general`` quantizes its float operands and which backend runs the GEMM."""

from __future__ import annotations

import dataclasses

from . import checks

BACKENDS = ("auto", "xla", "ffi-cpu", "hipblaslt", "scaled_dot", "pallas", "fp8")
PASS_PRECISIONS = ("mxfp4", "bf16")
GRAD_ROUNDINGS = ("stochastic", "nearest")


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
      hadamard: apply a random Hadamard transform (block 32, fixed seed per call site) to both
        wgrad operands along their contraction (token) axis before quantizing them.
      quantize_activations: True (default, "a4w4"): float operands are quantized on the fly.
        False ("w4a16"): a float operand multiplied by an MXFP4Array keeps its own dtype; with
        two float operands, lhs (the activation) stays float and rhs (the weight) is quantized.
      precision: the numerics contract of every GEMM this recipe runs (fprop, dgrad, wgrad):
        "default" (may use FP8 tensor cores with hardware accumulation: backend "fp8"),
        "high" (FP8 with fast accumulation off) or "highest" (exact block products with float32
        accumulation, the contract of every other backend). The ``precision`` argument of
        ``dot_general`` can only tighten it: the stricter of the two counts. See README "FP8 path".

    Raises:
      ValueError: an unknown ``scale_mode``, ``scale_layout``, ``backend`` or ``precision``.
    """

    scale_mode: str = "even"
    scale_layout: str = "plain"
    backend: str = "auto"
    fprop: str = "mxfp4"
    dgrad: str = "mxfp4"
    wgrad: str = "mxfp4"
    grad_rounding: str = "stochastic"
    hadamard: bool = False
    quantize_activations: bool = True
    precision: str = "default"

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
        if self.precision not in checks.PRECISIONS:
            raise ValueError(f"Recipe.precision must be one of {checks.PRECISIONS}, got {self.precision!r}")
        for name in ("hadamard", "quantize_activations"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Recipe.{name} must be a bool, got {getattr(self, name)!r}")

    def replace(self, **changes) -> "Recipe":
        return dataclasses.replace(self, **changes)
