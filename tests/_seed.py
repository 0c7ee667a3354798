"""The test run's seeds. conftest.py decides the run's base seed once (0 unless asked for a
fresh one) and publishes it as $LONGMOE_TEST_SEED, so that test modules and the processes they
start derive theirs from it: a failure reruns with the printed value."""

from __future__ import annotations

import os
import zlib

ENV = "LONGMOE_TEST_SEED"


def base_seed() -> int:
    return int(os.environ.get(ENV, "0"))


def seed_for(name: str) -> int:
    """A seed for `name` (a test id, a command), fixed for a given base seed."""
    return (base_seed() + zlib.crc32(name.encode())) % 2**31
