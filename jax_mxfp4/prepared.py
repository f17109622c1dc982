"""What the weight forms arranged once from an MXFP4Array share (:class:`jax_mxfp4.FP8Prepared`,
:class:`jax_mxfp4.DecodePrepared`): ``dequantize`` through the exact round trip ``to_mxfp4()``,
the decoding hint of a refused dense conversion, and the check of the ``hadamard`` record they
carry over from the MXFP4Array."""

from __future__ import annotations

import jax
import jax.numpy as jnp


class PreparedWeight:
    """Mixin of an :class:`jax_mxfp4.pytree.ArraysWithRecord` with static ``shape``, a method
    ``to_mxfp4()`` (bit-exact) and a class attribute ``holds`` (what its children are, for the
    error text)."""

    decode_hint = "decode it with q.dequantize(dtype), or get the exact MXFP4Array back with q.to_mxfp4()"

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """Same values as ``jax_mxfp4.dequantize(self.to_mxfp4(), dtype)`` (logical shape)."""
        return self.to_mxfp4().dequantize(dtype)

    def _check_hadamard(self):
        """Validate and normalize ``self.hadamard`` by the rule of ``MXFP4Array.hadamard`` (None, or
        ``(block, seed)`` with a block dividing the quantized length), applied by building one on
        shape-only children; ValueError naming the rule otherwise."""
        if self.hadamard is None:
            return
        from .array import MXFP4Array, _packed_shapes

        pdata, pscales = _packed_shapes(self.shape, self.axis)
        h = MXFP4Array(jax.ShapeDtypeStruct(pdata, jnp.uint8), jax.ShapeDtypeStruct(pscales, jnp.float8_e8m0fnu),
                       self.axis, self.shape, self.dtype, self.scale_mode, "plain", self.hadamard).hadamard
        object.__setattr__(self, "hadamard", h)

    def _check_child_forms(self, want, where: str):
        """Each child ``name`` in ``want`` ({name: (shape, dtype)}) has that shape and dtype;
        ValueError naming the field, the expected form and ``where`` (the layout rule) otherwise."""
        for name, (wshape, wdtype) in want.items():
            v = getattr(self, name)
            if not hasattr(v, "shape") or tuple(v.shape) != tuple(wshape) or jnp.dtype(v.dtype) != jnp.dtype(wdtype):
                got = (tuple(v.shape), jnp.dtype(v.dtype).name) if hasattr(v, "shape") else type(v).__name__
                raise ValueError(f"{type(self).__name__}.{name} must be {jnp.dtype(wdtype).name} of shape "
                                 f"{tuple(wshape)} ({where}), got {got}")
