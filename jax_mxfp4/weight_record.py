"""The record a quantized weight needs to be served as trained, and the one place it is checked.

Besides its bytes, a quantized weight (:class:`jax_mxfp4.MXFP4Array`, and the forms arranged
from one, :class:`jax_mxfp4.DecodePrepared`, :class:`jax_mxfp4.FP8Prepared`) records:

* its layout: the logical ``shape`` and the quantized ``axis`` (and, for an MXFP4Array, the
  ``scale_layout``);
* its logical ``dtype`` (the trained kernel's dtype: it sets the layers' computation dtype);
* ``scale_mode``: the E8M0 scale rule it was quantized with;
* ``hadamard``: None, or the ``(block, seed)`` of the random Hadamard rotation its values carry
  (:mod:`jax_mxfp4.hadamard`); :func:`jax_mxfp4.dot_general` rotates the facing activation the
  same way.

A weight whose record disagrees with the recipe of the layer serving it computes something else
than the trained forward pass (an unrotated weight facing a layer trained with a rotated forward
differs by the rotation's full effect), so every serving route refuses it
(:func:`check_against_recipe`, used by every :mod:`jax_mxfp4.flax` layer and by
:class:`jax_mxfp4.qwix.MxPtqProvider`), and every save/load route keeps the record: safetensors
files carry it as metadata (:func:`to_metadata`/:func:`from_metadata`, used by
:mod:`jax_mxfp4.checkpoint`); ``jit`` and orbax carry it in the pytree's static data (orbax
restores into the target's record: a target built without the training recipe gives kernels
that the layers then refuse); Qwix's serving provider keeps it in ``HowToQuantize``.
"""

from __future__ import annotations

import json

import jax.numpy as jnp

from . import checks
from . import hadamard as hd
from .array import MXFP4Array
from .quantize import quantize, quantize_rotated

#: safetensors metadata key of a weight's record: ``RECORD_KEY_PREFIX + name``.
RECORD_KEY_PREFIX = "jax_mxfp4.record."
#: Version of the record's JSON text; a file with another version is refused (written by a newer
#: jax_mxfp4, whose record this version cannot read).
RECORD_FORMAT = 1
_FIELDS = ("format", "axis", "shape", "dtype", "scale_mode", "scale_layout", "hadamard")


def fprop_rotation(recipe, shape, contracting, batch=()) -> tuple[int, int] | None:
    """The rotation the forward pass of ``recipe`` applies to a float weight of ``shape``
    contracted along ``contracting`` with batch dims ``batch``: ``(recipe.hadamard_block,
    hadamard.weight_seed(shape, contracting, batch))`` when ``recipe.hadamard`` includes "fprop"
    and ``recipe.fprop == "mxfp4"``, else None (the rule of :func:`jax_mxfp4.dot_general`)."""
    if "fprop" not in recipe.hadamard_passes or recipe.fprop != "mxfp4":
        return None
    return recipe.hadamard_block, hd.weight_seed(shape, tuple(contracting), tuple(batch))


def quantize_weight(w, axis: int, *, scale_mode: str, scale_layout: str = "plain", hadamard=None) -> MXFP4Array:
    """A trained float weight ``w`` -> the MXFP4Array serving it, with its full record: logical
    dtype ``w.dtype``, ``scale_mode``, ``scale_layout`` and ``hadamard`` (None, or the ``(block,
    seed)`` rotation applied along ``axis`` before quantizing, e.g. :func:`fprop_rotation`).

    Raises ValueError as :func:`jax_mxfp4.quantize`, and for ``w.shape[axis]`` not a multiple of
    the rotation block (naming it)."""
    if hadamard is None:
        return quantize(w, axis, scale_mode=scale_mode, scale_layout=scale_layout)
    hadamard = hd.check_spec(hadamard)
    hd.check_length(w.shape[axis], hadamard[0], f"the weight of shape {tuple(w.shape)} along axis {axis}")
    q = quantize_rotated(w, axis, hadamard, scale_mode=scale_mode).with_scale_layout(scale_layout)
    return MXFP4Array(q.data, q.scales, q.axis, q.shape, w.dtype, q.scale_mode, q.scale_layout, hadamard)


def _describe(h) -> str:
    return "no rotation (hadamard=None)" if h is None else f"hadamard=(block {h[0]}, seed {h[1]})"


