import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tokenizer():
    """The real SmolLM2 tokenizer (converted once from the bundled GGUF, then cached)."""
    from envace.backends.models import load_tokenizer

    return load_tokenizer("default")
