"""tokenforge.core must import and run with torch (and numpy, triton) unavailable."""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]

SCRIPT = f"""
import sys
for name in ("torch", "numpy", "triton"):
    sys.modules[name] = None          # any import of them now raises ImportError
sys.path[:0] = [{str(REPO_ROOT)!r}, {str(HERE)!r}]

import tokenforge.core
import tokenforge.core.scheduler, tokenforge.core.kv_cache_manager, tokenforge.core.block_pool
from core_fakes import make_request, make_scheduler, reference_generate, run_to_completion

sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=8)
for i in range(4):
    sched.add_request(make_request(f"r{{i}}", [i + 1] * (2 + 3 * i), max_tokens=5))
res = run_to_completion(sched)
assert all(res.tokens[f"r{{i}}"] == reference_generate([i + 1] * (2 + 3 * i), 5) for i in range(4))
assert sched.get_stats().num_preemptions > 0
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "triton")
                and sys.modules[m] is not None)
assert not leaked, leaked
print("torch-free ok")
"""


def test_core_runs_with_torch_blocked():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "torch-free ok" in proc.stdout
