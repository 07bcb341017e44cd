import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(int(os.environ.get("KESTREL_TEST_THREADS", "2")))


def pytest_configure(config) -> None:
    """Build (or load) Kestrel's compiled CPU kernels once, before any test or server subprocess needs them: a first
    build on a fresh machine takes ~25 s, longer than a server test waits for its worker to come up."""
    from kestrel.models.layers import cpu_kernels

    cpu_kernels.module()


@pytest.fixture(scope="session")
def hf_kimi_linear(tmp_path_factory):
    from hf_fixtures import save_hf_model

    path = tmp_path_factory.mktemp("hf_kimi_linear")
    return save_hf_model("kimi_linear", path, seed=1), path


@pytest.fixture(scope="session")
def hf_deepseek_v32(tmp_path_factory):
    from hf_fixtures import save_hf_model

    path = tmp_path_factory.mktemp("hf_deepseek_v32")
    return save_hf_model("deepseek_v32", path, seed=2), path


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Kestrel-written tiny checkpoints of all three families."""
    from kestrel.models.checkpoint import make_model

    root = tmp_path_factory.mktemp("tiny")
    return {fam: make_model(fam, "tiny", root / fam, seed=3) for fam in ("kimi_linear", "deepseek_v32", "kimi_k3")}


@pytest.fixture(scope="session")
def hf_deepseek_v3(tmp_path_factory):
    from hf_fixtures import save_hf_model

    path = tmp_path_factory.mktemp("hf_deepseek_v3")
    return save_hf_model("deepseek_v3", path, seed=4), path


@pytest.fixture(scope="session")
def hf_deepseek_v3_no_q_lora(tmp_path_factory):
    from hf_fixtures import save_hf_model

    path = tmp_path_factory.mktemp("hf_deepseek_v3_no_q_lora")
    return save_hf_model("deepseek_v3_no_q_lora", path, seed=5), path


@pytest.fixture(scope="session")
def hf_kimi_k2(tmp_path_factory):
    from hf_fixtures import save_hf_model

    path = tmp_path_factory.mktemp("hf_kimi_k2")
    return save_hf_model("kimi_k2", path, seed=6), path
