"""Who gets which adapter: global, per user, per API key; new scopes routed by the ReasoningBank to
a similar, well-rated scope's adapter or started from the merge of all scopes; bad feedback and bad
configuration are refused with one-line errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _sona_tiny import drain, random_tokens, serve, tiny_sona

from ruvllm.errors import RuvllmError
from ruvllm_sona import FeedbackError, SonaConfig, SonaError, UnknownResponseError
from ruvllm_sona.bank import ReasoningBank
from ruvllm_sona.sona import low_rank_product


def test_scope_modes(tmp_path):
    prompt, out = random_tokens(0, 8), random_tokens(1, 4)
    by_user = tiny_sona(tmp_path / "a", SonaConfig(scope="user"))
    assert serve(by_user, "r1", prompt, out, user="ada").metadata["sona"]["scope"] == "user:ada"
    assert serve(by_user, "r2", prompt, out).metadata["sona"]["scope"] == "global"
    by_key = tiny_sona(tmp_path / "b", SonaConfig(scope="api_key"))
    assert (
        serve(by_key, "r1", prompt, out, user="ada", metadata={"api_key_id": "k7"}).metadata["sona"]["scope"]
        == "key:k7"
    )
    shared = tiny_sona(tmp_path / "c")
    assert serve(shared, "r1", prompt, out, user="ada").metadata["sona"]["scope"] == "global"


def test_feedback_on_one_user_leaves_the_others_alone(tmp_path):
    sona = tiny_sona(tmp_path / "m", SonaConfig(scope="user"))
    serve(sona, "ada-1", random_tokens(0, 10), random_tokens(1, 5), user="ada")
    serve(sona, "bob-1", random_tokens(2, 10), random_tokens(3, 5), user="bob")
    drain(sona)
    receipt = sona.feedback("ada-1", 1.0)
    assert receipt.status == "applied" and receipt.scope == "user:ada"
    assert receipt.advantage == pytest.approx(0.5)
    assert not sona.adapter("user:ada").is_zero
    assert sona.adapter("user:bob").is_zero and sona.adapter("global").is_zero


def test_a_key_rates_only_its_own_responses(tmp_path):
    sona = tiny_sona(tmp_path / "m", SonaConfig(scope="api_key"))
    serve(sona, "a-1", random_tokens(0, 10), random_tokens(1, 5), metadata={"api_key_id": "key-a"})
    serve(sona, "b-1", random_tokens(2, 10), random_tokens(3, 5), metadata={"api_key_id": "key-b"})
    drain(sona)
    with pytest.raises(UnknownResponseError, match="no response 'a-1'"):  # as if it did not exist
        sona.feedback("a-1", 1.0, api_key_id="key-b")
    assert sona.stats()["counters"]["feedback"] == 0 and sona.adapter("key:key-a").is_zero
    receipt = sona.feedback("a-1", 1.0, api_key_id="key-a")
    assert receipt.scope == "key:key-a" and receipt.status == "applied"
    assert not sona.adapter("key:key-a").is_zero and sona.adapter("key:key-b").is_zero
    # Without a caller (in-process use) the response's own scope still gets it.
    assert sona.feedback("b-1", 1.0).scope == "key:key-b"
    # Other scope modes do not scope by key, so the caller's key is not checked.
    by_user = tiny_sona(tmp_path / "u", SonaConfig(scope="user"))
    serve(by_user, "u-1", random_tokens(0, 10), random_tokens(1, 5), user="ada")
    assert by_user.feedback("u-1", 0.5, api_key_id="key-b").scope == "user:ada"


def test_feedback_before_capture_is_queued_then_applied(tmp_path):
    sona = tiny_sona(tmp_path / "m", SonaConfig(capture="on_feedback"))
    serve(sona, "r1", random_tokens(0, 10), random_tokens(1, 5))
    receipt = sona.feedback("r1", 0.9)
    assert receipt.status == "queued"
    assert sona.adapter().is_zero
    drain(sona)
    assert not sona.adapter().is_zero
    assert sona.stats()["trajectories"]["feedback_waiting"] == 0


def test_new_scope_is_routed_to_a_similar_well_rated_scope(tmp_path):
    sona = tiny_sona(
        tmp_path / "m", SonaConfig(scope="user", bank_patterns=2, route_threshold=0.95, route_min_quality=0.6)
    )
    topic = random_tokens(10, 12)
    for i in range(4):
        serve(sona, f"ada-{i}", topic, random_tokens(20 + i, 5), user="ada")
        serve(sona, f"bob-{i}", random_tokens(30 + i, 12), random_tokens(40 + i, 5), user="bob")
    drain(sona)
    for i in range(4):
        sona.feedback(f"ada-{i}", 1.0)
        sona.feedback(f"bob-{i}", 0.3)
    sona.bank.cluster()
    serve(sona, "cy-1", topic, random_tokens(50, 5), user="cy")  # a new user asking what ada asks
    sona.run_cycle()
    cy, ada = sona._slot("user:cy"), sona._slot("user:ada")
    assert cy.routed_from == "user:ada"
    for key in sona.keys:
        np.testing.assert_array_equal(cy.params[key][1], ada.params[key][1])
    assert sona.stats()["counters"]["routed"] == 1


def test_api_keys_are_isolated_tenants(tmp_path):
    """The setup that routes and merges between users does neither between API keys: a new key's
    adapter starts empty although another key, asking the same things, was taught."""
    sona = tiny_sona(
        tmp_path / "m", SonaConfig(scope="api_key", bank_patterns=2, route_threshold=0.95, route_min_quality=0.6)
    )
    topic = random_tokens(10, 12)
    for i in range(4):
        serve(sona, f"a-{i}", topic, random_tokens(20 + i, 5), metadata={"api_key_id": "key-a"})
        serve(sona, f"b-{i}", random_tokens(30 + i, 12), random_tokens(40 + i, 5), metadata={"api_key_id": "key-b"})
    drain(sona)
    for i in range(4):
        sona.feedback(f"a-{i}", 1.0)
        sona.feedback(f"b-{i}", 0.3)
    sona.bank.cluster()
    serve(sona, "c-1", topic, random_tokens(50, 5), metadata={"api_key_id": "key-c"})
    result = sona.run_cycle()
    assert not result["routed"] and not result["merged"]
    assert sona._slot("key:key-c").routed_from is None
    assert sona.adapter("key:key-c").is_zero and not sona.adapter("key:key-a").is_zero
    assert sona.stats()["counters"]["routed"] == 0 and sona.stats()["counters"]["merges"] == 0


def test_new_scopes_start_from_the_merged_adapter(tmp_path):
    sona = tiny_sona(tmp_path / "m", SonaConfig(scope="user", route_threshold=1.1))  # routing off
    for user in ("ada", "bob"):
        serve(sona, f"{user}-1", random_tokens(hash(user) % 100, 10), random_tokens(5, 5), user=user)
    drain(sona)
    sona.feedback("ada-1", 1.0)
    sona.feedback("bob-1", 1.0)
    sona.feedback("bob-1", 1.0)
    assert sona.run_cycle()["merged"]
    new = sona.adapter("user:dee")
    ada, bob = sona.adapter("user:ada"), sona.adapter("user:bob")
    for key in sona.keys:
        # The feedback-weighted mean (1 : 2) of the users' dense updates, best rank-2 approximation.
        dense = sum(
            w * f.scale * f.B.astype(np.float64) @ f.A
            for w, f in ((1 / 3, ada.entries[key]), (2 / 3, bob.entries[key]))
        )
        u, sv, vt = np.linalg.svd(dense)
        want = (u[:, :2] * sv[:2]) @ vt[:2]
        got = new.entries[key].scale * new.entries[key].B.astype(np.float64) @ new.entries[key].A
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(np.abs(want).max(), 1e-6))


def test_low_rank_product_is_exact_when_rank_allows():
    rng = np.random.default_rng(0)
    b, a = rng.standard_normal((7, 3)), rng.standard_normal((3, 9))
    a2, b2 = low_rank_product(b.astype(np.float32), a.astype(np.float32), 3)
    np.testing.assert_allclose(b2 @ a2, b @ a, rtol=1e-5, atol=1e-5)
    a1, b1 = low_rank_product(b.astype(np.float32), a.astype(np.float32), 1)
    u, s, vt = np.linalg.svd(b @ a)
    np.testing.assert_allclose(b1 @ a1, s[0] * np.outer(u[:, 0], vt[0]), rtol=1e-4, atol=1e-5)


def test_bank_clusters_search_and_route():
    bank = ReasoningBank(4, num_patterns=2, max_entries=10)
    centers = np.eye(4)[:2]
    rng = np.random.default_rng(0)
    for i in range(8):
        c = i % 2
        bank.add(
            f"r{i}",
            "good" if c == 0 else "meh",
            centers[c] + 0.05 * rng.standard_normal(4),
            float(i),
            quality=0.9 if c == 0 else 0.2,
        )
    patterns = bank.cluster()
    assert sorted(p.size for p in patterns) == [4, 4]
    best = bank.search(centers[0], 2)
    assert best[0].similarity > 0.95 > best[1].similarity
    assert best[0].pattern.scope == "good" and best[0].pattern.mean_quality == pytest.approx(0.9)
    assert bank.route(centers[0], 0.9, 0.6).pattern.scope == "good"
    assert bank.route(centers[1], 0.9, 0.6) is None  # similar, but badly rated
    for i in range(8, 14):  # the oldest are forgotten past max_entries
        bank.add(f"r{i}", "good", centers[0], float(i))
    assert len(bank) == 10 and bank.set_quality("r0", 1.0) is False


@pytest.mark.parametrize("score", [-0.1, 1.5, math.nan, True, "0.5"])
def test_bad_scores_are_refused(tmp_path, score):
    sona = tiny_sona(tmp_path / "m")
    serve(sona, "r1", random_tokens(0, 8), random_tokens(1, 4))
    with pytest.raises(FeedbackError, match="score"):
        sona.feedback("r1", score)


def test_bad_feedback_targets_and_corrections_are_refused(tmp_path):
    sona = tiny_sona(tmp_path / "m")
    serve(sona, "r1", random_tokens(0, 8), random_tokens(1, 4))
    with pytest.raises(UnknownResponseError, match="no response 'nope'"):
        sona.feedback("nope", 0.5)
    with pytest.raises(FeedbackError, match="tokenizer"):  # no tokenizer here: text needs one
        sona.feedback("r1", 0.5, correction="text")
    with pytest.raises(FeedbackError, match="token ids"):
        sona.feedback("r1", 0.5, correction=[5, 1000])
    with pytest.raises(FeedbackError, match="no tokens"):
        sona.feedback("r1", 0.5, correction=[])
    assert issubclass(FeedbackError, RuvllmError)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"scope": "team"}, "scope must be one of"),
        ({"projections": ("qkv",)}, "unknown projection"),
        ({"layers": (5,)}, "outside 0..1"),
        ({"rank": 0}, "rank must be"),
        ({"ewc_decay": 1.5}, "ewc_decay"),
        ({"instant_lr": -1.0}, "instant_lr"),
        ({"capture": "sometimes"}, "capture must be"),
        ({"layers": (0,)}, "instant loop adapts the last layer"),
    ],
)
def test_bad_configs_are_refused(tmp_path, kw, message):
    with pytest.raises(SonaError, match=message):
        tiny_sona(tmp_path / "m", SonaConfig(**kw))


def test_merged_adapter_is_the_feedback_weighted_mean_of_the_scopes_updates():
    """Two scopes of rank 2 merged at rank 4: B A of the merge equals (w1 B1 A1 + w2 B2 A2) / (w1 + w2)
    in float64 (the rank holds both updates, so the truncation drops nothing)."""
    from ruvllm_sona.scopes import merge_adapters

    rng = np.random.default_rng(3)
    key = (0, "q_proj")

    def factors() -> tuple[np.ndarray, np.ndarray]:
        return rng.standard_normal((2, 6)).astype(np.float32), rng.standard_normal((5, 2)).astype(np.float32)

    parts = [(w, {key: factors()}) for w in (1.0, 3.0)]
    a, b = merge_adapters(parts, [key], rank=4)[key]
    assert a.shape == (4, 6) and b.shape == (5, 4)
    want = sum(w * p[key][1].astype(np.float64) @ p[key][0].astype(np.float64) for w, p in parts) / 4.0
    np.testing.assert_allclose(b.astype(np.float64) @ a, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # At rank 1 it is the best rank-1 approximation of that mean (Eckart-Young).
    a1, b1 = merge_adapters(parts, [key], rank=1)[key]
    u, s, vt = np.linalg.svd(want)
    np.testing.assert_allclose(b1.astype(np.float64) @ a1, s[0] * np.outer(u[:, 0], vt[0]), rtol=0, atol=1e-5 * s[0])


def test_gate_centre_similarity():
    """Centred cosine against a float64 reference; where a vector is the centre itself (one prompt
    seen so far), the uncentred cosine stands in; nothing taught gives None."""
    from ruvllm_sona.scopes import GateCenter

    rng = np.random.default_rng(5)
    seen = rng.standard_normal((6, 8)) + 10.0  # a large shared direction, as final hidden states have
    centre = GateCenter(8)
    for v in seen:
        centre.observe(v)
    np.testing.assert_allclose(centre.mean, seen.mean(0), rtol=0, atol=1e-12)
    q, taught = seen[0], [seen[1], seen[2]]
    mu = seen.mean(0)
    want = max(float((t - mu) @ (q - mu) / np.linalg.norm(t - mu) / np.linalg.norm(q - mu)) for t in taught)
    assert centre.similarity(q, taught) == pytest.approx(want, abs=1e-9)
    assert centre.similarity(q, []) is None
    lone = GateCenter(8)
    lone.observe(seen[0])
    assert lone.similarity(seen[0], [seen[0]]) == pytest.approx(1.0)


def test_gate_similarities_in_one_product_match_the_row_by_row_formula():
    """The router's one-product similarities (centring expanded algebraically) equal centring each
    row in float64, to 1e-9, for hidden-state-like vectors (a shared offset 30x their spread), and
    fall back to the uncentred cosine exactly where a row or the key is the centre."""
    from ruvllm_sona.scopes import GateCenter, KeyTable

    rng = np.random.default_rng(11)
    offset = rng.standard_normal(64) * 30.0
    centre = GateCenter(64)
    for v in rng.standard_normal((50, 64)) + offset:
        centre.observe(v)
    mu = centre.mean
    rows = [*(rng.standard_normal((40, 64)) + offset).astype(np.float32), mu.astype(np.float32)]
    for q in (rng.standard_normal(64) + offset, mu):
        got = centre.similarities(q, KeyTable.of(rows))
        for i, t in enumerate(rows):
            t64, q64 = t.astype(np.float64), np.asarray(q, np.float64)
            tc, qc = t64 - mu, q64 - mu
            if np.linalg.norm(tc) < 1e-3 * np.linalg.norm(t64) or np.linalg.norm(qc) < 1e-3 * np.linalg.norm(q64):
                want = t64 @ q64 / np.linalg.norm(t64) / np.linalg.norm(q64)
            else:
                want = tc @ qc / np.linalg.norm(tc) / np.linalg.norm(qc)
            assert got[i] == pytest.approx(want, abs=1e-9), i


def _ask(sona, rid: str, key: np.ndarray, output=(9, 9)):
    from ruvllm.inference import InferenceRequest, InferenceResult
    from ruvllm.sampling import SamplingParams

    request = InferenceRequest(rid, random_tokens(len(rid), 6), SamplingParams())
    sona.pre_inference(request)
    chosen = request.adapter_router(key)
    sona.post_inference(request, InferenceResult(rid, list(output), "", "stop", 6))
    return chosen


def test_the_router_picks_the_cluster_a_slot_by_slot_search_picks(tmp_path):
    """Twelve clusters taught through many prompts each: for fresh prompts, the one-product router
    chooses the cluster (and similarity) that comparing with each cluster's keys in turn chooses."""
    sona = tiny_sona(tmp_path / "ckpt", SonaConfig(deep_trigger=0))
    rng = np.random.default_rng(3)
    for _ in range(32):
        sona.gate_center.observe(rng.standard_normal(48).astype(np.float32) + 5.0)
    centres = [rng.standard_normal(48).astype(np.float32) * 3 + 5.0 for _ in range(12)]
    for t, c in enumerate(centres):
        for i in range(4):
            _ask(sona, f"t{t}-{i}", c + rng.standard_normal(48).astype(np.float32))
            sona.feedback(f"t{t}-{i}", 0.0, correction=[10 + t, 50 + t, 90 - t])
    drain(sona)
    with sona._lock:
        clusters = [s for s in sona._slots.values() if s.cluster_of == "global"]
    assert len(clusters) == 12
    for j in range(20):
        key = centres[j % 12] + rng.standard_normal(48).astype(np.float32) * 2
        best = max(clusters, key=lambda s: sona.gate_center.similarity(key, s.taught_keys))
        want = sona.gate_center.similarity(key, best.taught_keys)
        slot, sim = sona._nearest("global", key)
        assert slot is best and sim == pytest.approx(want, abs=1e-9)


