"""Qwix providers that route a model's matmuls through jax_mxfp4, without touching the model's code.

`Qwix <https://github.com/google/qwix>`_ (``pip install qwix``) intercepts ``jax.lax.dot_general``
and ``jax.numpy.einsum`` inside the Flax (linen or nnx) modules that a rule's ``module_path``
regex matches; ``qwix.quantize_model(model, provider)`` applies a provider. The two providers
here handle the calls matched by a :class:`MxRule` (which carries a :class:`jax_mxfp4.Recipe`);
calls matched by a plain Qwix rule go to Qwix's own implementation, unmatched calls stay
``lax.dot_general``/``jnp.einsum``.

* :class:`MxQtProvider` (training; a ``qwix.QtProvider``): matched ``dot_general`` calls run
  :func:`jax_mxfp4.dot_general` and matched ``einsum`` calls :func:`jax_mxfp4.einsum` with the
  rule's recipe: MXFP4 fprop, dgrad and wgrad (custom VJP), any K (zero-padded to 32 inside, as
  in the :mod:`jax_mxfp4.flax` layers). The first operand is taken as the activations (dgrad
  settings, kept float by ``Recipe(quantize_activations=False)``), the second as the weight,
  which is how Flax's ``Dense``/``DenseGeneral``/``Einsum``/nnx ``Linear`` call them. A model
  quantized this way computes exactly what the same model written with ``jax_mxfp4.flax``
  layers computes (same values and gradients, bit for bit).
* :class:`MxPtqProvider` (serving; a ``qwix.PtqProvider``): a weight met by a matched call is
  quantized once to an :class:`jax_mxfp4.MXFP4Array` along its contracting dim, rotated first
  as the recipe's forward pass rotates it (``Recipe.hadamard`` with "fprop"), and stored in
  the parameter tree through Qwix's parameter path (``ptq.WithAux``); later calls use it as is,
  after checking its record against the recipe (ValueError naming both when they differ).
  Turn trained float params into that tree with :func:`quantize_params`.

Qwix's own rule fields (``weight_qtype``, ``act_qtype``, calibration, tiles, ...) are not read
by these providers for :class:`MxRule` matches: the recipe says everything.

**Which calls are intercepted.** ``lax.dot_general`` and ``jnp.einsum`` (as Qwix does), and
also ``jnp.matmul`` and ``x @ w``, ``jnp.dot`` and ``x.dot(w)``, ``jnp.inner``, which count as
``dot_general`` calls. These three are jitted inside jax.numpy: were only the ``dot_general``
inside them intercepted, the provider would run inside their cached trace (a later call with the
same shapes may skip it, and a stochastic-rounding key drawn there leaks into the next trace:
``UnexpectedTracerError``). Keys are drawn in the caller's trace and passed as arguments of
the custom VJP, never captured. A name bound before quantization (``from jax.numpy import
matmul``) is not intercepted. Einsum letters follow :func:`jax_mxfp4.einsum.align_operands`
(a size-1 batch letter broadcasts, as in ``jnp.einsum``; e.g. one key/value head).

**Expert layers.** ``jax.lax.ragged_dot(x [M, K], experts [E, K, N], group_sizes)`` calls (the
grouped GEMM of mixture-of-experts layers; Qwix's QtProvider intercepts the same name) matched by
an :class:`MxRule` (``op_names`` ``"ragged_dot"``) run through :func:`jax_mxfp4.ragged_dot` by the
path of :class:`jax_mxfp4.flax.linen.RaggedDense` (:mod:`jax_mxfp4.experts`: any K, zero-padded
to 32), so an unmodified Flax MoE module computes what the same model written with that layer
computes (values and gradients, bit for bit, the same stochastic-rounding keys). Serving: the
experts are stored as an MXFP4Array [E, K, N] quantized along K (K a multiple of 32).
``jax.lax.ragged_dot_general`` is not intercepted (neither does Qwix): a model calling it directly
(e.g. [E, N, K] experts) keeps ``lax``'s, or calls :func:`jax_mxfp4.ragged_dot_general` itself.

**Activation x activation products** (attention's ``q.k`` scores and ``probs.v``) matched by a
rule (e.g. a catch-all ``module_path=".*"``) run through jax_mxfp4 like any other call: the
first operand takes the activation's role (dgrad settings; kept float by
``Recipe(quantize_activations=False)``), the second the weight's (k, v: quantized along the
contraction in fprop, their gradient computed by wgrad from dY and q/probs quantized along the
token axis, dY stochastically rounded). K is zero-padded to 32 (e.g. a short sequence in
``probs.v``). To keep them float, restrict the rule (``op_names``, ``module_path``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from jax._src.numpy import array_methods as _array_methods
from jax._src.numpy import tensor_contractions as _jnp_contractions
from qwix._src.providers import ptq as _ptq
from qwix._src.utils import flax_util as _flax_util

from . import checks
from .array import MXFP4Array
from .dims import takes_rounding_key
from .einsum import _einsum, align_operands, parse_subscripts
from .experts import expert_dot
from .mx_format import BLOCK_SIZE
from .recipe import Recipe
from .training import _dot_general
from .weight_record import check_against_recipe, fprop_rotation, quantize_weight


@dataclasses.dataclass(frozen=True, kw_only=True)
class MxRule(qwix.QtRule):
    """A Qwix rule whose matched ``dot_general``/``einsum`` calls run through jax_mxfp4.

    Attributes:
      module_path: regex on the module path (``"/"``-joined names), as in ``qwix.QtRule``.
      op_names: the ops it applies to, e.g. ``("dot_general",)`` or ``("einsum",)``; default
        every op.
      recipe: :class:`jax_mxfp4.Recipe` for the matched calls (default ``Recipe()``: a4w4, MXFP4
        fprop/dgrad/wgrad); ``Recipe(quantize_activations=False)`` for w4a16.
      rng_collection: RNG stream of the stochastic rounding of dY (default
        ``"stochastic_rounding"``, as the :mod:`jax_mxfp4.flax` layers): a linen module applied
        with that stream draws one key per matched call with ``make_rng``; an nnx module draws
        from ``qwix_rngs`` when ``model.set_attributes(qwix_rngs=nnx.data(nnx.Rngs(...)))`` gave it
        one (``nnx.data``: Flax 0.12 refuses an Rngs as a static attribute);
        otherwise the data-derived fallback key of :func:`jax_mxfp4.training.gradient_key`.
    """

    recipe: Recipe = Recipe()
    rng_collection: str = "stochastic_rounding"

    def __post_init__(self):
        if not isinstance(self.recipe, Recipe):
            raise TypeError(f"MxRule.recipe must be a jax_mxfp4.Recipe, got {type(self.recipe).__name__}")


def _mx_rule(provider, op_name):
    """The MxRule matching the current module and op, or None (no op count is taken)."""
    rule = provider._get_current_rule_and_op_id(op_name, only_rule=True)[0]
    return rule if isinstance(rule, MxRule) else None


def _rounding_key(rule):
    """The key for the stochastic rounding of this call's dY (MxRule docstring), or None."""
    if not takes_rounding_key(rule.recipe):
        return None
    try:
        module = _flax_util.get_current_module()
    except ValueError:
        return None
    if hasattr(module, "has_rng"):  # linen
        return module.make_rng(rule.rng_collection) if module.has_rng(rule.rng_collection) else None
    rngs = getattr(module, "qwix_rngs", None)  # nnx: Qwix's own attribute for module RNGs
    return rngs[rule.rng_collection]() if rngs is not None and rule.rng_collection in rngs else None


