"""``refusion serve``: an OpenAI-compatible HTTP server with continuous batching and streamed commits
(:mod:`~refusion.serve.app`, :mod:`~refusion.serve.engine`), and ``refusion loadtest``
(:mod:`~refusion.serve.loadtest`). The HTTP stack (Starlette, uvicorn) is the optional extra ``.[serve]``."""
