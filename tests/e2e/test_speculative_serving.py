"""`loraplex serve --speculative-config` through the official openai client: a copying
answer streams the same text it returns whole, and the drafts show in vLLM's metrics."""
from __future__ import annotations

import os

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.test_serve_cli import Serve

pytestmark = pytest.mark.slow

TEXT = ("The museum opens at nine on weekdays and at ten on weekends. The train to the airport leaves "
        "every fifteen minutes from platform four.")


def test_speculative_serving_streams_what_it_returns(empty_db_url, tmp_path, smollm2_dir):
    serve = Serve("--model", str(smollm2_dir), "--data-dir", str(tmp_path / "data"), "--database-url", empty_db_url,
                  "--dtype", "float32", "--threads", "1", "--max-model-len", "512",
                  "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
                  env={k: v for k, v in os.environ.items() if k != "LORAPLEX_ADMIN_TOKEN"})
    try:
        serve.wait_ready()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve.port}/v1", api_key=serve.keys[0], max_retries=0)
        ask = dict(model=smollm2_dir.name, max_tokens=48, temperature=0,
                   messages=[{"role": "user", "content": f"Repeat this text exactly:\n{TEXT}"}])
        whole = client.chat.completions.create(**ask)
        parts = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        streamed = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        assert streamed == whole.choices[0].message.content and "museum" in streamed
        assert parts[-1].usage.completion_tokens == whole.usage.completion_tokens
        text = httpx.get(f"http://127.0.0.1:{serve.metrics_port}/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        drafted = families["vllm:spec_decode_num_draft_tokens"].samples[0].value
        accepted = families["vllm:spec_decode_num_accepted_tokens"].samples[0].value
        assert 0 < accepted <= drafted
    finally:
        assert serve.stop() == 0, "".join(serve.lines)
