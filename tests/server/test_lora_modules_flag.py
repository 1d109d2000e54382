"""--lora-modules entries: vLLM's `name=path` and JSON forms, and each malformed entry as one
ValueError naming it (the server prints it and exits before serving)."""

from __future__ import annotations

import json

import pytest

from tokenforge.config.lora import LoRAConfig, parse_lora_modules


def test_both_forms_give_path_and_parent():
    entries = ["a=/x/a", json.dumps({"name": "b", "path": "/x/b", "base_model_name": "base-1"}),
               ' {"name": " c ", "path": "/x/c"} ']
    assert parse_lora_modules(entries) == {"a": ("/x/a", None), "b": ("/x/b", "base-1"), "c": ("/x/c", None)}


@pytest.mark.parametrize("entry, words", [
    ("a", "is not name=path or a JSON object"),
    ("=/x", "is not name=path"),
    ("a=", "is not name=path"),
    ('{"name": "a", "path": ', "is not valid JSON"),
    ('{"name": "a"}', "needs a non-empty string 'path'"),
    ('{"name": "", "path": "/x"}', "needs a non-empty string 'name'"),
    ('{"name": 3, "path": "/x"}', "needs a non-empty string 'name'"),
    ('{"name": "a", "path": "/x", "base_model_name": 5}', "base_model_name must be a non-empty string"),
    ('{"name": "a", "path": "/x", "rank": 8}', "unknown key(s) ['rank']"),
])
def test_malformed_entries_are_one_error_naming_them(entry, words):
    with pytest.raises(ValueError) as err:
        parse_lora_modules([entry])
    assert words in str(err.value) and repr(entry) in str(err.value)


def test_a_repeated_name_is_an_error_across_forms():
    with pytest.raises(ValueError, match="names the adapter 'a' twice"):
        parse_lora_modules(["a=/x", json.dumps({"name": "a", "path": "/y"})])


def test_the_config_checks_entries_at_validation():
    LoRAConfig(enable_lora=True, lora_modules=("a=/x",)).validate()
    with pytest.raises(ValueError, match="is not valid JSON"):
        LoRAConfig(enable_lora=True, lora_modules=("{nope",)).validate()
