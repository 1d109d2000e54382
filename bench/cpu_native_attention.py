"""The CPU's native decode step (kernels/gguf_decode.cpp) timed on the bundled SmolLM2 at two
contexts: 1 row (a batch-1 decode), 5 rows of one sequence (a K = 4 verify), 5 rows of other
sequences. Run: python bench/cpu_native_attention.py (CPU; A/B by running it on two commits in turn).
"""
import time, torch
from tokenforge import LLM
from tokenforge.model.attention.backend import AttentionBatch
llm = LLM(max_model_len=4096)
runner = llm.engine.executor.runner
dec = runner.graphs.decoder
bs = runner.block_size
def run(contexts, tables, reps=30):
    ids = torch.zeros(len(contexts), dtype=torch.long)
    b = AttentionBatch([1] * len(contexts), contexts, tables, bs, torch.device("cpu"))
    dec.forward(ids, b)
    t = time.perf_counter()
    for _ in range(reps): dec.forward(ids, b)
    return (time.perf_counter() - t) / reps * 1e3
for ctx in (300, 1000):
    nb = (ctx + 40) // bs + 2
    table = list(range(1, nb + 1))
    one = run([ctx], [table])
    five = run([ctx + j for j in range(5)], [table] * 5)
    t2 = list(range(nb + 1, 2 * nb + 1)); 
    five_sep = run([ctx, ctx + 7, ctx + 14, ctx + 21, ctx + 28], [table, t2, table, t2, table])
    print(f"ctx {ctx}: 1 row {one:.2f} ms, 5 rows of one sequence {five:.2f} ms, 5 rows not grouped {five_sep:.2f} ms")
