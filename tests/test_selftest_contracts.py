"""``python -m jax_mxfp4.selftest`` holds each backend to its own contract
(:meth:`jax_mxfp4.backends.base.Backend.numerics`): a result outside that contract is reported as
FAIL with a nonzero exit status, and the FP8 path on a GPU is held to its measured bound
(``ERROR_BOUNDS``), not to the float32-accumulation bound of the exact backends."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_mxfp4 import dispatch, selftest
from jax_mxfp4.backends import fp8 as fp8_backend
from jax_mxfp4.backends.base import EXACT, GemmProblem
from jax_mxfp4.quantize import dequantize

M, N, K = 32, 32, 256  # the --quick self-test's first shape


def _problem(platform, precision="default"):
    return GemmProblem(1, M, N, K, np.dtype(np.float32), "plain", platform, precision=precision)


def _perturb(monkeypatch, name, fraction):
    """Backend ``name`` returns its result plus ``fraction`` x sum_k |a_k b_k| (a wrong result)."""
    backend = dispatch.get_backend(name)
    inner = backend.gemm

    def gemm(lhs, rhs, problem):
        out = inner(lhs, rhs, problem).astype(jnp.float32)
        s = jnp.einsum("bmk,bnk->bmn", jnp.abs(dequantize(lhs)), jnp.abs(dequantize(rhs)), precision="highest")
        return (out + fraction * s).astype(problem.out_dtype)

    monkeypatch.setattr(backend, "gemm", gemm)


@pytest.fixture
def fp8_gpu_contract(monkeypatch):
    """Backend "fp8" declares its GPU contract (FP8 fast accumulation) on this CPU."""
    monkeypatch.setattr(fp8_backend.Fp8Backend, "numerics", lambda self, p: fp8_backend.numerics(p.precision, "cuda"))


def test_every_backend_declares_one_contract_that_explain_prints():
    for name in dispatch._REGISTRY:
        b = dispatch.get_backend(name)
        c = b.numerics(_problem("cpu"))
        assert c.summary and b.contract(_problem("cpu")) == c.summary, name
        assert c.kind == "exact", name  # fp8 too: on CPU XLA accumulates its codes in float32


def test_fp8_gpu_contract_is_its_measured_bound_not_the_exact_one():
    c = fp8_backend.numerics("default", "cuda")
    assert c.kind == "fp8-default"
    assert c.accumulation(K, "random") == fp8_backend.ERROR_BOUNDS[("default", "random")]
    assert c.accumulation(K, "adversarial") == fp8_backend.ERROR_BOUNDS[("default", "adversarial")]
    assert EXACT.accumulation(K) == pytest.approx(K * 2.0**-24, rel=1e-4)
    assert fp8_backend.numerics("high", "cuda").accumulation(K, "adversarial") == fp8_backend.ERROR_BOUNDS[
        ("high", "adversarial")]
    assert "fast accumulation" in dispatch.decide(_problem("cuda"), "fp8").contract  # explain() for CUDA


def test_a_wrong_result_makes_the_selftest_fail_with_nonzero_exit(monkeypatch, capsys):
    _perturb(monkeypatch, "xla", 2.0**-8)  # far outside g(K) = 2^-16
    rc = selftest.main(["--quick", "--no-speed", "--backends", "xla"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED: 8 failing case(s)" in out
    assert "backend xla: contract exact: |err| <= " in out


@pytest.mark.slow
def test_a_correct_result_passes_with_zero_exit(capsys):
    rc = selftest.main(["--quick", "--no-speed", "--backends", "xla"])
    out = capsys.readouterr().out
    assert rc == 0 and "OK: 0 failing case(s)" in out
    assert "backend xla: contract exact: |err| <= 2.29e-05 sum|a||b| (g(K), float32 accumulation) at K=384" in out


def test_fp8_within_its_bound_but_outside_the_exact_bound_passes(monkeypatch, fp8_gpu_contract):
    # 2^-12 S: above g(256) ~ 2^-16 (the exact contract), below 2^-10 (FP8 DEFAULT, random data)
    _perturb(monkeypatch, "fp8", 2.0**-12)
    _perturb(monkeypatch, "xla", 2.0**-12)
    status, detail = selftest.check_case("fp8", M, N, K, "plain", "float32")
    assert status == "PASS" and "(fp8-default)" in detail, detail
    status, detail = selftest.check_case("xla", M, N, K, "plain", "float32")
    assert status == "FAIL" and "(exact)" in detail, detail


def test_fp8_outside_its_own_bound_fails(monkeypatch, fp8_gpu_contract):
    _perturb(monkeypatch, "fp8", 2.0**-8)
    status, detail = selftest.check_case("fp8", M, N, K, "plain", "bfloat16")
    assert status == "FAIL" and "(fp8-default)" in detail, detail


def test_the_selftest_names_the_fp8_gpu_contract(fp8_gpu_contract):
    line = selftest.contract_line("fp8", M, N, K)
    assert line.startswith("backend fp8: contract fp8-default: |err| <= 0.000977 sum|a||b| (random data)"), line
    assert "fast accumulation" in line
