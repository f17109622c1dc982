"""``jax.shard_map`` and JAX's default meshes on 8 simulated CPU devices (conftest sets them up).

GEMMs of M, N >= 256, where "auto" stages backend "fp8" (CUDA Pallas kernels) for a CUDA
lowering and "hipblaslt" for a ROCm one besides this platform's own choice:
  - default mesh: ``jax.make_mesh`` with JAX's default axis types (explicit) under ``jit``, x
    sharded on rows against a column-sharded w, and x sharded on rows and K against a K-sharded w;
    the program compiled here traces no other platform's kernel (no ``pallas_call`` in its jaxpr);
    dense, einsum, linen.Dense and nnx.Linear alike, forward and gradients;
  - ``jax.shard_map`` with its defaults (``check_vma=True``) over Auto and explicit meshes: every
    backend that runs on a CPU, forward and gradients; a replicated weight's cotangent comes back
    summed over the shards and typed invariant (as ``jnp.dot``'s does); dense, einsum,
    linen.Dense, nnx.Linear and a pre-quantized MXFP4Array weight alike; the program exported
    for cpu, cuda and rocm lowers each platform's branch inside ``shard_map`` and runs here.
Values are compared with the single-device run: bit-equal where each output element is the same
arithmetic (forward rows computed whole on one device, dgrad rows), else within the float32
reassociation bound of a sum split over shards (wgrad over the token axis, K-sharded forward).
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_mxfp4 as mx
import jax_mxfp4.flax as mxf
from jax_mxfp4.ffi import export_safety_checks
from jax_mxfp4.mx_format import as_scale_bytes

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

DN = (((1,), (0,)), ((), ()))
M, K, N = 256, 512, 384
NEAREST = mx.Recipe(grad_rounding="nearest")  # data-derived rounding keys differ per shard
CPU_BACKENDS = ["auto", "xla", "pallas", "fp8"] + [b for b in ("ffi-cpu", "scaled_dot") if b in mx.available_backends()]
LAYOUTS = {  # the two layouts of the default-mesh regression: (x spec, w spec, K sharded)
    "rows-x-columns": (P("data", None), P(None, "model"), False),
    "rows-and-k-x-k": (P("data", "model"), P("model", None), True),
}


def operands(rng, k=K, n=N):
    """x [M, k], w [k, n]; the cases besides the two exact ones take a small K and N = M (still
    min(M, N) >= 256: "auto" stages fp8 for CUDA) to keep their compile times down."""
    x = jnp.asarray(rng.standard_normal((M, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)) / 16, jnp.float32)
    return x, w


def cotangent(rng, n=N):
    return jnp.asarray(rng.standard_normal((M, n)), jnp.float32)


def default_mesh():
    return jax.make_mesh((4, 2), ("data", "model"))  # JAX's default axis types


def mesh8(style):
    types = (AxisType.Auto,) if style == "auto" else (AxisType.Explicit,)
    return jax.make_mesh((8,), ("d",), axis_types=types)


def assert_within_reassociation(got, want, rel=1e-5):
    """Equal up to the order of a float32 sum split over shards (psum of partial sums)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=rel * (np.abs(w).max() + 1e-30))


