"""`pagellm serve` / `pagellm chat` command lines: help, one-line errors, in-process chat."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pagellm.entrypoints.cli import build_parser, main
from pagellm.entrypoints.openai.cli_args import ServerSettings
from pagellm.chat_template import load_chat_template
from server_utils import run_cli


def test_help_lists_verbs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert "{serve,router,chat,bench,rag}" in capsys.readouterr().out


def test_parsing_flags_loads_neither_torch_nor_the_engine() -> None:
    """`pagellm --help` and `bench serve` (a load generator, often on another machine) build
    and parse every verb's flags without torch, transformers or the engine: 3 s of start."""
    code = ("import sys; from pagellm.entrypoints.cli import build_parser; "
            "build_parser().parse_args(['bench', 'serve', '--num-prompts', '4']); "
            "print([m for m in ('torch', 'transformers', 'pagellm.engine.core') "
            "if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=60)
    assert result.stdout.strip() == "[]"


def test_serve_forks_its_engine_core_before_importing_torch(tmp_path: Path) -> None:
    """The core imports torch and loads the model on one core while the server imports its
    front end on the other; a settings check that imported transformers (and so torch)
    first made every start skip that fork. Checked up to the fork, with a template file."""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    code = ("import sys; import pagellm.entrypoints.openai.launch as launch\n"
            "def forked(*args):\n"
            "    print([m for m in ('torch', 'transformers') if m in sys.modules])\n"
            "    raise SystemExit(0)\n"
            "launch.start_core_process = forked\n"
            "from pagellm.entrypoints.cli import main\n"
            f"main(['serve', '--port', '0', '--chat-template', {str(template)!r}])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_bad_flag_is_one_line_exit_2() -> None:
    result = run_cli("serve", "--no-such-flag")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "unrecognized arguments: --no-such-flag" in result.stderr


def test_underscore_flags_mean_dashed_ones_and_prefixes_are_not_guessed(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(
        ["serve", "--served_model_name", "my_model", "--max_model_len=512", "--api-key", "a_b"])
    assert (args.served_model_name, args.max_model_len, args.api_key) == (["my_model"], 512, "a_b")
    code, err = one_line_error(["serve", "--max-model", "512"], capsys)
    assert code == 2 and "unrecognized arguments: --max-model" in err


def one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit code and stderr of `pagellm ARGV`, which must fail with exactly one line."""
    try:
        code = main(argv)
    except SystemExit as exited:
        code = exited.code
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err
    return code, err


def test_unbuilt_parallel_layout_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = one_line_error(["serve", "-dp", "2", "--nnodes", "2"], capsys)
    assert code == 1 and "data parallelism combined with --nnodes" in err
    assert "is not supported by pagellm yet" in err
    code, err = one_line_error(["serve", "-tp", "-1"], capsys)
    assert code == 2 and "must be 0 or more, got -1" in err


def test_bad_chat_template(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = one_line_error(["serve", str(tmp_path), "--chat-template", "{% for x in %}"],
                               capsys)
    assert code == 1 and "--chat-template has a syntax error" in err
    code, err = one_line_error(["serve", str(tmp_path), "--chat-template", "no-such.jinja"],
                               capsys)
    assert code == 1 and "neither a readable file nor a Jinja template" in err


def test_busy_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = one_line_error(["serve", str(tmp_path), "--port", str(port)], capsys)
    assert code == 1 and err.startswith(f"pagellm: error: cannot listen on 127.0.0.1:{port}")


def test_serve_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "/models/x", "--chat-template", str(template),
                                      "--served-model-name", "a", "b", "--max-model-len", "64"])
    settings = ServerSettings.from_args(args)
    assert settings.model_names == ["a", "b"] and settings.api_key == "from-env"
    assert settings.engine_args.chat_template == template.read_text()
    assert settings.engine_args.served_model_name == "a"
    assert settings.engine_args.max_model_len == 64
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)
    assert load_chat_template("{{ 'inline' }}") == "{{ 'inline' }}"


def test_chat_in_process(tiny_llama_dir: Path) -> None:
    result = run_cli("chat", "--model", str(tiny_llama_dir), "--dtype", "float32",
                     "--max-model-len", "256", "--num-gpu-blocks-override", "32",
                     "--temperature", "0", "--max-tokens", "5", stdin="Hello\nMore\n",
                     env={"PAGELLM_LOGGING_LEVEL": "WARNING"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") >= 2 and result.stdout.strip()


def test_api_key_sources_and_security_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    monkeypatch.setenv("PAGELLM_API_KEY", "from-env")
    parse = build_parser().parse_args
    assert ServerSettings.from_args(parse(["serve", "m"])).api_key == "from-env"
    settings = ServerSettings.from_args(parse([
        "serve", "m", "--api-key-file", str(key_file), "--allowed-origins", '["https://a.b"]',
        "--max-concurrent-requests", "8", "--shutdown-timeout", "5"]))
    assert settings.api_key == "from-file" and "from-file" not in repr(settings)
    assert settings.cors is not None and settings.cors.allowed_origins == ["https://a.b"]
    assert settings.limits.max_concurrent_requests == 8 and settings.limits.shutdown_timeout == 5
    assert ServerSettings.from_args(parse(["serve", "m"])).cors is None
    code, err = one_line_error(["serve", "m", "--api-key-file", str(tmp_path / "none")], capsys)
    assert code == 1 and "--api-key-file" in err and "No such file" in err
    code, err = one_line_error(["serve", "m", "--allowed-origins", "*"], capsys)
    assert code == 2 and "JSON list" in err
    code, err = one_line_error(["serve", "m", "--ssl-keyfile", "k.pem"], capsys)
    assert code == 1 and "--ssl-certfile" in err


def test_the_engine_core_start_method_follows_vllm_s_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pagellm.engine.core_process import start_method

    for name in ("PAGELLM_WORKER_MULTIPROC_METHOD", "VLLM_WORKER_MULTIPROC_METHOD"):
        monkeypatch.delenv(name, raising=False)
    assert start_method() == "spawn"  # in-process engines (tests, notebooks) stay safe
    assert start_method("fork") == "fork"  # what `pagellm serve` asks for on CPU
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert start_method("fork") == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "threads")
    with pytest.raises(ValueError, match="VLLM_WORKER_MULTIPROC_METHOD=threads: use fork"):
        start_method()
