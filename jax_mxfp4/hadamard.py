"""Blockwise random Hadamard transform (RHT) applied to both operands of a GEMM before quantizing.

For a block size ``n`` (a power of two, 32..256; 32, the MXFP4 block, by default) the transform
of every length-``n`` block ``v`` along an axis is ``v -> H D v`` with ``H`` the Sylvester-
Hadamard matrix scaled by ``1/sqrt(n)`` (orthonormal) and ``D = diag(s)`` a fixed random ±1 sign
vector drawn from ``numpy.random.default_rng(seed)``. ``H D`` is orthogonal, so applying the same
transform to both operands along their shared contraction axis leaves the exact product unchanged
(``(HDu)·(HDv) = u·v``) while spreading outliers across the block before 4-bit quantization
(QuaRot, arXiv 2404.00456, and QuEST/Quartet, arXiv 2502.05003 / 2505.14669, on the forward
pass; Tseng et al., arXiv 2502.20586, and NVIDIA's NVFP4 recipe, arXiv 2509.25149, on wgrad).

**Bit-exact definition.** The transform is computed in float32 as: multiply by the signs
(exact), then the ``log2(n)`` butterfly stages of the fast Walsh-Hadamard transform in the
Sylvester order (stage ``h = 1, 2, 4, ..., n/2``: every pair ``(v[j], v[j+h])`` with ``j mod 2h <
h`` becomes ``(v[j] + v[j+h], v[j] - v[j+h])``, each a correctly rounded float32 add/subtract),
then one multiply by the float32 constant ``1/sqrt(n)`` (exact for n = 64, 256). Every step is an
elementwise IEEE operation in a fixed order, so the bits do not depend on the backend, the array
layout or which axis is transformed (no matrix product whose summation order a compiler may
choose); tests/mx_reference.py holds a NumPy float32 twin.
"""

from __future__ import annotations

import functools
import zlib

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import checks
from .mx_format import BLOCK_SIZE

HADAMARD_BLOCKS = (32, 64, 128, 256)


@functools.lru_cache(maxsize=256)
def random_signs(seed: int, n: int = BLOCK_SIZE) -> np.ndarray:
    """The fixed ±1 sign vector (float64, length ``n``) of the transform with this ``seed``."""
    return np.random.default_rng(int(seed)).choice(np.array([-1.0, 1.0]), size=n)


