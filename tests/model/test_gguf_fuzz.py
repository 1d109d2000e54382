"""The GGUF reader against malformed files: a tiny GGUF written by the `gguf` library, then targeted
corruptions (each with its exact one-line error) and a few hundred seeded mutations (truncations,
byte flips in the header, overflowing length and count fields). Every case must end in either a
GGUFFormatError naming the file, or a clean load; never another exception, a hang or a huge
allocation."""

from __future__ import annotations

import random
import resource
import struct
import time
from pathlib import Path

import pytest

from tests.model.gguf_builder import write_tiny_gguf
from tokenforge.model.loader.gguf_file import GGUFFile, GGUFFormatError
from tokenforge.model.loader.gguf_loader import arch_config_from_gguf, gguf_weights

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_OVERFLOWS = (0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The file's bytes, and its header's integer fields: name -> (offset, size)."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q8_0", mixed={"ffn_down.weight": "Q4_0",
                                                                                          "output.weight": "F32"})
    data = path.read_bytes()
    return data, header_fields(data)


def header_fields(data: bytes) -> dict[str, tuple[int, int]]:
    """An independent walk of a well-formed GGUF header, recording where each integer field sits."""
    fields = {"version": (4, 4), "n_tensors": (8, 8), "n_kv": (16, 8)}
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(label: str) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", data, pos)
        fields[f"{label}.len"] = (pos, 8)
        return data[pos + 8: pos + 8 + length].decode(), pos + 8 + length

    for _ in range(n_kv):
        key, pos = string("key")
        fields[f"{key}.key.len"] = fields.pop("key.len")
        (vtype,) = struct.unpack_from("<I", data, pos)
        fields[f"{key}.type"], pos = (pos, 4), pos + 4
        if vtype == 8:
            _, pos = string(key)
        elif vtype == 9:
            etype, count = struct.unpack_from("<IQ", data, pos)
            fields[f"{key}.count"], pos = (pos + 4, 8), pos + 12
            for i in range(count):
                _, pos = string(f"{key}[{i}]") if etype == 8 else (None, pos + _SCALAR_SIZES[etype])
        else:
            fields[f"{key}.value"], pos = (pos, _SCALAR_SIZES[vtype]), pos + _SCALAR_SIZES[vtype]
    for _ in range(n_tensors):
        name, pos = string("tensor")
        fields[f"{name}.name.len"] = fields.pop("tensor.len")
        (n_dims,) = struct.unpack_from("<I", data, pos)
        fields[f"{name}.n_dims"] = (pos, 4)
        for d in range(n_dims):
            fields[f"{name}.dim{d}"] = (pos + 4 + 8 * d, 8)
        pos += 4 + 8 * n_dims
        fields[f"{name}.type"], fields[f"{name}.offset"], pos = (pos, 4), (pos + 4, 8), pos + 12
    fields["header_end"] = (pos, 0)
    return fields


def load_all(path: Path) -> int:
    """Everything the engine reads from a GGUF before building a model: header, architecture and
    every tensor dequantized. Returns the number of elements loaded."""
    f = GGUFFile(path)
    try:
        config = arch_config_from_gguf(f)
        return sum(t.numel() for _, t in gguf_weights(f, config))
    finally:
        f.close()


def patched(data: bytes, field: tuple[int, int], value: int) -> bytes:
    offset, size = field
    return data[:offset] + (value % (1 << (8 * size))).to_bytes(size, "little") + data[offset + size:]