def test_clusters_stop_at_max_clusters_and_new_answers_join_the_nearest(tmp_path):
    """At ``max_clusters`` a correction with a new answer joins the cluster whose taught prompts are
    nearest its prompt: the count stays bounded, the counter and that cluster's answers say so."""
    sona = tiny_sona(tmp_path / "ckpt", SonaConfig(deep_trigger=0, max_clusters=2))
    rng = np.random.default_rng(4)
    for _ in range(32):
        sona.gate_center.observe(rng.standard_normal(48).astype(np.float32) + 5.0)
    a, b = (rng.standard_normal(48).astype(np.float32) * 3 + 5.0 for _ in range(2))
    _ask(sona, "a", a)
    sona.feedback("a", 0.0, correction=[5, 6, 7])
    _ask(sona, "b", b)
    sona.feedback("b", 0.0, correction=[40, 41, 42])
    _ask(sona, "c", b + rng.standard_normal(48).astype(np.float32) * 0.5)  # near b, a third answer
    receipt = sona.feedback("c", 0.0, correction=[70, 71, 72])
    with sona._lock:
        clusters = {s.scope: s for s in sona._slots.values() if s.cluster_of == "global"}
    assert len(clusters) == 2 and receipt.scope == "global#topic1"
    assert clusters["global#topic1"].taught_answers == [frozenset({40, 41, 42}), frozenset({70, 71, 72})]
    assert sona.stats()["counters"]["cluster_cap_joins"] == 1
    with pytest.raises(SonaError, match="max_clusters must be at least 1"):
        SonaConfig(max_clusters=0).validate(sona.model_config)


