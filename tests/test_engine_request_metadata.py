"""``GenerationRequest.metadata`` reaches the plugins: the engine hands pre_inference / post_inference
a shallow copy of it as ``InferenceRequest.metadata`` (empty when the request has none)."""

from __future__ import annotations

import pytest
from _tiny_served_fixtures import tiny_served_model

from ruvllm import hookimpl
from ruvllm.engine import EngineConfig, GenerationRequest, LLMEngine
from ruvllm.sampling import SamplingParams


class MetadataRecorder:
    def __init__(self) -> None:
        self.pre: dict[str, dict] = {}
        self.post: dict[str, dict] = {}

    @hookimpl
    def pre_inference(self, request):
        self.pre[request.request_id] = dict(request.metadata)
        request.metadata["written_by_plugin"] = True

    @hookimpl
    def post_inference(self, request, result):
        self.post[request.request_id] = dict(request.metadata)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_served_model(tmp_path_factory.mktemp("tiny"))


def test_metadata_flows_from_the_request_to_the_hooks(model):
    recorder = MetadataRecorder()
    model.host.register(recorder, name="metadata-recorder")
    try:
        engine = LLMEngine(model, EngineConfig(num_blocks=16))
        nested = {"tier": "gold"}
        keyed = GenerationRequest([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                                  request_id="keyed", metadata={"api_key_id": "key-0123abcd", "nested": nested})
        plain = GenerationRequest([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                                  request_id="plain")
        engine.generate([keyed, plain])
    finally:
        model.host.pm.unregister(recorder)
    assert recorder.pre["keyed"] == {"api_key_id": "key-0123abcd", "nested": nested}
    assert recorder.pre["keyed"]["nested"] is nested  # a shallow copy: the values themselves are passed on
    # post_inference sees the same dict, with what pre_inference wrote into it.
    assert recorder.post["keyed"] == {"api_key_id": "key-0123abcd", "nested": nested, "written_by_plugin": True}
    # That stays on the engine's copy, not on the caller's request.
    assert keyed.metadata == {"api_key_id": "key-0123abcd", "nested": nested}
    assert recorder.pre["plain"] == {} and recorder.post["plain"] == {"written_by_plugin": True}
    assert plain.metadata == {}
