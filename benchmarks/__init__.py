"""The maintained benchmarks. Importing the package puts ``examples/`` on ``sys.path``: the demo
benchmarks build the LM of ``examples/train_lm.py`` (an application outside the library)."""

import os
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
