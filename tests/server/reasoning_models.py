"""Tiny random checkpoints that speak a reasoning format, for the --reasoning-parser tests.

The bundled SmolLM2 tokenizer plus the format's tokens (harmony's special tokens for gpt-oss; the
non-special `<think>` / `</think>` for Qwen3, as Qwen3's own tokenizer has them), a chat template of
the format (written here, in the shape of the models' own), and a tiny random model built with
transformers (gpt-oss; Qwen3-MoE) over that whole vocabulary. A random model never writes the format
by itself: the tests force its output with a grammar (llguidance references special tokens by name,
so the sampled ids are the real special tokens)."""

from __future__ import annotations

from pathlib import Path

import torch

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

# The shape of gpt-oss's template: a system message, the tools as a developer message, each turn as
# a harmony message; earlier calls on the commentary channel, tool results from functions.NAME.
HARMONY_TEMPLATE = (
    "{%- set ns = namespace(call='') -%}"
    "<|start|>system<|message|>You are a tiny test model.\nReasoning: {{ reasoning_effort | default('medium') }}"
    "\n# Valid channels: analysis, commentary, final.<|end|>"
    "{%- if tools -%}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{%- for t in tools %}\ntype {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;"
    "{%- endfor %}\n} // namespace functions<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|start|>developer<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'user' -%}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "{%- for c in m.tool_calls -%}{%- set ns.call = c.function.name -%}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>"
    "{{ c.function.arguments | tojson }}<|call|>{%- endfor -%}"
    "{%- elif m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}<|start|>functions.{{ ns.call }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")

# Qwen3's: ChatML turns; with enable_thinking=false the generation prompt closes an empty block.
QWEN3_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
# A thinking-only model's (QwQ, Qwen3-*-Thinking-2507): the block is opened in the prompt.
QWEN3_PREFILL_TEMPLATE = QWEN3_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")


def format_tokenizer(path: Path, kind: str):
    """The bundled tokenizer with the format's tokens and template, saved to `path` (a transformers
    tokenizer, returned)."""
    from transformers import PreTrainedTokenizerFast

    from tokenforge.engine.tokenization import load_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_file=str(load_tokenizer(None).hf.directory / "tokenizer.json"))
    if kind == "gpt_oss":
        tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
        tok.eos_token, tok.chat_template = "<|return|>", HARMONY_TEMPLATE
    else:
        tok.add_tokens(["<think>", "</think>"])
        tok.eos_token, tok.chat_template = "<|im_end|>", QWEN3_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(path)
    return tok


def format_checkpoint(path: Path, kind: str) -> Path:
    """A tiny random gpt-oss (kind "gpt_oss") or Qwen3-MoE ("qwen3") over the format's tokenizer."""
    from transformers import GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.model.moe_checkpoints import gpt_oss_config

    tok = format_tokenizer(path, kind)
    torch.manual_seed(0)
    if kind == "gpt_oss":
        # <|return|> ends an answer, <|call|> a tool call: both are end-of-sequence, as in gpt-oss.
        eos = [tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>")]
        hf = GptOssForCausalLM(gpt_oss_config(vocab_size=len(tok), eos_token_id=eos, num_hidden_layers=2))
    else:
        hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=512, eos_token_id=tok.eos_token_id, tie_word_embeddings=True))
    hf.eval().save_pretrained(path)
    return path
