"""``dsrl.runtime.redaction``: secrets recognised by their environment variable's name (``*_KEY``, ``*_PAT``,
``*TOKEN*``, ...) and by their shape (``ghp_``, ``hf_``, ``sk-``, ...) wherever dsrl shows a value, and nothing
else masked: no config key of the schema, no ordinary text. security_3 G1 (``OPENAI_KEY`` interpolated into the
experiment name reached the console and MLflow in clear) and G2 (``PRIVATE_KEY`` into the project name)."""

from __future__ import annotations

import pytest

from dsrl.config import load_and_validate, to_yaml
from dsrl.config.keys import LEAF_KEYS
from dsrl.runtime.redaction import MASK, is_secret_name, redact, redact_text
from tests.conftest import recipe, stub_file_overrides

# Fake credentials of each shape (none is real)
SHAPED = {
    "github classic": "ghp_" + "Ab3" * 12,
    "github oauth": "gho_" + "Zz9" * 12,
    "github fine-grained": "github_pat_11ABCDEFG0" + "x_Y1" * 10,
    "gitlab": "glpat-AbCdEf0123456789-_xy",
    "hugging face": "hf_FAKEsecretTOKEN1234567890",
    "openai": "sk-FAKEopenaiKEY0123456789",
    "openai project": "sk-proj-" + "aB3_" * 12,
    "anthropic": "sk-ant-api03-" + "Xy7-" * 10,
    "slack": "xoxb-1234567890-abcdefghij",
    "aws access key id": "AKIAIOSFODNN7EXAMPLE",
    "google api key": "AIza" + "Sy0_-" * 7,
}
# Text that looks a little like them and must stay
PLAIN = [
    "task-specific-fine-tuning-run-number-7",  # sk- inside a word
    "sk-learn-compatible-pipeline-without-digits",
    "hf_transformers_cache_dir",  # underscores: not a token's alphabet
    "hf_short1",
    "ghp_short",
    "the rollout used hf (transformers) and vllm",
    "AKIA-not-an-id",
    "data.prompt_key=prompt",
    "max_num_batched_tokens=8192",
    "TOKENIZERS_PARALLELISM=false",
]


@pytest.mark.parametrize("name", sorted(SHAPED))
def test_a_credential_is_masked_by_its_shape_in_text_values_keys_and_tables(name):
    secret = SHAPED[name]
    assert redact_text(f"model said: {secret}.") == f"model said: {MASK}."
    row = {"prompt": "p", "response": f"<tool_response>\n{secret}\n</tool_response> so", "score": 1.0}
    # a generation table's row: the credential masked, the rest of the response kept (not the whole value)
    assert redact(row) == {**row, "response": f"<tool_response>\n{MASK}\n</tool_response> so"}
    assert redact({f"header {secret}": 1}) == {f"header {MASK}": 1}


@pytest.mark.parametrize("text", PLAIN)
def test_text_that_only_resembles_a_credential_is_kept(text):
    assert redact_text(text) == text
    assert redact({"response": text}) == {"response": text}


@pytest.mark.parametrize(
    "name, secret",
    [
        ("OPENAI_KEY", True),  # G1
        ("PRIVATE_KEY", True),  # G2
        ("GITHUB_PAT", True),
        ("GH_PAT", True),
        ("TOKEN_GITHUB", True),
        ("HF_TOKEN_PATH", True),
        ("WANDB_API_KEY", True),
        ("STRIPE_KEYS", True),
        ("TOKENIZERS_PARALLELISM", False),
        ("AWS_ACCESS_KEY_ID", False),  # an id, not the secret (AWS_SECRET_ACCESS_KEY is)
        ("KEYBOARD", False),
        ("MONKEY", False),
        ("PWD", False),
        ("OLDPWD", False),
        ("PYTHONHASHSEED", False),
        ("PATH", False),
        ("SSH_AUTH_SOCK", False),
        ("data.prompt_key", False),  # config keys are lower case: the environment's rule is not theirs
        ("data.reward_fn_key", False),
        ("actor.ppo_max_token_len_per_gpu", False),
        ("trainer.private_key", False),
        ("trainer.api_key", True),
    ],
)
def test_secret_names_of_the_environment_and_of_config_keys(name, secret):
    assert is_secret_name(name) is secret


def test_no_key_of_the_schema_looks_like_a_secret():
    assert [key for key in LEAF_KEYS if is_secret_name(key)] == []


def test_a_secret_interpolated_from_the_environment_is_masked_and_noted(tmp_path, monkeypatch):
    """security_3 G1/G2: ${oc.env:OPENAI_KEY} in the experiment name and ${oc.env:PRIVATE_KEY} in the project
    name were printed (and sent to MLflow, which takes what redact_text gives it) in clear."""
    monkeypatch.setenv("OPENAI_KEY", "sk-FAKEopenaiKEY0123456789")
    monkeypatch.setenv("PRIVATE_KEY", "FAKEprivatekeymaterial123")
    overrides = [
        *stub_file_overrides(tmp_path),
        "trainer.experiment_name=exp-${oc.env:OPENAI_KEY}",
        "trainer.project_name=${oc.env:PRIVATE_KEY}",
    ]
    cfg, notes = load_and_validate(recipe("grpo"), overrides, 1)
    shown = redact_text(to_yaml(cfg) + "\n".join(notes))
    assert "FAKEopenaiKEY" not in shown and "FAKEprivatekeymaterial" not in shown
    assert f"experiment_name: exp-{MASK}" in shown and f"project_name: '{MASK}'" in shown
    assert any(note.startswith("trainer.experiment_name holds the value of the secret environment variable OPENAI_KEY")
               for note in notes)  # fmt: skip
    assert any("secret environment variable PRIVATE_KEY" in note for note in notes)
    assert redact_text(f"run {cfg.trainer.project_name}/{cfg.trainer.experiment_name}") == f"run {MASK}/exp-{MASK}"
