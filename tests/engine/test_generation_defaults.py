"""The model's generation_config.json as requests' sampling defaults (engine/generation_defaults.py),
as vLLM applies it: read with `--generation-config auto` (the default), ignored with `vllm`, taken
from another folder or file, overridden key by key; a request's own value wins, except that the
model's max_new_tokens caps max_tokens (vLLM's min); a bad file or override is one ValueError
naming it, before the engine starts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tokenforge.engine.generation_defaults import sampling_defaults
from tokenforge.sampling_params import SamplingParams

QWEN3_LIKE = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.95,
              "top_k": 20, "max_new_tokens": 7, "transformers_version": "4.51.0"}


def _folder(tmp_path, config: dict | str):
    (tmp_path / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return tmp_path


def test_the_recommended_keys_become_sampling_defaults(tmp_path):
    folder = _folder(tmp_path, QWEN3_LIKE)
    assert sampling_defaults(str(folder)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7}
    assert sampling_defaults(str(folder), "vllm") == {}
    # transformers' own default top_k (50) is no recommendation, as vLLM reads the file; 0 means off
    assert sampling_defaults(str(_folder(tmp_path, {"top_k": 50, "min_p": 0.05}))) == {"min_p": 0.05}
    assert sampling_defaults(None, "auto", '{"top_k": 0, "repetition_penalty": 1.1}') == \
        {"top_k": -1, "repetition_penalty": 1.1}


def test_another_folder_a_file_and_an_override(tmp_path):
    (tmp_path / "other").mkdir()
    other = _folder(tmp_path / "other", {"temperature": 0.2})
    assert sampling_defaults("/nowhere", str(other)) == {"temperature": 0.2}
    assert sampling_defaults(None, str(other / "generation_config.json")) == {"temperature": 0.2}
    assert sampling_defaults(str(other), "auto", {"temperature": 0.9, "max_new_tokens": 3}) == \
        {"temperature": 0.9, "max_tokens": 3}


@pytest.mark.parametrize("config,override,message", [
    ({"temperature": "hot"}, None, "generation_config.json: temperature must be a number, got 'hot'"),
    ({"top_p": 0}, None, "generation_config.json: top_p must be in (0, 1], got 0.0"),
    ({"max_new_tokens": 2.5}, None, "max_new_tokens must be an integer, got 2.5"),
    ({"temperature": True}, None, "temperature must be a number, got True"),
    ("[1, 2]", None, "generation_config.json holds list, not a JSON object"),
    ("{not json", None, "generation_config.json is not valid JSON"),
    ({}, '{"temprature": 0.5}', "--override-generation-config: unknown key(s) 'temprature'"),
    ({}, '{"repetition_penalty": -1}', "--override-generation-config: repetition_penalty must be > 0"),
    ({}, "0.5", "--override-generation-config holds float, not a JSON object"),
])
def test_a_bad_value_is_one_error_naming_where_it_is(tmp_path, config, override, message):
    folder = _folder(tmp_path, config)
    with pytest.raises(ValueError) as err:
        sampling_defaults(str(folder), "auto", override)
    assert message in str(err.value)


def test_a_bad_model_file_names_the_way_around_it(tmp_path):
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1, got 0 \(--generation-config vllm"):
        sampling_defaults(str(_folder(tmp_path, {"max_new_tokens": 0})))
    assert sampling_defaults(str(tmp_path), "vllm") == {}


def test_a_generation_config_path_without_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--generation-config .*: no generation_config.json there"):
        sampling_defaults(None, str(tmp_path))


def _ctx(defaults: dict, max_tokens_limit=None):
    from tokenforge.config import RuntimeInfo
    from tokenforge.server.serving_common import ServingContext
    from tokenforge.server.settings import ServerSettings

    runtime = RuntimeInfo(num_kv_blocks=1, vocab_size=1000, eos_token_ids=(), max_model_len=4096)
    engine = SimpleNamespace(runtime=runtime)
    return ServingContext(engine, ServerSettings(max_tokens_limit=max_tokens_limit), None, "m", None,
                          sampling_defaults=defaults)


def test_a_request_gets_the_defaults_only_for_what_it_leaves_out():
    from tokenforge.server.protocol import CompletionRequest
    from tokenforge.server.serving_common import build_sampling_params

    ctx = _ctx({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                "max_tokens": 7})
    bare = build_sampling_params(ctx, CompletionRequest(model="m", prompt="x"), max_tokens=None, logprobs=None)
    assert (bare.temperature, bare.top_p, bare.top_k, bare.min_p, bare.repetition_penalty, bare.max_tokens) == \
        (0.6, 0.95, 20, 0.05, 1.1, 7)
    own = CompletionRequest(model="m", prompt="x", temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                            repetition_penalty=1.0, max_tokens=30)
    mine = build_sampling_params(ctx, own, max_tokens=30, logprobs=None)
    assert (mine.temperature, mine.top_p, mine.top_k, mine.min_p, mine.repetition_penalty) == (0.0, 1.0, -1, 0.0, 1.0)
    # the model's max_new_tokens caps a request's max_tokens too (vLLM's min of both); one under it stays
    assert mine.max_tokens == 7
    assert build_sampling_params(ctx, own, max_tokens=3, logprobs=None).max_tokens == 3
    # the server's --max-tokens-limit still caps the model's default
    capped = build_sampling_params(_ctx({"max_tokens": 7}, max_tokens_limit=5), CompletionRequest(model="m", prompt="x"),
                                   max_tokens=None, logprobs=None)
    assert capped.max_tokens == 5
    plain = build_sampling_params(_ctx({}), CompletionRequest(model="m", prompt="x"), max_tokens=None, logprobs=None)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (1.0, 1.0, -1, None)


def test_the_offline_llm_generates_with_the_models_defaults(tmp_path):
    """LLM(path).generate without SamplingParams: the folder's max_new_tokens and top_k 1 (greedy)
    apply; `generation_config="vllm"` keeps SamplingParams()'s."""
    from tokenforge import LLM

    folder = _tiny_folder(tmp_path / "tiny", {"top_k": 1, "max_new_tokens": 5, "temperature": 0.7})
    prompt = {"prompt_token_ids": [5, 17, 99, 3, 42]}
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    assert llm.get_default_sampling_params() == SamplingParams(top_k=1, max_tokens=5, temperature=0.7)
    out = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert len(greedy.token_ids) == 5 and out.token_ids == greedy.token_ids     # top_k 1: greedy, 5 tokens
    llm.shutdown()
    plain = LLM(str(folder), dtype="float32", num_kv_blocks=64, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    plain.shutdown()


def _tiny_folder(path, generation: dict):
    from tests.model.moe_checkpoints import VOCAB, _save

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256)
    folder = _save(transformers.LlamaForCausalLM(cfg).eval(), path)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