def _reshard(y, out_sharding):
    return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)


# ----------------------------------------------------------------------------- jnp wrappers
# jitted jax.numpy contractions, intercepted whole (module docstring, "Which calls are intercepted")
_ORIGINAL = {"matmul": _jnp_contractions.matmul, "dot": _jnp_contractions.dot, "inner": _jnp_contractions.inner}
_WRAPPER_PATHS = {"matmul": ("jax.numpy.matmul",),
                  "dot": ("jax.numpy.dot", "jax._src.numpy.tensor_contractions.dot"),  # .dot() looks it up there
                  "inner": ("jax.numpy.inner",)}
# ``x @ w`` for arrays and tracers: also when w is a weight the serving provider stored (a
# ptq.WithAux, which has no ``__rmatmul__``)
_OPERATOR_PATHS = {"jax._src.numpy.array_methods._operator_matmul": False,
                   "jax._src.numpy.array_methods._operator_rmatmul": True}


def _wrapper_subscripts(op: str, a_ndim: int, b_ndim: int) -> str | None:
    """The two-operand einsum that ``jnp.<op>`` of operands of these ranks computes (NumPy's
    rules: matmul broadcasts its batch dims, dot and inner stack them), or None for a scalar
    operand (an element-wise product, left to jax.numpy)."""
    if a_ndim == 0 or b_ndim == 0:
        return None
    if op == "matmul":  # a 1-D operand is a vector, else [..., m, k] @ [..., k, n]
        lt, rt = ("k" if a_ndim == 1 else "...mk"), ("k" if b_ndim == 1 else "...kn")
        return f"{lt},{rt}->...{'m' * (a_ndim > 1)}{'n' * (b_ndim > 1)}"
    la, lb = "ABCDEFGHIJLMNOPQRSTUVWXYZ"[:a_ndim - 1], "abcdefghijlmnopqrstuvwxyz"[:b_ndim - 1]
    if op == "dot" and b_ndim > 1:  # a's last dim against b's second-to-last
        return f"{la}K,{lb[:-1]}K{lb[-1]}->{la}{lb}"
    return f"{la}K,{lb}K->{la}{lb}"  # inner, and dot with a vector b: the last dims


