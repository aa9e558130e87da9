"""Embedding models in the engine: BERT parity with sentence-transformers, decoders
converted to embeddings, and /v1/embeddings, /score, /rerank through real clients."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from pagellm.engine.arg_utils import EngineArgs
from pagellm.pooling.config import resolve_runner
from pagellm.pooling.engine import PoolingEngine, plan_batches
from tests.rag_utils import minilm_path
from tests.server_utils import RemoteServer

TEXTS = ["The KV cache is split into blocks of 16 tokens.", "Bonjour le monde !",
         "a", "Qdrant keeps vectors on disk in local mode. " * 12]


@pytest.fixture(scope="module")
def minilm() -> Path:
    return minilm_path()


@pytest.fixture(scope="module")
def engine(minilm: Path) -> PoolingEngine:
    return PoolingEngine(EngineArgs(model=str(minilm)))


@pytest.fixture(scope="module")
def server(minilm_server: RemoteServer) -> RemoteServer:
    """all-MiniLM-L6-v2 as "minilm", shared with test_router_classifier.py
    (shared_servers.py)."""
    return minilm_server


def test_minilm_matches_sentence_transformers(engine: PoolingEngine, minilm: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    reference = torch.from_numpy(st.SentenceTransformer(str(minilm), device="cpu").encode(TEXTS))
    ours = engine.embed([engine.tokenizer(t)["input_ids"] for t in TEXTS])
    cosine = torch.nn.functional.cosine_similarity(ours, reference)
    assert cosine.min().item() > 0.9999, cosine
    assert engine.info.pooler.pooling_type == "MEAN" and engine.info.pooler.normalize
    assert engine.info.max_model_len == 256  # sentence_bert_config.json, not BERT's 512


def test_batching_does_not_change_a_vector(engine: PoolingEngine) -> None:
    ids = [engine.tokenizer(t)["input_ids"] for t in TEXTS]
    together = engine.embed(ids)
    alone = torch.cat([engine.embed([one]) for one in ids])
    assert torch.allclose(together, alone, atol=1e-5)


def test_plan_batches_keeps_both_budgets() -> None:
    lengths = [5, 100, 7, 60, 6, 99]
    groups = plan_batches(lengths, max_seqs=2, max_tokens=150)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for group in groups:
        assert len(group) <= 2 and len(group) * max(lengths[i] for i in group) <= 150


def test_runner_choice_follows_vllm(minilm: Path, tiny_llama_dir: Path) -> None:
    assert resolve_runner(minilm, "auto", "auto") == "pooling"
    assert resolve_runner(tiny_llama_dir, "auto", "auto") == "generate"
    assert resolve_runner(tiny_llama_dir, "auto", "embed") == "pooling"
    assert resolve_runner(tiny_llama_dir, "pooling", "auto") == "pooling"
    with pytest.raises(ValueError, match="encoder-only model"):
        resolve_runner(minilm, "generate", "auto")


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_decoder_embeds_like_transformers(tiny_llama_dir: Path, pooling: str) -> None:
    """--convert embed: our final hidden states, pooled, against transformers' own."""
    transformers = pytest.importorskip("transformers")
    engine = PoolingEngine(EngineArgs(model=str(tiny_llama_dir), dtype="float32",
                                      convert="embed",
                                      pooler_config=f'{{"pooling_type": "{pooling}"}}'))
    prompts = [[1, 5, 9, 33, 2], [7, 8], list(range(3, 40))]
    ours = engine.embed(prompts)
    hf = transformers.AutoModel.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    expected = []
    for ids in prompts:
        hidden = hf(torch.tensor([ids])).last_hidden_state[0]
        vector = hidden[-1] if pooling == "LAST" else hidden.mean(dim=0)
        expected.append(torch.nn.functional.normalize(vector, dim=-1))
    assert torch.allclose(ours, torch.stack(expected).detach(), atol=1e-4)


def test_start_up_log_says_no_kv_cache(server: RemoteServer) -> None:
    log = server.output()
    assert "no KV cache is allocated" in log and "Allocating the KV cache" not in log


def test_metrics_answer(server: RemoteServer) -> None:
    """/metrics is a route shared with the generation server, read from the app's state."""
    response = httpx.get(f"{server.url}/metrics", timeout=10)
    assert response.status_code == 200 and "# TYPE" in response.text


