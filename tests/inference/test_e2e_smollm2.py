"""The real SmolLM2-135M-Instruct served as a separate process, as `tandem up` runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.helpers.servers import free_port, stop_process, wait_ready

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def smol_server(tandem_env: Path, smollm2_path: Path, api_key: str) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "TANDEM_INFERENCE_MODEL": str(smollm2_path)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "services.inference.app:create_app",
            "--factory",
            "--port",
            str(port),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 180)
        yield url
    finally:
        stop_process(proc, 20)


def test_smollm2_answers_through_openai_and_langchain(smol_server: str, api_key: str) -> None:
    from langchain_openai import ChatOpenAI

    client = openai.OpenAI(base_url=smol_server + "/v1", api_key=api_key, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=20)  # type: ignore[arg-type]
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"
    llm = ChatOpenAI(base_url=smol_server + "/v1", api_key=api_key, model=model, temperature=0, max_tokens=20)
    streamed = "".join(str(c.content) for c in llm.stream("What is the capital of France?"))
    assert streamed == "The capital of France is Paris."
