"""``python -m jax_mxfp4.selftest``: every available backend against an exact reference, then a
speed table against bf16 ``dot_general``, on whatever device JAX sees (gfx950 for "hipblaslt").

Correctness. Operands are MXFP4Arrays with random codes and scales; the reference is the exact
float64 product of their dequantized values (NumPy, independent of every backend). Each backend
is held to its own contract, :meth:`jax_mxfp4.backends.base.Backend.numerics` (printed per
backend): "exact" backends to |out - exact| <= g(K) S + r(out) elementwise, where S = |A| |B|^T,
u = 2^-24, g(n) = n u / (1 - n u) bounds any float32 summation order of K exact products, and r
is half an ulp of the output dtype at |exact| (bf16: 2^-8 |exact|, f16: 2^-11 |exact|, plus
subnormal spacing); backend "fp8" on a GPU (FP8 tensor-core accumulation) to its measured bound
c S for random data (``jax_mxfp4.backends.fp8.ERROR_BOUNDS``) plus the same r(out). The
hipBLASLt kernels accumulate in float32 (compute type 32F): exact contract.

hipBLASLt gates. Each rule of backend "hipblaslt" (the validated envelope, the opt-in documented
one behind ``JAX_MXFP4_HIPBLASLT_ENVELOPE=documented``, swizzled scales below hipBLASLt 1.5, plain
scales on the TensileLite route) is exercised with a shape on each side of it: a shape inside must
run and pass the bound above, a shape outside must be routed away with the rule as the reason. On
a gfx950 machine this is what verifies the documented envelope (its cases run); elsewhere only the
shape rules can be judged. The internal route hipBLASLt takes (rocRoller or TensileLite, and why)
is printed per device.

hipBLASLt repeats and routes. hipBLASLt below 1.5.0 carries an upstream bug giving intermittent
non-finite output on gfx950 (fixed in 1.5.0, CHANGELOG "Intermittent nonfinite (NaN/Inf) values in
hipblasLtMatmul output on gfx950"), which one pass cannot show absent: every swizzled case of
backend "hipblaslt" is repeated :data:`REPEATS` times on fresh data, every output finite and within
the bound. hipBLASLt's other internal route is checked in a subprocess with
``HIPBLASLT_USE_ROCROLLER=0`` (TensileLite; the library reads it when a handle is created): swizzled
scales must run exact there, plain scales must be refused naming TensileLite (or, if they ever
run, be exact).

Exit status: 0 when every case that ran passed, 1 otherwise. Options: --quick (small shapes only),
--no-speed, --iters N, --backends NAME[,NAME...] (only these backends).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from . import dispatch
from .array import MXFP4Array
from .backends.base import Contract, GemmProblem
from .backends.hipblaslt import ENVELOPE_ENV
from .gemm import dot_general
from .recipe import Recipe

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
DN = (((1,), (1,)), ((), ()))
DATA = "random"  # the data family of _random_mx, for contracts with a bound per family


def _random_mx(rng, rows, k):
    data = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    scales = rng.integers(120, 133, (rows, k // 32), dtype=np.uint8)
    q = MXFP4Array(jnp.asarray(data), jnp.asarray(scales.view(ml_dtypes.float8_e8m0fnu)), 1, (rows, k), jnp.float32)
    codes = np.stack([data & 0xF, data >> 4], -1).reshape(rows, k)
    exact = E2M1[codes] * np.ldexp(1.0, np.repeat(scales.astype(np.int64), 32, axis=1) - 127)
    return q, exact


def contract_for(backend, m, n, k, layout, out) -> Contract:
    """The contract ``backend`` holds for this self-test GEMM (its ``numerics``)."""
    problem = dispatch_problem_shape(m, n, k, out, Recipe(backend=backend, scale_layout=layout))
    return dispatch.get_backend(backend).numerics(problem)


def contract_line(backend, m, n, k) -> str:
    """The self-test's line naming the contract ``backend`` is held to (at the largest shape)."""
    contract = contract_for(backend, m, n, k, "plain", "float32")
    return f"backend {backend}: contract {contract.describe(k, DATA)} at K={k}; {contract.summary}"