class _MxCalls:
    """The interception both providers share: a call matched by an :class:`MxRule` runs through
    the provider's ``_mx_dot_general`` / ``_mx_einsum``; any other call goes to Qwix's own.
    ``jnp.matmul``/``@``, ``jnp.dot``/``.dot`` and ``jnp.inner`` count as ``dot_general`` calls
    (see ``_WRAPPER_PATHS``)."""

    def get_intercept_map(self):
        mapping = super().get_intercept_map()
        for op, paths in _WRAPPER_PATHS.items():
            for path in paths:
                mapping[path] = functools.partial(self._jnp_contraction, op)
        for path, reflected in _OPERATOR_PATHS.items():
            mapping[path] = functools.partial(self._matmul_operator, reflected)
        mapping["jax.lax.ragged_dot"] = self.ragged_dot  # Qwix's QtProvider's key; not its PtqProvider's
        return mapping

    def _matmul_operator(self, reflected, x, other):
        """``x @ other`` (``other @ x`` if ``reflected``), as jax's array operator accepts it."""
        as_array = getattr(other, "__jax_array__", None)
        other = as_array() if as_array is not None else other
        if not isinstance(other, (_ptq.WithAux, *_array_methods._accepted_binop_types)):
            return NotImplemented
        return self._jnp_contraction("matmul", *((other, x) if reflected else (x, other)))

    def _jnp_contraction(self, op, a, b, **kwargs):
        """``jnp.<op>(a, b, **kwargs)`` as one ``dot_general`` call of this provider, traced in
        the caller's trace (not inside jax.numpy's jit)."""
        original = functools.partial(_ORIGINAL[op], **kwargs)
        # stored weights (ptq.WithAux, MXFP4Array) stand in for their logical shape and dtype
        avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") and hasattr(x, "dtype") else x
                 for x in (a, b)]
        jax.eval_shape(original, *avals)  # jax.numpy's own argument, dtype and shape errors
        subscripts = _wrapper_subscripts(op, *(np.ndim(v) if not hasattr(v, "shape") else len(v.shape) for v in avals))
        if subscripts is None:
            return original(a, b)
        dtype = jnp.result_type(*(v.dtype for v in avals))  # jax.numpy promotes the operands first
        a, b = (x.astype(dtype) if isinstance(x, (jax.Array, np.ndarray)) and x.dtype != dtype else x
                for x in (a, b))
        a, b, dn, perm = align_operands(subscripts, a, b)  # matmul's size-1 batch dims broadcast
        y = self.dot_general(a, b, dn, kwargs.get("precision"), kwargs.get("preferred_element_type"))
        return _reshard(y if perm is None else jnp.transpose(y, perm), kwargs.get("out_sharding"))

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                    out_sharding=None):
        rule = _mx_rule(self, "dot_general")
        if rule is None:
            return super().dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                                       out_sharding=out_sharding)
        return _reshard(self._mx_dot_general(lhs, rhs, dimension_numbers, preferred_element_type, rule),
                        out_sharding)

    def ragged_dot(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None):
        rule = _mx_rule(self, "ragged_dot")
        if rule is None:  # Qwix's own (QtProvider), else the unquantized op (PtqProvider has none)
            fallback = getattr(super(), "ragged_dot", jax.lax.ragged_dot)
            return fallback(lhs, rhs, group_sizes, precision=precision,
                            preferred_element_type=preferred_element_type, group_offset=group_offset)
        if group_offset is not None:
            raise ValueError("jax_mxfp4.qwix: ragged_dot with group_offset is not supported (jax.lax.ragged_dot "
                             "has no implementation of it either); pass group_offset=None")
        return self._mx_ragged_dot(lhs, rhs, group_sizes, preferred_element_type, rule)

    def einsum(self, einsum_str, *operands, precision=None, preferred_element_type=None,
               _dot_general=jax.lax.dot_general, out_sharding=None):  # noqa: N803 (Qwix's signature)
        rule = _mx_rule(self, "einsum")
        if rule is None:
            return super().einsum(einsum_str, *operands, precision=precision,
                                  preferred_element_type=preferred_element_type, _dot_general=_dot_general,
                                  out_sharding=out_sharding)
        if len(operands) != 2:
            raise ValueError(f"jax_mxfp4.qwix: einsum {einsum_str!r} has {len(operands)} operands; "
                             "an MxRule needs two (lhs activations, rhs weight)")
        return _reshard(self._mx_einsum(einsum_str, *operands, preferred_element_type, rule), out_sharding)


