"""Replicas of the serving engine on Ray Serve (the optional extra ``.[ray]``): one deployment replica per
device, each a whole server (model, engine, the same Starlette app), behind Ray Serve's HTTP proxy, which
spreads requests over the replicas and streams their responses through.

Each replica loads the model on its own device (with ``num_gpus=1`` per replica Ray gives each its own
GPU, seen as ``cuda``), runs its own engine thread and batch, and answers ``/metrics`` and ``/health``
for itself; every response names the replica that answered in its ``X-Refusion-Server`` header
(``refusion#<replica id>``). The proxy listens on ``host:port`` (loopback by default).
"""

from __future__ import annotations

from typing import Any

#: the name of the Ray Serve application
APP_NAME = "refusion"


def replica_class():
    """The deployment class (built on first use: Ray is imported only here)."""
    from ray import serve

    @serve.ingress()
    class Replica:
        """One server on one device: loads the model and builds the app when the replica starts."""

        def __init__(self, model: str, config: dict, model_name: str, runtime: dict, settings: dict) -> None:
            from refusion.core.threads import set_threads
            from refusion.models.backend import Backbone
            from refusion.models.loading import resolve_model_path
            from refusion.serve.server import create_state

            set_threads(settings.pop("threads", None))
            path = resolve_model_path(model)
            backbone = Backbone.from_pretrained(path, **runtime)
            replica = serve.get_replica_context().replica_id.unique_id
            self.state = create_state(backbone, config, model_name, str(path), server_id=f"{APP_NAME}#{replica}",
                                      **settings)

        def __serve_build_asgi_app__(self):
            from refusion.serve.app import build_app

            return build_app(self.state)

    return Replica


def run_replicas(model: str, config: dict, replicas: int = 2, host: str = "127.0.0.1", port: int = 8000,
                 model_name: str | None = None, runtime: dict | None = None, gpus_per_replica: float = 0,
                 cpus_per_replica: float = 1, blocking: bool = False, **settings: Any) -> str:
    """Deploy ``replicas`` servers of ``config`` on ``model`` on the Ray cluster of this process (started
    here when none is: ``ray.init``), behind Ray Serve's proxy on ``host:port``; -> the proxy's URL.
    ``settings``: :func:`~refusion.serve.server.create_state`'s (max_batch, max_queue, api_key, ...) and
    ``threads``. ``blocking``: serve until interrupted."""
    import ray
    from ray import serve

    if replicas < 1:
        raise ValueError(f"--replicas: must be at least 1, got {replicas}")
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": host, "port": port})
    max_ongoing = int(settings.get("max_batch", 16)) + int(settings.get("max_queue", 64))
    deployment = serve.deployment(replica_class(), name="refusion", num_replicas=replicas,
                                  max_ongoing_requests=max_ongoing,
                                  ray_actor_options={"num_gpus": gpus_per_replica, "num_cpus": cpus_per_replica})
    app = deployment.bind(model, config, model_name or model, runtime or {}, settings)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=blocking)
    return f"http://{host}:{port}"


def shutdown_replicas() -> None:
    """Remove the deployment and Ray Serve (the Ray cluster this process started goes too)."""
    import ray
    from ray import serve

    serve.shutdown()
    if ray.is_initialized():
        ray.shutdown()