def check_case(backend, m, n, k, layout, out, seed=0):
    """(status, detail) for one backend and GEMM: "PASS", "FAIL" or "SKIP". The result is held to
    the backend's own contract (:func:`contract_for`), named in ``detail``."""
    rng = np.random.default_rng(seed)
    (a, ea), (b, eb) = _random_mx(rng, m, k), _random_mx(rng, n, k)
    recipe = Recipe(backend=backend, scale_layout=layout)
    try:
        dispatch.decide(dispatch_problem_shape(m, n, k, out, recipe), backend)
    except dispatch.BackendUnavailableError as e:
        return "SKIP", str(e).split(": ", 1)[-1][:90]
    try:
        got = np.asarray(_gemm_fn(recipe, out)(a, b)).astype(np.float64)
    except Exception as e:  # report, never crash the table
        return "FAIL", f"{type(e).__name__}: {str(e)[:120]}"
    exact = ea @ eb.T
    contract = contract_for(backend, m, n, k, layout, out)
    bound = contract.bound(exact, np.abs(ea) @ np.abs(eb).T, k, getattr(jnp, out), DATA)
    err = np.abs(got - exact)
    ok = bool(np.all(err <= bound))
    worst = float(np.max(err / np.maximum(bound, 1e-300)))
    return ("PASS" if ok else "FAIL"), f"max err/bound = {worst:.3g} ({contract.kind})"


def _gemm_fn(recipe, out):
    """The jitted GEMM the self-test runs: lhs [M, K] . rhs [N, K]^T in ``out``."""
    return jax.jit(lambda x, y: dot_general(x, y, DN, preferred_element_type=getattr(jnp, out), recipe=recipe))


REPEATS = 20  # runs of each repeated case (an intermittent fault needs more than one)


def repeat_case(backend, m, n, k, layout, out, runs=REPEATS):
    """(status, detail): one GEMM compiled once and run ``runs`` times on fresh random data (seeds
    0..runs-1); "FAIL" names the first run with a non-finite output or one outside the backend's
    contract, "SKIP" the reason the backend cannot take it."""
    recipe = Recipe(backend=backend, scale_layout=layout)
    try:
        dispatch.decide(dispatch_problem_shape(m, n, k, out, recipe), backend)
    except dispatch.BackendUnavailableError as e:
        return "SKIP", str(e).split(": ", 1)[-1][:90]
    fn, contract = _gemm_fn(recipe, out), contract_for(backend, m, n, k, layout, out)
    for i in range(runs):
        rng = np.random.default_rng(i)
        (a, ea), (b, eb) = _random_mx(rng, m, k), _random_mx(rng, n, k)
        try:
            got = np.asarray(fn(a, b)).astype(np.float64)
        except Exception as e:  # report, never crash the table
            return "FAIL", f"run {i + 1} of {runs}: {type(e).__name__}: {str(e)[:100]}"
        nonfinite = int(np.sum(~np.isfinite(got)))
        if nonfinite:
            return "FAIL", f"run {i + 1} of {runs}: {nonfinite} non-finite output(s)"
        exact = ea @ eb.T
        bound = contract.bound(exact, np.abs(ea) @ np.abs(eb).T, k, getattr(jnp, out), DATA)
        if not np.all(np.abs(got - exact) <= bound):
            worst = float(np.max(np.abs(got - exact) / np.maximum(bound, 1e-300)))
            return "FAIL", f"run {i + 1} of {runs}: max err/bound = {worst:.3g} ({contract.kind})"
    return "PASS", f"{runs} runs, every output finite and within the {contract.kind} bound"


ROUTE_ENV = "HIPBLASLT_USE_ROCROLLER"
ROUTE_CHECK_SHAPE = (64, 32, 512)  # inside the validated envelope: only the route decides


def route_check_rows():
    """Rows (case, status, detail) for backend "hipblaslt" in this process, run by
    :func:`tensilelite_route_check` under ``HIPBLASLT_USE_ROCROLLER=0``: swizzled scales must run
    and meet the bound; plain scales must be refused naming TensileLite, or run and meet it."""
    m, n, k = ROUTE_CHECK_SHAPE
    rows = []
    for layout in ("plain", "swizzled"):
        for out in ("float32", "bfloat16"):
            status, detail = check_case("hipblaslt", m, n, k, layout, out)
            if status == "SKIP" and layout == "plain":
                recipe = Recipe(backend="hipblaslt", scale_layout=layout)
                why = dispatch.decide(dispatch_problem_shape(m, n, k, out, recipe), "auto").reasons["hipblaslt"]
                if "TensileLite" in why:
                    status, detail = "PASS", f"refused: {why[:100]}"
            rows.append((f"{m}x{n}x{k} {layout} {out}", status, detail))
    return rows


