"""llama.cpp as a peer for the CPU bench, through llama-cpp-python (the `bench` extra; it builds
llama.cpp from source on install).

In: the GGUF file tokenforge runs, the prompts as token ids (the same ids: both read the file's
own vocabulary), the output length, the thread count. Out: rates as `harness.rates` gives them,
plus the greedy ids. Greedy is an argmax over llama.cpp's logits; every sequence is forced to
`output_len` tokens (EOS does not stop it), as tokenforge's bench requests are.

Two shapes, through the low-level API (llama_batch / llama_decode), so each is what llama.cpp
itself does best at it:
- `sequential`: one prompt after another (batch 1): prefill the prompt, then one token per decode;
  the KV cache is cleared between prompts.
`use_extra_bufts` (llama.cpp's weight repacking and AMX buffers) is off by default: on the
development VM the CPU reports AMX but llama.cpp 0.3.36's AMX matmul segfaults there (in
ggml_backend_amx_mul_mat). It also turns off llama.cpp's repacked CPU layouts, which may cost it
speed on the types it repacks (Q4_0, Q4_K, IQ4_NL, ...); `--llama-cpp-extra-bufts` turns them on.
- `parallel`: every prompt is its own sequence in one context (`n_seq_max`), prefilled in batches
  of up to `n_batch` tokens, then one decode per step with one token of every sequence (llama.cpp's
  `llama-batched` / `llama-parallel` pattern).
"""

from __future__ import annotations

import time

import numpy as np

_MISSING = ("llama.cpp peer: llama-cpp-python is not installed (pip install 'tokenforge[bench]' or "
            "pip install llama-cpp-python; it builds llama.cpp from source, a few minutes)")


def load_library():
    """The llama_cpp module, or an ImportError with the install line."""
    try:
        import llama_cpp  # noqa: PLC0415 - optional
    except ImportError as exc:
        raise ImportError(_MISSING) from exc
    try:        # llama.cpp logs every tensor and graph node it loads: keep its errors only
        from llama_cpp import _logger  # noqa: PLC0415

        _logger.set_verbose(False)
    except (ImportError, AttributeError):
        pass
    return llama_cpp


class LlamaCppPeer:
    """One llama.cpp model and context for `num_seqs` sequences of up to `seq_len` tokens each."""

    def __init__(self, path: str, threads: int, num_seqs: int, seq_len: int, n_batch: int = 512,
                 use_extra_bufts: bool = False) -> None:
        lib = self.lib = load_library()
        lib.llama_backend_init()
        model_params = lib.llama_model_default_params()
        model_params.use_extra_bufts = use_extra_bufts
        self.model = lib.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lib.llama_context_default_params()
        params.n_ctx = num_seqs * seq_len
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = num_seqs
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch = n_batch
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(n_batch, 0, num_seqs)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def clear(self) -> None:
        lib = self.lib
        if hasattr(lib, "llama_memory_clear"):
            lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        else:
            lib.llama_kv_self_clear(self.ctx)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits), at most n_batch of them."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed (KV cache full?)")

    def _argmax(self, row: int) -> int:
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))
        return int(logits.argmax())

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        """Greedy continuations of `prompts`, decoded together as one sequence each."""
        pending = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        last_row: dict[int, int] = {}
        firsts: dict[int, int] = {}
        for start in range(0, len(pending), self.n_batch):        # prefill, n_batch tokens at a time
            chunk = pending[start:start + self.n_batch]
            self._decode(chunk)
            last_row = {seq: i for i, (_, _, seq, wants) in enumerate(chunk) if wants}
            firsts.update({seq: self._argmax(i) for seq, i in last_row.items()})
        outs = [[firsts[s]] for s in range(len(prompts))]
        for _ in range(output_len - 1):                             # one token of every sequence a step
            entries = [(out[-1], len(p) + len(out) - 1, s, True) for s, (p, out) in enumerate(zip(prompts, outs))]
            for start in range(0, len(entries), self.n_batch):
                chunk = entries[start:start + self.n_batch]
                self._decode(chunk)
                for i, (_, _, s, _) in enumerate(chunk):
                    outs[s].append(self._argmax(i))
        return outs


def run(path: str, prompts: list[list[int]], output_len: int, threads: int, parallel: bool,
        use_extra_bufts: bool = False) -> dict:
    """Time llama.cpp on the prompts, one after another (`parallel` False) or all together."""
    seq_len = max(map(len, prompts)) + output_len + 1
    peer = LlamaCppPeer(path, threads, len(prompts) if parallel else 1, seq_len, use_extra_bufts=use_extra_bufts)
    try:
        peer.generate([prompts[0][:8]], 4)                          # warm-up
        peer.clear()
        start = time.perf_counter()
        if parallel:
            ids = peer.generate(prompts, output_len)
        else:
            ids = []
            for p in prompts:
                ids += peer.generate([p], output_len)
                peer.clear()
        seconds = time.perf_counter() - start
    finally:
        peer.close()
    version = getattr(load_library(), "__version__", "?")
    return {"name": f"llama.cpp {version} ({'parallel' if parallel else 'sequential'})", "seconds": seconds,
            "output_tok_s": len(prompts) * output_len / seconds, "threads": threads, "_ids": ids}


__all__ = ["LlamaCppPeer", "load_library", "run"]
