"""The tenants' keys file and its limits, without a server: what an operator's mistakes get back."""

from __future__ import annotations

import pytest
import yaml

from knnlm_core.errors import ConfigError
from knnlm_core.keys_file import check_keys_config, key_hash, load_keys_file, new_key
from knnlm_serve.server.keyring import AuthError, Keyring, RateLimits

GOOD = {"id": "team-a", "sha256": key_hash("secret-a"), "datastores": {"docs": ["generate", "explain"]}, "default": "docs"}


def written(tmp_path, keys) -> str:
    path = tmp_path / "keys.yaml"
    path.write_text(keys if isinstance(keys, str) else yaml.safe_dump({"keys": keys}))
    return str(path)


@pytest.mark.parametrize(
    "keys, message",
    [
        ("keys: [{id: a", "not valid YAML at line 1"),
        ("- just a list", "expected a mapping with a `keys` list"),
        (
            [{**GOOD, "datastores": {"wiki": ["generate"]}, "default": "wiki"}],
            "keys.0.datastores: 'wiki' is not a datastore of this server",
        ),
        (
            [{**GOOD, "datastores": {"docs": ["read"]}, "default": None}],
            "keys.0.datastores.docs.0: Input should be 'generate', 'explain' or 'documents'",
        ),
        ([{**GOOD, "datastores": {"docs": []}, "default": None}], "docs: grant at least one of generate, explain, documents"),
        ([GOOD, {**GOOD, "sha256": key_hash("secret-b")}], "two keys have the same id (team-a)"),
        ([GOOD, {**GOOD, "id": "team-b"}], "two keys have the same sha256 (another key's)"),
        ([{**GOOD, "sha256": "secret-a"}], "keys.0.sha256: String should match pattern"),
        ([{**GOOD, "expires": "2027-01-01T00:00:00"}], "keys.0.expires: Input should have timezone info"),
        ([{**GOOD, "default": "other"}], "default 'other' must be one of this key's datastores with the right 'generate'"),
        ([{**GOOD, "requests_per_minute": 0}], "keys.0.requests_per_minute: Input should be greater than 0"),
        ([{**GOOD, "key": "secret-a"}], "keys.0.key: Extra inputs are not permitted"),
    ],
    ids=[
        "not-yaml",
        "not-a-mapping",
        "unknown-datastore",
        "unknown-right",
        "no-right",
        "duplicate-id",
        "duplicate-key",
        "not-a-hash",
        "naive-expiry",
        "default-not-granted",
        "zero-limit",
        "plain-key",
    ],
)
def test_a_bad_keys_file_is_one_error_naming_the_file_and_the_field(tmp_path, keys, message):
    path = written(tmp_path, keys)
    with pytest.raises(ConfigError) as refused:
        load_keys_file(path, ["docs"])
    assert str(refused.value).startswith(f"knn.keys_file {path}: ") and message in str(refused.value)
    assert "secret-a" not in str(refused.value)


def test_keys_replace_vllms_one_api_key(tmp_path, monkeypatch):
    path = written(tmp_path, [GOOD])
    with pytest.raises(ConfigError, match="remove --api-key"):
        check_keys_config(path, ["docs"], ["--api-key", "x"])
    monkeypatch.setenv("VLLM_API_KEY", "x")
    with pytest.raises(ConfigError, match="remove VLLM_API_KEY"):
        check_keys_config(path, ["docs"], [])


def test_a_new_key_is_found_by_its_hash_alone(tmp_path):
    secret, digest = new_key()
    keyring = Keyring(written(tmp_path, [{**GOOD, "sha256": digest}]), lambda: ["docs"])
    assert keyring.authenticate([(b"authorization", f"Bearer {secret}".encode())]).id == "team-a"
    with pytest.raises(AuthError) as refused:
        keyring.authenticate([(b"authorization", f"Bearer {secret}x".encode())])
    assert refused.value.reason == "unknown" and secret not in str(refused.value)


def test_a_sliding_minute_admits_the_limit_and_says_when_the_next_fits():
    now = [0.0]
    limits = RateLimits(clock=lambda: now[0])
    key = load_keys_model({**GOOD, "requests_per_minute": 2, "tokens_per_minute": 100})
    assert limits.admit(key) is None
    now[0] = 10.0
    assert limits.admit(key) is None
    assert limits.admit(key) == ("requests_per_minute", pytest.approx(50.0))
    now[0] = 60.5  # the first request left the window
    limits.charge(key, 150)
    assert limits.admit(key) == ("tokens_per_minute", pytest.approx(60.0))
    now[0] = 121.0
    assert limits.admit(key) is None


def load_keys_model(data: dict):
    from knnlm_core.keys_file import TenantKey

    return TenantKey.model_validate(data)
