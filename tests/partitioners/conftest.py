"""Shared set-up for the replay partitioner tests.

pyspark.rdd.portable_hash (and so spark_key_hash) refuses to hash without
PYTHONHASHSEED in the environment. Setting it here does not change this interpreter's
own hash seed: the tests compare our hash with portable_hash inside one process, where
both call the same `hash()`, which is exactly the agreement that matters.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTHONHASHSEED", "0")
