"""The scheduler's policy, driven without a model: token budget, chunked prefill, admission order,
seat limits, preemption and the block accounting behind them."""

from __future__ import annotations

import itertools

import pytest

from ruvllm.block_manager import BlockManager
from ruvllm.engine.config import EngineConfig, EngineConfigError, default_num_blocks, kv_block_bytes
from ruvllm.engine.scheduler import Scheduler, SchedulerOutput
from ruvllm.engine.sequence import RequestState, Sequence
from ruvllm.engine.types import GenerationRequest, RequestMetrics
from ruvllm.inference import InferenceRequest
from ruvllm.model_config import ModelConfig
from ruvllm.sampling import Sampler, SamplingParams

_order = itertools.count()
_token_base = itertools.count(1000, 1000)


def make_seq(prompt_len: int, *, priority: int = 0, shared_prompt: list[int] | None = None) -> Sequence:
    # Distinct token ids per sequence unless a prompt is given, so prefix hits happen only on purpose.
    base = next(_token_base)
    prompt = list(shared_prompt) if shared_prompt is not None else list(range(base, base + prompt_len))
    req = GenerationRequest(prompt, SamplingParams(max_tokens=64), priority=priority)
    state = RequestState(
        request=req,
        inference=InferenceRequest(req.request_id, prompt, req.sampling),
        sampling=req.sampling,
        prompt_token_ids=prompt,
        order=next(_order),
        metrics=RequestMetrics(),
    )
    seq = Sequence(state, 0, Sampler(req.sampling), detokenizer=None)
    state.seqs.append(seq)
    return seq


def run_step(sched: Scheduler) -> SchedulerOutput:
    """One step as the engine runs it: schedule, 'compute', and append a token where one is due."""
    out = sched.schedule()
    sched.update_after_forward(out)
    for chunk in out.chunks:
        if chunk.completes:
            chunk.seq.token_ids.append(7)
    return out


def planned(out: SchedulerOutput) -> dict[Sequence, tuple[int, int]]:
    return {c.seq: (c.start, c.num_tokens) for c in out.chunks}


def test_token_budget_chunks_long_prompts_and_mixes_them_with_decodes():
    bm = BlockManager(64, 16)
    sched = Scheduler(bm, max_num_batched_tokens=128)
    a, b, c = make_seq(100), make_seq(100), make_seq(100)
    for s in (a, b, c):
        sched.add(s)
    out = run_step(sched)
    assert planned(out) == {a: (0, 100), b: (0, 28)}
    assert out.num_tokens == 128 and sched.waiting == [c]
    out = run_step(sched)
    # a decodes its first sampled token, b finishes its prompt, c starts with what is left.
    assert planned(out) == {a: (100, 1), b: (28, 72), c: (0, 55)}
    out = run_step(sched)
    assert planned(out) == {a: (101, 1), b: (100, 1), c: (55, 45)}


