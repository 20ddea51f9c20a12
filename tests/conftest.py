import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    from tests.tiny_models import build_pair

    return build_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_target(tiny_pair):
    from specdec.models import load_model

    return load_model(str(tiny_pair[1]), device="cpu")


@pytest.fixture(scope="session")
def tiny_draft(tiny_pair):
    from specdec.models import load_model

    return load_model(str(tiny_pair[2]), device="cpu")


@pytest.fixture(scope="session")
def embedded_target():
    from specdec.models import load_model

    return load_model("embedded", device="cpu")
