import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module: tiny models and 135M decoding at small batches gain
    little from a second thread, while OpenMP threads spin-wait badly when other jobs share the
    cores (4-10x slower, measured on a busy 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer():
    """The real SmolLM2 tokenizer (converted once from the bundled GGUF, then cached)."""
    from envace.backends.models import load_tokenizer

    return load_tokenizer("default")