class MxQtProvider(_MxCalls, qwix.QtProvider):
    """Training provider: :class:`MxRule` matches run through :func:`jax_mxfp4.dot_general` /
    :func:`jax_mxfp4.einsum` with the rule's recipe (see the module docstring).

    Usage: ``qmodel = qwix.quantize_model(model, MxQtProvider([MxRule(module_path=".*mlp.*")]))``
    (nnx models also take example inputs, as Qwix requires).
    """

    def _mx_dot_general(self, lhs, rhs, dimension_numbers, preferred_element_type, rule):
        return _dot_general(lhs, rhs, dimension_numbers, preferred_element_type, rule.recipe, pad_k=True,
                            key=_rounding_key(rule))

    def _mx_einsum(self, einsum_str, lhs, rhs, preferred_element_type, rule):
        return _einsum(einsum_str, lhs, rhs, preferred_element_type, rule.recipe, pad_k=True,
                       key=_rounding_key(rule))

    def _mx_ragged_dot(self, lhs, rhs, group_sizes, preferred_element_type, rule):
        return expert_dot(lhs, rhs, group_sizes, rule.recipe, _rounding_key(rule), preferred_element_type)


# ----------------------------------------------------------------------------- serving (PTQ)
@dataclasses.dataclass(frozen=True)
class HowToQuantize:
    """How :class:`MxPtqProvider` quantized a weight (static, stored in ``ptq.WithAux.how``):
    ``hadamard`` is None or the ``(block, seed)`` rotation of the recipe's forward pass
    (:func:`jax_mxfp4.weight_record.fprop_rotation`), applied before quantizing and recorded."""

    axis: int
    scale_mode: str = "even"
    scale_layout: str = "plain"
    hadamard: tuple[int, int] | None = None


class _QuantizeModule:
    """The ``_qarray_module`` Qwix's PTQ calls to quantize a weight: here to an MXFP4Array."""

    @staticmethod
    def quantize(value, how):
        if not isinstance(how, HowToQuantize):
            raise TypeError(f"jax_mxfp4.qwix: expected a jax_mxfp4.qwix.HowToQuantize, got {type(how).__name__}")
        return quantize_weight(value, how.axis, scale_mode=how.scale_mode, scale_layout=how.scale_layout,
                               hadamard=how.hadamard)


def _param_shape(name: str) -> tuple[int, ...]:
    """The shape of parameter ``name`` of the current (linen or nnx) module."""
    module = _flax_util.get_current_module()
    value = module.get_variable("params", name) if hasattr(module, "get_variable") else getattr(module, name)
    return tuple(_flax_util.unbox(value).shape)


