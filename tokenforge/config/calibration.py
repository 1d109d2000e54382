"""The int4 calibration text (`--quantization-calibration FILE|builtin`): where it comes from.

`builtin` is calibration_text.txt beside this file: about 5,000 tokens of varied English prose
(narrative, instructions, explanation, dialogue, correspondence) and code (Python, JavaScript,
SQL, shell, C, JSON), written for tokenforge and in none of the texts the quality tables measure.
A FILE is any UTF-8 text; it must hold at least one window (CALIBRATION_WINDOW tokens once the
model's tokenizer has encoded it), and at most MAX_WINDOWS windows of it are used.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN = "builtin"
BUILTIN_PATH = Path(__file__).with_name("calibration_text.txt")
CALIBRATION_WINDOW = 512           # tokens per calibration sequence
MAX_WINDOWS = 32


def calibration_text(spec: str) -> str:
    """The text `--quantization-calibration` names (a file, or the built-in corpus)."""
    path = BUILTIN_PATH if spec == BUILTIN else Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"--quantization-calibration {spec!r}: no such file (give a UTF-8 text file, or 'builtin')")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--quantization-calibration {spec!r} is not UTF-8 text ({exc.reason} at byte "
                         f"{exc.start})") from None


def check_calibration_tokens(spec: str, num_tokens: int, window: int = CALIBRATION_WINDOW) -> None:
    if num_tokens < window:
        raise ValueError(f"--quantization-calibration {spec!r} is {num_tokens} tokens long: int4 calibration needs "
                         f"at least one window of {window} tokens (use a longer text, or 'builtin')")


__all__ = ["BUILTIN", "CALIBRATION_WINDOW", "MAX_WINDOWS", "calibration_text", "check_calibration_tokens"]