def assert_bit_equal(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_auto_stages_cuda_and_rocm_kernels_for_these_shapes(rng):
    """The premise of this file: besides this platform's choice, "auto" stages Pallas/FFI
    backends for CUDA and ROCm lowerings of these GEMMs (else the cases below test nothing)."""
    x, w = operands(rng)
    plan = mx.explain(x, w, DN, preferred_element_type=jnp.float32).per_platform
    assert plan["cpu"] == "xla" and plan["cuda"] == "fp8" and plan["rocm"] == "hipblaslt"


# ----------------------------------------------------------------------------- default mesh
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_default_mesh_jit_traces_no_other_platforms_kernel(layout, rng):
    """The regression: under ``jit`` on a default (explicit) mesh the CUDA branch's Pallas
    kernel was traced on sharded types ("sharded ref ... can only be sliced along unsharded
    axes") though the program runs on the CPU."""
    x, w = operands(rng)
    xs, ws, k_sharded = LAYOUTS[layout]
    f = jax.jit(lambda a, b: mx.dot_general(a, b, DN, preferred_element_type=jnp.float32))
    single = f(x, w)
    mesh = default_mesh()
    xx, ww = jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(w, NamedSharding(mesh, ws))
    assert "pallas_call" not in str(jax.make_jaxpr(f)(xx, ww))
    out = f(xx, ww)
    if k_sharded:  # partial sums over the K shards, then one psum
        assert_within_reassociation(out, single)
    else:
        assert_bit_equal(out, single)
        assert tuple(out.sharding.spec) == tuple(jax.jit(jnp.matmul)(xx, ww).sharding.spec)


def _entry_points():
    """name -> (params from (w, recipe), apply(params, x)) for x [M, k] and a [k, n] weight w."""
    def dense(w, recipe):
        return w, lambda p, x: mx.dense(x, p, recipe=recipe)

    def einsum(w, recipe):
        return w, lambda p, x: mx.einsum("mk,kn->mn", x, p, recipe=recipe)

    def linen_dense(w, recipe):
        m = mxf.linen.Dense(w.shape[1], recipe=recipe, use_bias=False)
        return {"params": {"kernel": w}}, m.apply

    def nnx_linear(w, recipe):
        lin = mxf.nnx.Linear(*w.shape, recipe=recipe, use_bias=False, rngs=nnx.Rngs(0))
        lin.kernel.set_value(w)
        graph, state = nnx.split(lin)
        return state, lambda s, x: nnx.merge(graph, s)(x)

    return {"dense": dense, "einsum": einsum, "linen.Dense": linen_dense, "nnx.Linear": nnx_linear}


ENTRY_POINTS = _entry_points()


def _value_and_grads(apply):
    """(y, dL/dparams, dL/dx) of L = sum(y * t) for a fixed cotangent t."""
    def run(p, x, t):
        y = apply(p, x)
        gp, gx = jax.grad(lambda p, x: jnp.sum(apply(p, x) * t), argnums=(0, 1))(p, x)
        return y, gp, gx
    return run


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_default_mesh_entry_points_forward_and_gradients(entry, rng):
    x, w = operands(rng, k=64, n=M)
    t = cotangent(rng, M)
    params, apply = ENTRY_POINTS[entry](w, NEAREST)
    run = jax.jit(_value_and_grads(apply))
    y1, gp1, gx1 = run(params, x, t)
    mesh = default_mesh()
    rows = NamedSharding(mesh, P("data", None))
    y, gp, gx = run(params, jax.device_put(x, rows), jax.device_put(t, rows))
    assert_bit_equal((y, gx), (y1, gx1))
    assert_within_reassociation(gp, gp1)  # wgrad sums over the token shards


# ----------------------------------------------------------------------------- shard_map
def _in_shard_map(fn, mesh, in_specs, out_specs):
    """jit of shard_map(fn); on an explicit mesh the arguments are first placed as in_specs say
    (shard_map takes explicitly sharded arguments as they are)."""
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    if AxisType.Explicit not in mesh.axis_types:
        return f
    return lambda *args: f(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs, strict=True)))


@pytest.mark.parametrize("style", ["auto", "explicit"])
def test_shard_map_dot_general_with_the_defaults(style, rng):
    """The exact case: per-platform branches typed alike ("switch branches must have equal
    output types" before); every row is computed whole on one device: bit-equal."""
    x, w = operands(rng)
    f = lambda a, b: mx.dot_general(a, b, DN)  # noqa: E731
    out = _in_shard_map(f, mesh8(style), (P("d", None), P()), P("d", None))(x, w)
    assert_bit_equal(out, jax.jit(f)(x, w))