def test_clusters_teach_each_topic_its_own_adapter(tmp_path):
    """``clusters=true``: a correction whose prompt is near no taught topic starts a new cluster (a
    fresh adapter); one near a topic teaches that topic's; the gate applies the nearest topic's
    adapter and none to unrelated prompts; clusters are saved and loaded with their parent scope."""
    from ruvllm.inference import InferenceRequest, InferenceResult
    from ruvllm.sampling import SamplingParams

    sona = tiny_sona(tmp_path / "ckpt", SonaConfig(clusters=True, cluster_by="prompt", deep_trigger=0))
    rng = np.random.default_rng(0)
    for _ in range(32):  # ordinary traffic: the gate's centre
        sona.gate_center.observe(rng.standard_normal(48).astype(np.float32) + 5.0)
    topics = {name: rng.standard_normal(48).astype(np.float32) * 3 + 5.0 for name in ("a", "b")}

    def ask(rid: str, key: np.ndarray, output: list[int]):
        request = InferenceRequest(rid, random_tokens(len(rid), 6), SamplingParams())
        sona.pre_inference(request)
        chosen = request.adapter_router(key)
        sona.post_inference(request, InferenceResult(rid, output, "", "stop", 6))
        return chosen

    def near(name: str) -> np.ndarray:
        return topics[name] + rng.standard_normal(48).astype(np.float32) * 0.3

    for name, answer in (("a", [5, 6, 7]), ("b", [40, 41, 42])):
        for i in range(3):  # the corrections come before the background cycle captures them
            rid = f"{name}{i}"
            ask(rid, near(name), [9, 9])
            sona.feedback(rid, 0.0, correction=answer)
        drain(sona)
    clusters = {s["scope"]: s for s in sona.stats()["adapters"] if s["cluster_of"] == "global"}
    assert set(clusters) == {"global#topic0", "global#topic1"}
    assert all(c["instant_updates"] == 3 and c["taught_prompts"] == 3 for c in clusters.values())
    assert sona.adapter("global").is_zero  # the scope's own adapter learnt nothing
    assert ask("qa", near("a"), [1]).scope == "global#topic0"
    assert ask("qb", near("b"), [1]).scope == "global#topic1"
    assert ask("qx", rng.standard_normal(48).astype(np.float32) + 5.0, [1]) is None
    # Feedback on a response that ran under a topic's adapter teaches that topic.
    sona.feedback("qa", 0.0, correction=[5, 6, 7])
    drain(sona)
    assert sona.adapter("global#topic0").version > clusters["global#topic0"]["version"]
    assert len([s for s in sona.stats()["adapters"] if s["cluster_of"]]) == 2
    saved = sona.save(tmp_path / "state")
    again = tiny_sona(tmp_path / "ckpt", SonaConfig(clusters=True, cluster_by="prompt", deep_trigger=0),
                      state_dir=saved)
    assert {s["scope"]: s["cluster_of"] for s in again.stats()["adapters"]} == {
        "global": None,
        "global#topic0": "global",
        "global#topic1": "global",
    }
    with pytest.raises(SonaError, match="clusters needs gate"):
        SonaConfig(clusters=True, gate=False).validate(sona.model_config)


