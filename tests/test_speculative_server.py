"""Speculative decoding through the server: ``ServerSettings.speculative``, the per-request opt-out
(``"speculative": false`` in the body), the draft counters under ruvllm's and vLLM's names in
/metrics and the acceptance rate in /health."""

from __future__ import annotations

import httpx
import pytest
from _server_fixtures import live_server, smollm2_model  # noqa: F401

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick"


def _counter(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_served_with_speculation(smollm2_model):  # noqa: F811
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    with live_server(smollm2_model) as plain:
        want = httpx.post(plain.url("/v1/completions"), json=body, timeout=120).json()["choices"][0]["text"]
        assert "spec_acceptance_rate" not in httpx.get(plain.url("/health"), timeout=30).json()
    with live_server(smollm2_model, speculative="ngram", num_speculative_tokens=4) as srv:
        r = httpx.post(srv.url("/v1/completions"), json={**body, "speculative": False}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        metrics = httpx.get(srv.url("/metrics"), timeout=30).text
        assert _counter(metrics, "vllm:spec_decode_num_draft_tokens_total") == 0  # it opted out
        r = httpx.post(srv.url("/v1/completions"), json=body, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want  # greedy: unchanged
        metrics = httpx.get(srv.url("/metrics"), timeout=30).text
        drafted = _counter(metrics, "vllm:spec_decode_num_draft_tokens_total")
        accepted = _counter(metrics, "vllm:spec_decode_num_accepted_tokens_total")
        assert drafted > 0 and 0 < accepted <= drafted
        assert _counter(metrics, "ruvllm_spec_decode_num_draft_tokens_total") == drafted
        assert _counter(metrics, "ruvllm_spec_decode_acceptance_rate") == accepted / drafted
        health = httpx.get(srv.url("/health"), timeout=30).json()
        assert health["spec_acceptance_rate"] == round(accepted / drafted, 4)


def test_serve_takes_the_combined_mode_and_a_draft_vocabulary() -> None:
    """``--speculative ngram+draft`` and ``--draft-vocab-size`` reach the engine's config; another mode
    is refused by name when the settings load."""
    from ruvllm_server.settings import ServerConfigError, load_settings

    s = load_settings({"model": "x", "speculative": "ngram+draft", "draft_model": "d.gguf", "draft_vocab_size": 4096})
    assert (s.speculative, s.draft_vocab_size) == ("ngram+draft", 4096)
    with pytest.raises(ServerConfigError, match="speculative"):
        load_settings({"model": "x", "speculative": "auto"})