def _serving_weight(x, contracting, rule: MxRule, what: str, batch=()):
    """``x`` as the GEMM operand: a stored MXFP4 weight (its record checked against the rule's
    recipe), a weight quantized now (and stored) as the recipe's forward pass quantizes it, or
    ``x`` itself when it is not a parameter (an activation)."""
    if isinstance(x, (_ptq.WithAux, MXFP4Array)):
        w = x.array if isinstance(x, _ptq.WithAux) else x
        check_against_recipe(w, rule.recipe, contracting=contracting, batch=batch, what=f"{what} weight")
        return w
    name = _flax_util.find_param(x)
    if not name or _param_shape(name) != tuple(x.shape):
        # not a parameter, or one transposed/reshaped on the way (a tied embedding's ``.T``):
        # storing it would replace the parameter its other uses (the lookup) read
        return x
    if len(contracting) != 1 or x.shape[contracting[0]] % BLOCK_SIZE:
        module_path = "/".join(map(str, _flax_util.get_current_module_path()))
        raise ValueError(
            f"jax_mxfp4.qwix: {what} weight {name!r} of module {module_path!r} (shape {tuple(x.shape)}) is "
            f"contracted along dims {tuple(contracting)}; serving it as MXFP4 needs one contracting dim "
            f"whose length is a multiple of {BLOCK_SIZE}. Exclude this module from the MxRule"
        )
    checks.check_float_input(x, name)
    how = HowToQuantize(contracting[0], rule.recipe.scale_mode, rule.recipe.scale_layout,
                        fprop_rotation(rule.recipe, x.shape, contracting, batch))
    return _ptq.create_quantized_param(name, x, how, _qarray_module=_QuantizeModule).array


class MxPtqProvider(_MxCalls, qwix.PtqProvider):
    """Serving provider: in :class:`MxRule` matches, weights become MXFP4Arrays (quantized along
    their contracting dim, once, stored in the params through ``ptq.WithAux``), and the GEMM runs
    through jax_mxfp4 with the rule's recipe (``Recipe(quantize_activations=False)`` for w4a16).

    The matched weights' contraction must be a single dim of length a multiple of 32 (ValueError
    naming the module otherwise). Use ``qmodel.init`` for fresh quantized params, or
    :func:`quantize_params` to convert trained float params.
    """

    def __init__(self, rules, **kwargs):
        super().__init__(rules, _qarray_module=_QuantizeModule, **kwargs)

    def _mx_dot_general(self, lhs, rhs, dimension_numbers, preferred_element_type, rule):
        (_, rc), (_, rb) = dimension_numbers
        rhs = _serving_weight(rhs, tuple(rc), rule, "rhs", tuple(rb))
        # pad_k: an activation x activation product (attention's probs x values) pads K as in
        # training; a weight's K is a multiple of 32 (_serving_weight)
        return _dot_general(lhs, rhs, dimension_numbers, preferred_element_type, rule.recipe, pad_k=True)

    def _mx_einsum(self, einsum_str, lhs, rhs, preferred_element_type, rule):
        (_, rc), (_, rb) = parse_subscripts(einsum_str, len(lhs.shape), len(rhs.shape))[0]
        rhs = _serving_weight(rhs, rc, rule, "rhs", rb)
        return _einsum(einsum_str, lhs, rhs, preferred_element_type, rule.recipe, pad_k=True)

    def _mx_ragged_dot(self, lhs, rhs, group_sizes, preferred_element_type, rule):
        if len(getattr(rhs, "shape", ())) == 3:  # else expert_dot names the rank rule
            rhs = _serving_weight(rhs, (1,), rule, "rhs", (0,))  # experts [E, K, N], quantized along K
        return expert_dot(lhs, rhs, group_sizes, rule.recipe, None, preferred_element_type)


def quantize_params(params: Any, abstract_quantized_params: Any, **kwargs) -> Any:
    """Trained float params -> the params of a model quantized with :class:`MxPtqProvider`.

    ``qwix.quantize_params`` with jax_mxfp4's quantizer: every weight that the quantized model
    stores as an MXFP4Array (``abstract_quantized_params``: e.g. ``jax.eval_shape`` of
    ``qmodel.init``, or the nnx model itself) is quantized the same way from ``params`` (an
    unboxed linen param tree, or ``nnx.to_pure_dict`` of an nnx state); the rest is copied.
    Other keyword arguments go to ``qwix.quantize_params``.
    """
    return qwix.quantize_params(params, abstract_quantized_params, _qarray_module=_QuantizeModule, **kwargs)


__all__ = ["HowToQuantize", "MxPtqProvider", "MxQtProvider", "MxRule", "quantize_params"]
