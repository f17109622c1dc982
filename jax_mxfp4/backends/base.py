"""The backend interface and the canonical GEMM problem every backend receives.

Canonical form (one place maps every ``dimension_numbers`` onto it: :mod:`jax_mxfp4.gemm`):
  lhs: MXFP4Array [B, M, K], quantized along axis 2, plain scales [B, M, K/32]
  rhs: MXFP4Array [B, N, K], quantized along axis 2, plain scales [B, N, K/32]
  (with ``Recipe(quantize_activations=False)`` one side may instead be a float array [B, M|N, K]
  in its own dtype: the "w4a16" case; ``GemmProblem.lhs_kind``/``rhs_kind`` say which)
  out: [B, M, N] = lhs · rhsᵀ per batch (the "TN" GEMM of BLAS, hipBLASLt's only FP4 layout)
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

F32_UNIT = 2.0**-24  # unit roundoff of float32
F32_MIN_NORMAL = 2.0**-126
OUT_EPS = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}  # half an ulp, relative
OUT_TINY = {"float32": 0.0, "bfloat16": 2.0**-133, "float16": 2.0**-24}  # the subnormal spacing


@dataclasses.dataclass(frozen=True)
class Contract:
    """The numerics a backend promises for one problem, as an elementwise error bound against the
    exact product of the operands' decoded values (:func:`jax_mxfp4.mx_format.dequantize_blocks`
    for every element, a float64 sum):

        |out - exact| <= c * S + eps_out * (|exact| + c * S) + tiny_out + (K + 1) 2^-126

    with S = sum_k |a_k b_k|, ``c`` = :meth:`accumulation` (the summation), eps_out / tiny_out half
    an ulp / the subnormal spacing of the output dtype (one rounding of the result), and
    (K + 1) 2^-126 for float32 products and partial sums below 2^-126, which XLA on CPU flushes to
    zero. Outputs where a product or the sum overflows float32 are not bounded (they may be
    +-Inf/NaN, or finite on a path that sums before it scales). ``kind``: "exact" (exact block
    products, float32 accumulation in any order: c = g(K) = K u / (1 - K u), u = 2^-24, the
    bound for any summation order: Higham, Accuracy and Stability of Numerical Algorithms, §3.1)
    or a named bound with fixed ``rel`` per data family (the FP8 path on a GPU, measured:
    ``jax_mxfp4.backends.fp8.ERROR_BOUNDS``). ``summary``: one line for explain() and the
    self-test."""

    kind: str
    summary: str
    rel: tuple = ()  # ((data family, c), ...) for kinds other than "exact"

    def accumulation(self, k: int, data: str = "random") -> float:
        """``c`` of the bound for a contraction of length ``k`` on data family ``data`` ("random",
        "adversarial"; the exact contract holds for every family)."""
        if self.kind == "exact":
            return k * F32_UNIT / (1 - k * F32_UNIT)
        rel = dict(self.rel)
        if data not in rel:
            raise ValueError(f"contract {self.kind!r} states no error bound for data family {data!r} "
                             f"(it states one for {sorted(rel) or 'none'})")
        return rel[data]

    def bound(self, exact, abs_dot, k: int, out_dtype, data: str = "random"):
        """Elementwise bound (float64 ndarray) on |out - exact| for float64 ``exact`` and
        ``abs_dot`` = sum_k |a_k b_k| of the same shape, an output of dtype ``out_dtype``."""
        name = np.dtype(out_dtype).name
        acc = self.accumulation(k, data) * np.asarray(abs_dot, np.float64)
        return acc + OUT_EPS[name] * (np.abs(exact) + acc) + OUT_TINY[name] + (k + 1) * F32_MIN_NORMAL

    def describe(self, k: int, data: str = "random") -> str:
        """The bound in one line (self-test output)."""
        c = self.accumulation(k, data)
        head = f"{self.kind}: |err| <= {c:.3g} sum|a||b|"
        return head + (" (g(K), float32 accumulation)" if self.kind == "exact" else f" ({data} data)")


EXACT = Contract("exact", "exact block products, float32 accumulation (equal to backend 'xla' up to summation order)")


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """Static description of one canonical GEMM (sizes in logical elements)."""

    batch: int
    m: int
    n: int
    k: int
    out_dtype: np.dtype
    scale_layout: str  # the layout the recipe asks the backend to consume ("plain" | "swizzled")
    platform: str  # "cpu", "cuda", "rocm", ...
    lhs_kind: str = "mxfp4"  # "mxfp4" (pre-quantized), "quantized" (float, quantized on the fly),
    rhs_kind: str = "mxfp4"  # or "float" (kept in its dtype: w4a16)
    lhs_dtype: np.dtype = np.dtype(np.float32)  # logical dtype of the operand
    rhs_dtype: np.dtype = np.dtype(np.float32)
    precision: str = "default"  # "default" | "high" | "highest" (jax_mxfp4.checks.canonical_precision)
    # The operand is a jax_mxfp4.DecodePrepared (canonical: data [B, F, K/2], K-major scales
    # [B, K/32, F]): its byte_order ("natural" | "lanes"), or False for any other operand; a
    # backend receives it as such only where takes_decode_prepared says so.
    lhs_decode_prepared: bool | str = False
    rhs_decode_prepared: bool | str = False

    @property
    def has_float_operand(self) -> bool:
        return "float" in (self.lhs_kind, self.rhs_kind)


class Backend:
    """A GEMM backend. Subclasses set ``name`` and ``auto_platforms`` and implement the methods.

    ``auto_platforms``: platforms on which "auto" may pick this backend, in the order of
    :data:`jax_mxfp4.dispatch.AUTO_ORDER`; empty means explicit use only.
    """

    name: str = ""
    auto_platforms: tuple[str, ...] = ()
    opaque: bool = False
    """True for FFI custom calls and Pallas kernels, which XLA's SPMD partitioner cannot see into:
    jax_mxfp4.partitioning then supplies their sharding rule."""

    symbolic_dims: bool = False
    """True if the GEMM takes symbolic batch/row/column dims (``jax.export`` shape polymorphism):
    a backend made of XLA ops; custom calls and kernels are built for static shapes."""

    lowers_on: tuple[str, ...] | None = None
    """Platforms ("cpu", "cuda", "rocm", ...) whose compiled programs this backend's GEMM can be
    lowered into; None: every platform."""

    def unavailable_reason(self) -> str | None:
        """None if this backend can run in this process, else why not (for explain())."""
        return None

    def foreign_reason(self, platform: str) -> str | None:
        """None if this backend's GEMM can be traced here and lowered for ``platform``, a platform
        other than this process's own (``jax.export(..., platforms=[...])``, multi-platform
        lowering), else why not. Device and library checks cannot apply there; shape rules
        (:meth:`rejects`) still do. Default: ``lowers_on``, then :meth:`unavailable_reason`
        (right for backends whose availability does not depend on the local devices)."""
        if self.lowers_on is not None and platform not in self.lowers_on:
            return f"lowers only for {', '.join(self.lowers_on)}, not {platform}"
        return self.unavailable_reason()

    def rejects(self, problem: GemmProblem) -> str | None:
        """None if this backend handles ``problem``, else why not."""
        return None

    def auto_rejects(self, problem: GemmProblem) -> str | None:
        """None if "auto" may pick this backend for ``problem`` (which it can run), else why
        another backend is preferred there (shape rules justified by the benchmarks)."""
        return None

    def route(self, problem: GemmProblem) -> str:
        """The backend's own path for ``problem`` (kernel, tiling), for explain(); "" if one."""
        return ""

    def takes_decode_prepared(self, problem: GemmProblem) -> tuple[bool, bool]:
        """(lhs, rhs): whether :meth:`gemm` reads that operand as a canonical
        :class:`jax_mxfp4.DecodePrepared` as it is stored; where not (the default), it receives
        ``to_mxfp4()`` (an exact round trip)."""
        return (False, False)

    def numerics(self, problem: GemmProblem) -> Contract:
        """The :class:`Contract` this backend holds for ``problem`` (the one place that states it;
        explain(), ``python -m jax_mxfp4.selftest`` and the tests read it). Default: :data:`EXACT`."""
        return EXACT

    def contract(self, problem: GemmProblem) -> str:
        """One line for explain(): the numerics this backend gives for ``problem``."""
        return self.numerics(problem).summary

    def gemm(self, lhs, rhs, problem: GemmProblem) -> jax.Array:
        raise NotImplementedError
