"""The pytree protocol and the shared surface of the quantized weight forms, declared once.

:class:`jax_mxfp4.MXFP4Array`, :class:`jax_mxfp4.FP8Prepared` and :class:`jax_mxfp4.DecodePrepared`
are frozen dataclasses whose array fields are the pytree's children (traced by ``jit``, moved by
``device_put``) and whose other fields are static (the weight's record: part of the treedef). A
subclass names its children in ``CHILDREN``; every other dataclass field, in declaration order,
is static. ``_restore(static, children)`` lets a form re-derive static fields from its children
when it is rebuilt (symbolic dims of a shape-polymorphic export, dims added by ``vmap``).
Each form also has ``ndim``/``size`` of its static logical ``shape`` and refuses to pass for a
dense array (``np.asarray``/``jnp.asarray``) with a TypeError saying how to decode it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np


class ArraysWithRecord:
    """Base of the weight forms: ``CHILDREN`` array fields, the rest static; ``holds`` and
    ``decode_hint`` complete the error text of a dense conversion."""

    CHILDREN: ClassVar[tuple[str, ...]] = ()
    holds: ClassVar[str] = "a quantized weight"
    decode_hint: ClassVar[str] = "decode it with q.dequantize(dtype)"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_node(cls, cls.tree_flatten, cls.tree_unflatten)

    @classmethod
    def static_fields(cls) -> tuple[str, ...]:
        """The static fields' names, in declaration order (the treedef's auxdata order)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in cls.CHILDREN)

    def tree_flatten(self):
        static = tuple(jnp.dtype(getattr(self, name)) if name == "dtype" else getattr(self, name)
                       for name in self.static_fields())
        return tuple(getattr(self, name) for name in self.CHILDREN), static

    @classmethod
    def tree_unflatten(cls, aux, children):
        static = cls._restore(dict(zip(cls.static_fields(), aux)), tuple(children))
        obj = object.__new__(cls)  # no __post_init__: children may be tracers or placeholders
        for name, value in (*zip(cls.CHILDREN, children), *static.items()):
            object.__setattr__(obj, name, value)
        return obj

    @classmethod
    def _restore(cls, static: dict[str, Any], children: tuple) -> dict[str, Any]:
        return static

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def _not_dense(self, how: str) -> TypeError:
        return TypeError(f"{how} on {self!r}: {self.holds}, not a dense array; {self.decode_hint}")

    def __array__(self, dtype=None, copy=None):
        raise self._not_dense("np.asarray/np.array")

    def __jax_array__(self):
        raise self._not_dense("jnp.asarray/jnp.array")
