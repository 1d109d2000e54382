import pytest

from .core_fakes import make_request, make_scheduler, reference_generate, run_to_completion

PROMPT = [5, 6, 7]
EXPECTED = reference_generate(PROMPT, 40)


def first_repeat_free_index(start: int) -> int:
    """An index i >= start whose token does not occur earlier in EXPECTED (a clean stop point)."""
    return next(i for i in range(start, len(EXPECTED)) if EXPECTED[i] not in EXPECTED[:i])


def run_one(max_model_len: int = 256, **kwargs):
    sched = make_scheduler(max_model_len=max_model_len)
    sched.add_request(make_request("r", PROMPT, **kwargs))
    res = run_to_completion(sched)
    return res.tokens["r"], res.finish["r"]


def test_eos_stops_and_is_included():
    i = first_repeat_free_index(2)
    tokens, finish = run_one(max_tokens=30, eos=(EXPECTED[i],))
    assert tokens == EXPECTED[:i + 1] and finish == ("stop", None)


def test_ignore_eos_runs_to_max_tokens():
    i = first_repeat_free_index(2)
    tokens, finish = run_one(max_tokens=30, eos=(EXPECTED[i],), ignore_eos=True)
    assert tokens == EXPECTED[:30] and finish == ("length", None)


def repeated_token() -> tuple[int, int]:
    """Indices i < j of the first token that the fake model emits twice."""
    return next((i, j) for j in range(len(EXPECTED)) for i in range(j) if EXPECTED[i] == EXPECTED[j])


@pytest.mark.parametrize("kind", ["eos", "stop_token_ids"])
def test_min_tokens_suppresses_the_stop_until_reached(kind):
    i, j = repeated_token()                  # the stop token first shows up at output i + 1 < min
    stop = {"eos": (EXPECTED[i],)} if kind == "eos" else {"stop_token_ids": (EXPECTED[i],)}
    tokens, finish = run_one(max_tokens=30, min_tokens=i + 2, **stop)
    assert tokens == EXPECTED[:j + 1]
    assert finish == ("stop", None if kind == "eos" else EXPECTED[i])


def test_min_tokens_counts_the_token_just_sampled():
    i = first_repeat_free_index(2)
    tokens, finish = run_one(max_tokens=30, eos=(EXPECTED[i],), min_tokens=i + 1)
    assert tokens == EXPECTED[:i + 1] and finish == ("stop", None)


def test_stop_token_id_is_reported():
    i = first_repeat_free_index(3)
    tokens, finish = run_one(max_tokens=30, stop_token_ids=(999, EXPECTED[i]))
    assert tokens == EXPECTED[:i + 1] and finish == ("stop", EXPECTED[i])


def test_eos_is_checked_before_stop_token_ids():
    i = first_repeat_free_index(2)
    tokens, finish = run_one(max_tokens=30, eos=(EXPECTED[i],), stop_token_ids=(EXPECTED[i],))
    assert tokens == EXPECTED[:i + 1] and finish == ("stop", None)


@pytest.mark.parametrize("max_tokens", [1, 4])
def test_max_tokens(max_tokens):
    tokens, finish = run_one(max_tokens=max_tokens)
    assert tokens == EXPECTED[:max_tokens] and finish == ("length", None)


def test_max_model_len_caps_prompt_plus_output():
    tokens, finish = run_one(max_model_len=10, max_tokens=30)
    assert tokens == EXPECTED[:7] and finish == ("length", None)


def test_a_prompt_of_exactly_max_model_len_gets_one_token():
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("r", list(range(8)), max_tokens=5))
    res = run_to_completion(sched)
    assert len(res.tokens["r"]) == 1 and res.finish["r"] == ("length", None)