@pytest.mark.slow  # the default tier has this layout under jit (test_default_mesh_jit_...[rows-and-k-x-k])
@pytest.mark.parametrize("style", ["auto", "explicit"])
def test_shard_map_k_sharded_partial_products_summed_by_the_caller(style, rng):
    """The second layout inside shard_map: x on rows and K, w on K; each device's GEMM of its
    K shard (whole 32-element blocks) is a partial product that the caller psums, as with
    ``jnp.dot``; the weight gradient comes back sharded on K and equals one device's."""
    x, w = operands(rng, k=128, n=M)
    t = cotangent(rng, M)
    axis_type = AxisType.Auto if style == "auto" else AxisType.Explicit
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)

    def run(b, a, t):
        f = lambda b, a: jax.lax.psum(mx.dot_general(a, b, DN, recipe=NEAREST), "model")  # noqa: E731
        return f(b, a), *jax.grad(lambda b, a: jnp.sum(f(b, a) * t), argnums=(0, 1))(b, a)

    one = lambda b, a: mx.dot_general(a, b, DN, recipe=NEAREST)  # noqa: E731
    want = jax.jit(_value_and_grads(one))(w, x, t)
    got = _in_shard_map(run, mesh, (P("model", None), P("data", "model"), P("data", None)),
                        (P("data", None), P("model", None), P("data", "model")))(w, x, t)
    assert_within_reassociation(got, want)


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("backend", ["xla"] + [b for b in CPU_BACKENDS if b != "xla"])
def test_shard_map_backend_forward_and_gradients(backend, rng):
    """Every backend that runs on a CPU, inside shard_map (check_vma on): the replicated weight's
    cotangent is the sum of the per-shard ones and invariant (out_specs P() checks the type),
    as with ``jnp.dot``; dgrad rows and the forward bit-equal to one device."""
    x, w = operands(rng, k=64, n=M)
    t = cotangent(rng, M)
    recipe = NEAREST.replace(backend=backend)
    run = _value_and_grads(lambda b, a: mx.dot_general(a, b, DN, recipe=recipe))
    y1, gw1, gx1 = jax.jit(run)(w, x, t)
    y, gw, gx = _in_shard_map(run, mesh8("auto"), (P(), P("d", None), P("d", None)),
                              (P("d", None), P(), P("d", None)))(w, x, t)
    assert_bit_equal((y, gx), (y1, gx1))
    assert_within_reassociation(gw, gw1)


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_shard_map_entry_points_forward_and_gradients(entry, rng):
    x, w = operands(rng, k=64, n=M)
    t = cotangent(rng, M)
    params, apply = ENTRY_POINTS[entry](w, NEAREST)
    run = _value_and_grads(apply)
    y1, gp1, gx1 = jax.jit(run)(params, x, t)
    y, gp, gx = _in_shard_map(run, mesh8("auto"), (P(), P("d", None), P("d", None)),
                              (P("d", None), P(), P("d", None)))(params, x, t)
    assert_bit_equal((y, gx), (y1, gx1))
    assert_within_reassociation(gp, gp1)


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("style", ["auto", "explicit"])
def test_shard_map_pre_quantized_weight_forward_and_activation_gradient(style, rng):
    """A replicated MXFP4Array weight (quantize_params-style) inside shard_map: forward and the
    activation gradient bit-equal to one device."""
    x, w = operands(rng, k=64, n=M)
    t = cotangent(rng, M)
    wq = mx.quantize(w, axis=0)

    def run(q, a, t):
        y = mx.dense(a, q, recipe=NEAREST)
        return y, jax.grad(lambda a: jnp.sum(mx.dense(a, q, recipe=NEAREST) * t))(a)

    want = jax.jit(run)(wq, x, t)
    got = _in_shard_map(run, mesh8(style), (P(), P("d", None), P("d", None)), (P("d", None), P("d", None)))(wq, x, t)
    assert_bit_equal(got, want)


def test_shard_map_export_lowers_every_platforms_branch_and_runs_here(rng):
    """The shard_map program exported for cpu, cuda and rocm: the deferred CUDA (fp8 Pallas
    kernels) and ROCm (hipBLASLt custom call) branches lower inside shard_map; the exported
    program runs the cpu branch here, bit-equal to the direct call."""
    x, w = operands(rng)
    mesh = mesh8("auto")
    f = jax.jit(jax.shard_map(lambda a, b: mx.dot_general(a, b, DN), mesh=mesh,
                              in_specs=(P("d", None), P()), out_specs=P("d", None)))
    xx = jax.device_put(x, NamedSharding(mesh, P("d", None)))
    ww = jax.device_put(w, NamedSharding(mesh, P()))
    exp = jax.export.export(f, platforms=["cpu", "cuda", "rocm"], disabled_checks=export_safety_checks())(xx, ww)
    text = exp.mlir_module()
    assert "@jax_mxfp4_gemm_hipblaslt" in text  # the ROCm branch
    assert "__gpu$xla.gpu.triton" in text or "mosaic_gpu" in text  # the CUDA branch's Pallas kernels
    assert_bit_equal(exp.call(xx, ww), f(xx, ww))