def test_max_num_seqs_limits_admission():
    sched = Scheduler(BlockManager(64, 16), max_num_seqs=2)
    seqs = [make_seq(5) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    run_step(sched)
    assert sched.running == seqs[:2] and sched.waiting == seqs[2:]
    sched.remove(seqs[0])
    run_step(sched)
    assert seqs[2] in sched.running


def test_fcfs_admits_in_arrival_order_and_priority_by_priority():
    fcfs = Scheduler(BlockManager(64, 16), max_num_seqs=1)
    first, second = make_seq(5, priority=5), make_seq(5, priority=0)
    fcfs.add(second)
    fcfs.add(first)  # added later, but arrived (was created) earlier
    run_step(fcfs)
    assert fcfs.running == [first]

    prio = Scheduler(BlockManager(64, 16), max_num_seqs=1, policy="priority")
    low, high = make_seq(5, priority=5), make_seq(5, priority=0)
    prio.add(low)
    prio.add(high)
    run_step(prio)
    assert prio.running == [high]


def test_priority_policy_preempts_a_less_important_running_sequence():
    sched = Scheduler(BlockManager(64, 16), max_num_seqs=1, policy="priority")
    low = make_seq(5, priority=5)
    sched.add(low)
    run_step(sched)
    high = make_seq(5, priority=0)
    sched.add(high)
    run_step(sched)
    assert sched.running == [high] and sched.waiting == [low]
    assert low.num_computed == 0 and sched.preemptions == 1
    assert not sched.block_manager.has(low.seq_id)


def test_out_of_blocks_preempts_the_newest_and_it_recomputes_later():
    bm = BlockManager(4, 4)  # 16 slots in all
    sched = Scheduler(bm)
    old, new = make_seq(6), make_seq(6)  # 2 blocks each: the cache is full after admission
    sched.add(old)
    sched.add(new)
    run_step(sched)
    assert set(sched.running) == {old, new} and bm.num_free_blocks == 0
    # Both decode slots 6 and 7; slot 8 needs a third block: the newest sequence gives its up.
    run_step(sched)
    run_step(sched)
    assert sched.preemptions == 0
    out = run_step(sched)
    assert out.preempted == [new] and sched.preemptions == 1
    assert sched.running == [old] and sched.waiting == [new]
    assert new.num_computed == 0 and len(new.token_ids) == 9  # prompt + 3 produced tokens kept
    assert planned(out) == {old: (8, 1)}
    # Once old finishes, new is recomputed (prompt and output so far) in one chunk; its first
    # block, full and computed before the preemption, comes back from the prefix cache.
    sched.remove(old)
    out = run_step(sched)
    assert planned(out) == {new: (4, 5)}
    assert sched.prefix_cache_hit_tokens == 4
    sched.remove(new)
    assert bm.num_used_blocks == 0


def test_sequence_that_cannot_get_a_block_preempts_itself_when_it_is_the_newest():
    bm = BlockManager(3, 4)
    sched = Scheduler(bm)
    old, new = make_seq(2), make_seq(8)
    sched.add(old)
    sched.add(new)
    run_step(sched)  # old: 1 block, new: 2 blocks; the cache is full
    out = run_step(sched)  # old decodes slot 2 in its block; new needs a block for slot 8
    assert out.preempted == [new] and planned(out) == {old: (2, 1)}
    # No admission in a step that preempted: new waits for the next step.
    assert sched.waiting == [new]


def test_admission_reuses_cached_prefix_blocks_and_counts_hits():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm)
    prompt = list(range(10))
    first = make_seq(0, shared_prompt=prompt)
    sched.add(first)
    run_step(sched)
    second = make_seq(0, shared_prompt=prompt)
    sched.add(second)
    out = run_step(sched)
    assert planned(out)[second] == (8, 2)  # two full blocks came from the cache
    assert second.num_cached_tokens == 8
    assert bm.block_table(second.seq_id)[:2] == bm.block_table(first.seq_id)[:2]
    assert sched.prefix_cache_hit_tokens == 8 and sched.prefix_cache_queried_tokens == 20


def test_blocks_all_return_after_every_sequence_is_removed():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_batched_tokens=16)
    seqs = [make_seq(n) for n in (3, 9, 14, 5, 20)]
    for s in seqs:
        sched.add(s)
    for _ in range(12):
        run_step(sched)
    assert sched.preemptions > 0  # 16 blocks were too few for all of them
    for s in seqs:
        sched.remove(s)
    assert bm.num_used_blocks == 0 and not sched.running and not sched.waiting


def test_unknown_policy_is_refused():
    with pytest.raises(EngineConfigError, match="policy"):
        Scheduler(BlockManager(4, 4), policy="random")


@pytest.mark.parametrize(
    "bad",
    [
        {"block_size": 0},
        {"num_blocks": 0},
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"eviction": "mru"},
        {"policy": "lifo"},
        {"max_model_len": 1},
    ],
)
def test_engine_config_values_are_checked(bad):
    with pytest.raises(EngineConfigError):
        EngineConfig(**bad).validate()


def test_default_num_blocks_is_max_num_seqs_contexts_capped_by_the_memory_budget():
    # SmolLM2-135M's shape: 30 layers, 3 KV heads of 64.
    cfg = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 8192)
    per_block = kv_block_bytes(cfg, 16)
    assert per_block == 2 * 30 * 3 * 64 * 16 * 4
    # Budget large enough: 4 sequences of 2048 tokens = 4 * 128 blocks.
    roomy = EngineConfig(max_num_seqs=4, kv_cache_memory_bytes=10**12)
    assert default_num_blocks(cfg, roomy, max_model_len=2048) == 512
    # Budget binding: 100 blocks' worth of bytes.
    tight = EngineConfig(max_num_seqs=64, kv_cache_memory_bytes=100 * per_block + 5)
    assert default_num_blocks(cfg, tight, max_model_len=8192) == 100
