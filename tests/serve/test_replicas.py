"""Replicas on Ray Serve: a local 2-replica cluster on the CPU, loopback only, behind Ray Serve's proxy;
every answer is the offline decode, and both replicas serve requests (each response names its replica)."""

from __future__ import annotations

import collections
import concurrent.futures
import socket

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from refusion.core.config import build_decoder  # noqa: E402
from refusion.models.backend import Backbone  # noqa: E402
from refusion.models.tokenizer import encode_prompt  # noqa: E402
from refusion.serve.app import SERVER_HEADER  # noqa: E402
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
        queries = [ex.query for ex in get_task("arith").examples("test", 4)]

        def ask(query: str) -> tuple[str, list[int], str]:
            """(the replica that answered, the answer's tokens, its text) of one chat request."""
            raw = client.chat.completions.with_raw_response.create(
                model="tiny-refusion", messages=[{"role": "user", "content": query}])
            out = raw.parse()
            return raw.headers[SERVER_HEADER], out.model_extra["refusion"]["token_ids"], out.choices[0].message.content

        # 16 requests, 8 at a time: the proxy spreads concurrent requests over the replicas
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, queries * 4))
        replicas = collections.Counter(replica for replica, _, _ in answers)
        assert len(replicas) == 2 and all(r.startswith("refusion#") for r in replicas), replicas  # both served
        offline = {q: decoder.generate(encode_prompt(bb.tokenizer, q)).token_ids for q in queries}
        for query, (_, ids, _) in zip(queries * 4, answers):
            assert ids == offline[query]
        for query, (_, _, text) in zip(queries, answers):
            chunks = list(client.chat.completions.create(model="tiny-refusion", stream=True,
                                                         messages=[{"role": "user", "content": query}]))
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    finally:
        shutdown_replicas()
