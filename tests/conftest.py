import json
import os
from pathlib import Path

import pytest


def _vectors_dir() -> Path:
    # CI clones the repo into a folder with shared/ beside it; KVBRIDGE_VECTORS overrides.
    env = os.environ.get("KVBRIDGE_VECTORS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "vectors"


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    path = _vectors_dir()
    if not path.is_dir():
        pytest.fail(f"compatibility vectors not found at {path} (set KVBRIDGE_VECTORS)")
    return path


@pytest.fixture(scope="session")
def load_vectors(vectors_dir):
    def load(name: str):
        return json.loads((vectors_dir / name).read_text())

    return load
