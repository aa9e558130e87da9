"""The router's detectors, complexity tier and configuration checks, without any server."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from server_utils import run_cli

from pagellm.router.complexity import complexity_score
from pagellm.router.config import PrivacyConfig, config_from_dict, load_config
from pagellm.router.pii import PIIDetector

FOUND = [
    ("email", "reach me at j.smith+billing@mail.example.co.uk"),
    ("phone", "my number is (415) 555-2671"),
    ("phone", "appelez le +33 6 12 34 56 78"),
    ("iban", "IBAN FR14 2004 1010 0505 0001 3M02 606"),
    ("iban", "GB29NWBK60161331926819"),
    ("credit_card", "card 5555-5555-5555-4444 exp 12/29"),
    ("credit_card", "amex 378282246310005"),
    ("national_id", "SSN 123-45-6789"),
    ("national_id", "NIR 2 95 10 99 126 111 93"),
    ("national_id", "DNI 12345678Z"),
    ("national_id", "codice fiscale RCCMNL83S18D969H"),
    ("national_id", "Steuer-ID 36 574 261 809"),
]
NOT_FOUND = [
    "card 4111 1111 1111 1112",              # Luhn fails
    "IBAN DE89 3704 0044 0532 0130 01",      # mod-97 fails
    "SSN 000-12-3456",                       # area 000 is never issued
    "order 2024-11-05, ticket 12345, version 3.14.159",
    "the price is 1234567 units",
    "email me at nobody@localhost",
    "meeting at 10:30 on 05/11/2024, call 2024.11.05",
]


@pytest.mark.parametrize(("entity", "text"), FOUND)
def test_detector_finds(entity: str, text: str) -> None:
    findings = PIIDetector(PrivacyConfig()).scan({"messages": [{"role": "user",
                                                                "content": text}]})
    assert entity in [finding.entity for finding in findings]


@pytest.mark.parametrize("text", NOT_FOUND)
def test_detector_ignores_numbers_that_fail_their_checksum(text: str) -> None:
    assert PIIDetector(PrivacyConfig()).scan({"prompt": text}) == []


def test_detector_reads_every_field_and_only_the_entities_configured() -> None:
    detector = PIIDetector(PrivacyConfig(pii=["email"], customer_names=["ACME Corp"],
                                         patterns={"ticket": r"TCK-\d+"}))
    body = {"model": "x", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hello"}]}],
        "tools": [{"function": {"description": "owner a@b.example"}}],
        "metadata": {"customer": "acme corp", "ref": "TCK-42"}}
    assert sorted(f.entity for f in detector.scan(body)) == [
        "customer_name", "email", "pattern:ticket"]
    assert detector.scan({"prompt": "call +1 415-555-2671"}) == []   # phones not configured
    image = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    assert [f.entity for f in detector.scan(image)] == ["unscannable"]


def test_complexity_tiers() -> None:
    config = config_from_dict({"groups": {"g": {"backends": ["http://h:1"]}}}).complexity
    simple = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    hard = {"messages": [{"role": "user", "content":
                          "Design an algorithm, prove it correct step by step and compare "
                          "the trade-off with the naive one:\n1. speed\n2. memory\n3. cost"}]}
    assert complexity_score(simple, config) < config.threshold <= complexity_score(hard, config)


BASE = {"groups": {"local": {"local": True, "backends": ["http://h:1"]},
                   "cloud": {"backends": ["https://api.example.com/v1"]}}}


@pytest.mark.parametrize(("change", "message"), [
    ({"privacy": {"local_group": "cloud"}}, "must name a group whose backends are all"),
    ({"privacy": {"pii": ["email", "dna"]}}, "unknown entities"),
    ({"privacy": {"fail_open": True}}, "unknown keys"),
    ({"models": {"a": {"default": "nowhere"}}}, "unknown group"),
    ({"models": {"local": {"default": "local"}}}, "both a model and a group"),
    ({"groups": {"g": {"backends": ["ftp://x"]}}}, r"not an http\(s\) URL"),
    ({"groups": {"g": {"backends": ["http://x"], "balancing": "random"}}}, "balancing must"),
    ({"models": {"a": {"default": "local", "rules": [
        {"name": "r", "target": "cloud", "when": {"tenants": ["nobody"]}}]}}}, "unknown tenant"),
])
def test_config_errors(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_dict({**BASE, **change})


def test_config_file_and_urls(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("groups:\n  local:\n    local: true\n    backends: [http://h:8000]\n"
                    "  cloud:\n    backends: [https://api.example.com/v1/]\n"
                    "privacy:\n  customer_names_file: names.txt\n".replace(
                        "names.txt", str(tmp_path / "names.txt")))
    (tmp_path / "names.txt").write_text("Jane Doe\n\nJohn Roe\n")
    config = load_config(path)
    local, cloud = (config.groups[name].backends[0] for name in ("local", "cloud"))
    assert (local.url, local.root) == ("http://h:8000/v1", "http://h:8000")
    assert (cloud.url, cloud.local) == ("https://api.example.com/v1", False)
    assert config.privacy.local_group == "local"
    assert config.privacy.customer_names == ["Jane Doe", "John Roe"]


def test_cli_errors_are_one_line() -> None:
    result = run_cli("router", timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == ("pagellm: error: give --config router.yaml or at least "
                                     "one --backend URL")
    missing = run_cli("router", "--config", "/nonexistent/router.yaml", timeout=60)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr


def test_the_documented_config_loads(tmp_path: Path) -> None:
    """docs/router.md's example is a working configuration."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "router.md").read_text()
    example = text.split("```yaml\n# router.yaml\n", 1)[1].split("```", 1)[0]
    names = tmp_path / "customers.txt"
    names.write_text("John Roe\n")
    config = config_from_dict(yaml.safe_load(
        example.replace("/etc/pagellm/customers.txt", str(names))))
    assert config.public_models == ["assistant", "local", "mistral"]
    assert config.privacy.local_group == "local" and not config.groups["mistral"].local
    assert [rule.target for rule in config.models["assistant"].rules] == ["mistral", "mistral"]
    assert config.privacy.customer_names == ["Jane Doe", "John Roe"]