def test_clusters_by_answer_keep_one_answer_together_and_same_wording_apart(tmp_path):
    """``cluster_by="answer"``: corrections teaching one answer through prompts far apart make one
    cluster; one prompt wording about two subjects (prompt keys nearly equal) with different answers
    makes two. The gate still routes by prompt; the answers are saved and loaded with the clusters."""
    from ruvllm.inference import InferenceRequest, InferenceResult
    from ruvllm.sampling import SamplingParams

    config = SonaConfig(clusters=True, cluster_by="answer", deep_trigger=0)
    sona = tiny_sona(tmp_path / "ckpt", config)
    rng = np.random.default_rng(1)
    for _ in range(32):
        sona.gate_center.observe(rng.standard_normal(48).astype(np.float32) + 5.0)

    def ask(rid: str, key: np.ndarray):
        request = InferenceRequest(rid, random_tokens(len(rid), 6), SamplingParams())
        sona.pre_inference(request)
        chosen = request.adapter_router(key)
        sona.post_inference(request, InferenceResult(rid, [9, 9], "", "stop", 6))
        return chosen

    wording = rng.standard_normal(48).astype(np.float32) * 3 + 5.0  # "What is the capital of {e}?"
    far = [rng.standard_normal(48).astype(np.float32) * 3 + 5.0 for _ in range(2)]  # other wordings
    answer_x, answer_y = [11, 12, 13, 14, 15], [11, 12, 13, 30, 31]  # share 3 of 7 tokens: 0.43
    # Subject x: the shared wording, then two unrelated wordings, all answered x.
    for i, key in enumerate([wording, *far]):
        ask(f"x{i}", key + rng.standard_normal(48).astype(np.float32) * 0.05)
        sona.feedback(f"x{i}", 0.0, correction=answer_x)
    # Subject y: the same wording (its key within 0.05 noise of x's), answered y.
    ask("y0", wording + rng.standard_normal(48).astype(np.float32) * 0.05)
    sona.feedback("y0", 0.0, correction=answer_y)
    drain(sona)
    clusters = {s["scope"]: s for s in sona.stats()["adapters"] if s["cluster_of"] == "global"}
    assert set(clusters) == {"global#topic0", "global#topic1"}
    assert clusters["global#topic0"]["taught_prompts"] == 3 and clusters["global#topic1"]["taught_prompts"] == 1
    assert ask("q", far[1] + rng.standard_normal(48).astype(np.float32) * 0.05).scope == "global#topic0"
    saved = sona.save(tmp_path / "state")
    again = tiny_sona(tmp_path / "ckpt", config, state_dir=saved)
    with again._lock:
        answers = {s.scope: s.taught_answers for s in again._slots.values()}
    assert answers["global#topic0"] == [frozenset(answer_x)] and answers["global#topic1"] == [frozenset(answer_y)]
    # A later correction with x's answer joins x's cluster even from y's wording.
    ask("y1", wording)
    sona.feedback("y1", 0.0, correction=answer_x)
    assert len([s for s in sona.stats()["adapters"] if s["cluster_of"]]) == 2
    for bad, match in (({"cluster_by": "subject"}, "cluster_by must be"), ({"cluster_answer_overlap": 0.0}, "overlap")):
        with pytest.raises(SonaError, match=match):
            SonaConfig(clusters=True, **bad).validate(sona.model_config)


