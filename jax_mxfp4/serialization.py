"""``jax.export`` serialization of the package's pytrees (MXFP4Array, FP8Prepared, DecodePrepared).

An exported function's calling convention stores the pytree structure of its arguments and
results (``Exported.in_tree``/``out_tree``); ``Exported.serialize`` needs every custom node
registered with ``jax.export.register_pytree_node_serialization``. Each type's static fields
(its ``tree_flatten`` auxdata: axis, logical shape, dtype, scale rule, ...) are stored as JSON
under the name ``jax_mxfp4.<Type>``: dtypes by name, tuples tagged, a symbolic dim (a shape-
polymorphic export) by its text. The unflattened values re-derive their shape from the children
(:meth:`jax_mxfp4.MXFP4Array.tree_unflatten`), so a result of a symbolic-row export called with
concrete rows has concrete shapes.
"""

from __future__ import annotations

import json

import jax
import numpy as np

from .array import MXFP4Array
from .decode_prepared import DecodePrepared
from .fp8_prepared import FP8Prepared

SERIALIZED_TYPES = (MXFP4Array, FP8Prepared, DecodePrepared)


def _encode(v):
    if isinstance(v, np.dtype):
        return {"dtype": v.name}
    if isinstance(v, (tuple, list)):
        return {"tuple": [_encode(e) for e in v]}
    if jax.export.is_symbolic_dim(v):
        return {"dim": str(v)}
    if isinstance(v, np.integer):
        return int(v)
    if v is None or isinstance(v, (bool, int, str)):
        return v
    raise TypeError(f"cannot serialize the static field {v!r} ({type(v).__name__})")


def _decode(v):
    if isinstance(v, dict):
        (tag, value), = v.items()
        if tag == "dtype":
            import jax.numpy as jnp

            return jnp.dtype(value)
        if tag == "tuple":
            return tuple(_decode(e) for e in value)
        if tag == "dim":  # only the structure is rebuilt from it (jax.export: from_children)
            return jax.export.symbolic_shape(value)[0]
    return v


def serialize_auxdata(aux) -> bytes:
    return json.dumps(_encode(tuple(aux))).encode()


def deserialize_auxdata(data: bytes):
    return _decode(json.loads(data.decode()))


def register() -> None:
    """Register every type in :data:`SERIALIZED_TYPES` (done once, on import of this module)."""
    for cls in SERIALIZED_TYPES:
        jax.export.register_pytree_node_serialization(
            cls, serialized_name=f"jax_mxfp4.{cls.__name__}",
            serialize_auxdata=serialize_auxdata, deserialize_auxdata=deserialize_auxdata)


_REGISTERED = False


def _register_once() -> None:
    global _REGISTERED
    if not _REGISTERED:
        register()
        _REGISTERED = True


_register_once()
