"""`pagellm router`'s privacy guarantees through the `openai` SDK: customer data (each
detector, tags, tenant keys, a failing detector) only ever reaches local replicas, through
retries and fallbacks too, and neither keys nor bodies reach the logs.
"""

from __future__ import annotations

import io
import logging
from typing import Any

import openai
import pytest
from fake_openai_server import FakeOpenAIServer
from router_gateway import (EXTERNAL_KEY, LONG_TASK, TENANT_KEY, a, b, chat,  # noqa: F401
                            ext, fakes, gateway_config)
from router_utils import RouterServer


def contents(server: FakeOpenAIServer) -> str:
    return repr(server.state.bodies)


SENSITIVE = {
    "email": "Write to jane.roe@example.com about the invoice.",
    "phone": "Call the customer back on +1 415-555-2671 today.",
    "iban": "Refund to DE89 3704 0044 0532 0130 00 please.",
    "credit_card": "The card 4111 1111 1111 1111 was charged twice.",
    "national_id": "Her social security number is 123-45-6789.",
    "customer_name": "Summarise the complaint from jane doe.",
    "pattern:contract": "What does contract CT-123456 say about refunds?",
}


@pytest.mark.parametrize("entity", sorted(SENSITIVE))
def test_customer_data_stays_local(entity: str, a: FakeOpenAIServer, b: FakeOpenAIServer,
                                   ext: FakeOpenAIServer) -> None:
    # Appended to a complex task, which would otherwise go to the external provider.
    text = f"{LONG_TASK} {SENSITIVE[entity]}"
    with RouterServer(gateway_config(a, b, ext)) as router:
        raw = chat(router, text)
    assert raw.headers["x-pagellm-route"] == (f"rule=privacy(pii:{entity}); target=local; "
                                              f"sensitive=true")
    assert raw.parse().model == "local-model"
    assert ext.state.bodies == []
    assert SENSITIVE[entity] in contents(a) + contents(b)


def test_complex_goes_out_and_simple_stays(a: FakeOpenAIServer, b: FakeOpenAIServer,
                                           ext: FakeOpenAIServer) -> None:
    with RouterServer(gateway_config(a, b, ext)) as router:
        complex_raw = chat(router, LONG_TASK)
        simple_raw = chat(router, "What is the capital of France?")
    assert complex_raw.headers["x-pagellm-route"] == ("rule=complex; target=cloud; "
                                                      "sensitive=false")
    assert complex_raw.parse().model == "cloud-model"
    assert [body["model"] for body in ext.state.bodies] == ["cloud-model"]
    assert simple_raw.headers["x-pagellm-route"] == "rule=simple; target=local; sensitive=false"
    # the provider gets its own key, never the client's
    assert ext.state.headers[0]["authorization"] == f"Bearer {EXTERNAL_KEY}"


def test_tag_and_tenant_mark_customer_data(a: FakeOpenAIServer, b: FakeOpenAIServer,
                                           ext: FakeOpenAIServer) -> None:
    with RouterServer(gateway_config(a, b, ext)) as router:
        tagged = chat(router, LONG_TASK, extra_headers={"x-pagellm-tags": "x, customer-data"})
        tenant = chat(router, LONG_TASK, api_key=TENANT_KEY)
        other = chat(router, LONG_TASK, api_key="someone-else")
    assert "privacy(tag:customer-data)" in tagged.headers["x-pagellm-route"]
    assert "privacy(tenant:acme)" in tenant.headers["x-pagellm-route"]
    assert "rule=complex" in other.headers["x-pagellm-route"]
    assert len(ext.state.bodies) == 1
    assert all("authorization" not in h or h["authorization"] != f"Bearer {TENANT_KEY}"
               for h in a.state.headers + b.state.headers + ext.state.headers)


def test_token_id_prompt_cannot_be_scanned_so_stays_local(
        a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer) -> None:
    with RouterServer(gateway_config(a, b, ext)) as router:
        raw = router.client().completions.with_raw_response.create(
            model="cloud", prompt=[1, 2, 3], max_tokens=2)
    assert "privacy(pii:unscannable)" in raw.headers["x-pagellm-route"]
    assert ext.state.bodies == []


