"""The pytree protocol of the quantized weight forms, declared once.

:class:`jax_mxfp4.MXFP4Array`, :class:`jax_mxfp4.FP8Prepared` and :class:`jax_mxfp4.DecodePrepared`
are frozen dataclasses whose array fields are the pytree's children (traced by ``jit``, moved by
``device_put``) and whose other fields are static (the weight's record: part of the treedef). A
subclass names its children in ``CHILDREN``; every other dataclass field, in declaration order,
is static. ``_restore(static, children)`` lets a form re-derive static fields from its children
when it is rebuilt (symbolic dims of a shape-polymorphic export, dims added by ``vmap``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp


class ArraysWithRecord:
    """Base of the weight forms: ``CHILDREN`` array fields, the rest static."""

    CHILDREN: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_node(cls, cls._flatten, cls._unflatten)

    @classmethod
    def static_fields(cls) -> tuple[str, ...]:
        """The static fields' names, in declaration order (the treedef's auxdata order)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in cls.CHILDREN)

    def _flatten(self):
        static = tuple(jnp.dtype(getattr(self, name)) if name == "dtype" else getattr(self, name)
                       for name in self.static_fields())
        return tuple(getattr(self, name) for name in self.CHILDREN), static

    @classmethod
    def _unflatten(cls, aux, children):
        static = cls._restore(dict(zip(cls.static_fields(), aux)), tuple(children))
        obj = object.__new__(cls)  # no __post_init__: children may be tracers or placeholders
        for name, value in (*zip(cls.CHILDREN, children), *static.items()):
            object.__setattr__(obj, name, value)
        return obj

    @classmethod
    def _restore(cls, static: dict[str, Any], children: tuple) -> dict[str, Any]:
        return static

    # the protocol under the names jax.tree_util.register_pytree_node_class uses
    def tree_flatten(self):
        return self._flatten()

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls._unflatten(aux, children)
