from __future__ import annotations

import pytest

from workloads.traces.text import TextSource
from workloads.traces.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="session")
def source(tokenizer):
    return TextSource(tokenizer)