def test_sensitive_request_gets_503_when_every_local_replica_fails(
        a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer) -> None:
    a.reset(fail_status=500)
    b.reset(fail_status=503)
    with RouterServer(gateway_config(a, b, ext)) as router:
        with pytest.raises(openai.APIStatusError) as caught:
            chat(router, SENSITIVE["email"])
        metrics = router.metrics_text()
    assert caught.value.status_code == 503
    assert "customer data" in caught.value.message
    assert caught.value.response.headers["x-pagellm-route"].endswith("sensitive=true")
    assert len(a.state.bodies) == len(b.state.bodies) == 1   # each local replica tried once
    assert ext.state.bodies == []
    assert 'pagellm_router_rejected_total{reason="no_local_backend"} 1.0' in metrics


def test_sensitive_request_gets_503_when_local_replicas_are_down(
        a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer) -> None:
    a.reset(healthy=False)
    b.reset(healthy=False)
    with RouterServer(gateway_config(a, b, ext)) as router:
        with pytest.raises(openai.APIStatusError) as caught:
            chat(router, SENSITIVE["iban"], stream=True)
    assert caught.value.status_code == 503
    assert a.state.bodies == b.state.bodies == ext.state.bodies == []


def test_detector_error_fails_closed(a: FakeOpenAIServer, b: FakeOpenAIServer,
                                     ext: FakeOpenAIServer) -> None:
    with RouterServer(gateway_config(a, b, ext)) as router:
        def broken(body: dict[str, Any]) -> list[Any]:
            raise RuntimeError("detector crashed")
        router.state.policy.detector.scan = broken
        raw = chat(router, LONG_TASK)
    assert raw.headers["x-pagellm-route"] == ("rule=privacy(detector-error); target=local; "
                                              "sensitive=true")
    assert ext.state.bodies == []


def test_sensitive_retry_stays_on_local_replicas(a: FakeOpenAIServer, b: FakeOpenAIServer,
                                                 ext: FakeOpenAIServer) -> None:
    a.reset(break_after_chunks=0)   # a accepts, then drops the connection before any chunk
    with RouterServer(gateway_config(a, b, ext, balancing="round_robin")) as router:
        answers = [chat(router, SENSITIVE["phone"], stream=True) for _ in range(2)]
        text = [list(raw.parse()) for raw in answers]
        assert not router.backend(a.url).healthy   # ejected after its failure
    assert all(raw.headers["x-pagellm-backend"] == f"{b.url}/v1" for raw in answers)
    assert all(chunks for chunks in text)
    assert len(a.state.bodies) == 1
    assert ext.state.bodies == []


def test_non_sensitive_falls_back_to_local_when_external_fails(
        a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer) -> None:
    ext.reset(fail_status=502)
    with RouterServer(gateway_config(a, b, ext)) as router:
        raw = chat(router, LONG_TASK)
        metrics = router.metrics_text()
    assert raw.parse().model == "local-model"
    assert raw.headers["x-pagellm-route"] == "rule=complex; target=cloud; sensitive=false"
    assert len(ext.state.bodies) == 1
    assert 'pagellm_router_fallbacks_total{source="cloud",target="local"} 1.0' in metrics


def test_external_key_and_bodies_are_never_logged(
        a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer) -> None:
    ext.reset(fail_status=503)
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("pagellm").addHandler(handler)
    try:
        with RouterServer(gateway_config(a, b, ext)) as router:
            chat(router, LONG_TASK)
            chat(router, SENSITIVE["email"])
            metrics = router.metrics_text()
    finally:
        logging.getLogger("pagellm").removeHandler(handler)
    logged = log.getvalue()
    assert "Routed model=assistant rule=complex" in logged
    assert "failed (HTTP 503)" in logged
    for secret in (EXTERNAL_KEY, "jane.roe@example.com", LONG_TASK[:40]):
        assert secret not in logged + metrics