def tensilelite_route_check(timeout=600):
    """(exit status, output) of ``python -m jax_mxfp4.selftest --route-check`` in a subprocess with
    ``HIPBLASLT_USE_ROCROLLER=0``: hipBLASLt fixes its route when a handle is created, so the other
    route needs a fresh process. The child allocates GPU memory on demand: this process already
    holds JAX's preallocated share."""
    env = dict(os.environ, **{ROUTE_ENV: "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    r = subprocess.run([sys.executable, "-m", "jax_mxfp4.selftest", "--route-check"], env=env,
                       capture_output=True, text=True, timeout=timeout)
    return r.returncode, (r.stdout + r.stderr).strip()


def dispatch_problem_shape(m, n, k, out, recipe):
    return GemmProblem(1, m, n, k, np.dtype(getattr(jnp, out)), recipe.scale_layout, dispatch.current_platform())


# (M, N, K, scale layout, out dtype, envelope, what the rule says, expected reason when routed).
# "run": inside every rule; "route": outside the envelope's shape/dtype rules; "either": inside
# the shape rules, decided by the device's version/route (runs, or routes naming that rule).
GATE_CASES = (
    (64, 32, 256, "plain", "bfloat16", "validated", "run", ""),
    (64, 32, 512, "swizzled", "float32", "validated", "run", ""),
    (64, 32, 384, "plain", "bfloat16", "validated", "route", "K % 256"),
    (48, 32, 256, "plain", "float32", "validated", "route", "M % 32"),
    (64, 48, 256, "swizzled", "float32", "validated", "route", "N % 32"),
    (64, 32, 256, "plain", "float16", "validated", "route", "float32 or bfloat16"),
    (48, 16, 384, "plain", "float32", "documented", "either", "TensileLite"),
    (48, 16, 384, "swizzled", "bfloat16", "documented", "either", "< 1.5.0"),
    (64, 64, 256, "plain", "float16", "documented", "either", "no usable algorithm"),
    (24, 16, 128, "plain", "float32", "documented", "route", "M % 16"),
    (32, 32, 96, "plain", "float32", "documented", "route", "K % 128"),
)


@contextlib.contextmanager
def _envelope(value):
    old = os.environ.get(ENVELOPE_ENV)
    os.environ[ENVELOPE_ENV] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENVELOPE_ENV, None)
        else:
            os.environ[ENVELOPE_ENV] = old


def hipblaslt_gates(platform):
    """Rows (case, expectation, outcome, status) for :data:`GATE_CASES`. On ROCm every case is
    decided with all checks and the ones that run are checked against the exact product; on
    other platforms the decision is the one made for a ROCm lowering (shape rules only)."""
    backend = dispatch.get_backend("hipblaslt")
    rows = []
    for m, n, k, layout, out, envelope, expect, reason in GATE_CASES:
        with _envelope(envelope):
            problem = GemmProblem(1, m, n, k, np.dtype(getattr(jnp, out)), layout, platform)
            if platform != "rocm":
                problem = dataclasses.replace(problem, platform="rocm")  # judged for a ROCm lowering
                why = backend.foreign_reason("rocm") or backend.rejects(problem)
            else:
                why = backend.unavailable_reason() or backend.rejects(problem)
            if why:
                # "either": the device's version/route rule, or an empty heuristic (reported).
                ok = (expect == "route" and reason in why) or (
                    expect == "either" and (reason in why or "no usable algorithm" in why))
                outcome, status = f"routed: {why[:110]}", "PASS" if ok else "FAIL"
            elif platform != "rocm":
                ok = expect in ("run", "either")
                outcome, status = "taken (shape rules; device checks happen on ROCm)", "PASS" if ok else "FAIL"
            else:
                status, detail = check_case("hipblaslt", m, n, k, layout, out)
                status = status if expect in ("run", "either") else "FAIL"
                outcome = f"ran: {detail}"
        rows.append((f"{m}x{n}x{k} {layout} {out} [{envelope}]", expect, outcome, status))
    return rows