def _observed(slot) -> int:
    """Trajectories a slot's EWC++ has observed (still in its window, or accumulated into its task)."""
    return len(slot.ewc._window) + slot.ewc._n + slot.ewc.consolidated.count


@pytest.mark.parametrize("clusters", [True, False])
def test_a_clusters_ewc_observes_nothing(tmp_path, clusters):
    """A cluster holds one taught topic and its EWC++ observes nothing (issue 18: a boundary inside
    the topic anchored the penalty at a half-taught adapter and held taught facts back): not the
    correction, not a response corrected before its capture (moved into the cluster at its
    feedback), not one that ran under the cluster. Without clusters everything goes to the scope's
    one adapter, whose EWC++ observes all of it as before."""
    from ruvllm_sona.records import Trajectory

    sona = tiny_sona(tmp_path / "ckpt", SonaConfig(clusters=clusters, cluster_by="answer", deep_trigger=0))
    serve(sona, "r1", random_tokens(0, 10), random_tokens(1, 5))  # not captured yet: eager, no cycle ran
    receipt = sona.feedback("r1", 0.0, correction=[11, 12, 13])
    drain(sona)
    with sona._lock:
        taught = sona._slots[receipt.scope]
    assert taught.cluster_of == ("global" if clusters else None)
    # A later response that ran under the taught adapter (routed there by the gate).
    sona.record(Trajectory("r2", receipt.scope, random_tokens(2, 10), random_tokens(3, 5), taught.snapshot, 0.0))
    drain(sona)
    assert sona.stats()["counters"]["captures"] == 3  # all three were captured
    assert _observed(taught) == (0 if clusters else 3)
    assert sona.stats()["counters"]["boundaries"] == 0
    assert not taught.snapshot.is_zero  # the correction was still taught
