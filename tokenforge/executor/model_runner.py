"""ModelRunner: a SchedulerOutput -> tensors -> model -> sampler -> a ModelRunnerOutput of lists.

In: `SchedulerOutput` (plain lists from core/). Out: `ModelRunnerOutput` (plain lists). The runner
makes no policy decisions: it computes exactly the tokens it is given, computes logits only for
rows that sample (or asked for prompt logprobs), and samples on the device with one host copy
per step. Per-request seeded generators live here, keyed by request id, and die with
`finished_request_ids`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from tokenforge.config import EngineConfig
from tokenforge.core.outputs import ModelRunnerOutput, SchedulerOutput, ScheduledSequence
from tokenforge.distributed import parallel_state
from tokenforge.executor.pipeline import StageComm
from tokenforge.executor.cuda_graph import CudaGraphRunner
from tokenforge.executor.input_batch import InputBatch, build_inputs
from tokenforge.executor.kv_cache import (allocate_kv_caches, finish_calibration, kv_scales_for,
                                          start_calibration)
from tokenforge.executor.sampler import (LogprobsTensors, Sampler, SamplerOutput, SamplingBatch,
                                        compute_prompt_logprobs)
from tokenforge.kernels.kv_quant import FP8_DTYPE, cache_dtype
from tokenforge.model.attention import get_attention_backend
from tokenforge.model.attention.backend import AttentionBatch
from tokenforge.model.forward_context import set_forward_context
from tokenforge.model.layers.cpu_packed import packing_pays, prepack_linears, quantize_linears_int8
from tokenforge.model.loader import CacheOptions, load_model
from tokenforge.model.offload import offload_layers
from tokenforge.model.quant import QuantOptions, check_device

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class StepInFlight:
    """A launched step: device tensors not yet copied back to the host."""

    sequences: list[ScheduledSequence]
    inputs: InputBatch | None = None
    hidden: torch.Tensor | None = None          # [T, hidden]
    sampling: list[ScheduledSequence] = field(default_factory=list)
    sampler_output: SamplerOutput | None = None
    host_token_ids: torch.Tensor | None = None  # [N] sampled ids, copied back asynchronously
    host_logprobs: LogprobsTensors | None = None
    copied: torch.cuda.Event | None = None      # recorded after those copies (CUDA only)
    logits: torch.Tensor | None = None          # [N, V] of the sampling rows while sampling waits
    sample_pending: bool = False                # launched with defer_sampling: `sample` not run yet
    prompt_logits: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)   # (seq, rows, [rows, V])
    # Pipelined steps, first stage: its layers ran and were sent on, and the receive of the last
    # stage's hidden states is posted (work, [T, hidden]); the rest waits for `finish_stages`.
    last_stage: tuple | None = None
    sched: SchedulerOutput | None = None        # kept for that rest (sampling reads its grammar rows)

    @property
    def awaits_last_stage(self) -> bool:
        return self.last_stage is not None


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # This process's place among the ranks (rank 0 of 1 without tensor/pipeline parallelism).
        self.rank = parallel_state.parallel_rank()
        self.device = parallel_state.torch_device_for(self.rank, config.device.resolved_device())
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.kv_dtype = cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.block_size = config.cache.block_size
        self._init_threads()
        self._init_model()
        self._init_attention()
        self.stages = StageComm(self.rank, self.device, self.dtype, self.arch.hidden_size,
                                config.scheduler.pipeline_steps)
        # Pipelined steps, first stage: steps started, oldest first, waiting for the last stage.
        self._unfinished: deque[StepInFlight] = deque()
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: CudaGraphRunner | None = None
        # The last launched step's sampled ids (device) and each sampling request's row in them:
        # the next step's placeholder tokens are read from here (async scheduling).
        self._prev_rows: dict[str, int] = {}
        self._prev_tokens: torch.Tensor | None = None
        self._deferred: StepInFlight | None = None     # launched, its sampling not queued yet
        # Grammar bitmasks travel from two reused host slots (pinned on CUDA), alternating: the
        # upload of one step's mask may still be queued while the next step's mask is filled.
        self._mask_slots: torch.Tensor | None = None   # [2, rows, ceil(V / 32)] int32
        self._mask_slot = 0

    # ---- init steps -----------------------------------------------------------------------------
    def _init_threads(self) -> None:
        if self.config.device.num_threads:
            torch.set_num_threads(self.config.device.num_threads)

    def _init_model(self) -> None:
        r, cfg, m = self.rank, self.config, self.config.model
        check_device(m.quantization, self.device.type)
        cpu_int8 = m.quantization == "int8" and self.device.type == "cpu"   # the CPU's int8 is dynamic int8
        if cpu_int8 and m.quantize_lm_head:
            raise ValueError("quantize_lm_head is not available with the CPU's dynamic int8 (the lm_head stays float32)")
        quant = QuantOptions(m.quantization, m.quantization_group_size, m.quantize_lm_head, m.prune_rate, m.sparsity)
        cache = (CacheOptions(cfg.load.engine_cache_dir, m.model_version, m.quantization)
                 if cfg.load.engine_cache_dir else None)
        loaded = load_model(m.model, cfg.load.load_format, self.dtype, self.device, m.seed,
                            r.tp_rank, r.tp_size, r.pp_rank, r.pp_size, cache=cache, quant=quant,
                            cpu_int8_dynamic=cpu_int8)
        self.model = loaded.model.eval()
        self.arch = loaded.arch_config
        # fp8 KV: per-layer [4] scale vectors, from the checkpoint or (None) calibrated later
        # (all layers in the checkpoint; a pipeline stage keeps its own layers' scales)
        scales = loaded.kv_scales
        if scales is not None and self.rank.pp_size > 1:
            scales = [scales[i] for i in self.model.model.stage]
        self.kv_scales = kv_scales_for(self, scales) if self.kv_dtype == FP8_DTYPE else None
        self.vocab_size = self.arch.vocab_size
        if cpu_int8:
            logger.info("dynamic int8: %d linear weights quantized", quantize_linears_int8(self.model))
        self.offloader = self._offload()
        if self.device.type == "cpu" and self.config.load.load_format != "lazy":
            # Lazy keeps the weights where the loader put them (views of the engine cache's map).
            max_seqs = self.config.scheduler.max_num_seqs
            if packing_pays(max_seqs):
                logger.info("MKL-prepacked %d CPU linear weights", prepack_linears(self.model))
            else:
                logger.info("CPU linear weights not prepacked: decode batches stay below the packed row count "
                            "(max_num_seqs %d)", max_seqs)

    def _offload(self):
        gb = self.config.load.cpu_offload_gb
        if not gb:
            return None
        if self.device.type != "cuda":
            raise ValueError("cpu_offload_gb keeps weights in host memory for a GPU; on the CPU they are there already")
        if self.config.model.quantization:
            raise ValueError("cpu_offload_gb moves a layer's float weights to host memory: it does not combine "
                             "with quantization yet (quantized linears keep their weights as buffers)")
        layers = [self.model.model.layers[i] for i in self.model.model.stage]
        return offload_layers(layers, int(gb * 1e9))

    def _init_attention(self) -> None:
        name = self.config.device.attention_backend
        if name == "auto":
            name = "triton" if self.device.type == "cuda" else "torch"
        self.backend = get_attention_backend(name, self.device)
        for layer in self.model.attention_layers():
            layer.backend = self.backend
        if self.kv_dtype == FP8_DTYPE and name == "triton" and torch.cuda.get_device_capability(self.device) < (8, 9):
            major, minor = torch.cuda.get_device_capability(self.device)
            raise ValueError(f"kv_cache_dtype='fp8' needs a GPU with FP8 (compute capability 8.9+: Ada, Hopper, "
                             f"Blackwell); {torch.cuda.get_device_name(self.device)} is sm_{major}{minor}. "
                             "Use kv_cache_dtype='auto'")

    def init_kv_cache(self, num_blocks: int, max_model_len: int | None = None) -> None:
        """Allocate the KV cache; `max_model_len` is the resolved context length (the config
        the runner was built with may still carry the scheduler's unresolved default), which sizes
        every preallocated buffer from here on (the CUDA graphs' block tables among them)."""
        if max_model_len is not None and max_model_len != self.config.scheduler.max_model_len:
            self.config = self.config.with_max_model_len(max_model_len)
        if self.kv_dtype == FP8_DTYPE and self.kv_scales is None:
            # no profiling pass ran (CPU, client profile, a given KV size): calibrate on its own,
            # over fewer tokens on the CPU, where the pass costs seconds (the 4x headroom covers it)
            tokens = 1024 if self.device.type == "cuda" else 256
            with torch.inference_mode():
                self.forward_dummy(min(tokens, self.config.scheduler.max_num_batched_tokens,
                                       self.config.scheduler.max_model_len))
        layers = self.model.attention_layers()
        self.kv_caches = allocate_kv_caches(self.backend, layers, num_blocks, self.block_size, self.kv_dtype,
                                            self.device)
        for i, (layer, cache) in enumerate(zip(layers, self.kv_caches)):
            layer.kv_cache = cache
            layer.kv_scales = self.kv_scales[i] if self.kv_scales is not None else None
        if (self.device.type == "cuda" and self.backend.name == "triton" and not self.config.device.enforce_eager
                and self.rank.pp_size == 1 and self.offloader is None):   # offloaded weights move: no graphs
            self.graphs = CudaGraphRunner(self, num_blocks)
            self.graphs.capture()

    # ---- one step -------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, defer_sampling: bool = False) -> StepInFlight:
        """Queue the step's device work (forward + sampling) without waiting for it.

        `defer_sampling`: queue the forward and the logits only; `sample(step, sched)` queues the
        sampling later, once `sched.grammar_rows/grammar_bitmask` are known (async scheduling with
        grammar requests: their masks need the previous step's tokens, which arrive meanwhile).
        It must be called before the next `launch`, which reads this step's sampled ids.
        """
        if self._deferred is not None:
            raise RuntimeError("a step was launched before the previous one was sampled")
        for rid in sched.finished_request_ids:
            self.generators.pop(rid, None)
        step = StepInFlight(sched.sequences)
        if sched.is_empty:
            return step
        step.inputs = build_inputs(sched.sequences, self.block_size, self.device, self.config.cache.pin_memory,
                                   self._prev_rows)
        if self.rank.is_first_stage:
            self._fill_placeholders(step.inputs)
            if self.stages.pipelined:
                self._start_stages(step, sched, defer_sampling)
                return step
        step.hidden = self._forward(step.inputs)
        return self._after_forward(step, sched, defer_sampling)

    def _after_forward(self, step: StepInFlight, sched, defer_sampling: bool) -> StepInFlight:
        """Queue what follows the forward: logits and sampling (rank 0), the LM head's collectives
        (the first stage's other ranks)."""
        step.sampling = [s for s in step.sequences if s.sample]
        self._prev_rows = {s.request_id: i for i, s in enumerate(step.sampling)}
        if not self.rank.is_first_stage:      # later stages neither sample nor read the ids back
            return step
        if self.rank.is_driver:
            step.logits = self._sampling_logits(step)
            if defer_sampling and step.logits is not None:
                self._prompt_logits(step)     # the LM head's collectives keep the workers' order
                step.sample_pending, self._deferred = True, step
                return step
            self._finish_launch(step, sched)
        else:
            self._prev_tokens = self._follow_sampling(step)
            self._prompt_logits(step)
            self._broadcast_sampled(step)
        return step

    def _start_stages(self, step: StepInFlight, sched, defer_sampling: bool) -> None:
        """Pipelined steps, first stage: run this stage's layers and send them on; the step's
        sampling waits for the last stage (`finish_stages`), so the next step can start first."""
        assert not defer_sampling, "pipelined steps carry no placeholders: nothing waits for masks"
        metadata = self.backend.build_metadata(step.inputs.attn_batch)
        with set_forward_context(metadata):
            step.last_stage = self.stages.start(self.model, step.inputs.input_ids, step.inputs.positions)
        step.sched = sched
        self._unfinished.append(step)

    @torch.inference_mode()
    def finish_stages(self) -> StepInFlight:
        """Pipelined steps, first stage: the oldest step started takes the last stage's hidden
        states, then queues its logits and sampling as `launch` does for an unsplit step."""
        step = self._unfinished.popleft()
        step.hidden = self.stages.finish(step.last_stage)
        sched, step.sched, step.last_stage = step.sched, None, None
        self._after_forward(step, sched, defer_sampling=False)
        return step

    @torch.inference_mode()
    def sample(self, step: StepInFlight, sched: SchedulerOutput) -> None:
        """Queue the sampling of a step launched with `defer_sampling` (a no-op for any other)."""
        if not step.sample_pending:
            return
        step.sample_pending, self._deferred = False, None
        self._finish_launch(step, sched, prompt_logits_done=True)

    def _finish_launch(self, step: StepInFlight, sched: SchedulerOutput, prompt_logits_done: bool = False) -> None:
        self._sample(step, sched)
        self._prev_tokens = step.sampler_output.token_ids if step.sampler_output is not None else None
        if not prompt_logits_done:
            self._prompt_logits(step)
        self._broadcast_sampled(step)
        self._copy_back(step)

    def _broadcast_sampled(self, step: StepInFlight) -> None:
        if self.rank.tp_size > 1 and step.sampling:
            # Every rank of the first stage embeds the next step's placeholders: one source of truth.
            torch.distributed.broadcast(self._prev_tokens, src=0, group=parallel_state.tp_group())

    def grammar_bitmask_buffer(self, rows: int, width: int):
        """A host array [rows, width] int32 for a step's grammar bitmask: a view of a reused slot
        (pinned on CUDA, so its upload is one asynchronous copy). Slots alternate; a slot is
        reused two steps later, after the step that uploaded from it was collected."""
        slots = self._mask_slots
        if slots is None or slots.shape[1] < rows or slots.shape[2] != width:
            cap = max(rows, self.config.scheduler.max_num_seqs)
            # Pipelined steps sample at collect: a slot waits for K steps in flight, so K + 1 slots.
            count = max(2, self.config.scheduler.pipeline_steps + 1)
            slots = torch.empty((count, cap, width), dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._mask_slots = slots
        self._mask_slot = (self._mask_slot + 1) % slots.shape[0]
        return slots[self._mask_slot, :rows].numpy()

    def _follow_sampling(self, step: StepInFlight) -> torch.Tensor | None:
        """A first-stage worker: take part in the LM head's collectives; rank 0 samples."""
        rows = [i for i, s in enumerate(step.sequences) if s.sample]
        if not rows:
            return None
        self.model.compute_logits(step.hidden[step.inputs.last_token_index(rows)])
        return torch.empty(len(rows), dtype=torch.long, device=self.device)

    def _fill_placeholders(self, inputs: InputBatch) -> None:
        """Write the previous step's sampled ids (still on the device) into the placeholder rows."""
        dst, src = inputs.placeholder_dst, inputs.placeholder_src
        if not dst:
            return
        n = len(dst)
        if n == inputs.num_tokens and dst == src and src[-1] == n - 1:   # rows kept their order
            inputs.input_ids = self._prev_tokens[:n]
            return
        index = torch.tensor([dst, src], dtype=torch.long)
        if self.device.type == "cuda":
            index = index.pin_memory().to(self.device, non_blocking=True)
        inputs.input_ids.index_copy_(0, index[0], self._prev_tokens.index_select(0, index[1]))

    def _copy_back(self, step: StepInFlight) -> None:
        """Queue the device-to-host copies of the sampled ids (and logprobs) behind the step."""
        out = step.sampler_output
        if out is None:
            return
        if self.device.type != "cuda":
            step.host_token_ids, step.host_logprobs = out.token_ids, out.logprobs
            return
        step.host_token_ids = out.token_ids.to("cpu", non_blocking=True)
        if out.logprobs is not None:
            lp = out.logprobs
            step.host_logprobs = LogprobsTensors(
                lp.token_ids.to("cpu", non_blocking=True), lp.logprobs.to("cpu", non_blocking=True),
                lp.sampled_rank.to("cpu", non_blocking=True), lp.num_logprobs)
        step.copied = torch.cuda.Event()
        step.copied.record()

    @torch.inference_mode()
    def collect(self, step: StepInFlight) -> ModelRunnerOutput:
        """Wait for a launched step and turn its results into lists (the one host sync)."""
        out = ModelRunnerOutput()
        if step.inputs is None:
            return out
        if step.sample_pending:
            raise RuntimeError("a step launched with defer_sampling was collected before `sample`")
        if step.awaits_last_stage and self.finish_stages() is not step:
            raise RuntimeError("pipelined steps must be collected in the order they were launched")
        if step.copied is not None:
            # Waits for this step only: a step queued after it keeps the device busy.
            step.copied.synchronize()
        if step.host_token_ids is not None:
            for s, tok in zip(step.sampling, step.host_token_ids.tolist()):
                out.sampled_token_ids[s.request_id] = tok
            if step.host_logprobs is not None:
                for s, pos in zip(step.sampling, step.host_logprobs.to_position_logprobs()):
                    if s.params.logprobs is not None:
                        out.logprobs[s.request_id] = pos
        self._prompt_logprobs(step, out)
        self._release_fragmented_memory()
        return out

    def allocator_fragmentation(self) -> float:
        """Reserved-but-unallocated over reserved bytes of the device allocator (0 on the CPU)."""
        if self.device.type != "cuda":
            return 0.0
        reserved = torch.cuda.memory_reserved(self.device)
        return (reserved - torch.cuda.memory_allocated(self.device)) / reserved if reserved else 0.0

    def _release_fragmented_memory(self) -> None:
        threshold = self.config.cache.memory_fragmentation_threshold
        if threshold is not None and self.allocator_fragmentation() > threshold:
            torch.cuda.empty_cache()

    def _forward(self, inputs: InputBatch) -> torch.Tensor | None:
        """[T, hidden] on the first stage; None on later pipeline stages."""
        if self.graphs is not None and self.graphs.can_run(inputs):
            return self.graphs.run(inputs)
        metadata = self.backend.build_metadata(inputs.attn_batch)
        with set_forward_context(metadata):
            return self.stages.forward(self.model, inputs.input_ids, inputs.positions)

    def forward_dummy(self, num_tokens: int) -> None:
        """One prefill of `num_tokens` into a scratch KV cache, for memory profiling. With an fp8
        cache whose scales are not known yet it is also the calibration pass: random tokens, an
        unquantized scratch cache, and max|k|, max|v| recorded per layer."""
        num_blocks = -(-num_tokens // self.block_size)
        layers = self.model.attention_layers()
        scratch = allocate_kv_caches(self.backend, layers, num_blocks, self.block_size, self.dtype, self.device)
        for layer, cache in zip(layers, scratch):
            layer.kv_cache = cache
        batch = AttentionBatch([num_tokens], [0], [list(range(num_blocks))], self.block_size, self.device)
        calibrate = self.kv_dtype == FP8_DTYPE and self.kv_scales is None
        if calibrate:
            start_calibration(layers, self.device)
            gen = torch.Generator().manual_seed(self.config.model.seed)
            ids = torch.randint(self.vocab_size, (num_tokens,), generator=gen).to(self.device)
        else:
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, device=self.device)
        with set_forward_context(self.backend.build_metadata(batch)):
            hidden = self.stages.forward(self.model, ids, pos)
        if hidden is not None:
            rows = min(num_tokens, self.config.scheduler.max_num_seqs)
            self.model.compute_logits(hidden[-rows:])
        if calibrate:
            self.kv_scales = finish_calibration(layers, self.device)
        for layer in layers:
            layer.kv_cache = None

    def _sampling_logits(self, step: StepInFlight) -> torch.Tensor | None:
        rows = [i for i, s in enumerate(step.sequences) if s.sample]
        if not rows:
            return None
        return self.model.compute_logits(step.hidden[step.inputs.last_token_index(rows)])   # [N, V]

    def _sample(self, step: StepInFlight, sched: SchedulerOutput) -> None:
        logits, step.logits = step.logits, None
        if logits is None:
            return
        batch = SamplingBatch.build(
            [s.params for s in step.sampling], [s.prompt_token_ids for s in step.sampling],
            [s.output_token_ids for s in step.sampling], [self._generator(s) for s in step.sampling],
            self.vocab_size, self.device, banned=[s.banned_token_ids for s in step.sampling],
            grammar_rows=sched.grammar_rows, grammar_bitmask=sched.grammar_bitmask)
        step.sampler_output = self.sampler(logits, batch)

    def _generator(self, seq: ScheduledSequence) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.is_greedy:
            return None
        gen = self.generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seq.params.seed)
            self.generators[seq.request_id] = gen
        return gen

    def _prompt_logits(self, step: StepInFlight) -> None:
        """Logits of the prompt rows that asked for logprobs, taken at launch so that every TP rank
        runs the LM head's collective in the same order (a worker passes its row counts)."""
        for i, s in enumerate(step.sequences):
            n = s.prompt_logprob_rows if hasattr(s, "prompt_logprob_rows") else prompt_logprob_rows(s)
            if n <= 0:
                continue
            start = step.inputs.query_start_loc[i]
            step.prompt_logits.append((i, n, self.model.compute_logits(step.hidden[start:start + n])))

    def _prompt_logprobs(self, step: StepInFlight, out: ModelRunnerOutput) -> None:
        for i, n, logits in step.prompt_logits:
            s = step.sequences[i]
            targets = torch.tensor(s.prompt_token_ids[s.start_position + 1:s.start_position + 1 + n],
                                   device=self.device)
            out.prompt_logprobs[s.request_id] = compute_prompt_logprobs(logits, targets, s.params.prompt_logprobs)


def prompt_logprob_rows(s: ScheduledSequence) -> int:
    """Rows of this chunk whose logits give prompt logprobs: row j predicts prompt token
    start + j + 1, so the chunk stops counting at the prompt's end."""
    if not s.want_prompt_logprobs:
        return 0
    return max(0, min(s.num_tokens, len(s.prompt_token_ids) - 1 - s.start_position))
