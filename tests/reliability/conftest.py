"""Reliability suite: servers shared by its modules, and what they measure with.

`fuzz_server` serves the schema fuzzer and the soak: a small context (every generation is short)
and a small KV pool (preemption and prefix-cache eviction happen under load).
"""
from __future__ import annotations

import pytest

from tests.reliability.harness import FUZZ_NAME
from tests.test_server import model_copy, start_server

FUZZ_ARGS = ["--served-model-name", FUZZ_NAME, "--max-seq-len-override", "256", "--num-tokens", "320",
             "--max-running-requests", "4", "--max-extend-tokens", "64", "--max-output-tokens", "8",
             "--sampling-defaults", "openai"]


@pytest.fixture(scope="session")
def fuzz_server(checkpoint, tmp_path_factory):
    model_dir = model_copy(checkpoint, tmp_path_factory.mktemp("served") / "tiny")
    s = start_server(model_dir, FUZZ_ARGS, tmp_path_factory.mktemp("logs") / "fuzz-server.log")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def soak(request) -> bool:
    return request.config.getoption("--soak")
