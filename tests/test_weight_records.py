"""A quantized weight's record (rotation block and seed, scale rule, logical dtype, axis/shape,
scale layout) survives every save/load route -- safetensors metadata, orbax, Qwix's serving
provider, the prepared forms -- so serving equals the trained forward bit for bit; a layer (or the
Qwix provider) given a weight whose record disagrees with its recipe refuses it, naming both."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from mx_reference import hadamard_transform_ref, qdq  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
import jax_mxfp4.flax as mxf  # noqa: E402
from jax_mxfp4 import hadamard as hd  # noqa: E402
from jax_mxfp4.checkpoint import load_mxfp4, save_mxfp4  # noqa: E402
from jax_mxfp4.weight_record import RECORD_KEY_PREFIX, quantize_weight  # noqa: E402

ROT = mx.Recipe(backend="xla", hadamard="fprop")
PLAIN = mx.Recipe(backend="xla")
SCALE_MODES = ("floor", "ceil", "even", "rceil")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
NOT_ROTATED = r"records no rotation \(hadamard=None\), but this layer's recipe .*trains its forward with hadamard=\(block 32, seed"


def rnd(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def same_bits(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def record(q):
    return (q.axis, q.shape, jnp.dtype(q.dtype), q.scale_mode, getattr(q, "scale_layout", "plain"), q.hadamard)


# ----------------------------------------------------------------------------- safetensors
def test_rotated_kernel_survives_safetensors_and_serves_as_trained(tmp_path, rng):
    """The reported case: the rotation came back None and the layer served unrotated weights."""
    model, x = mxf.linen.Dense(16, recipe=ROT), rnd(rng, (4, 64))
    v = model.init(jax.random.key(1), x)
    q = mxf.quantize_params(v, recipe=ROT)
    save_mxfp4(tmp_path / "m.safetensors", q["params"])
    back = load_mxfp4(tmp_path / "m.safetensors")  # no axes, no dtype: all from the record
    k = back["kernel"]
    seed = hd.weight_seed((64, 16), (0,), ())
    assert record(k) == (0, (64, 16), jnp.float32, "even", "plain", (32, seed))
    # independent oracle: the stored values are the NumPy-rotated kernel quantized along K
    w = np.asarray(v["params"]["kernel"])
    np.testing.assert_array_equal(np.asarray(k.dequantize(jnp.float32), np.float64),
                                  qdq(hadamard_transform_ref(w, 0, seed, 32), 0, "even"))
    same_bits(model.apply({"params": back}, x), model.apply(v, x))


@pytest.mark.sweep(keep=4)
@pytest.mark.parametrize("scale_mode,dtype", [(m, DTYPES[(i + j) % 3]) for j in range(3)  # first 4: every
                                              for i, m in enumerate(SCALE_MODES)])        # rule, every dtype
def test_every_scale_rule_and_logical_dtype_survive_safetensors(tmp_path, rng, scale_mode, dtype):
    w = rnd(rng, (3, 64, 8), dtype)
    rotated = quantize_weight(w, 1, scale_mode=scale_mode, scale_layout="swizzled", hadamard=(64, 5))
    plain = mx.quantize(jnp.swapaxes(w, 1, 2), 2, scale_mode=scale_mode)  # K last, no rotation
    save_mxfp4(tmp_path / "w.safetensors", {"rot": rotated, "plain": plain})
    back = load_mxfp4(tmp_path / "w.safetensors")
    for name, q in (("rot", rotated), ("plain", plain)):
        assert record(back[name]) == record(q), name
        same_bits(back[name].data, q.data)
        same_bits(np.asarray(back[name].scales).view(np.uint8), np.asarray(q.scales).view(np.uint8))
    assert record(rotated)[2:] == (jnp.dtype(dtype), scale_mode, "swizzled", (64, 5))


def test_published_file_without_records_loads_as_before(tmp_path, rng):
    blocks = rng.integers(0, 256, size=(6, 2, 16), dtype=np.uint8)
    scales = rng.integers(120, 130, size=(6, 2), dtype=np.uint8)
    save_file({"w_blocks": blocks, "w_scales": scales}, str(tmp_path / "pub.safetensors"))
    q = load_mxfp4(tmp_path / "pub.safetensors", axes={"w": 0})
    assert record(q["w"]) == (0, (64, 6), jnp.bfloat16, "even", "plain", None)
    assert load_mxfp4(tmp_path / "pub.safetensors", dtype=jnp.float16)["w"].dtype == jnp.float16


def test_records_that_disagree_or_do_not_parse_are_refused(tmp_path, rng):
    q = quantize_weight(rnd(rng, (64, 8)), 0, scale_mode="rceil", hadamard=(32, 3))
    f = tmp_path / "q.safetensors"
    save_mxfp4(f, {"w": q}, metadata={"note": "kept"})
    with pytest.raises(ValueError, match=r"w: load_mxfp4\(dtype=bfloat16\) but .* records logical dtype float32"):
        load_mxfp4(f, dtype=jnp.bfloat16)
    assert load_mxfp4(f, dtype=jnp.float32, axes={"w": 0})["w"].hadamard == (32, 3)  # agreeing: fine
    moved = load_mxfp4(f, axes={"w": 1})["w"]  # K moved: the record holds, rotation along K
    assert record(moved) == (1, (8, 64), jnp.float32, "rceil", "plain", (32, 3))
    same_bits(moved.dequantize(), q.dequantize().T)
    with pytest.raises(ValueError, match=r"metadata keys \['jax_mxfp4.record.x'\] .* reserved"):
        save_mxfp4(tmp_path / "bad.safetensors", {"w": q}, metadata={RECORD_KEY_PREFIX + "x": "{}"})
    tensors = load_file(str(f))
    good = json.loads(_metadata(f)[RECORD_KEY_PREFIX + "w"])
    cases = [
        ({**good, "format": 2}, r"has format 2; this jax_mxfp4 reads format 1"),
        ({**good, "hadamard": [48, 3]}, r"malformed: .*hadamard block must be a power of two"),
        ({**good, "scale_mode": "nearest"}, r"malformed: .*scale_mode must be one of"),
        ({**good, "shape": [32, 8]}, r"records logical shape \(32, 8\) \(axis 0\) but its pair holds \(8, 64\)"),
        ({k: v for k, v in good.items() if k != "dtype"}, r"must hold exactly the fields"),
    ]
    for i, (rec, match) in enumerate(cases):
        g = tmp_path / f"bad{i}.safetensors"
        save_file(tensors, str(g), metadata={RECORD_KEY_PREFIX + "w": json.dumps(rec)})
        with pytest.raises(ValueError, match=r"record of 'w'.*" + match if "pair holds" not in match else match):
            load_mxfp4(g)
    g = tmp_path / "orphan.safetensors"
    save_file(tensors, str(g), metadata={RECORD_KEY_PREFIX + "w": json.dumps(good), RECORD_KEY_PREFIX + "v": "{}"})
    with pytest.raises(ValueError, match=r"records \['v'\] name no _blocks/_scales pair"):
        load_mxfp4(g)


def _metadata(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        return f.metadata()


# ----------------------------------------------------------------------------- layers refuse
def _layers():
    """``make(recipe) -> (apply(params), float params, quantize(recipe) -> params)`` per layer; the
    float params are the same whatever the recipe (fixed seeds)."""
    x2, x3 = jnp.linspace(-2.0, 2.0, 4 * 64).reshape(4, 64), jnp.linspace(-2.0, 2.0, 2 * 3 * 64).reshape(2, 3, 64)

    def linen(module, x):
        def make(recipe):
            m = module(recipe)
            v = m.init(jax.random.key(0), x)  # the same values whatever the recipe
            return (lambda p: m.apply(p, x)), v, (lambda r: mxf.quantize_params(v, model=m, inputs=(x,), recipe=r))
        return make

    def nnx_(module, x):
        def make(recipe):
            m = module(recipe)
            fresh = lambda: nnx.state(module(recipe), nnx.Param)  # noqa: E731  (nnx.update changes m's own)

            def apply(p):
                nnx.update(m, p)
                return m(x)
            return apply, fresh(), (lambda r: mxf.quantize_params(fresh(), model=m, recipe=r))
        return make

    slow = pytest.mark.slow
    return [
        pytest.param(linen(lambda r: mxf.linen.Dense(16, recipe=r), x2), id="linen.Dense"),
        pytest.param(linen(lambda r: mxf.linen.DenseGeneral((2, 8), recipe=r), x3), id="linen.DenseGeneral", marks=slow),
        pytest.param(linen(lambda r: mxf.linen.DenseGeneral(8, batch_dims=(0,), recipe=r), x3),
                     id="linen.DenseGeneral-batch-dims", marks=slow),  # the seed counts the batch dims
        pytest.param(linen(lambda r: mxf.linen.Einsum((64, 4, 4), "bsk,khn->bshn", recipe=r), x3), id="linen.Einsum",
                     marks=slow),
        pytest.param(linen(lambda r: mxf.linen.Einsum((2, 64, 4), "bsk,bkn->bsn", recipe=r), x3),
                     id="linen.Einsum-batch-dims", marks=slow),
        pytest.param(nnx_(lambda r: mxf.nnx.Linear(64, 16, recipe=r, rngs=nnx.Rngs(0)), x2), id="nnx.Linear"),
        pytest.param(nnx_(lambda r: mxf.nnx.Einsum("bsk,khn->bshn", (64, 4, 4), (4, 4), recipe=r, rngs=nnx.Rngs(0)), x3),
                     id="nnx.Einsum", marks=slow),
    ]


@pytest.mark.parametrize("make", _layers())
def test_every_layer_serves_its_rotated_kernel_as_trained_and_refuses_a_mismatch(make):
    apply, v, quantize = make(ROT)
    trained = apply(v)
    same_bits(apply(quantize(ROT)), trained)
    with pytest.raises(ValueError, match="kernel: an MXFP4Array " + NOT_ROTATED):
        apply(quantize(None))  # quantized without the recipe
    with pytest.raises(ValueError, match=r"records hadamard=\(block 64, seed \d+\), but .*hadamard=\(block 32"):
        apply(quantize(ROT.replace(hadamard_block=64)))
    plain_apply = make(PLAIN)[0]
    with pytest.raises(ValueError, match=r"records hadamard=\(block 32, seed \d+\), .* no rotation"):
        plain_apply(quantize(ROT))  # a rotated kernel in a layer trained without rotation


@pytest.mark.parametrize("prepare", ["fp8", pytest.param("decode", marks=pytest.mark.slow)])
def test_prepared_forms_carry_the_rotation_and_refuse_a_mismatch(prepare, rng):
    """prepare_fp8 dropped the record: an FP8Prepared of a rotated kernel was served unrotated."""
    model, x = mxf.linen.Dense(16, recipe=ROT), rnd(rng, (3, 64))
    v = model.init(jax.random.key(2), x)
    form = mx.prepare_decode if prepare == "decode" else mx.prepare_fp8

    def served(recipe):
        q = mxf.quantize_params(v, recipe=recipe)
        k = form(q["params"]["kernel"])
        return {"params": {**q["params"], "kernel": k}}, k

    p, k = served(ROT)
    assert k.hadamard == (32, hd.weight_seed((64, 16), (0,), ())) and k.to_mxfp4().hadamard == k.hadamard
    same_bits(model.apply(p, x), model.apply(v, x))
    kind = "a DecodePrepared" if prepare == "decode" else "an FP8Prepared"
    with pytest.raises(ValueError, match=f"kernel: {kind} " + NOT_ROTATED):
        model.apply(served(None)[0], x)


@pytest.mark.slow
def test_scanned_stack_is_rotated_per_layer_as_trained(rng):
    class Body(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return jnp.tanh(mxf.linen.Dense(64, recipe=ROT)(h)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, h):
            return nn.scan(Body, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()(h, None)[0]

    model, x = Net(), rnd(rng, (3, 64))
    v = model.init(jax.random.key(3), x)
    q = mxf.quantize_params(v, model=model, inputs=(x,), recipe=ROT)
    (k,) = [t for t in jax.tree.leaves(q, is_leaf=lambda t: isinstance(t, mx.MXFP4Array)) if isinstance(t, mx.MXFP4Array)]
    assert k.shape == (2, 64, 64) and k.hadamard == (32, hd.weight_seed((64, 64), (0,), ()))  # per-layer seed
    same_bits(model.apply(q, x), model.apply(v, x))


# ----------------------------------------------------------------------------- orbax
def test_orbax_restore_keeps_the_record_or_the_layer_refuses(tmp_path, rng):
    ocp = pytest.importorskip("orbax.checkpoint")
    model, x = mxf.linen.Dense(16, recipe=ROT.replace(scale_mode="rceil")), rnd(rng, (3, 64))
    recipe = model.recipe
    v = model.init(jax.random.key(4), x)
    q = mxf.quantize_params(v, recipe=recipe, scale_layout="swizzled")
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "q", q)
    ckpt.wait_until_finished()
    right = ckpt.restore(tmp_path / "q", mxf.abstract_params(q))
    assert record(right["params"]["kernel"]) == record(q["params"]["kernel"])
    same_bits(model.apply(right, x), model.apply(v, x))
    # a target built without the recipe: orbax restores the bytes into its (empty) record
    wrong = ckpt.restore(tmp_path / "q", mxf.abstract_params(mxf.quantize_params(v, scale_mode="rceil",
                                                                                 scale_layout="swizzled")))
    with pytest.raises(ValueError, match=NOT_ROTATED):
        model.apply(wrong, x)


# ----------------------------------------------------------------------------- qwix
def test_qwix_serving_provider_rotates_as_the_trained_forward(rng):
    qwix = pytest.importorskip("qwix")
    from jax_mxfp4.qwix import MxPtqProvider, MxQtProvider, MxRule, quantize_params

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(64, name="up")(x)
            return nn.Einsum((64, 2, 16), "bk,khn->bhn", name="es")(h)

    x, plain = rnd(rng, (4, 32)), Net()
    p = plain.init(jax.random.key(5), x)
    rule = lambda r: [MxRule(module_path="up|es", recipe=r)]  # noqa: E731
    trained = qwix.quantize_model(plain, MxQtProvider(rule(ROT))).apply(p, x)
    serving = qwix.quantize_model(plain, MxPtqProvider(rule(ROT)))
    qp = quantize_params(p["params"], jax.eval_shape(serving.init, jax.random.key(0), x)["params"])
    for name, shape in (("up", (32, 64)), ("es", (64, 2, 16))):
        assert qp[name]["kernel"].array.hadamard == (32, hd.weight_seed(shape, (0,), ()))
    same_bits(serving.apply({"params": qp}, x), trained)
    # weights stored by a provider without the rotation, served by one with it: refused
    unrotated = qwix.quantize_model(plain, MxPtqProvider(rule(PLAIN)))
    qp0 = quantize_params(p["params"], jax.eval_shape(unrotated.init, jax.random.key(0), x)["params"])
    with pytest.raises(ValueError, match=r"rhs weight: an MXFP4Array records no rotation"):
        serving.apply({"params": qp0}, x)
