import pytest


@pytest.fixture(scope="session")
def train_cache(tmp_path_factory):
    """One tokenizer/token cache for the session (a 1 MiB stdlib corpus trains its tokenizer in ~1 s)."""
    return tmp_path_factory.mktemp("k3-train-cache")
