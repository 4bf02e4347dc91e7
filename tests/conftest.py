import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "sample_data")

# Progress bars off in tests; short collective timeout so a broken test fails instead of hanging.
os.environ.setdefault("VARLEN_NO_PROGRESS", "1")
os.environ.setdefault("VARLEN_TIMEOUT", "120")


@pytest.fixture
def sample_dir():
    return SAMPLE


def sample(name: str) -> str:
    return os.path.join(SAMPLE, name)