# ----------------------------------------------------------------------------- kernel guard
def _encode(data, sb):
    from jax_mxfp4.fp8_prepared import encode_rows_on

    return encode_rows_on(data, sb, "cuda")


def _rescale(acc, e_rows, e_cols, on="cuda"):
    from jax_mxfp4.backends.fp8 import rescale, rescale_on

    no_rows, no_cols = jnp.zeros((1,) + e_rows.shape, bool), jnp.zeros((1,) + e_cols.shape, bool)
    args = (acc[None], e_rows[None], e_cols[None], no_rows, no_cols, jnp.float32)
    return (rescale_on(*args, on) if on else rescale(*args))[0]


def _kernel_sites(rng):
    """name -> (fn staged for a CUDA lowering, its XLA formulation, args, their row-sharded
    specs): the CUDA Pallas kernels that give way where jax_mxfp4.sharding.kernel_may_run says no."""
    from jax_mxfp4.fp8_prepared import encode_rows

    q = mx.quantize(jnp.asarray(rng.standard_normal((256, 64)), jnp.float32), axis=1)
    acc = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)
    e_rows, e_cols = (jnp.asarray(rng.integers(-20, 20, (n,)), jnp.int32) for n in (256, 128))
    return {
        "fp8-encode": (_encode, encode_rows, (q.data, as_scale_bytes(q.plain_scales())), (P("d"), P("d"))),
        "fp8-rescale": (_rescale, functools.partial(_rescale, on=None), (acc, e_rows, e_cols), (P("d"), P("d"), P())),
    }


@pytest.mark.parametrize("where", ["explicit-mesh", "shard_map"])
@pytest.mark.parametrize("site", ["fp8-encode", "fp8-rescale"])
def test_cuda_kernels_give_way_on_sharded_and_varying_operands(site, where, rng):
    """Traced for a CUDA lowering (as on a GPU), each kernel site takes its Pallas kernel on plain
    arrays but the XLA formulation (bit-identical) on explicitly sharded arrays and inside
    shard_map, where a pallas_call fails to trace or is opaque to the partitioner."""
    fn, xla_form, plain, specs = _kernel_sites(rng)[site]
    assert "pallas_call" in str(jax.make_jaxpr(fn)(*plain))  # the kernel where nothing is sharded
    if where == "explicit-mesh":
        mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
        staged = jax.jit(fn)
        args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(plain, specs)]
    else:
        staged = jax.jit(jax.shard_map(fn, mesh=mesh8("auto"), in_specs=specs, out_specs=P("d")))
        args = plain
    assert "pallas_call" not in str(jax.make_jaxpr(staged)(*args))
    assert_bit_equal(staged(*args), jax.jit(xla_form)(*plain))


@pytest.mark.parametrize("where", ["explicit-mesh", "shard_map"])
def test_fused_quantizer_gives_way_on_sharded_and_varying_operands(where, monkeypatch, rng):
    """mx.quantize as traced on a CUDA GPU: the fused Pallas quantizer on a plain array, the
    reference path on an explicitly sharded one (no set_mesh around it) and inside shard_map."""
    qmod = importlib.import_module("jax_mxfp4.quantize")  # the module (the package exports a function of that name)
    monkeypatch.setattr(qmod, "current_platform", lambda: "cuda")
    x = jnp.asarray(rng.standard_normal((256, 64)), jnp.float32)
    fn = lambda a: mx.quantize(a, axis=1).data  # noqa: E731
    assert "pallas_call" in str(jax.make_jaxpr(fn)(x))  # the kernel where nothing is sharded
    if where == "explicit-mesh":
        mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
        staged, arg = jax.jit(fn), jax.device_put(x, NamedSharding(mesh, P("d", None)))
    else:
        staged, arg = jax.jit(jax.shard_map(fn, mesh=mesh8("auto"), in_specs=P("d"), out_specs=P("d"))), x
    assert "pallas_call" not in str(jax.make_jaxpr(staged)(arg))
