import os

import pytest
import torch

from tests.tiny_models import TEST_DEVICE

torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "2")))
# The suite's models run on the torch runtimes (lean where it runs them, else hf; `make test` reruns
# the exactness tests on hf), which `auto` would swap for the gguf runtime on the embedded default;
# the gguf runtime's own tests (tests/test_gguf_*.py) name it. Services the tests start inherit this.
os.environ.setdefault("SPECDEC_RUNTIME", "torch")

# The unit tier (`make test-fast`, about a minute on 2 cores): modules whose tests run the core in this
# process (acceptance math, sampling, policies, the runtimes' passes, stopping, the simulator) and
# start no service, server or subprocess. Every other module's tests are marked ``services``; a new
# module lands there until it is listed here.
UNIT_MODULES = frozenset({
    "test_acceptance", "test_bench_prompts", "test_device_decisions", "test_distill", "test_distribution", "test_eagle",
    "test_gguf_runtime", "test_layer_parity", "test_layout", "test_lean_runtime", "test_policy", "test_protos",
    "test_sampling_keys", "test_service_config", "test_serving_tokenizer", "test_sim", "test_split",
    "test_static_kv", "test_stopping", "test_suffix",
})


# The GPU tier (``-m gpu``; scripts/gpu_sweep.sh runs it with SPECDEC_TEST_DEVICE=cuda): the exactness
# tests whose models run on TEST_DEVICE, so that on a GPU they check the CUDA passes (static KV, graphs).
GPU_MODULES = frozenset({
    "test_greedy_equality", "test_batching", "test_distribution", "test_static_kv", "test_device_decisions",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        item.add_marker(pytest.mark.unit if module in UNIT_MODULES else pytest.mark.services)
        if module in GPU_MODULES:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    from tests.tiny_models import build_pair

    return build_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_target(tiny_pair):
    from specdec.models import load_model

    return load_model(str(tiny_pair[1]), device=TEST_DEVICE)


@pytest.fixture(scope="session")
def tiny_draft(tiny_pair):
    from specdec.models import load_model

    return load_model(str(tiny_pair[2]), device=TEST_DEVICE)


@pytest.fixture(scope="session")
def embedded_target():
    from specdec.models import load_model

    return load_model("embedded", device=TEST_DEVICE)


@pytest.fixture(scope="session")
def tiny_noisy_draft(tiny_pair):
    """The tiny target plus small gaussian noise: greedy drafts agree ~70% of the time."""
    from specdec.models import load_model
    from tests.tiny_models import build_noisy_copy

    target_dir = tiny_pair[1]
    path = build_noisy_copy(target_dir.parent / "noisy", target_dir, noise_std=0.01)
    return load_model(str(path), device=TEST_DEVICE)


@pytest.fixture
def one_thread():
    """Run a test on one intra-op thread: the tiny models are dominated by per-op overhead, and
    two OpenMP threads on a busy 2-core machine spin-wait (runs 5x slower or worse)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
