"""Secret redaction for everything MLflow receives, every line of the ``dsrl`` logger (``dsrl.tracking.console``) and
what the CLI prints.

Three rules, the name rules case-insensitive and blind to ``_``/``-``:

* a key whose last dotted component looks like a secret (ends in token, secret, password, passwd,
  api key, credential(s) or auth, or contains secret, password, passwd, credential or api key)
  gets the value ``***`` — except tokenizer special tokens (``pad_token``, ``eos_token``, …). A name
  in upper case (``OPENAI_KEY``: an environment variable's) also counts with the word token anywhere
  (``*TOKEN*``) or ending in key or pat (``*_KEY``, ``*_PAT``); config keys are lower case, where
  ``prompt_key`` and ``max_num_batched_tokens`` are no secrets;
* any value equal to or containing the value of an environment variable whose *name* looks like a
  secret (same rule; values shorter than 8 characters are ignored) becomes ``***``;
* text shaped like a known kind of credential becomes ``***`` wherever it appears, whatever names it
  (``_SECRET_SHAPES``: GitHub ``ghp_``/``github_pat_``, Hugging Face ``hf_``, OpenAI and Anthropic
  ``sk-``, GitLab ``glpat-``, Slack ``xox?-``, AWS ``AKIA``, Google ``AIza``), in a generation table's
  response as in a config value.

Passwords in URLs (``https://user:pw@host``) are masked too.

What is shown is redacted, not what is on disk: a secret interpolated into a path (e.g.
``trainer.default_local_dir=/runs/${oc.env:MY_API_TOKEN}``) names a real folder that holds the value itself
(``dsrl.config.loading.secret_notes`` says so when the config is loaded).
"""

from __future__ import annotations

import os
import re
from typing import Any

MASK = "***"
MIN_SECRET_LENGTH = 8  # shorter environment values ("1", "true") are too common to redact
_ENDINGS = ("token", "secret", "secrets", "password", "passwd", "apikey", "credential", "credentials", "auth")
_ANYWHERE = ("secret", "password", "passwd", "credential", "apikey")
_SPECIAL_TOKENS = {
    "pad",
    "eos",
    "bos",
    "unk",
    "sep",
    "cls",
    "mask",
    "stop",
    "start",
    "end",
    "begin",
    "special",
    "image",
    "video",
    "audio",
    "vision",
}
_ENV_ENDINGS = ("key", "keys", "pat")  # an environment variable's last word: OPENAI_KEY, PRIVATE_KEY, GITHUB_PAT
_ENV_WORDS = ("token", "tokens")  # anywhere in an environment variable's name: HF_TOKEN, TOKEN_GITHUB
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
# Credentials by their shape: a vendor's prefix, then a long random part (with a digit where the prefix is short).
_SECRET_SHAPES = re.compile(
    r"\b(?:"
    r"gh[pousr]_[A-Za-z0-9]{30,}"  # GitHub tokens
    r"|github_pat_[A-Za-z0-9_]{30,}"  # GitHub fine-grained tokens
    r"|glpat-[A-Za-z0-9_-]{20,}"  # GitLab
    r"|hf_(?=[A-Za-z]*[0-9])[A-Za-z0-9]{20,}"  # Hugging Face
    r"|sk-(?:proj-|ant-|live-|test-)?(?=[A-Za-z_-]*[0-9])[A-Za-z0-9_-]{20,}"  # OpenAI, Anthropic, Stripe
    r"|xox[abposr]-[A-Za-z0-9-]{10,}"  # Slack
    r"|AKIA[0-9A-Z]{16}"  # AWS access key ids
    r"|AIza[0-9A-Za-z_-]{35}"  # Google API keys
    r")"
)
_BARE_MASK = re.compile(r"(?P<head>^[ \t]*(?:- |[\w.\-]+:[ \t]+))\*\*\*[ \t]*$", re.MULTILINE)
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][\w+.\-]*://[^/\s:@]+:)[^@\s/]+@")
# key: value / key=value / "key": "value" on one line (YAML, dotted overrides, JSON)
_KEY_VALUE = re.compile(
    r"""(?P<q>["']?)(?P<key>[A-Za-z_][\w.\-]*)(?P=q)(?P<sep>[ \t]*[:=][ \t]*)"""
    r"""(?P<val>"[^"\n]*"|'[^'\n]*'|[^\s,;}\]#]+)"""
)


def is_secret_name(name: str) -> bool:
    """Whether a config key (its last dotted component) or an environment variable names a secret."""
    last = str(name).rsplit(".", 1)[-1]
    words = [w.lower() for w in _WORD.findall(last)]
    if not words:
        return False
    if words[-1] == "token" and len(words) > 1 and words[-2] in _SPECIAL_TOKENS:
        return False
    joined = "".join(words)
    if joined.endswith(_ENDINGS) or any(part in joined for part in _ANYWHERE):
        return True
    return bool(_ENV_NAME.fullmatch(last)) and (words[-1] in _ENV_ENDINGS or any(w in _ENV_WORDS for w in words))


def secret_environment() -> dict[str, str]:
    """The environment variables whose name looks like a secret and whose value is long enough to redact."""
    return {k: v for k, v in os.environ.items() if len(v) >= MIN_SECRET_LENGTH and is_secret_name(k)}


def secret_values() -> list[str]:
    """Values of the secret-looking environment variables, longest first."""
    return sorted(set(secret_environment().values()), key=len, reverse=True)


def _mask_value(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, dict):
        return _redact_mapping(value, secrets)
    if isinstance(value, (list, tuple)):
        return type(value)(_mask_value(item, secrets) for item in value)
    if isinstance(value, str):
        if any(secret in value for secret in secrets):
            return MASK
        return _URL_PASSWORD.sub(rf"\g<head>{MASK}@", _SECRET_SHAPES.sub(MASK, value))
    if isinstance(value, (int, float)) and not isinstance(value, bool) and str(value) in secrets:
        return MASK
    return value


def _redact_mapping(tree: dict, secrets: list[str]) -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(key, str):
            for secret in secrets:
                key = key.replace(secret, MASK)
            key = _SECRET_SHAPES.sub(MASK, key)
        if is_secret_name(key) and not isinstance(value, dict):
            out[key] = MASK
        else:
            out[key] = _mask_value(value, secrets)
    return out


def redact(tree: dict) -> dict:
    """A copy of a nested or flattened dict with secrets replaced by ``***`` (same shape)."""
    return _redact_mapping(tree, secret_values())


def redact_text(text: str) -> str:
    """``text`` with environment secrets, values of secret-looking keys and URL passwords masked."""
    for secret in secret_values():
        text = text.replace(secret, MASK)
    text = _SECRET_SHAPES.sub(MASK, text)

    def mask_pair(match: re.Match) -> str:
        if not is_secret_name(match["key"]):
            return match[0]
        value = match["val"]
        quote = value[0] if value[0] in "'\"" else ("'" if ":" in match["sep"] else "")
        return f"{match['q']}{match['key']}{match['q']}{match['sep']}{quote}{MASK}{quote}"

    text = _KEY_VALUE.sub(mask_pair, text)
    text = _BARE_MASK.sub(rf"\g<head>'{MASK}'", text)  # `key: ***` would be a YAML alias
    return _URL_PASSWORD.sub(rf"\g<head>{MASK}@", text)
