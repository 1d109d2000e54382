"""ModelRunner: a SchedulerOutput -> tensors -> model -> sampler -> a ModelRunnerOutput of lists.

In: `SchedulerOutput` (plain lists from core/; a worker gets the same step as a `WorkerStep`).
Out: `ModelRunnerOutput` (plain lists). A step is: prepare the inputs (placeholders filled from
the previous step's sampled ids on the device), forward, then the rank's role after the forward
(executor/roles.py: the driver takes logits and samples, a TP follower joins the LM head's
collectives, a later pipeline stage does nothing). The runner makes no policy decisions: it
computes exactly the tokens it is given, logits only for rows that sample (or asked for prompt
logprobs), and syncs with the host once per step, in `collect`.
"""

from __future__ import annotations

import logging
import torch

from tokenforge.config import EngineConfig
from tokenforge.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenforge.distributed import parallel_state
from tokenforge.executor.cpu_decode import CpuDecodeRunner
from tokenforge.executor.cuda_graph import CudaGraphRunner
from tokenforge.executor.input_batch import InputBatch, PreviousSample, build_inputs
from tokenforge.executor.kv_cache import (allocate_kv_caches, finish_calibration, kv_scales_for,
                                          rotate_keys, start_calibration)
from tokenforge.executor.pipeline import PipelinedSteps, StageComm
from tokenforge.executor.roles import StepInFlight, make_role
from tokenforge.executor.spec.burst import NoBurst, make_burst
from tokenforge.executor.spec.components import make_drafter, make_speculative_role
from tokenforge.executor.warmup import warm_up
from tokenforge.kernels.kv_quant import FP8_DTYPE, cache_dtype
from tokenforge.model.attention import get_attention_backend
from tokenforge.model.attention.backend import AttentionBatch
from tokenforge.model.forward_context import set_forward_context
from tokenforge.model.loader import CacheOptions, load_model
from tokenforge.model.offload import offload_layers
from tokenforge.model.quant import QuantOptions, check_device, packing_pays, prepack_linears, quantize_linears_int8

