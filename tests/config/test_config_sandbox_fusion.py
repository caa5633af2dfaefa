"""reward.sandbox_fusion.* (verl's keys): a server's /run_code URL and a reward call long enough for its test
cases, and verl's older places of the keys refused with the new one."""

import pytest

from tests.conftest import stub_file_overrides
from tests.helpers.config import problems

URL = "reward.sandbox_fusion.url=http://localhost:8080/run_code"


@pytest.fixture
def files(tmp_path):
    return stub_file_overrides(tmp_path)


def test_a_server_loads_with_a_reward_call_long_enough(files):
    assert problems(files + [URL, "reward.timeout_s=30"]) == []
    more = ["reward.sandbox_fusion.max_concurrent=8", "reward.sandbox_fusion.memory_limit_mb=2048"]
    assert problems(files + [URL.replace("http:", "https:"), "reward.timeout_s=11", *more]) == []
    assert problems(files + ["reward.sandbox_fusion.max_concurrent=8"]) == []  # read only with a url, but valid


def test_the_reward_call_must_outlast_a_case(files):
    [v] = problems(files + [URL])
    assert v.startswith(
        "reward.timeout_s=10.0: with reward.sandbox_fusion.url set, a code row runs its test cases on the server, "
        "each for up to 10 s (verl's limit)"
    )
    assert v.endswith("; fix: set reward.timeout_s=30")


@pytest.mark.parametrize(
    "setting, rule",
    [
        ("url=localhost:8080/run_code", "must be an http:// or https:// URL with a host"),
        ("url=http://host:port/run_code", "has a bad port"),
        ("max_concurrent=0", "must be >= 1 request; fix: set it to 64"),
        ("memory_limit_mb=0", "must be >= 1 MB; fix: set it to 1024"),
    ],
)
def test_bad_values(files, setting, rule):
    [v] = problems(files + [URL, "reward.timeout_s=30", f"reward.sandbox_fusion.{setting}"])
    assert v.startswith(f"reward.sandbox_fusion.{setting}: {rule}"), v


@pytest.mark.parametrize(
    "setting, rule",
    [
        (
            "sandbox_fusion.url=http://localhost:8080/run_code",
            "verl 0.9.1's legacy place of reward.sandbox_fusion.*, which verl moves there at start-up",
        ),
        ("reward_model.sandbox_fusion.max_concurrent=8", "verl 0.4-0.6's place of reward.sandbox_fusion.*"),
    ],
)
def test_verls_older_places_name_the_new_one(files, setting, rule):
    [v] = problems(files + [setting])
    name = setting.partition("=")[0].rpartition(".")[2]
    assert v.startswith(f"{setting}: {rule}") and v.endswith(f"; fix: set reward.sandbox_fusion.{name}"), v