def test_embeddings_through_the_sdk(server: RemoteServer, engine: PoolingEngine) -> None:
    client = server.client()
    one = client.embeddings.create(model="minilm", input=TEXTS[0])
    assert one.object == "list" and one.model == "minilm" and len(one.data) == 1
    assert len(one.data[0].embedding) == 384 and one.id.startswith("embd-")
    ids = engine.tokenizer(TEXTS[0])["input_ids"]
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids)
    many = client.embeddings.create(model="minilm", input=TEXTS)
    assert [d.index for d in many.data] == [0, 1, 2, 3]
    assert np.allclose(many.data[0].embedding, one.data[0].embedding, atol=1e-5)
    by_ids = client.embeddings.create(model="minilm", input=ids)
    assert np.allclose(by_ids.data[0].embedding, one.data[0].embedding, atol=1e-5)
    lists = client.embeddings.create(model="minilm", input=[ids, ids[:3]])
    assert len(lists.data) == 2 and lists.usage.prompt_tokens == len(ids) + 3


def test_base64_is_little_endian_float32(server: RemoteServer) -> None:
    body = {"model": "minilm", "input": TEXTS[1]}
    floats = httpx.post(f"{server.url}/v1/embeddings", json=body).json()
    encoded = httpx.post(f"{server.url}/v1/embeddings",
                         json={**body, "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, floats["data"][0]["embedding"], atol=1e-7)
    # the SDK asks for base64 by default and decodes it itself
    sdk = server.client().embeddings.create(model="minilm", input=TEXTS[1])
    assert np.allclose(sdk.data[0].embedding, decoded, atol=1e-7)


def test_dimensions_is_refused_for_a_model_without_matryoshka(server: RemoteServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().embeddings.create(model="minilm", input="x", dimensions=128)
    assert caught.value.body["message"] == (
        'Model "minilm" does not support matryoshka representation, changing output '
        "dimensions will lead to poor results.")


def test_too_long_input_says_how_long_unless_truncation_is_asked(server: RemoteServer) -> None:
    long_text = "word " * 400
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().embeddings.create(model="minilm", input=long_text)
    assert "maximum context length is 256 tokens" in caught.value.body["message"]
    assert "you requested 402 tokens" in caught.value.body["message"]
    body = {"model": "minilm", "input": long_text, "truncate_prompt_tokens": -1}
    answer = httpx.post(f"{server.url}/v1/embeddings", json=body).json()
    assert answer["usage"]["prompt_tokens"] == 256
    body["truncate_prompt_tokens"] = 1000
    refused = httpx.post(f"{server.url}/v1/embeddings", json=body)
    assert refused.status_code == 400 and "greater than max_model_len (256)" in refused.text


@pytest.mark.parametrize("body, param", [({"input": []}, "input"),
                                         ({"input": [[]]}, "input"),
                                         ({"input": [99999]}, "input"),
                                         ({"input": "x", "encoding_format": "int8"},
                                          "encoding_format"),
                                         ({"input": "x", "model": "other"}, "model")])
def test_bad_embedding_requests(server: RemoteServer, body: dict, param: str) -> None:
    answer = httpx.post(f"{server.url}/v1/embeddings", json=body)
    assert answer.status_code in (400, 404), answer.text
    assert answer.json()["error"]["param"] == param


def test_score_and_rerank_share_the_cosine(server: RemoteServer,
                                           engine: PoolingEngine) -> None:
    query, docs = "How big is a KV block?", [TEXTS[1], TEXTS[0], TEXTS[3]]
    score = httpx.post(f"{server.url}/score",
                       json={"model": "minilm", "text_1": query, "text_2": docs}).json()
    vectors = engine.embed([engine.tokenizer(t)["input_ids"] for t in [query, *docs]])
    expected = (vectors[1:] @ vectors[0]).tolist()  # normalized: the dot is the cosine
    assert [d["score"] for d in score["data"]] == pytest.approx(expected, abs=1e-5)
    rerank = httpx.post(f"{server.url}/v1/rerank",
                        json={"model": "minilm", "query": query, "documents": docs,
                              "top_n": 2}).json()
    best = sorted(range(3), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in rerank["results"]] == best
    assert rerank["results"][0]["document"]["text"] == docs[best[0]]
    assert rerank["usage"]["total_tokens"] == score["usage"]["total_tokens"]
    uneven = httpx.post(f"{server.url}/score",
                        json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert uneven.status_code == 400
