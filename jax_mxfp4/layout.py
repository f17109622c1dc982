"""Scale layouts: the plain row-major layout and hipBLASLt's pre-swizzled 32x8 layout.

"plain" (hipBLASLt ``HIPBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0``): scales of the 2-D view
[rows, K/32] stored row-major, byte ``r * (K/32) + c`` for row r, block c.

"swizzled" (hipBLASLt ``HIPBLASLT_MATMUL_MATRIX_SCALE_BLK32_UE8M0_32_8_EXT`` = AITER
``e8m0_shuffle`` = TE-ROCm ``compute_scale_shuffle_index``; hipBLASLt
``preSwizzleScalesGFX950``): pad rows to a multiple of 32 and K/32 to a multiple of 8, then

    S[r][c] -> out[a*32*C + d*256 + f*64 + cc*4 + e*2 + b]
    with a = r//32, b = (r%32)//16, cc = r%16, d = c//8, e = (c%8)//4, f = c%4,

C the padded K/32. Equivalently ``view(R/32, 2, 16, C/8, 2, 4).transpose(0, 3, 5, 2, 4, 1)``.
Pad bytes are 0x00 (2^-127), as AITER's Triton quantizer writes; they scale only padding rows or
blocks and are dropped when converting back to plain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .mx_format import BLOCK_SIZE

SCALE_LAYOUTS = ("plain", "swizzled")
SWIZZLE_ROWS = 32
SWIZZLE_COLS = 8
SWIZZLE_PAD_BYTE = 0x00


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def scale_view_2d(shape: tuple[int, ...], axis: int) -> tuple[int, int]:
    """(rows, K/32) of the 2-D scale view of a tensor of logical ``shape`` quantized along
    ``axis``: every dim but ``axis`` flattened, in order (the view the swizzle applies to)."""
    k = shape[axis]
    rows = int(np.prod(shape)) // k if k else 0
    return rows, k // BLOCK_SIZE


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape [rows padded to 32, cols padded to 8] of a swizzled scale matrix."""
    return _round_up(rows, SWIZZLE_ROWS), _round_up(cols, SWIZZLE_COLS)


def swizzle(plain: jax.Array) -> jax.Array:
    """Plain 2-D scales [rows, K/32] -> swizzled [round_up(rows, 32), round_up(K/32, 8)].

    dtype is preserved (uint8 or float8_e8m0fnu); padding holds byte 0x00.
    """
    if plain.ndim != 2:
        raise ValueError(f"swizzle expects 2-D scales [rows, K/32], got shape {plain.shape}")
    rows, cols = plain.shape
    r_pad, c_pad = swizzled_shape(rows, cols)
    as_bytes = jax.lax.bitcast_convert_type(plain, jnp.uint8) if plain.dtype != jnp.uint8 else plain
    padded = jnp.pad(as_bytes, ((0, r_pad - rows), (0, c_pad - cols)), constant_values=SWIZZLE_PAD_BYTE)
    out = padded.reshape(r_pad // 32, 2, 16, c_pad // 8, 2, 4).transpose(0, 3, 5, 2, 4, 1)
    out = out.reshape(r_pad, c_pad)
    return out if plain.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(out, plain.dtype)


def unswizzle(swizzled: jax.Array, rows: int, cols: int) -> jax.Array:
    """Inverse of :func:`swizzle`: swizzled [R_pad, C_pad] -> plain [rows, cols] (exact)."""
    r_pad, c_pad = swizzled_shape(rows, cols)
    if swizzled.shape != (r_pad, c_pad):
        raise ValueError(
            f"swizzled scales for a [{rows}, {cols}] scale matrix must have shape {(r_pad, c_pad)}, "
            f"got {swizzled.shape}"
        )
    s = swizzled.reshape(r_pad // 32, c_pad // 8, 4, 16, 2, 2).transpose(0, 5, 3, 1, 4, 2)
    return s.reshape(r_pad, c_pad)[:rows, :cols]
