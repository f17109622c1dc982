"""Blockwise random Hadamard transform (RHT) used on the wgrad operands of the training recipe.

For a block size ``n`` (a power of two; 32, the MXFP4 block, by default) the transform of every
length-``n`` block ``v`` along an axis is ``v -> H D v`` with ``H`` the Sylvester-Hadamard matrix
scaled by ``1/sqrt(n)`` (orthonormal) and ``D = diag(s)`` a fixed random ±1 sign vector drawn
from ``numpy.random.default_rng(seed)``. ``H D`` is orthogonal, so applying the same transform to
both operands along their shared contraction axis leaves the exact product unchanged
(``(HDu)·(HDv) = u·v``) while spreading outliers across the block before quantization, which
bounds the variance of stochastic rounding (Tseng et al., arXiv 2502.20586; NVIDIA NVFP4 recipe,
arXiv 2509.25149, applies it to the wgrad inputs only, as done here).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from .mx_format import BLOCK_SIZE


@functools.lru_cache(maxsize=64)
def hadamard_matrix(n: int = BLOCK_SIZE) -> np.ndarray:
    """Orthonormal Sylvester-Hadamard matrix of order ``n`` (float64 NumPy, ``H @ H.T = I``).

    Raises:
      ValueError: ``n`` is not a positive power of two.
    """
    if not isinstance(n, (int, np.integer)) or n < 1 or n & (n - 1):
        raise ValueError(f"n must be a positive power of two (Sylvester construction), got {n!r}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


@functools.lru_cache(maxsize=256)
def random_signs(seed: int, n: int = BLOCK_SIZE) -> np.ndarray:
    """The fixed ±1 sign vector (float64, length ``n``) of the transform with this ``seed``."""
    return np.random.default_rng(int(seed)).choice(np.array([-1.0, 1.0]), size=n)


def random_hadamard_transform(x, axis: int, seed: int, block: int = BLOCK_SIZE):
    """Apply ``v -> H diag(s) v`` to every length-``block`` block of ``x`` along ``axis``.

    Args:
      x: float array (any rank); ``x.shape[axis]`` a multiple of ``block``.
      axis: the axis whose blocks are transformed (the contraction axis of the GEMM).
      seed: Python int selecting the sign vector ``s`` (:func:`random_signs`).
      block: transform size, a power of two (default 32).

    Returns:
      float32 array of ``x.shape`` (computed in float32 with ``Precision.HIGHEST``).

    Raises:
      ValueError: ``x.shape[axis]`` is not a multiple of ``block``; ``block`` not a power of two.
    """
    axis = axis % x.ndim
    if x.shape[axis] % block:
        raise ValueError(
            f"x: axis {axis} has length {x.shape[axis]}, not a multiple of the Hadamard block {block}"
        )
    m = jnp.asarray(hadamard_matrix(block) * random_signs(seed, block)[None, :], jnp.float32)
    xm = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    blocks = xm.reshape(*xm.shape[:-1], xm.shape[-1] // block, block)
    y = jnp.einsum("...j,ij->...i", blocks, m, precision=lax.Precision.HIGHEST)
    return jnp.moveaxis(y.reshape(xm.shape), -1, axis)
