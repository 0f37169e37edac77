"""Message sizes for ``mq bench``: parsing ``1.25KB``-style sizes and printing them back."""

from __future__ import annotations

import re
from typing import Iterable

from mq.errors import ConfigError

KB, MB, GB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = (1280, 20 * KB, 1280 * KB, 10 * MB, 40 * MB, 640 * MB, 1280 * MB)  # 1.25 KB .. 1.25 GB
MAX_SIZE = 2560 * MB  # 2.5 GB
_UNITS = {"": 1, "b": 1, "k": KB, "kb": KB, "kib": KB, "m": MB, "mb": MB, "mib": MB,
          "g": GB, "gb": GB, "gib": GB}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """``"1.25KB"`` -> 1280. Units are binary (KB = 1024 bytes, as in the design's table);
    KiB/MiB/GiB and bare byte counts are accepted too. At most 2.5 GB.

    Raises:
        ConfigError: not a size, zero, or larger than 2.5 GB.
    """
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(f"{text!r} is not a size: use a number with B, KB, MB or GB, e.g. 1.25KB")
    value = round(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ConfigError(f"size {text!r} is less than one byte")
    if value > MAX_SIZE:
        raise ConfigError(f"size {text!r} is larger than the 2.5GB the benchmark allows")
    return value


def parse_sizes(text: str | Iterable[str]) -> list[int]:
    """``"1.25KB,20KB"`` -> ``[1280, 20480]`` (order kept, duplicates dropped)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    items = [i for i in (s.strip() for s in items) if i]
    if not items:
        raise ConfigError("no sizes given: e.g. --sizes 1.25KB,20KB")
    return list(dict.fromkeys(parse_size(i) for i in items))


def format_size(n: int) -> str:
    """1280 -> ``"1.25 KB"``, 671088640 -> ``"640 MB"``."""
    for unit, mult in (("GB", GB), ("MB", MB), ("KB", KB)):
        if n >= mult:
            return f"{n / mult:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n} B"