def check_against_recipe(kernel, recipe, *, shape=None, contracting=None, batch=(), what: str = "kernel"):
    """ValueError unless quantized ``kernel``'s record matches what ``recipe``'s forward pass did
    with the float weight: the same ``scale_mode``, and the rotation :func:`fprop_rotation` gives
    (none when the recipe does not rotate fprop).

    ``shape``/``contracting``/``batch`` describe the float weight as trained (default: the
    kernel's own logical shape, its quantized axis, no batch dims): the rotation's seed depends
    on them (:func:`jax_mxfp4.hadamard.weight_seed`), e.g. a kernel whose K was zero-padded by
    :func:`jax_mxfp4.flax.quantize_params` was trained with the unpadded K. Objects that are
    not quantized weights pass. The message names the kernel's record and the recipe's.
    """
    if not hasattr(kernel, "scale_mode") or not hasattr(kernel, "hadamard"):
        return
    name = type(kernel).__name__
    kind = ("an " if name[0] in "AEFHILMNORSX" else "a ") + name
    if kernel.scale_mode != recipe.scale_mode:
        raise ValueError(
            f"{what}: {kind} quantized with scale_mode={kernel.scale_mode!r}, but this layer's recipe trains "
            f"with scale_mode={recipe.scale_mode!r}; quantize_params(..., scale_mode={recipe.scale_mode!r}) "
            "(or recipe=) gives the weights the trained forward used"
        )
    shape = tuple(kernel.shape) if shape is None else tuple(shape)
    contracting = (kernel.axis,) if contracting is None else tuple(contracting)
    want = fprop_rotation(recipe, shape, contracting, batch)
    if kernel.hadamard != want:
        raise ValueError(
            f"{what}: {kind} records {_describe(kernel.hadamard)}, but this layer's recipe "
            f"(hadamard={recipe.hadamard!r}, hadamard_block={recipe.hadamard_block}, fprop={recipe.fprop!r}) "
            f"trains its forward with {_describe(want)} for a weight of shape {shape} contracted along "
            f"{contracting}" + (f" with batch dims {tuple(batch)}" if batch else "") + ": serving it would "
            "compute another product than training. Quantize the float weights with the training recipe "
            "(jax_mxfp4.flax.quantize_params(params, recipe=recipe)), or restore a checkpoint into a target "
            "built that way"
        )


# ----------------------------------------------------------------------------- safetensors metadata
def to_metadata(name: str, q: MXFP4Array) -> dict[str, str]:
    """``{RECORD_KEY_PREFIX + name: json}``: ``q``'s record as safetensors metadata (str -> str)."""
    record = {"format": RECORD_FORMAT, "axis": q.axis, "shape": list(q.shape), "dtype": jnp.dtype(q.dtype).name,
              "scale_mode": q.scale_mode, "scale_layout": q.scale_layout,
              "hadamard": None if q.hadamard is None else list(q.hadamard)}
    return {RECORD_KEY_PREFIX + name: json.dumps(record, sort_keys=True)}


def from_metadata(name: str, text: str, where: str = "the file") -> dict:
    """Parse and validate the record of ``name`` written by :func:`to_metadata`.

    Returns ``{"axis", "shape", "dtype", "scale_mode", "scale_layout", "hadamard"}``.
    Raises ValueError naming ``name`` and ``where`` for text that is not such a record, or a
    record of another format version."""
    prefix = f"{where}: record of {name!r} ({RECORD_KEY_PREFIX}{name})"
    try:
        record = json.loads(text)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{prefix} is not JSON: {e}") from None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        got = record.get("format") if isinstance(record, dict) else record
        raise ValueError(f"{prefix} has format {got!r}; this jax_mxfp4 reads format {RECORD_FORMAT} (a file "
                         "written by another version: re-save it with that version's load/save, or upgrade)")
    if set(record) != set(_FIELDS):
        raise ValueError(f"{prefix} must hold exactly the fields {_FIELDS}, got {sorted(record)}")
    try:
        checks.check_mx_dtype(jnp.dtype(record["dtype"]), f"{prefix} dtype")
        checks.check_scale_mode(record["scale_mode"], f"{prefix} scale_mode")
        checks.check_scale_layout(record["scale_layout"], f"{prefix} scale_layout")
        h = record["hadamard"]
        h = None if h is None else hd.check_spec(tuple(h), f"{prefix} hadamard")
        shape = tuple(int(d) for d in record["shape"])
        axis = checks.normalize_axis(record["axis"], len(shape), f"{prefix} axis")
    except (TypeError, ValueError) as e:
        raise ValueError(f"{prefix} is malformed: {e}") from None
    return {"axis": axis, "shape": shape, "dtype": jnp.dtype(record["dtype"]), "scale_mode": record["scale_mode"],
            "scale_layout": record["scale_layout"], "hadamard": h}
