"""LLM: the offline API, shaped like vLLM's so users can switch.

    from tokenforge import LLM, SamplingParams
    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))

In: prompts (str, token ids, or {"prompt_token_ids": [...]}) and SamplingParams. Out:
RequestOutputs in input order. The engine core runs in-process; all prompts are validated before
any is added, so a bad prompt raises ValueError and leaves the engine usable.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from tokenforge.config import EngineConfig, RuntimeInfo
from tokenforge.engine.engine_core import EngineCore
from tokenforge.engine.generation_defaults import sampling_defaults
from tokenforge.engine.output_processor import OutputProcessor
from tokenforge.engine.processor import ProcessedRequest, Processor, PromptType
from tokenforge.engine.tokenization import continue_final_message as continue_final_text
from tokenforge.engine.tokenization import config_tokenizer
from tokenforge.messages import EngineStats, LoRARequest, RequestOutput
from tokenforge.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto", block_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, num_kv_blocks: int | None = None,
                 kv_cache_memory: int | str | None = None, seed: int = 0, load_format: str = "auto",
                 generation_config: str = "auto", override_generation_config: str | dict | None = None,
                 **kwargs) -> None:
        # The device and its batch limits are the engine core's to resolve (engine/startup.py).
        self.config = EngineConfig.unresolved(
            model=model, dtype=dtype, block_size=block_size, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory, seed=seed, load_format=load_format, **kwargs)
        # the sampling defaults `generate` uses without SamplingParams (engine/generation_defaults.py)
        self.sampling_defaults = sampling_defaults(self.config.model.model, generation_config,
                                                   override_generation_config)
        start = time.perf_counter()
        self.tokenizer = config_tokenizer(self.config)
        loaded = time.perf_counter()
        self.engine = EngineCore(self.config, self.tokenizer, defer_graphs=False)   # no idle loop: all graphs now
        self.config = self.engine.config        # resolved: the device, batch limits, context length
        logger.info("tokenizer loaded in %.2f s; ready in %.2f s", loaded - start, time.perf_counter() - start)
        self.runtime = RuntimeInfo(
            num_kv_blocks=self.engine.num_kv_blocks, vocab_size=self.engine.vocab_size,
            eos_token_ids=tuple(self.tokenizer.eos_token_ids), max_model_len=self.engine.max_model_len,
            max_logprobs=RuntimeInfo.logprobs_limit(self.config.model.max_logprobs, self.engine.vocab_size))
        self.processor = Processor(self.engine.config, self.runtime, self.tokenizer)
        self._ids = itertools.count()

    # ---- public API -----------------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without SamplingParams: the model's generation config's defaults
        (`generation_config="vllm"`: SamplingParams()), as vLLM's LLM does."""
        return SamplingParams(**self.sampling_defaults)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None: the base model) per prompt."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts), self.get_default_sampling_params)
        loras = _as_lora_list(lora_request, len(prompts))
        # Validate everything first: a bad prompt or adapter raises before any request reaches the engine.
        processed = [self.processor.process(p, sp, str(next(self._ids)), lora_request=lora)
                     for p, sp, lora in zip(prompts, params, loras)]
        for lora in {lora for lora in loras if lora is not None}:
            self.engine.lora_key(lora)      # read once: later calls naming it reuse the host copy
        return self._run(processed, params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation or a list of them, rendered with the model's chat template (`tools` and
        `chat_template_kwargs` passed to it), then `generate`. `continue_final_message`: the model
        continues the last (assistant) message instead of starting a turn, as in vLLM."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      tools=tools, **(chat_template_kwargs or {}))
            if continue_final_message:
                text = continue_final_text(text, conversation)
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def shutdown(self) -> None:
        """Stop the engine: with tensor/pipeline parallelism, the worker processes exit."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def start_profile(self) -> None:
        """Profile the following generate() calls with torch.profiler (needs profile_dir=...)."""
        self.engine.start_profile()

    def stop_profile(self) -> str:
        """Write the trace under profile_dir and return the kernel-time summary table."""
        return self.engine.stop_profile()

    def get_tokenizer(self):
        return self.tokenizer

    # ---- the loop -------------------------------------------------------------------------------
    def _run(self, processed: list[ProcessedRequest], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        outputs = OutputProcessor(self.tokenizer, stream_deltas=False)
        arrival = time.time()
        for req, sp in zip(processed, params):
            outputs.add_request(req, sp, arrival)
            for core_request in req.core_requests:
                self.engine.add_request(core_request)
        finished: dict[str, RequestOutput] = {}
        bar = _progress(len(processed), use_tqdm, self.engine.scheduler.drafts)
        try:
            while outputs.has_unfinished():
                # step() leaves the steps it queued ahead on the device: this detokenizes meanwhile.
                core_outputs = self.engine.step()
                step = outputs.process_outputs(core_outputs)
                self.engine.abort_requests(step.abort_ids)
                for out in step.request_outputs:
                    finished[out.request_id] = out
                if bar is not None:
                    bar.update(core_outputs, len(step.request_outputs))
            self.engine.drain()      # a step scheduled ahead may still be queued; its requests are done
        except BaseException:
            # Leave the engine usable: whatever was in flight is aborted and its blocks freed.
            for req in processed:
                self.engine.abort_requests(outputs.abort_request(req.request_id))
            try:
                self.engine.drain()
            except Exception:  # noqa: BLE001 - the error being raised is the one to report
                logger.exception("a step in flight failed while unwinding an interrupted generate()")
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[req.request_id] for req in processed]


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]   # one prompt given as token ids
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    return prompts


def _as_lora_list(lora, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    lora = list(lora)
    if len(lora) != n:
        raise ValueError(f"got {len(lora)} lora requests for {n} prompts: give one, or one per prompt")
    return lora


def _as_params_list(params, n: int, default) -> list[SamplingParams]:
    if params is None:
        return [default() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts: give one, or one per prompt")
    return params


class _Progress:
    """A bar over finished prompts that shows the output tokens/s as they are generated."""

    def __init__(self, total: int, drafts=None) -> None:
        from tqdm.auto import tqdm  # noqa: PLC0415

        self.drafts = drafts        # the DraftPlanner with speculative decoding: its acceptance is shown

        self.bar = tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)
        self.start = time.perf_counter()
        self.tokens = 0

    def update(self, core_outputs: list, num_finished: int) -> None:
        self.tokens += sum(len(o.new_token_ids) for o in core_outputs)
        seconds = max(time.perf_counter() - self.start, 1e-6)
        line = f"{self.tokens} tokens, {self.tokens / seconds:.1f} tok/s"
        if self.drafts is not None and self.drafts.num_verify_steps:
            d = self.drafts
            line += (f", drafts accepted {d.num_accepted / max(d.num_drafted, 1):.0%}, "
                     f"mean acceptance length {1 + d.num_accepted / d.num_verify_steps:.2f}")
        self.bar.set_postfix_str(line, refresh=False)
        self.bar.update(num_finished)   # also redraws the postfix, at most every 0.1 s

    def close(self) -> None:
        self.bar.close()


def _progress(total: int, enabled: bool, drafts=None) -> _Progress | None:
    return _Progress(total, drafts) if enabled else None
