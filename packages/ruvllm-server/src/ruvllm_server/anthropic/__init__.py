"""``/v1/messages``, the Anthropic Messages API, served through the chat path: wire types
(:mod:`.wire`), the translation both ways (:mod:`.translate`), the event stream (:mod:`.events`) and
the handlers (:mod:`.routes`, whose ``ANTHROPIC_ROUTES`` the app registers). Nothing is imported
here: :mod:`ruvllm_server.errors` reads the wire types, and the routes read the errors."""
