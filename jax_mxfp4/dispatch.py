"""Backend registry and selection: ``Recipe.backend``, ``JAX_MXFP4_BACKEND`` and "auto"."""

from __future__ import annotations

import dataclasses
import logging
import os

import jax

from .backends.base import Backend, GemmProblem

ENV_VAR = "JAX_MXFP4_BACKEND"
AUTO_ORDER = ("hipblaslt", "fp8", "pallas", "scaled_dot", "xla")
"""Preference of "auto" among backends whose ``auto_platforms`` include the current platform."""

logger = logging.getLogger("jax_mxfp4")

_REGISTRY: dict[str, Backend] = {}
_LOGGED: set[tuple] = set()


class BackendUnavailableError(RuntimeError):
    """A backend named explicitly (Recipe.backend or JAX_MXFP4_BACKEND) cannot run this GEMM."""


def register_backend(backend: Backend) -> None:
    """Add (or replace) a backend under ``backend.name``."""
    _REGISTRY[backend.name] = backend


def get_backend(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise BackendUnavailableError(
            f"backend {name!r} is not registered; known backends: {sorted(_REGISTRY)}"
        ) from None


def current_platform() -> str:
    """Platform of JAX's default backend: "cpu", "cuda", "rocm", "tpu", ..."""
    platform = jax.default_backend()
    if platform == "gpu":
        version = jax.devices()[0].client.platform_version.lower()
        return "rocm" if ("rocm" in version or "hip" in version) else "cuda"
    return platform


def available_backends() -> list[str]:
    """Names of the backends that can run in this process (platform, libraries, devices)."""
    return [name for name, b in _REGISTRY.items() if b.unavailable_reason() is None]


@dataclasses.dataclass(frozen=True)
class Decision:
    """What :func:`select` chose and why each other backend was not chosen."""

    backend: str
    requested: str  # "auto", or the explicit name (from the recipe or the environment)
    problem: GemmProblem
    reasons: dict  # backend name -> why it was not chosen ("" for the chosen one)

    @property
    def contract(self) -> str:
        """The numerics contract in force for the chosen backend at the problem's precision."""
        return _REGISTRY[self.backend].contract(self.problem)

    def __str__(self) -> str:
        p = self.problem
        lines = [
            f"jax_mxfp4 GEMM [B={p.batch}] {p.m}x{p.n}x{p.k} (MxNxK) -> {p.out_dtype.name} "
            f"on {p.platform}: backend {self.backend!r} (requested {self.requested!r})",
            f"  numerics (precision {p.precision!r}): {self.contract}",
        ]
        for name, why in self.reasons.items():
            lines.append(f"  {'*' if name == self.backend else '-'} {name}: {why or 'chosen'}")
        return "\n".join(lines)


def requested_backend(recipe_backend: str) -> str:
    if recipe_backend != "auto":
        return recipe_backend
    env = os.environ.get(ENV_VAR, "").strip()
    return env or "auto"


def decide(problem: GemmProblem, recipe_backend: str) -> Decision:
    """Choose the backend for ``problem``; explicit requests that cannot run raise."""
    requested = requested_backend(recipe_backend)
    reasons: dict[str, str] = {}
    for name, b in _REGISTRY.items():
        reasons[name] = b.unavailable_reason() or b.rejects(problem) or ""
    if requested != "auto":
        source = "Recipe.backend" if recipe_backend != "auto" else f"${ENV_VAR}"
        if requested not in _REGISTRY:
            raise BackendUnavailableError(
                f"{source}={requested!r} is not a known backend; known: {sorted(_REGISTRY)}"
            )
        if reasons[requested]:
            raise BackendUnavailableError(
                f"{source}={requested!r} cannot run this GEMM: {reasons[requested]} "
                f"(no silent fallback; use backend='auto' to let jax_mxfp4 choose)"
            )
        chosen = requested
        for name in reasons:
            if name != chosen and not reasons[name]:
                reasons[name] = f"not requested ({source}={requested!r})"
        return Decision(chosen, requested, problem, reasons)

    candidates = [n for n in AUTO_ORDER if n in _REGISTRY and problem.platform in _REGISTRY[n].auto_platforms]
    cannot_run = {n for n, why in reasons.items() if why}
    for name in candidates:
        reasons[name] = reasons[name] or _REGISTRY[name].auto_rejects(problem) or ""
    chosen = next((n for n in candidates if not reasons[n]), "xla")
    for name in reasons:
        if name == chosen or reasons[name]:
            continue
        if name in candidates:
            reasons[name] = f"'auto' prefers {chosen!r} on {problem.platform}"
        elif _REGISTRY[name].auto_platforms:
            reasons[name] = f"'auto' picks it only on {', '.join(_REGISTRY[name].auto_platforms)}"
        else:
            reasons[name] = "explicit use only ('auto' never picks it)"
    # A fallback is a preferred backend that could not run (not one declining by a shape rule).
    preferred = candidates[: candidates.index(chosen)] if chosen in candidates else candidates
    skipped = [n for n in preferred if n in cannot_run]
    key = (problem.platform, chosen, tuple(skipped))
    if skipped and key not in _LOGGED:
        _LOGGED.add(key)
        logger.warning(
            "jax_mxfp4 'auto' fell back to backend %r on %s: %s",
            chosen,
            problem.platform,
            "; ".join(f"{n}: {reasons[n]}" for n in skipped),
        )
    return Decision(chosen, "auto", problem, reasons)


def _register_builtin() -> None:
    from .backends.scaled_dot import ScaledDotBackend
    from .backends.xla import XlaBackend
    from .backends.pallas import PallasBackend
    from .backends.fp8 import Fp8Backend

    register_backend(XlaBackend())
    register_backend(ScaledDotBackend())
    register_backend(PallasBackend())
    register_backend(Fp8Backend())

    from .backends.ffi_cpu import FfiCpuBackend
    from .backends.hipblaslt import HipblasltBackend

    register_backend(FfiCpuBackend())
    register_backend(HipblasltBackend())


_register_builtin()
