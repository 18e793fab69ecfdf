"""Shared pytest setup: the repository root on ``sys.path``, the ``slow`` marker, and a ``tokenizer`` fixture."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than ~10 s; still run by CI")


@pytest.fixture(scope="session")
def tokenizer():
    """The project tokenizer from ``data/tokenizer`` (built with ``data/prepare.py --tokenizer-only`` if missing)."""
    import chinese_tokenizer

    tok_dir = REPO_ROOT / "data" / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        subprocess.run([sys.executable, str(REPO_ROOT / "data" / "prepare.py"), "--tokenizer-only", "--quiet"],
                       cwd=REPO_ROOT, check=True)
    return chinese_tokenizer.load_tokenizer(str(tok_dir))
