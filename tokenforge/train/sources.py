"""Input records for `tokenforge preprocess`: text files, JSONL, parquet, chat JSONL.

In: input paths and the format (auto: by extension, and chat when records carry `messages`).
Out: units of work, `(unit_id, records)`, in a fixed order, so a resumed run numbers them alike.
A record is a text string or (chat) a list of {role, content} messages.

JSONL and parquet are read through pyarrow (columnar, in batches); text files are split at blank
lines into ~64 KiB chunks of one document (the EOS goes after the file's last chunk).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = ("auto", "text", "jsonl", "parquet", "chat")
_TEXT_SUFFIXES = (".txt", ".md", ".text")
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_CHUNK_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class Unit:
    unit_id: str                 # "<file index>-<batch index>", stable across runs
    kind: str                    # text | chat
    records: list[Any]           # texts, or message lists
    ends_document: list[bool]    # per record: append EOS after it (False inside a text file)
    continues_document: bool = False    # a later chunk of a text file (no BOS)


def detect_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    if suffix in _TEXT_SUFFIXES:
        return "text"
    if suffix in _JSONL_SUFFIXES:
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    raise ValueError(f"cannot tell the format of {path} from its extension; pass --format text|jsonl|parquet|chat")


def check_inputs(paths: list[Path], fmt: str = "auto", text_field: str = "text",
                 messages_field: str = "messages") -> None:
    """Every input exists and (JSONL, parquet) has the field to read: one error naming the file."""
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"input file(s) not found: {', '.join(missing)}")
    for path in paths:
        kind = detect_format(path, fmt)
        if kind == "text":
            continue
        columns = _columns(path, kind)
        if columns is not None and text_field not in columns and messages_field not in columns:
            field = messages_field if kind == "chat" else text_field
            raise ValueError(f"{path}: no {field!r} field (fields: {', '.join(columns)}); "
                             f"name the text field with --text-field")


def _columns(path: Path, kind: str) -> list[str] | None:
    """The field names of a table input (the first block of a JSONL file); None when empty."""
    import pyarrow as pa  # noqa: PLC0415

    if kind == "parquet":
        import pyarrow.parquet as pq  # noqa: PLC0415

        try:
            return pq.ParquetFile(path).schema_arrow.names
        except pa.ArrowException as e:
            raise ValueError(f"{path}: not a readable parquet file ({e})") from e
    with open(path, "rb") as f:            # the first record's keys (reading the file is for later)
        line = next((raw for raw in f if raw.strip()), None)
    if line is None:
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON Lines ({e})") from e
    if not isinstance(record, dict):
        raise ValueError(f"{path}: not JSON Lines of objects (the first line is a {type(record).__name__})")
    return list(record)


def iter_units(paths: list[Path], fmt: str, text_field: str, messages_field: str,
               records_per_unit: int) -> Iterator[Unit]:
    for file_index, path in enumerate(paths):
        kind = detect_format(path, fmt)
        if kind == "text":
            yield from _text_units(file_index, path)
        else:
            yield from _table_units(file_index, path, kind, text_field, messages_field, records_per_unit)


def _text_units(file_index: int, path: Path) -> Iterator[Unit]:
    chunks = _text_chunks(path)
    chunk = next(chunks, None)
    i = 0
    while chunk is not None:
        following = next(chunks, None)          # one chunk of lookahead: is this the last?
        yield Unit(f"{file_index:05d}-{i:07d}", "text", [chunk], [following is None], i > 0)
        chunk, i = following, i + 1


def _text_chunks(path: Path, read_chars: int = 1 << 20) -> Iterator[str]:
    """The file's text cut at the first blank line after every TEXT_CHUNK_BYTES characters, read
    a piece at a time. The cuts are those of the whole text: the first match in a buffer that
    holds it whole is the first in the file, and a buffer without one grows."""
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = "", 0, False
        while True:
            cut = buf.find("\n\n", pos + TEXT_CHUNK_BYTES)
            if cut >= 0:
                yield buf[pos:cut + 2]
                pos = cut + 2
                continue
            if eof:
                break
            more = f.read(read_chars)
            eof = not more
            buf, pos = buf[pos:] + more, 0
        if pos < len(buf):
            yield buf[pos:]


def _table_units(file_index: int, path: Path, kind: str, text_field: str, messages_field: str,
                 records_per_unit: int) -> Iterator[Unit]:
    for batch_index, table in enumerate(_read_batches(path, kind, records_per_unit)):
        columns = table.column_names
        chat = kind == "chat" or (messages_field in columns and text_field not in columns)
        field = messages_field if chat else text_field
        if field not in columns:
            raise ValueError(f"{path}: no {field!r} field (fields: {', '.join(columns)}); "
                             f"name the text field with --text-field")
        values = table.column(field).to_pylist()
        if chat:
            values = [json.loads(v) if isinstance(v, str) else v for v in values]
        values = [v for v in values if v]
        yield Unit(f"{file_index:05d}-{batch_index:07d}", "chat" if chat else "text", values, [True] * len(values))


def _read_batches(path: Path, kind: str, rows: int):
    import pyarrow as pa  # noqa: PLC0415 - only preprocessing needs it

    if kind == "parquet":
        import pyarrow.parquet as pq  # noqa: PLC0415

        for batch in pq.ParquetFile(path).iter_batches(batch_size=rows):
            yield pa.Table.from_batches([batch])
        return
    import pyarrow.json as pj  # noqa: PLC0415

    # Streamed block by block (16 MiB), so memory stays bounded whatever the file's size.
    try:
        reader = pj.open_json(path, read_options=pj.ReadOptions(block_size=16 << 20, use_threads=False))
        pending: list = []
        count = 0
        for batch in reader:
            pending.append(batch)
            count += batch.num_rows
            while count >= rows:
                table = pa.Table.from_batches(pending)
                yield table.slice(0, rows)
                rest = table.slice(rows)
                pending, count = rest.to_batches(), rest.num_rows
        if count:
            yield pa.Table.from_batches(pending)
    except pa.ArrowInvalid as e:
        raise ValueError(f"{path}: not valid JSON Lines ({e})") from e
