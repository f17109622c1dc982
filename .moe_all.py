import sys
import jax_mxfp4.backends.grouped as g
g.MAX_ROWS_PER_EXPERT = 10**9  # every group size on the grouped kernel, to compare with bf16-decode
sys.path.insert(0, ".")
from benchmarks import moe
sys.exit(moe.main(sys.argv[1:]))
