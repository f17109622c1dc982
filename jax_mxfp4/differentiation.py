"""Derivatives of quantized computations: straight-through, or a clear error, never a silent zero.

The backward passes of :func:`jax_mxfp4.dot_general` are MXFP4 matmuls (4-bit codes, integer
scales): differentiated as written they give an exact zero, so a gradient penalty or a
Hessian-vector product through them would be silently zero. :func:`straight_through` makes such
a computation differentiable by the straight-through rule: its value is the quantized one, its
derivative (to every order) that of the float computation it approximates.
:func:`not_differentiable` marks a quantizer's input: differentiating through it raises instead
of returning the zero that the 4-bit codes would give.
"""

from __future__ import annotations

import functools

import jax


def straight_through(quantized, exact):
    """``f(args, aux) = quantized(args, aux)``, differentiated as ``exact(args)``.

    Args:
      quantized: ``(args, aux) -> outputs``; may round, quantize or call custom kernels.
      exact: ``args -> outputs`` of the same shapes and dtypes, made of differentiable JAX ops:
        the float computation ``quantized`` approximates.

    Returns:
      ``f(args, aux)``. ``args``: a pytree of float arrays, differentiated through ``exact``'s VJP;
      ``aux``: a pytree (PRNG keys, None) that gets no cotangent. Both may be tracers. The
      primal output is computed by ``quantized`` at every level of differentiation (``f``'s own
      forward rule calls ``f``), so an outer ``jax.grad`` sees ``exact``'s derivative again
      rather than differentiating the quantizer (which would give zero). Forward mode
      (``jax.jvp``) raises JAX's custom_vjp error, as for every ``jax.custom_vjp``.
    """

    @jax.custom_vjp
    def f(args, aux):
        return quantized(args, aux)

    def fwd(args, aux):
        return f(args, aux), args

    def bwd(args, ct):
        return jax.vjp(exact, args)[1](ct)[0], None

    f.defvjp(fwd, bwd)
    return f


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def not_differentiable(x, what: str):
    """``x`` unchanged; a derivative with respect to it raises ``ValueError`` naming ``what``.

    JAX differentiates integer outputs (MXFP4 codes, E8M0 scales) as constants, so a gradient
    through a quantizer would be an exact, silent zero. Only a perturbed ``x`` raises: the rule
    is not called when JAX knows the tangent is zero (e.g. a weight closed over by ``jax.grad``).
    """
    return x


@not_differentiable.defjvp
def _not_differentiable_jvp(what, primals, tangents):
    raise ValueError(
        f"{what} is not differentiable: its output holds 4-bit codes and integer scales, so JAX would "
        "return an exact zero gradient. Differentiate jax_mxfp4.dot_general / dense / einsum (or the "
        "jax_mxfp4.flax layers) with float operands instead: they quantize inside and pass gradients "
        "straight through the quantizers (jax_mxfp4.training); or apply jax.lax.stop_gradient to the "
        "input if a zero gradient is what you mean")
