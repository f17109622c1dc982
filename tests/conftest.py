import os

# 8 simulated CPU devices for the sharding tests (must be set before JAX initializes its backend).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", deadline=None, max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "40")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")
