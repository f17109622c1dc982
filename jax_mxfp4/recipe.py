"""``Recipe``: how ``dot_general`` quantizes its float operands and which backend runs the GEMM."""

from __future__ import annotations

import dataclasses

from . import checks

BACKENDS = ("auto", "xla", "ffi-cpu", "hipblaslt", "scaled_dot", "pallas")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Frozen, hashable options for :func:`jax_mxfp4.dot_general` (usable as a static argument).

    Attributes:
      scale_mode: E8M0 shared-scale rule for float operands quantized on the fly: "floor" (OCP MX
        v1.0 §6.3), "ceil", "even" (default; AMD ecosystem) or "rceil" (NVIDIA ecosystem).
      scale_layout: "plain" or "swizzled" (hipBLASLt 32x8 pre-swizzled scales).
      backend: "auto" (default; :func:`jax_mxfp4.explain` tells what it picks and why) or one of
        "xla", "ffi-cpu", "hipblaslt", "scaled_dot", "pallas". The environment variable
        ``JAX_MXFP4_BACKEND`` overrides "auto". Naming a backend that cannot run raises an error.

    Raises:
      ValueError: an unknown ``scale_mode``, ``scale_layout`` or ``backend``.
    """

    scale_mode: str = "even"
    scale_layout: str = "plain"
    backend: str = "auto"

    def __post_init__(self):
        checks.check_scale_mode(self.scale_mode, "Recipe.scale_mode")
        checks.check_scale_layout(self.scale_layout, "Recipe.scale_layout")
        if self.backend not in BACKENDS:
            raise ValueError(f"Recipe.backend must be one of {BACKENDS}, got {self.backend!r}")

    def replace(self, **changes) -> "Recipe":
        return dataclasses.replace(self, **changes)