def error_for(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFFormatError) as info:
        load_all(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: GGUF ")
    return message[len(f"{path}: GGUF "):]


def test_the_unmutated_file_loads(tiny, tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(tiny[0])
    assert load_all(path) == 2 * 96 * 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128 + 2 * 64) + 64


def test_each_corruption_names_its_field(tiny, tmp_path):
    data, fields = tiny
    q = "blk.0.attn_q.weight"
    assert error_for(tmp_path, b"GGML" + data[4:]) == "magic: expected b'GGUF', got b'GGML' (not a GGUF file)"
    assert error_for(tmp_path, data[:10]) == "header: the file has 10 bytes, fewer than a GGUF header's 24"
    assert error_for(tmp_path, patched(data, fields["version"], 1)) == "version: 1 is not supported (2 and 3 are)"
    assert error_for(tmp_path, patched(data, fields["n_kv"], 2**62)).startswith(
        f"metadata count: {2**62} entries cannot fit in the {len(data) - 24} bytes left")
    assert error_for(tmp_path, patched(data, fields["n_tensors"], 2**64 - 1)).startswith("tensor count: ")
    key_len = fields["general.architecture.key.len"]
    assert error_for(tmp_path, patched(data, key_len, 2**64 - 1)) == (
        f"metadata key #0 (a string of {2**64 - 1} bytes): needs {2**64 - 1} bytes at offset {key_len[0] + 8}, past the "
        f"end of the file ({len(data)} bytes): truncated or corrupt")
    assert error_for(tmp_path, patched(data, fields["tokenizer.ggml.tokens.count"], 2**61)).startswith(
        f"metadata 'tokenizer.ggml.tokens' (an array of {2**61} strings): needs ")
    assert error_for(tmp_path, patched(data, fields["llama.block_count.type"], 77)) == (
        "metadata 'llama.block_count': unknown value type 77")
    assert error_for(tmp_path, patched(data, fields[f"{q}.n_dims"], 9)) == (
        f"tensor '{q}' dimension count: 9 is outside 1..4")
    assert error_for(tmp_path, patched(data, fields[f"{q}.dim1"], 2**63)) == (
        f"tensor '{q}' shape: [{2**63}, 64] overflows the element count")
    assert error_for(tmp_path, patched(data, fields[f"{q}.dim0"], 48)) == (
        f"tensor '{q}' shape: rows of 48 do not split into Q8_0 blocks of 32")
    assert error_for(tmp_path, patched(data, fields[f"{q}.dim1"], 1 << 20)).startswith(
        f"tensor '{q}' offset: its {(1 << 20) * 68} bytes at ")
    assert error_for(tmp_path, patched(data, fields[f"{q}.offset"], 2**40)).startswith(
        f"tensor '{q}' offset: its 4352 bytes at {2**40 + fields['header_end'][0] + 32 - fields['header_end'][0] % 32}")
    assert error_for(tmp_path, patched(data, fields[f"{q}.offset"], 3)) == (
        f"tensor '{q}' offset: 3 is not a multiple of the alignment 32")
    assert error_for(tmp_path, patched(data, fields["llama.block_count.value"], 2**31)) == (
        f"metadata 'llama.block_count': expected a positive integer up to 2, got {2**31}")   # 21 tensors: 2 layers
    last = list(fields)[-2].rpartition(".weight.")[0] + ".weight"        # the table's last tensor
    assert error_for(tmp_path, patched(data, fields["n_tensors"], 20)) == f"tensor '{last}': is missing"
    assert error_for(tmp_path, data.replace(b"blk.1.ffn_up.weight", b"blk.9.ffn_up.weight")) == (
        "tensor 'blk.9.ffn_up.weight': has no counterpart in a 2-layer LlamaForCausalLM model")
    assert error_for(tmp_path, patched(data, fields["llama.embedding_length.value"], 2**31)) == (
        f"tensor 'output_norm.weight' shape: [64] disagrees with the metadata's architecture (expected [{2**31}])")
    assert error_for(tmp_path, patched(data, fields["llama.context_length.value"], 2**30)) == (
        f"metadata 'llama.context_length': expected a positive integer up to {1 << 24}, got {2**30}")
    assert error_for(tmp_path, data[:fields["header_end"][0] + 100]).endswith(
        f"end past the end of the file ({fields['header_end'][0] + 100} bytes)")


def test_unsupported_quantization_types_are_named(tiny, tmp_path):
    data, fields = tiny
    q = "blk.0.attn_q.weight"
    unsupported = error_for(tmp_path, patched(data, fields[f"{q}.type"], 15))       # Q8_K: a compute-only type
    assert unsupported.startswith(f"tensor '{q}' type: ggml Q8_K is not supported (supported: F32, F16, Q4_0, ")
    assert "Q4_K, Q5_K, Q6_K" in unsupported and unsupported.endswith(")")
    assert error_for(tmp_path, patched(data, fields[f"{q}.type"], 999)).startswith(
        f"tensor '{q}' type: unknown ggml type 999 is not supported (supported: F32, ")


def _mutations(data: bytes, fields: dict[str, tuple[int, int]], count: int, seed: int):
    rng = random.Random(seed)
    header_end = fields["header_end"][0]
    int_fields = [(name, f) for name, f in fields.items() if f[1]]
    for case in range(count):
        kind = case % 4
        if kind == 0:
            cut = rng.randrange(header_end + 64) if rng.random() < 0.7 else rng.randrange(len(data))
            yield f"truncated to {cut}", data[:cut]
        elif kind == 1:
            mutated = bytearray(data)
            spots = [rng.randrange(header_end) for _ in range(rng.randint(1, 4))]
            for spot in spots:
                mutated[spot] = rng.randrange(256)
            yield f"bytes {spots} replaced", bytes(mutated)
        else:
            name, field = rng.choice(int_fields)
            old = int.from_bytes(data[field[0]: field[0] + field[1]], "little")
            value = rng.choice(_OVERFLOWS + (old + 1, old - 1, old * 2, old << 17, rng.getrandbits(64)))
            yield f"{name} = {value}", patched(data, field, value)


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # numpy on corrupt scales (inf, nan): not errors
def test_seeded_mutations_fail_cleanly(tiny, tmp_path):
    data, fields = tiny
    path = tmp_path / "mutated.gguf"
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss      # KiB on Linux
    outcomes, failures, slowest = {"error": 0, "loaded": 0}, [], 0.0
    for what, mutated in _mutations(data, fields, 400, seed=23):
        path.write_bytes(mutated)
        start = time.perf_counter()
        try:
            load_all(path)
            outcomes["loaded"] += 1
        except GGUFFormatError as exc:
            outcomes["error"] += 1
            if "\n" in str(exc) or not str(exc).startswith(f"{path}: GGUF "):
                failures.append(f"{what}: badly formed message {str(exc)!r}")
        except Exception as exc:  # noqa: BLE001 - the point of the test
            failures.append(f"{what}: {type(exc).__name__}: {exc}")
        slowest = max(slowest, time.perf_counter() - start)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    print(f"\n[tokenforge] GGUF fuzz: {outcomes}, slowest case {slowest * 1000:.0f} ms, peak RSS +{grown_mib:.0f} MiB")
    assert not failures, "\n".join(failures[:20])
    assert outcomes["error"] >= 200 and outcomes["loaded"] >= 10      # both paths exercised
    assert slowest < 20.0, f"a case took {slowest:.1f} s"               # generous: a hang, not load, fails this
    assert grown_mib < 512, f"peak RSS grew by {grown_mib:.0f} MiB"


def test_a_token_that_is_not_utf8_is_one_line_naming_the_file(tiny, tmp_path):
    """The GGUF reader keeps strings it cannot decode (replacement characters); the tokenizer's
    conversion through transformers does not: its UnicodeDecodeError becomes a ValueError that
    names the file (the CLI prints it as one line)."""
    from tokenforge.engine.tokenization import load_tokenizer

    data = tiny[0]
    at = data.index(b"t17")                            # a token string's bytes: "t17" -> b"\xbe17"
    path = tmp_path / "bad-token.gguf"
    path.write_bytes(data[:at] + b"\xbe" + data[at + 1:])
    with pytest.raises(ValueError, match=f"^{path}: its tokenizer could not be read from the GGUF metadata "
                                         r"\(UnicodeDecodeError: "):
        load_tokenizer(path, cache_dir=tmp_path / "cache")
