"""Prometheus metrics of one server instance, in its own registry (several apps may share a process).

Routing (the Kubernetes Gateway API Inference Extension's model-server protocol, llm-d, KServe): the
protocol's metrics are served under ruvllm names and, unchanged, under the vLLM names routers built
for vLLM scrape:

==========================  =====================================  ==================================
protocol metric             ruvllm name                            vLLM alias
==========================  =====================================  ==================================
TotalQueuedRequests         ``ruvllm_num_requests_waiting``        ``vllm:num_requests_waiting``
TotalRunningRequests        ``ruvllm_num_requests_running``        ``vllm:num_requests_running``
KVCacheUtilization          ``ruvllm_kv_cache_usage_perc`` (0-1)   ``vllm:kv_cache_usage_perc``,
                                                                   ``vllm:gpu_cache_usage_perc``
BlockSize, NumGPUBlocks     ``ruvllm_cache_config_info`` labels    ``vllm:cache_config_info``
                            ``block_size``, ``num_gpu_blocks``
LoRA adapters               ``ruvllm_lora_requests_info`` labels   ``vllm:lora_requests_info``
                            ``max_lora``, ``running_lora_adapters``,
                            ``waiting_lora_adapters`` (value: time)
==========================  =====================================  ==================================

Waiting counts requests queued in the engine plus those waiting for admission; running counts
requests with a sequence in the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ruvllm.engine.types import EngineStats, RequestMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _StateCollector(Collector):
    """Gauges and counters read at scrape time from the engine and the admission controller."""

    def __init__(
        self,
        engine_stats: Callable[[], EngineStats | None],
        admission: Callable[[], tuple[int, int]],
        max_lora: int = 0,
    ) -> None:
        self._engine_stats = engine_stats
        self._admission = admission
        self._max_lora = max_lora

    def collect(self) -> Iterator[Metric]:
        in_flight, queued = self._admission()
        yield GaugeMetricFamily(
            "ruvllm_server_requests_in_flight", "Requests admitted and being served", value=in_flight
        )
        yield GaugeMetricFamily("ruvllm_server_requests_queued", "Requests waiting for admission", value=queued)
        stats = self._engine_stats()
        if stats is None:
            return
        usage = stats.blocks_used / stats.blocks_total if stats.blocks_total else 0.0
        if stats.local_blocks_total:  # a hybrid cache: the fuller of its two pools bounds admission
            usage = max(usage, stats.local_blocks_used / stats.local_blocks_total)
        for prefix in ("ruvllm_", "vllm:"):
            yield GaugeMetricFamily(
                f"{prefix}num_requests_running", "Requests being served by the engine", value=stats.running_requests
            )
            yield GaugeMetricFamily(
                f"{prefix}num_requests_waiting",
                "Requests waiting (engine queue and admission queue)",
                value=stats.waiting_requests + queued,
            )
            yield GaugeMetricFamily(f"{prefix}kv_cache_usage_perc", "KV cache usage (1 = full)", value=usage)
            info = GaugeMetricFamily(
                f"{prefix}cache_config_info", "KV cache configuration", labels=["block_size", "num_gpu_blocks"]
            )
            info.add_metric([str(stats.block_size), str(stats.blocks_total)], 1.0)
            yield info
            lora = GaugeMetricFamily(
                f"{prefix}lora_requests_info",
                "Adapters of running and waiting requests (value: when this was read)",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            lora.add_metric(
                [str(self._max_lora), ",".join(stats.running_adapters), ",".join(stats.waiting_adapters)], time.time()
            )
            yield lora
        yield GaugeMetricFamily("vllm:gpu_cache_usage_perc", "KV cache usage (1 = full; older vLLM name)", value=usage)
        yield GaugeMetricFamily("ruvllm_kv_blocks_used", "KV cache blocks in use", value=stats.blocks_used)
        yield GaugeMetricFamily("ruvllm_kv_blocks_total", "KV cache blocks allocated", value=stats.blocks_total)
        if stats.local_blocks_total:
            yield GaugeMetricFamily(
                "ruvllm_kv_local_blocks_used",
                "KV blocks in use in the windowed layers' own pool (hybrid cache)",
                value=stats.local_blocks_used,
            )
            yield GaugeMetricFamily(
                "ruvllm_kv_local_blocks_total",
                "KV blocks of the windowed layers' own pool (hybrid cache)",
                value=stats.local_blocks_total,
            )
        yield CounterMetricFamily(
            "ruvllm_preemptions", "Sequences preempted for lack of KV blocks", value=stats.preemptions
        )
        yield CounterMetricFamily(
            "ruvllm_prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache",
            value=stats.prefix_cache_hit_tokens,
        )
        yield CounterMetricFamily(
            "ruvllm_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache",
            value=stats.prefix_cache_queried_tokens,
        )
        for prefix in ("ruvllm_", "vllm:"):  # speculative decoding, under vLLM's names too
            yield CounterMetricFamily(
                f"{prefix}spec_decode_num_draft_tokens", "Draft tokens verified", value=stats.spec_draft_tokens
            )
            yield CounterMetricFamily(
                f"{prefix}spec_decode_num_accepted_tokens", "Draft tokens kept", value=stats.spec_accepted_tokens
            )
            yield CounterMetricFamily(
                f"{prefix}spec_decode_num_drafts", "Verification chunks run", value=stats.spec_verifications
            )
        if stats.spec_acceptance_rate is not None:  # what a router reads of the load without a rate()
            yield GaugeMetricFamily(
                "ruvllm_spec_decode_acceptance_rate",
                "Draft tokens kept / draft tokens verified",
                value=stats.spec_acceptance_rate,
            )


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter(
            "ruvllm_http_requests",
            "HTTP requests by route template, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "ruvllm_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "ruvllm_inter_token_latency_seconds", "Time between tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "ruvllm_e2e_request_latency_seconds", "Request latency, end to end", buckets=_E2E_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "ruvllm_request_queue_time_seconds", "Time queued in the engine", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("ruvllm_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_tokens = Counter(
            "ruvllm_prompt_cached_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.completion_tokens = Counter("ruvllm_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "ruvllm_request_finished", "Generation requests by finish reason", ["finish_reason"], registry=r
        )
        self.lora_requests = Counter(
            "ruvllm_lora_requests", "Finished requests per LoRA adapter (model name)", ["lora_name"], registry=r
        )
        self.lora_tokens = Counter(
            "ruvllm_lora_generation_tokens", "Tokens generated per LoRA adapter", ["lora_name"], registry=r
        )

    def watch(
        self,
        engine_stats: Callable[[], EngineStats | None],
        admission: Callable[[], tuple[int, int]],
        max_lora: int = 0,
    ) -> None:
        self.registry.register(_StateCollector(engine_stats, admission, max_lora))

    def observe_request(self, m: RequestMetrics, finish_reasons: list[str], adapter: str | None = None) -> None:
        if adapter:
            self.lora_requests.labels(adapter).inc()
            self.lora_tokens.labels(adapter).inc(m.completion_tokens)
        self.prompt_tokens.inc(m.prompt_tokens)
        self.cached_tokens.inc(m.cached_tokens)
        self.completion_tokens.inc(m.completion_tokens)
        self.queue_time.observe(m.queue_time)
        if m.completion_tokens:
            self.ttft.observe(m.ttft)
        for gap in m.inter_token_latencies:
            self.itl.observe(gap)
        self.e2e.observe(m.e2e)
        for reason in finish_reasons:
            self.finished.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