def _time(fn, args, iters):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def speed_table(backends, shapes, iters):
    rows = []
    for m, n, k in shapes:
        rng = np.random.default_rng(1)
        (a, _), (b, _) = _random_mx(rng, m, k), _random_mx(rng, n, k)
        xa = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        xb = jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16)
        base = _time(jax.jit(lambda x, y: jax.lax.dot_general(x, y, DN)), (xa, xb), iters)
        rows.append((f"{m}x{n}x{k}", "bf16 dot_general", base, 2 * m * n * k / base / 1e12, 1.0))
        for name in backends:
            recipe = Recipe(backend=name)
            fn = jax.jit(lambda x, y, r=recipe: dot_general(x, y, DN, preferred_element_type=jnp.bfloat16, recipe=r))
            try:
                t = _time(fn, (a, b), iters)
            except Exception as e:
                rows.append((f"{m}x{n}x{k}", name, float("nan"), float("nan"), f"error: {str(e)[:60]}"))
                continue
            rows.append((f"{m}x{n}x{k}", name, t, 2 * m * n * k / t / 1e12, t / base))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_mxfp4.selftest", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes only")
    ap.add_argument("--no-speed", action="store_true", help="skip the speed table")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--backends", default="", help="comma-separated backend names (default: every available one)")
    ap.add_argument("--route-check", action="store_true",
                    help="only the hipBLASLt route rows (run by the self-test itself with HIPBLASLT_USE_ROCROLLER=0)")
    args = ap.parse_args(argv)
    if args.route_check:
        rows = route_check_rows()
        for case, status, detail in rows:
            print(f"{case:<28} {status:<7} {detail}")
        return 1 if any(r[1] == "FAIL" for r in rows) else 0

    platform = dispatch.current_platform()
    devices = jax.devices()
    print(f"jax {jax.__version__}; platform {platform}; devices: {[d.device_kind for d in devices]}")
    if platform == "rocm":
        from .ffi import hipblaslt_status

        st = hipblaslt_status()
        print(f"hipBLASLt: loaded={st.get('loaded')} path={st.get('hipblaslt_path')} error={st.get('error') or '-'}")
        print(f"  envelope: {st.get('envelope')}; librocroller: {st.get('rocroller_path') or 'none seen'}")
        for d in st.get("devices", []):
            v = d.get("hipblaslt_version", 0)
            print(f"  device {d['ordinal']}: {d['arch']} hipBLASLt {v // 100000}.{v // 100 % 1000}.{v % 100} "
                  f"route: {d.get('route', '?')} {d['error']}")
    names = [n for n in dispatch._REGISTRY if n != "xla"] + ["xla"]
    unavailable = {n: dispatch.get_backend(n).unavailable_reason() for n in names}
    for n, why in unavailable.items():
        if why:
            print(f"  backend {n}: unavailable ({why})")
    backends = [n for n in names if not unavailable[n]]
    if args.backends:
        wanted = [w.strip() for w in args.backends.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in names]
        if unknown:
            ap.error(f"--backends: unknown backend(s) {unknown}; known: {names}")
        backends = [n for n in backends if n in wanted]

    shapes = [(32, 32, 256), (64, 48, 384)] + ([] if args.quick else [(256, 256, 1024), (512, 256, 2048)])
    print("\ncorrectness vs exact float64, each backend held to its own contract (+ half an output ulp)")
    failures = 0
    for name in backends:
        print("\n" + contract_line(name, *shapes[-1]))
        print(f"{'backend':<11} {'M x N x K':<15} {'scales':<9} {'out':<9} result  detail")
        for m, n, k in shapes:
            for layout in ("plain", "swizzled"):
                for out in ("float32", "bfloat16"):
                    status, detail = check_case(name, m, n, k, layout, out)
                    failures += status == "FAIL"
                    print(f"{name:<11} {f'{m}x{n}x{k}':<15} {layout:<9} {out:<9} {status:<7} {detail}")

    if "hipblaslt" in backends:
        print(f"\nhipBLASLt swizzled cases, {REPEATS} runs each (hipBLASLt < 1.5.0: upstream fix for "
              "intermittent non-finite output on gfx950)")
        for m, n, k in shapes:
            for out in ("float32", "bfloat16"):
                status, detail = repeat_case("hipblaslt", m, n, k, "swizzled", out)
                failures += status == "FAIL"
                print(f"{'hipblaslt':<11} {f'{m}x{n}x{k}':<15} {'swizzled':<9} {out:<9} {status:<7} {detail}")
        print(f"\nhipBLASLt with {ROUTE_ENV}=0 (TensileLite route), in a subprocess")
        rc, output = tensilelite_route_check()
        failures += rc != 0
        print("\n".join("  " + line for line in output.splitlines()[-8:]))

    if "hipblaslt" in dispatch._REGISTRY and not dispatch.get_backend("hipblaslt").foreign_reason("rocm"):
        where = "on this device" if platform == "rocm" else "as judged for a ROCm lowering (shape rules only)"
        print(f"\nhipBLASLt gates, {where}")
        print(f"{'case':<40} {'rule says':<9} result  outcome")
        for case, expect, outcome, status in hipblaslt_gates(platform):
            failures += status == "FAIL"
            print(f"{case:<40} {expect:<9} {status:<7} {outcome}")

    if not args.no_speed:
        big = [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192)] if platform != "cpu" else [(256, 256, 1024)]
        if args.quick:
            big = big[:1]
        print("\nspeed (bf16 out, pre-quantized operands; median of", args.iters, "single calls, launch cost "
              "included: indicative only, benchmarks/gemm.py times fairly)")
        print(f"{'M x N x K':<17} {'backend':<17} {'ms':>9} {'TFLOP/s':>9} {'time/bf16':>10}  (< 1 is faster)")
        for shape, name, t, tflops, ratio in speed_table(backends, big, args.iters):
            r = ratio if isinstance(ratio, str) else f"{ratio:.2f}x"
            print(f"{shape:<17} {name:<17} {t * 1e3:>9.3f} {tflops:>9.2f} {r:>9}")
    print(f"\n{'FAILED' if failures else 'OK'}: {failures} failing case(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
