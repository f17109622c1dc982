"""The k_split_wgs kernel's warp-specialized pipeline schedule (jax_mxfp4/kernels/wgemm_mgpu.py
``_k_split_own_pipeline``, the real function) around a toy payload, run in jax's Mosaic GPU
interpreter on CPU (``plgpu.kernel(interpret=InterpretGPUParams())``: one Python thread per
warpgroup, shared memory, TMA copies and mbarriers simulated with their phases; a thread that
waits on a phase it already missed, or a phase completed twice unobserved, is an error there).

The payload: x float32 [R, steps * C]; per step the TMA warpgroup copies x[:, t C : (t+1) C]
into the step's slot; compute warpgroup w adds its columns w C/kw .. (w+1) C/kw of the slot to
its own accumulator; out[w] = sum over t of those columns, compared exactly (small integers)
with NumPy. A schedule that deadlocks (a barrier never completing) hangs here as on the GPU: the
caller runs this file in a child process with a time limit (tests/test_wgemm_mgpu.py).

Usage: python tests/mgpu_pipeline_toy.py KW:STEPS:STAGES[:CONSUMED_ARRIVALS] ...; prints
"OK kw steps stages" or "MISMATCH ..." per case, flushed, in order.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from jax_mxfp4.kernels import wgemm_mgpu as wm  # noqa: E402


def interpret_params():
    """jax's Mosaic GPU interpreter parameters (private in jax 0.10/0.11)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def run_toy(kw: int, steps: int, stages: int, consumed_arrivals: int | None = None, rows: int = 8,
            cols: int = 32) -> bool:
    """One case; ``consumed_arrivals`` overrides the consumed barriers' count (kw: the kernel's)."""
    cw = cols // kw

    def body(x_g, o_g, x_smem, ready, consumed, acc_smem):
        wg = lax.axis_index("wg")

        def fetch(t, slot):
            plgpu.copy_gmem_to_smem(x_g.at[:, pl.ds(t * cols, cols)], x_smem.at[slot], ready.at[slot])

        def step(slot, acc):
            acc[...] += x_smem.at[slot][:, pl.ds(wg * cw, cw)]

        def compute_context(run):
            acc = acc_smem.at[wg]
            acc[...] = jnp.zeros((rows, cw), jnp.float32)
            run(acc)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(acc, o_g.at[wg])
            plgpu.wait_smem_to_gmem(0)

        wm._k_split_own_pipeline(wg, kw, steps, stages, fetch=fetch, step=step, ready=ready, consumed=consumed,
                                 compute_context=compute_context)

    f = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((kw, rows, cw), jnp.float32), num_threads=kw + 1, thread_name="wg",
        scratch_types=dict(x_smem=plgpu.SMEM((stages, rows, cols), jnp.float32),
                           ready=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
                           consumed=plgpu.Barrier(num_arrivals=consumed_arrivals or kw, num_barriers=stages),
                           acc_smem=plgpu.SMEM((kw, rows, cw), jnp.float32)),
        interpret=interpret_params())
    x = np.random.default_rng(0).integers(-8, 9, (rows, steps * cols)).astype(np.float32)
    got = np.asarray(f(jnp.asarray(x)))
    want = x.reshape(rows, steps, kw, cw).sum(1).transpose(1, 0, 2)
    return bool(np.array_equal(got, want))


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        case = [int(v) for v in arg.split(":")]  # KW:STEPS:STAGES[:CONSUMED_ARRIVALS]
        ok = run_toy(*case)
        print(f"{'OK' if ok else 'MISMATCH'} {' '.join(map(str, case))}", flush=True)
