"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/tags``, ``/api/show``,
``/api/ps``, ``/api/version``), served through the chat, completions and embeddings paths: wire
types (:mod:`.wire`), the translation both ways (:mod:`.translate`), NDJSON streams
(:mod:`.stream`), what the model list and ``show`` say about the served model (:mod:`.models`) and
the handlers (:mod:`.routes`, whose ``OLLAMA_ROUTES`` the app registers)."""
