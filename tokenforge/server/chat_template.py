"""Chat messages -> one prompt string, through a chat template rendered in a Jinja sandbox.

The model's own template is rendered by the tokenizer (HF renders it in an immutable sandbox),
exactly as the offline `LLM.chat` does, so greedy server output equals offline output. A
template given on the command line (--chat-template) or, only with
--trust-request-chat-template, in the request, is rendered here in ImmutableSandboxedEnvironment:
no attribute access to internals, no mutation of the inputs.
"""

from __future__ import annotations

import functools
import os

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

_RESERVED = {"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "tools"}


class TemplateError(ValueError):
    """The template failed to render (including its own raise_exception): a 400, not a 500."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateError as err:
        raise TemplateError(f"chat_template does not compile: {err}") from err


def load_template(value: str | None) -> str | None:
    """--chat-template takes a path to a file or the template itself."""
    if value and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


class ChatTemplateRenderer:
    def __init__(self, tokenizer, server_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.server_template = load_template(server_template)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               template: str | None = None, template_kwargs: dict | None = None,
               tools: list[dict] | None = None) -> str:
        source = template or self.server_template
        kwargs = dict(template_kwargs or {})
        clash = _RESERVED & kwargs.keys()
        if clash:
            raise TemplateError(f"chat_template_kwargs must not set {sorted(clash)}")
        if tools is not None:
            kwargs["tools"] = tools
        if source is None:
            return self._render_model_template(messages, add_generation_prompt, kwargs)
        try:
            return _compile(source).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=_special(self.tokenizer, "bos_token"), eos_token=_special(self.tokenizer, "eos_token"),
                **kwargs)
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            raise TemplateError(f"chat_template failed to render: {err}") from err

    def _render_model_template(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        try:
            if kwargs:
                return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                          **kwargs)
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            raise TemplateError(f"the model's chat template failed to render these messages: {err}") from err


def _special(tokenizer, name: str) -> str:
    value = getattr(tokenizer, name, None)
    if value is None and hasattr(tokenizer, "hf"):
        value = getattr(tokenizer.hf, name, None)
    return value if isinstance(value, str) else ""
