"""Request fields -> one StructuredOutputsParams: OpenAI's response_format, vLLM's guided_* fields
and `structured_outputs`. At most one source may be given; each error is a 400 naming its field.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenforge.sampling_params import StructuredOutputsParams
from tokenforge.server.errors import bad_request
from tokenforge.server.protocol import SamplingFields

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True, frozen=True)
class StructuredRequest:
    spec: StructuredOutputsParams
    param: str                 # the request field it came from, for error messages


def structured_request(req: SamplingFields) -> StructuredRequest | None:
    found: list[StructuredRequest] = []
    if req.response_format is not None:
        spec = _from_response_format(req.response_format)
        if spec is not None:
            found.append(StructuredRequest(spec, "response_format"))
    for field, kind in _GUIDED.items():
        value = getattr(req, field)
        if value is not None:
            found.append(StructuredRequest(_spec(field, **{kind: value}), field))
    if req.structured_outputs is not None:
        found.append(StructuredRequest(_from_structured_outputs(req.structured_outputs), "structured_outputs"))
    if len(found) > 1:
        raise bad_request(f"give at most one output constraint, got {[f.param for f in found]}",
                          param=found[1].param)
    return found[0] if found else None


def _spec(param: str, **fields) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except (TypeError, ValueError) as err:
        raise bad_request(f"{param}: {err}", param=param) from err


def _from_response_format(body: dict) -> StructuredOutputsParams | None:
    kind = body.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("response_format", json_object=True)
    if kind == "json_schema":
        entry = body.get("json_schema")
        schema = entry.get("schema", entry.get("json_schema")) if isinstance(entry, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format of type 'json_schema' needs json_schema.schema, a JSON schema object",
                              param="response_format")
        # strict or not, the schema is enforced: the grammar admits only conforming output.
        return _spec("response_format", json=schema)
    raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                      param="response_format")


def _from_structured_outputs(body: dict) -> StructuredOutputsParams:
    unknown = sorted(set(body) - set(_KINDS) - {"disable_fallback", "disable_any_whitespace",
                                                "disable_additional_properties", "whitespace_pattern"})
    if unknown:
        raise bad_request(f"structured_outputs has unknown fields {unknown}; use one of {list(_KINDS)}",
                          param="structured_outputs")
    fields = {k: body[k] for k in _KINDS if body.get(k) is not None}
    if "json_object" in fields:
        fields["json_object"] = bool(fields["json_object"])
    return _spec("structured_outputs", **fields)
