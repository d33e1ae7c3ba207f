"""Replicas on Ray Serve: a local 2-replica cluster on the CPU, loopback only, behind Ray Serve's proxy;
every answer is the offline decode, and both replicas run."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from refusion.core.config import build_decoder  # noqa: E402
from refusion.models.backend import Backbone  # noqa: E402
from refusion.models.tokenizer import encode_prompt  # noqa: E402
from refusion.tasks import get_task  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_replicas_on_ray_serve_answer_as_offline():
    import ray
    from ray import serve

    from refusion.serve.replicas import run_replicas, shutdown_replicas

    config = {"decoder": "refusion", "gen_length": 16, "slot_size": 8}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        url = run_replicas("tiny-refusion", config, replicas=2, host="127.0.0.1", port=free_port(), threads=1)
        status = serve.status().applications["refusion"].deployments["refusion"]
        assert status.replica_states.get("RUNNING") == 2
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        bb = Backbone.from_pretrained("tiny-refusion")
        decoder = build_decoder(bb, config)
        for ex in get_task("arith").examples("test", 4):
            messages = [{"role": "user", "content": ex.query}]
            out = client.chat.completions.create(model="tiny-refusion", messages=messages)
            want = decoder.generate(encode_prompt(bb.tokenizer, ex.query)).token_ids
            assert out.model_extra["refusion"]["token_ids"] == want
            chunks = list(client.chat.completions.create(model="tiny-refusion", stream=True,
                                                         messages=[{"role": "user", "content": ex.query}]))
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    finally:
        shutdown_replicas()