def site_seed(*parts) -> int:
    """A 31-bit seed from static values: ``zlib.crc32(repr(parts)) & 0x7FFFFFFF``."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def weight_seed(shape, contracting, batch) -> int:
    """Sign-vector seed of the fprop rotation of a GEMM whose rhs (the weight) has ``shape``.

    Depends only on the weight's logical shape and its contracting/batch dims (normalized
    tuples of ints), never on the activation, so that :func:`jax_mxfp4.flax.quantize_params`
    rotates a kernel exactly as training's forward pass did, whatever the batch size at serving.
    ValueError for a symbolic dim (``jax.export`` shape polymorphism): the seed needs the
    concrete shape.
    """
    if any(checks.is_symbolic(d) for d in shape):
        raise ValueError(
            f"the weight has symbolic dims {tuple(shape)} (shape polymorphism: jax.export with symbolic shapes): "
            "the fprop Hadamard rotation's seed is derived from the weight's concrete shape; export a "
            "Recipe with 'fprop' in hadamard with a concrete weight shape (activation rows may stay symbolic)")
    return site_seed("fprop-hadamard", tuple(int(d) for d in shape), tuple(int(d) for d in contracting),
                     tuple(int(d) for d in batch))


def check_block(block, name: str = "block") -> int:
    """``block`` as an int if it is one of 32, 64, 128, 256 (powers of two from the MXFP4 block
    size up to 256); else raise ``ValueError`` (``TypeError`` for a non-int) naming ``name``."""
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
        raise TypeError(f"{name} must be an int, one of {HADAMARD_BLOCKS}, got {block!r}")
    if int(block) not in HADAMARD_BLOCKS:
        raise ValueError(
            f"{name} must be a power of two from 32 (the MXFP4 block) to 256, one of {HADAMARD_BLOCKS}; "
            f"got {block!r}"
        )
    return int(block)


def check_spec(spec, name: str = "hadamard") -> tuple[int, int]:
    """``(block, seed)`` validated: a 2-tuple of a block (:func:`check_block`) and a non-negative
    Python int seed (the seed of :func:`random_signs`, ``numpy.random.default_rng``).

    Raises:
      TypeError: ``spec`` is not a 2-tuple/list, or the seed is not an int.
      ValueError: a bad block, or a negative seed.
    """
    if not isinstance(spec, (tuple, list)) or len(spec) != 2:
        raise TypeError(f"{name} must be a (block, seed) pair, got {spec!r}")
    block = check_block(spec[0], f"{name} block")
    seed = spec[1]
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"{name} seed must be a Python int (the sign vector's numpy seed), got {seed!r}")
    if seed < 0:
        raise ValueError(f"{name} seed must be >= 0 (numpy.random.default_rng), got {seed}")
    return block, int(seed)


def check_length(length: int, block: int, what: str) -> None:
    """Raise ``ValueError`` unless the contraction ``length`` is a multiple of ``block``."""
    if length % block:
        fits = [b for b in HADAMARD_BLOCKS if length % b == 0]
        advice = (f"Use a block size that divides {length} ({fits}, Recipe.hadamard_block)" if fits else
                  f"No block size in {HADAMARD_BLOCKS} divides {length}: pad the axis to a multiple of 32")
        raise ValueError(
            f"{what} has length {length}, not a multiple of the Hadamard block {block}: the rotation "
            f"acts on whole blocks of the contraction axis. {advice}, or leave this pass out of "
            "Recipe.hadamard"
        )


def random_hadamard_transform(x, axis: int, seed: int, block: int = BLOCK_SIZE):
    """Apply ``v -> H diag(s) v`` to every length-``block`` block of ``x`` along ``axis``.

    Computed as defined in the module docstring (signs, butterfly stages, one scaling), bit for
    bit the same on every backend. Differentiable (its transpose is the inverse rotation).

    Args:
      x: float array (any rank); ``x.shape[axis]`` a multiple of ``block``.
      axis: the axis whose blocks are transformed (the contraction axis of the GEMM).
      seed: Python int selecting the sign vector ``s`` (:func:`random_signs`).
      block: transform size, a power of two (default 32).

    Returns:
      float32 array of ``x.shape``.

    Raises:
      ValueError: ``x.shape[axis]`` is not a multiple of ``block``; ``block`` not a power of two.
    """
    if not isinstance(block, (int, np.integer)) or block < 1 or block & (block - 1):
        raise ValueError(f"block must be a positive power of two, got {block!r}")
    axis = axis % x.ndim
    length = x.shape[axis]
    if length % block:
        raise ValueError(
            f"x: axis {axis} has length {length}, not a multiple of the Hadamard block {block}"
        )
    pre, post = tuple(x.shape[:axis]), tuple(x.shape[axis + 1:])
    signs = np.tile(random_signs(seed, block), length // block).astype(np.float32)
    y = x.astype(jnp.float32) * jnp.asarray(signs.reshape((length,) + (1,) * len(post)))
    h = 1
    while h < block:
        z = y.reshape(pre + (length // (2 * h), 2, h) + post)
        a = lax.index_in_dim(z, 0, axis + 1, keepdims=False)
        b = lax.index_in_dim(z, 1, axis + 1, keepdims=False)
        y = jnp.stack([a + b, a - b], axis=axis + 1).reshape(x.shape)
        h *= 2
    return y * np.float32(1.0 / np.sqrt(block))