logger = logging.getLogger(__name__)

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
        self.loras = self._init_lora()
        self.stages = StageComm(self.rank, self.device, self.dtype, self.arch.hidden_size,
                                config.scheduler.pipeline_steps)
        # Pipelined steps, first stage: steps started, oldest first, waiting for the last stage.
        self.pipeline = PipelinedSteps(self.stages) if self.stages.pipelined and self.rank.is_first_stage else None
        self.previous = PreviousSample()
        speculative = config.scheduler.speculative_method is not None and self.rank.is_first_stage
        self.role = make_speculative_role(self) if speculative else make_role(self)
        self.drafter = make_drafter(self)        # a draft model or head that fills draft slots (draft, eagle)
        self.burst = NoBurst()                   # n-gram bursts at batch 1 (made with the KV cache: spec/burst.py)
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: CudaGraphRunner | CpuDecodeRunner | None = None

    # ---- init steps -----------------------------------------------------------------------------
    def _init_threads(self) -> None:
        if self.config.device.num_threads:
            torch.set_num_threads(self.config.device.num_threads)

    def _init_model(self) -> None:
        r, cfg, m = self.rank, self.config, self.config.model
        check_device(m.quantization, self.device.type)
        cpu_int8 = m.quantization == "int8" and self.device.type == "cpu"   # the CPU's int8 is dynamic int8
        quant = QuantOptions(m.quantization, m.quantization_group_size, m.quantize_lm_head, m.prune_rate, m.sparsity,
                             tuple(m.calibration_token_ids) if m.calibration_token_ids else None)
        cache = (CacheOptions(cfg.load.engine_cache_dir, m.model_version, m.quantization)
                 if cfg.load.engine_cache_dir else None)
        loaded = load_model(m.model, cfg.load.load_format, self.dtype, self.device, m.seed,
                            r.tp_rank, r.tp_size, r.pp_rank, r.pp_size, cache=cache, quant=quant,
                            cpu_int8_dynamic=cpu_int8, expert_parallel=cfg.parallel.enable_expert_parallel,
                            gguf_native=m.dtype == "auto")
        self.model = loaded.model.eval()
        self.arch = loaded.arch_config
        # fp8 KV: per-layer [4] scale vectors, from the checkpoint or (None) calibrated later
        # (all layers in the checkpoint; a pipeline stage keeps its own layers' scales)
        scales = loaded.kv_scales
        if scales is not None and self.rank.pp_size > 1:
            scales = [scales[i] for i in self.model.model.stage]
        self.kv_scales = kv_scales_for(self, scales) if self.kv_dtype == FP8_DTYPE else None
        if self.kv_dtype == FP8_DTYPE and self.kv_scales is None:
            rotate_keys(self.model.attention_layers(), self.device, self.dtype)
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

    def _init_lora(self):
        """The adapters' device slots and host copies (None without --enable-lora: no hook, no index)."""
        if not self.config.lora.enable_lora:
            return None
        from tokenforge.executor.lora import LoRAManager  # noqa: PLC0415

        return LoRAManager(self.model, self.config.lora, self.device)

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

    def init_kv_cache(self, num_blocks: int, max_model_len: int | None = None, defer_graphs: bool = False) -> None:
        """Allocate the KV cache; `max_model_len` is the resolved context length (the config
        the runner was built with may still carry the scheduler's unresolved default), which sizes
        every preallocated buffer from here on (the CUDA graphs' block tables among them).
        `defer_graphs`: capture the small decode buckets now and the rest later (graph_stages.py)."""
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
        self.drafter.init_kv_cache(num_blocks)
        if (self.device.type == "cuda" and self.backend.name == "triton" and not self.config.device.enforce_eager
                and self.rank.pp_size == 1 and self.offloader is None):   # offloaded weights move: no graphs
            self.graphs = CudaGraphRunner(self, num_blocks, defer=defer_graphs and self.rank.tp_size == 1)
            self.graphs.capture()
        elif self.device.type == "cpu":
            self.graphs = CpuDecodeRunner.for_runner(self)     # GGUF blocks: a decode step per native call
        if self.rank.is_first_stage and self.config.scheduler.speculative_method is not None:
            self.burst = make_burst(self)
        if self.device.type == "cuda" and self.rank.pp_size == 1:
            self.warmup_seconds = warm_up(self, num_blocks)     # prefill/mixed shapes compile now

    # ---- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, defer_sampling: bool = False) -> StepInFlight:
        """Queue the step's device work (forward + sampling) without waiting for it.

        `defer_sampling`: queue the forward and the logits only; `sample(step, sched)` queues the
        sampling later, once `sched.grammar_rows/grammar_bitmask` are known (async scheduling with
        grammar requests: their masks need the previous step's tokens, which arrive meanwhile).
        It must be called before the next `launch`, which reads this step's sampled ids.
        """
        self.role.check_launch()
        self.role.forget(sched.finished_request_ids)
        step = StepInFlight(sched)
        if sched.is_empty:
            return step
        if sched.lora_loads:
            self.loras.apply(sched.lora_loads)       # queued before this step's forward reads the slots
        if self.burst.takes(sched):
            self.burst.launch(step)                  # verify iterations chained on the device
            return step
        step.inputs = build_inputs(sched.sequences, self.block_size, self.device, self.config.cache.pin_memory,
                                   self.previous.rows, lora=self.loras is not None)
        if self.rank.is_first_stage:
            self.previous.fill(step.inputs)
            self.drafter.before_forward(step)
        if self.pipeline is not None:
            # The sampling waits for the last stage (`finish_stages`), so the next step can start first.
            assert not defer_sampling, "pipelined steps carry no placeholders: nothing waits for masks"
            self.pipeline.start(self.model, self.backend.build_metadata(step.inputs.attn_batch), step)
            return step
        step.hidden = self._forward(step.inputs)
        self._after_forward(step, defer_sampling)
        return step

    def _after_forward(self, step: StepInFlight, defer_sampling: bool) -> None:
        step.sampling = [s for s in step.sched.sequences if s.sample]
        self.previous.rows = {s.request_id: i for i, s in enumerate(step.sampling)}
        self.role.after_forward(step, defer_sampling)

    @torch.inference_mode()
    def finish_stages(self) -> StepInFlight:
        """Pipelined steps, first stage: the oldest step started takes the last stage's hidden
        states, then queues what follows its forward as `launch` does for an unsplit step."""
        step = self.pipeline.finish_oldest()
        self._after_forward(step, defer_sampling=False)
        return step

    @torch.inference_mode()
    def sample(self, step: StepInFlight, sched: SchedulerOutput) -> None:
        """Queue the sampling of a step launched with `defer_sampling` (a no-op for any other)."""
        self.role.sample(step, sched)

    def grammar_bitmask_buffer(self, rows: int, width: int):
        """A reused host array [rows, width] int32 for a step's grammar bitmask (rank 0)."""
        return self.role.grammar_bitmask_buffer(rows, width)

    @torch.inference_mode()
    def collect(self, step: StepInFlight) -> ModelRunnerOutput:
        """Wait for a launched step and turn its results into lists (the one host sync)."""
        out = ModelRunnerOutput()
        if step.inputs is None and step.verify is None:     # an empty step (a burst has no inputs)
            return out
        if step.sample_pending:
            raise RuntimeError("a step launched with defer_sampling was collected before `sample`")
        if step.awaits_last_stage and self.finish_stages() is not step:
            raise RuntimeError("pipelined steps must be collected in the order they were launched")
        self.role.collect(step, out)
        self._release_fragmented_memory()
        return out

    def kv_layers(self) -> list:
        """The attention layers whose KV the cache's blocks hold (a draft model's too)."""
        return self.model.attention_layers() + self.drafter.attention_layers()

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
        with set_forward_context(metadata, inputs.lora_indices):
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
        lora = torch.zeros_like(ids) if self.loras is not None else None    # the adapters' activations count too
        with set_forward_context(self.backend.build_metadata(batch), lora):
            hidden = self.stages.forward(self.model, ids, pos)
        if hidden is not None:
            rows = min(num_tokens, self.config.scheduler.max_num_seqs)
            self.model.compute_logits(hidden[-rows:])
        if calibrate:
            self.kv_scales = finish_calibration(layers, self.device)
        for layer in layers:
            layer.kv_cache = None