@pytest.mark.timeout(300)
def test_a_served_model_answers_with_its_defaults_through_the_openai_client(tmp_path):
    """`tokenforge serve FOLDER`: a completion that leaves max_tokens and the sampling out gets the
    folder's max_new_tokens (it caps a larger request too) and top_k 1 (greedy); a request's own
    temperature 0 gives the same tokens; `--override-generation-config` changes one key."""
    import sys

    openai = pytest.importorskip("openai")
    from tests.server.servers import ServerProcess

    folder = _tiny_folder(tmp_path / "tiny", {"top_k": 1, "max_new_tokens": 5, "temperature": 0.7})
    server = ServerProcess([sys.executable, "-m", "tokenforge.cli", "serve", str(folder), "--dtype", "float32",
                            "--device", "cpu", "--override-generation-config", '{"max_new_tokens": 6}'])
    try:
        server.wait_healthy(300)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        plain = client.completions.create(model=model, prompt=[5, 17, 99, 3])
        greedy = client.completions.create(model=model, prompt=[5, 17, 99, 3], temperature=0, max_tokens=40)
        assert plain.usage.completion_tokens == 6 and greedy.usage.completion_tokens == 6    # capped at 6
        assert plain.choices[0].text == greedy.choices[0].text
        assert "sampling defaults from the model's generation config: {'temperature': 0.7, 'top_k': 1, " \
               "'max_tokens': 6}" in server.output()
    finally:
        server.stop()
