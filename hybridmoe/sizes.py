"""Sizes as people write them ("6GB", "512MiB", "1.5 TB") and the bytes they mean. No torch."""

from __future__ import annotations

import re

from hybridmoe.errors import UserError

UNITS = {
    "": 1,
    "B": 1,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}

SIZE = re.compile(r"([0-9]*\.?[0-9]+)\s*([KMGT]I?B|B)?")


def parse_size(text: str, flag: str) -> int:
    """Bytes of a size with a unit ("4GB"); a UserError naming `flag` for anything else."""
    m = SIZE.fullmatch(str(text).strip().upper())
    if not m or not m.group(2):
        raise UserError(f"{flag} {text!r}: give a size with a unit, like 4GB or 512MiB")
    return int(float(m.group(1)) * UNITS[m.group(2)])
