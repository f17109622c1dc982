"""Backend registry and selection: ``Recipe.backend``, ``JAX_MXFP4_BACKEND`` and "auto".

Decisions are made per platform (:func:`plan`): for this process's platform with every check
(devices, libraries), and for the other platforms a GEMM may be lowered for (``jax.export(...,
platforms=[...])``) with what can be known here (the backend lowers there, shape rules).
:mod:`jax_mxfp4.gemm` stages each platform's choice with ``lax.platform_dependent``, so the
compiled or exported program runs the choice of the platform it is lowered for.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax

from .backends.base import Backend, GemmProblem
from .backends.ffi_cpu import FfiCpuBackend
from .backends.fp8 import Fp8Backend
from .backends.hipblaslt import HipblasltBackend
from .backends.pallas import PallasBackend
from .backends.scaled_dot import ScaledDotBackend
from .backends.xla import XlaBackend
from .errors import BackendUnavailableError
from .platform import current_platform

ENV_VAR = "JAX_MXFP4_BACKEND"
AUTO_ORDER = ("hipblaslt", "fp8", "pallas", "scaled_dot", "xla")
"""Preference of "auto" among backends whose ``auto_platforms`` include the current platform."""
LOWERING_PLATFORMS = ("cpu", "cuda", "rocm")
"""Platforms "auto" decides for besides the current one (each gets its own branch)."""

logger = logging.getLogger("jax_mxfp4")

_REGISTRY: dict[str, Backend] = {}
_LOGGED: set[tuple] = set()


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
    route: str = ""  # the chosen backend's own path for this problem (Backend.route)
    per_platform: dict = dataclasses.field(default_factory=dict)
    """platform -> backend staged for it (:func:`plan`); the program lowered for a platform runs
    that platform's entry ("default": any platform not listed)."""

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
            chosen = "chosen" + (f": {self.route}" if self.route else "")
            lines.append(f"  {'*' if name == self.backend else '-'} {name}: {why or chosen}")
        others = {k: v for k, v in self.per_platform.items() if k not in (p.platform, "default")}
        if others:
            lines.append("  when lowered for another platform: " + ", ".join(f"{k} -> {v}" for k, v in others.items()))
        return "\n".join(lines)


def requested_backend(recipe_backend: str) -> str:
    if recipe_backend != "auto":
        return recipe_backend
    env = os.environ.get(ENV_VAR, "").strip()
    return env or "auto"


SYMBOLIC_REASON = ("the GEMM has symbolic dims (shape polymorphism: jax.export with symbolic shapes) and this "
                   "backend is a custom call or kernel built for static shapes; backend 'xla' takes symbolic "
                   "batch/row/column dims (Backend.symbolic_dims)")


def _symbolic(problem: GemmProblem) -> bool:
    return any(jax.export.is_symbolic_dim(d) for d in (problem.batch, problem.m, problem.n))


def _judge(rule, problem: GemmProblem) -> str:
    """A backend rule's reason; a size rule that symbolic dims leave undecided rejects the backend."""
    try:
        return rule(problem) or ""
    except jax.errors.InconclusiveDimensionOperation:
        return SYMBOLIC_REASON


def _reason(b: Backend, problem: GemmProblem, here: str) -> str:
    if _symbolic(problem) and not b.symbolic_dims:
        return SYMBOLIC_REASON
    if problem.platform == here:
        return b.unavailable_reason() or _judge(b.rejects, problem)
    return b.foreign_reason(problem.platform) or _judge(b.rejects, problem)


def decide(problem: GemmProblem, recipe_backend: str) -> Decision:
    """Choose the backend for ``problem`` on ``problem.platform``; explicit requests that cannot
    run there raise. For a platform other than this process's own, backends are judged by
    :meth:`Backend.foreign_reason` and their shape rules (no device or library checks)."""
    requested = requested_backend(recipe_backend)
    here = current_platform()
    reasons: dict[str, str] = {}
    for name, b in _REGISTRY.items():
        reasons[name] = _reason(b, problem, here)
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
        return Decision(chosen, requested, problem, reasons, _REGISTRY[chosen].route(problem))

    candidates = [n for n in AUTO_ORDER if n in _REGISTRY and problem.platform in _REGISTRY[n].auto_platforms]
    cannot_run = {n for n, why in reasons.items() if why}
    for name in candidates:
        reasons[name] = reasons[name] or _judge(_REGISTRY[name].auto_rejects, problem)
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
    if skipped and key not in _LOGGED and problem.platform == here:
        _LOGGED.add(key)
        logger.warning(
            "jax_mxfp4 'auto' fell back to backend %r on %s: %s",
            chosen,
            problem.platform,
            "; ".join(f"{n}: {reasons[n]}" for n in skipped),
        )
    return Decision(chosen, "auto", problem, reasons, _REGISTRY[chosen].route(problem))


def plan(problem: GemmProblem, recipe_backend: str) -> Decision:
    """:func:`decide` for ``problem.platform`` (this process's platform), with ``per_platform``
    filled in: what each platform in :data:`LOWERING_PLATFORMS` runs when the program is lowered
    for it, and "default" (this platform's choice) for any other.

    "auto": each platform gets its own decision. An explicit backend runs on every platform if it
    can run here; if it cannot run here but can be lowered for another platform whose shape rules
    it accepts (``Recipe(backend="hipblaslt")`` exported for ROCm from a CPU machine), it is staged
    for every platform and lowering it for a platform it has no handler on raises
    :class:`BackendUnavailableError` naming both; otherwise :class:`BackendUnavailableError` as
    :func:`decide`.
    """
    requested = requested_backend(recipe_backend)
    here = problem.platform
    if requested != "auto":
        try:
            d = decide(problem, recipe_backend)
            return dataclasses.replace(d, per_platform={"default": d.backend})
        except BackendUnavailableError as error:
            backend = _REGISTRY.get(requested)
            if backend is None or backend.lowers_on is None:
                raise
            elsewhere = []
            for p in backend.lowers_on:
                if p == here:
                    continue
                foreign = dataclasses.replace(problem, platform=p)
                why = _reason(backend, foreign, here)
                if not why:
                    d = decide(foreign, recipe_backend)
                    return dataclasses.replace(d, per_platform={"default": d.backend})
                elsewhere.append(f"lowered for {p}: {why}")
            if elsewhere:
                raise BackendUnavailableError(f"{error}; and {'; '.join(elsewhere)}") from None
            raise
    d = decide(problem, "auto")
    per_platform = {"default": d.backend, here: d.backend}
    for p in LOWERING_PLATFORMS:
        if p != here:
            per_platform[p] = decide(dataclasses.replace(problem, platform=p), "auto").backend
    return dataclasses.replace(d, per_platform=per_platform)


def _register_builtin() -> None:
    register_backend(XlaBackend())
    register_backend(ScaledDotBackend())
    register_backend(PallasBackend())
    register_backend(Fp8Backend())
    register_backend(FfiCpuBackend())
    register_backend(HipblasltBackend())


_register_builtin()
