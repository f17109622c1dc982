import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", deadline=None, max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "40")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")
