import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
from hypothesis import HealthCheck, Phase, settings

# Property tests run a fixed set of examples (derandomize: seeded from each test's source), so a
# failure reproduces on every run and machine; print_blob prints the @reproduce_failure line.
# HYPOTHESIS_PROFILE=explore draws fresh random examples (and keeps a local example database).
settings.register_profile("odb", derandomize=True, print_blob=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", print_blob=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
# `make mutation`: the same examples, stopping at the first failure without shrinking it.
settings.register_profile("mutation", settings.get_profile("odb"), print_blob=False,
                          report_multiple_bugs=False,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "odb"))


def pytest_collection_modifyitems(config, items):
    """`make mutation`: a mutant's tests run fastest first (by the durations mutmut measured on
    the unmutated code), so a killed mutant costs its cheapest failing test, not the suite."""
    stats = Path("mutmut-stats.json")  # mutmut runs the tests from its mutants/ directory
    if os.environ.get("HYPOTHESIS_PROFILE") != "mutation" or not stats.exists():
        return
    durations = json.loads(stats.read_text()).get("duration_by_test", {})
    items.sort(key=lambda item: durations.get(item.nodeid, float("inf")))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    """`make mutation`: the functions this test reached in its child processes count for it
    (tests/helpers/mutation_site/sitecustomize.py records them); tryfirst, so that they are in
    before mutmut files the test's hits."""
    hits = os.environ.get("ODB_MUTATION_HITS")
    if not hits or os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return
    from mutmut.state import state
    for path in Path(hits).glob("*.hits"):
        state()._stats.update(path.read_text().split())
        path.unlink()
    getattr(sys.modules.get("sitecustomize"), "forget_written", lambda: None)()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The embedded tiny Qwen3-VL (random weights, built offline)."""
    from odb_factory.demo.tiny_model import build_tiny_qwen3vl
    return build_tiny_qwen3vl(tmp_path_factory.mktemp("models") / "tiny_qwen3vl", seed=0)


@pytest.fixture(scope="session")
def text_model(tmp_path_factory):
    """The tiny text-only Qwen3 (random weights, built offline)."""
    from odb_factory.demo.tiny_qwen3 import build_tiny_qwen3
    return build_tiny_qwen3(tmp_path_factory.mktemp("models") / "tiny_qwen3", seed=0)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    """The generated mixed text/image demo set (heavy-tailed lengths)."""
    from odb_factory.demo.synthetic_data import write_demo_dataset
    out = tmp_path_factory.mktemp("data") / "odb_demo"
    write_demo_dataset(out, num_samples=96, seed=0)
    return out
