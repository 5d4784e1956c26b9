"""A vLLM user's launch command runs: `python -m tpgraph.serve` (one process, the built-in model, CPU) with vLLM's
flags serves over HTTPS under a proxy's prefix, with the request defaults, limits, roles and CORS asked; a flag value
this engine cannot honour stops it at once, named."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")

VLLM_FLAGS = ["--served-model-name", "llama", "--trust-remote-code", "--tokenizer-mode", "auto",
              "--max-logprobs", "5", "--generation-config", "vllm",
              "--override-generation-config", '{"temperature": 0.0, "max_new_tokens": 3}',
              "--uvicorn-log-level", "warning", "--disable-log-requests", "--disable-log-stats",
              "--allowed-origins", '["https://ui.example"]', "--root-path", "/api", "--response-role", "assistant",
              "--kv-cache-dtype", "auto", "--swap-space", "4", "--max-num-partial-prefills", "1",
              "--cuda-graph-sizes", "8", "--return-tokens-as-token-ids", "--disable-fastapi-docs"]
ENGINE_FLAGS = ["--device", "cpu", "--max-model-len", "128", "--max-num-seqs", "4", "--block-size", "8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(flags: list[str], log) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "tpgraph.serve", *ENGINE_FLAGS, *flags], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def request(url: str, context: ssl.SSLContext, body: dict | None = None, headers: dict | None = None):
    """(status, headers, JSON or None) of a GET, or of a POST of `body`."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60, context=context) as r:
            text = r.read().decode()
            return r.status, r.headers, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read().decode())


def test_a_vllm_launch_command_serves(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    port = free_port()
    base, trusting = f"https://127.0.0.1:{port}/api", ssl.create_default_context(cafile=str(cert))
    with tempfile.TemporaryFile("w+") as log:
        proc = serve([*VLLM_FLAGS, "--port", str(port), "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)], log)
        try:
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, "the server exited"
                assert time.monotonic() < deadline, "the server did not come up in 180 s"
                with contextlib.suppress(OSError):
                    if request(f"{base}/health", trusting)[0] == 200:
                        break
                time.sleep(0.5)
            chat = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                    "top_logprobs": 2}
            status, headers, reply = request(f"{base}/v1/chat/completions", trusting, chat,
                                             {"Origin": "https://ui.example"})
            assert status == 200, reply
            assert headers["access-control-allow-origin"] == "https://ui.example"
            choice = reply["choices"][0]
            assert reply["model"] == "llama" and choice["message"]["role"] == "assistant"
            assert reply["usage"]["completion_tokens"] == 3  # (the overridden max_new_tokens)
            tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
            assert all(t.startswith("token_id:") for t in tokens)
            again = request(f"{base}/v1/chat/completions", trusting, chat)[2]  # (the overridden temperature 0)
            assert [e["token"] for e in again["choices"][0]["logprobs"]["content"]] == tokens
            status, _, refused = request(f"{base}/v1/chat/completions", trusting, {**chat, "top_logprobs": 6})
            assert status == 400 and "more than the 5 this server returns" in refused["error"]["message"]
            assert request(f"{base}/docs", trusting)[0] == 404
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
            log.seek(0)
            out = log.read()
        assert "serving llama on https://127.0.0.1" in out, out[-3000:]


@pytest.mark.parametrize("flags,needle", [
    (["--kv-cache-dtype", "fp8"], "argument --kv-cache-dtype: 'fp8' is not supported"),
    (["--quantization", "awq"], "argument --quantization/-q: 'awq' is not supported"),
    (["--tokenizer-mode", "mistral"], "argument --tokenizer-mode: 'mistral' is not supported"),
    (["--model", "meta-llama/Not-Cached", "--download-dir", "EMPTY"], "tpgraph downloads nothing"),
])
def test_a_value_this_engine_cannot_honour_stops_it_at_once(flags, needle, tmp_path):
    flags = [str(tmp_path) if f == "EMPTY" else f for f in flags]
    done = subprocess.run([sys.executable, "-m", "tpgraph.serve", *ENGINE_FLAGS, "--port", str(free_port()), *flags],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2 and needle in done.stderr, done.stderr[-3000:]
    assert "warmed up" not in done.stdout + done.stderr  # (refused before the model loaded)
