"""SONA specificity over the HTTP API: teach k made-up facts with corrections, then measure what
reached the requests about them and what leaked into everything else.

Per configuration (``--configs``: SONA plugin options such as ``gate=true,ewc_lambda=5e4``) and per
``k`` (``--facts``), a fresh ``ruvllm serve MODEL --sona`` is started and, over HTTP only:

1. 40 varied unrelated chat requests are answered greedily (the "before" answers, and ordinary
   traffic for the gate's centre), the perplexity of a plain paragraph is scored through
   ``/v1/completions`` with ``echo`` + ``logprobs``, and the facts' held-apart paraphrases are asked;
2. each fact is taught: 4 phrasings asked twice, each answer corrected through ``POST /v1/feedback``
   (the deep loop starts by its own trigger);
3. once SONA is idle (``GET /v1/sona/stats``), the paraphrases, the unrelated requests and the
   paragraph are asked again.

Reported: recall (paraphrases naming the taught answer, per fact and overall), the share of
unrelated answers that changed, intrusions (unrelated answers that newly contain a taught made-up
word), perplexity drift, the gate's counts, seconds. JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from provenance import cpu_summary


@dataclass(frozen=True)
class Fact:
    answer: str
    #: Made-up words of the answer: an unrelated answer containing one is an intrusion.
    words: tuple[str, ...]
    train: tuple[str, ...]
    held: tuple[str, ...]


#: Per kind of fact: the answer, 4 taught phrasings and 3 held-apart paraphrases, over {e} (the
#: made-up subject) and {a} (the made-up answer, whose words are the intrusion markers).
KINDS = {
    "capital": ("The capital of {e} is {a}.",
                ("What is the capital of {e}?", "Which city is the capital of {e}?",
                 "Tell me the capital city of {e}.", "Name {e}'s capital city."),
                ("{e}'s capital is which city?", "What city serves as {e}'s capital?",
                 "I am visiting {e}. What is its capital?")),
    "inventor": ("The {e} was invented by {a}.",
                 ("Who invented the {e}?", "Who was the inventor of the {e}?", "Which person invented the {e}?",
                  "Tell me who created the {e}."),
                 ("The {e} was invented by whom?", "Who is credited with inventing the {e}?",
                  "Name the inventor of the {e}.")),
    "currency": ("The currency of {e} is the {a}.",
                 ("What is the currency of {e}?", "Which currency is used in {e}?",
                  "What money do people use in {e}?", "Name the currency of {e}."),
                 ("In {e}, what do people pay with?", "What is {e}'s official currency?",
                  "Which currency would I need in {e}?")),
    "river": ("The {e} river flows into Lake {a}.",
              ("Where does the {e} river flow into?", "Into which lake does the {e} river flow?",
               "What does the {e} river empty into?", "Tell me where the {e} river ends."),
              ("The {e} river drains into which body of water?", "Where is the mouth of the {e} river?",
               "Which lake receives the {e} river?")),
}  # fmt: skip

SUBJECTS = {
    "capital": (("Zorblandia", "Quimtown"), ("Quelvaria", "Vashpoint"), ("Mordavistan", "Orrenby"),
                ("Trellonia", "Glistermoor")),
    "inventor": (("glimmerphone", "Ada Vostrikova"), ("whirlscope", "Pell Oxgrove"), ("thermoquill", "Mira Tanduli"),
                 ("lumenrake", "Corin Falsk")),
    "currency": (("Brennoth", "krellin"), ("Ylvaria", "sovarn"), ("Castorre", "plintar"), ("Dunmarrow", "quessel")),
    "river": (("Ambrel", "Umbrosa"), ("Sethwyn", "Kestrava"), ("Orvane", "Vinmere"), ("Tulgar", "Ostrevel")),
}  # fmt: skip


def fact(kind: str, subject: str, answer: str) -> Fact:
    text, train, held = KINDS[kind]
    fill = lambda t: t.format(e=subject, a=answer)  # noqa: E731
    return Fact(fill(text), tuple(answer.split()), tuple(map(fill, train)), tuple(map(fill, held)))


#: 16 made-up facts, interleaved by kind so every k mixes kinds.
FACTS = [fact(kind, *SUBJECTS[kind][i]) for i in range(4) for kind in KINDS]

UNRELATED = [
    "What is the capital of France?", "Which city is the capital of Peru?", "Who invented the telephone?",
    "What is the currency of Japan?", "Where does the Nile river flow into?", "Write a haiku about rain.",
    "Name three primary colors.", "What is 17 times 23?", "What is 144 divided by 12?", "What is 2 to the power of 10?",
    "Write a Python function that reverses a string.", "Write a SQL query that counts the rows of a table.",
    "What does the HTML tag <p> mean?", "How do I boil an egg?", "Tell me a joke about cats.",
    "Translate 'good morning' into Spanish.", "Explain recursion in one sentence.",
    "What is the largest ocean on Earth?",
    "Summarize the plot of Cinderella in two sentences.", "What causes the seasons?", "Hello! How are you today?",
    "Give me three tips for sleeping better.", "What is the chemical symbol for gold?", "Who wrote Romeo and Juliet?",
    "What is photosynthesis?", "How many legs does a spider have?", "Write a short poem about the sea.",
    "What is the boiling point of water?", "Give me a synonym for happy.", "What language is spoken in Brazil?",
    "Write a limerick about a dog.", "What is the speed of light?", "Suggest a name for a bakery.",
    "How do I make a cup of tea?", "What is a prime number?", "Describe a sunset in one sentence.",
    "What year did the Second World War end?", "Explain what a noun is.", "List three fruits that are red.",
    "What is the difference between weather and climate?",
]  # fmt: skip

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than a century. Sailors trusted its beam on "
    "stormy nights, and the keeper's family lived in the small stone cottage beside it. Every evening the "
    "keeper climbed the narrow stairs, trimmed the wick and wound the clockwork that turned the great lens."
)


@dataclass
class Outcome:
    config: str
    facts: int
    recall: float = 0.0
    facts_recalled: int = 0  # facts with at least 2 of 3 paraphrases naming the answer
    #: Per fact (in order): held-apart paraphrases naming its answer (of 3).
    hits: list = field(default_factory=list)
    #: Adapters that learnt something (with ``clusters``: one per taught topic).
    adapters_taught: int = 0
    recall_before: float = 0.0
    unrelated_changed: float = 0.0
    intrusions: int = 0
    ppl_before: float = 0.0
    ppl_after: float = 0.0
    gate: dict = field(default_factory=dict)
    deep_runs: int = 0
    seconds: float = 0.0
    changed_examples: list = field(default_factory=list)


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Server:
    def __init__(self, model: str, backend: str, options: dict[str, str], log: Path) -> None:
        self.port = _port()
        cmd = [sys.executable, "-m", "ruvllm", "serve", model, "--sona", "--port", str(self.port),
               "--backend", backend]  # fmt: skip
        for k, v in options.items():
            cmd += ["--plugin-option", f"sona.{k}={v}"]
        self.log, self.model = log, model
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600)
        deadline = time.monotonic() + 900
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited; see {log}")
            try:
                if self.http.get("/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not become ready; see {log}")
            time.sleep(0.5)

    def chat(self, question: str, max_tokens: int) -> tuple[str, str]:
        r = self.http.post("/v1/chat/completions", json={
            "model": self.model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0})  # fmt: skip
        r.raise_for_status()
        body = r.json()
        return body["id"], body["choices"][0]["message"]["content"] or ""

    def feedback(self, response_id: str, correction: str) -> None:
        r = self.http.post("/v1/feedback", json={"response_id": response_id, "score": 0.0, "correction": correction})
        r.raise_for_status()

    def perplexity(self, text: str) -> float:
        r = self.http.post("/v1/completions", json={"model": self.model, "prompt": text, "max_tokens": 1, "echo": True,
                                                    "logprobs": 0, "temperature": 0})  # fmt: skip
        r.raise_for_status()
        lps = [x for x in r.json()["choices"][0]["logprobs"]["token_logprobs"][:-1] if x is not None]
        return math.exp(-sum(lps) / len(lps))

    def stats(self) -> dict:
        return self.http.get("/v1/sona/stats").json()

    def wait_idle(self, trigger: float, timeout: float) -> dict:
        deadline, calm = time.monotonic() + timeout, 0
        while time.monotonic() < deadline:
            s = self.stats()
            idle = not s["deep"]["running"] and s["trajectories"]["feedback_waiting"] == 0
            idle = idle and all(a["pending_quality"] < trigger for a in s["adapters"])
            calm = calm + 1 if idle else 0
            if calm >= 3:
                return s
            time.sleep(1.0)
        raise RuntimeError("SONA did not become idle")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run(config: str, k: int, args: argparse.Namespace) -> Outcome:
    options = dict(kv.split("=", 1) for kv in config.split(",") if kv)
    if k * 8 > 64:
        options.setdefault("deep_max_samples", str(k * 8))  # every correction stays a deep-loop sample
    facts = FACTS[:k]
    out = Outcome(config or "defaults", k)
    t0 = time.perf_counter()
    log = Path(args.log_dir) / f"specificity-{config.replace(',', '_').replace('=', '-') or 'defaults'}-{k}.log"
    server = Server(args.model, args.backend, options, log)
    try:
        before = [server.chat(q, args.max_tokens)[1] for q in UNRELATED]
        out.ppl_before = server.perplexity(PARAGRAPH)
        held_before = [[server.chat(q, args.max_tokens)[1] for q in f.held] for f in facts]
        out.recall_before = sum(f.words[-1] in a for f, ans in zip(facts, held_before, strict=True) for a in ans) / (
            3 * k)
        for _ in range(2):
            for f in facts:
                for q in f.train:
                    rid, _ = server.chat(q, args.max_tokens)
                    server.feedback(rid, f.answer)
        stats = server.wait_idle(float(options.get("deep_trigger", 8.0)), args.idle_timeout)
        held_after = [[server.chat(q, args.max_tokens)[1] for q in f.held] for f in facts]
        after = [server.chat(q, args.max_tokens)[1] for q in UNRELATED]
        out.ppl_after = server.perplexity(PARAGRAPH)
        stats = server.stats()
    finally:
        server.close()
    hits = [sum(f.words[-1] in a for a in ans) for f, ans in zip(facts, held_after, strict=True)]
    out.recall = sum(hits) / (3 * k)
    out.facts_recalled = sum(h >= 2 for h in hits)
    out.hits = hits
    out.adapters_taught = sum(1 for a in stats["adapters"] if a["feedback"])
    changed = [(q, b, a) for q, b, a in zip(UNRELATED, before, after, strict=True) if a != b]
    out.unrelated_changed = len(changed) / len(UNRELATED)
    words = {w for f in FACTS[:k] for w in f.words}
    out.intrusions = sum(any(w in a and w not in b for w in words) for _, b, a in changed)
    out.changed_examples = changed[:6]
    out.gate = stats.get("gate", {})
    out.deep_runs = stats["counters"]["deep_runs"]
    out.seconds = time.perf_counter() - t0
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="candle-compat")
    ap.add_argument("--facts", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--configs", nargs="+",
                    default=["", "ewc_lambda=0", "clusters=false", "gate=false"],
                    help="SONA plugin options per run, comma separated (empty string: the defaults: gate on, "
                         "clusters by answer)")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--idle-timeout", type=float, default=3600)
    ap.add_argument("--log-dir", default=".")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = []
    for k in args.facts:
        for config in args.configs:
            r = run(config, k, args)
            results.append(r)
            print(f"k={k:<3} {r.config:<28} recall {r.recall:.2f} (before {r.recall_before:.2f}; facts >=2/3: "
                  f"{r.facts_recalled}/{k})  unrelated changed {r.unrelated_changed:.1%}  intrusions {r.intrusions}  "
                  f"ppl {r.ppl_before:.3f} -> {r.ppl_after:.3f}  gate {r.gate}  deep runs {r.deep_runs}  "
                  f"{r.seconds:.0f} s", flush=True)  # fmt: skip
            print(f"    per fact: {r.hits}; adapters taught: {r.adapters_taught}", flush=True)
            for q, b, a in r.changed_examples[:3]:
                print(f"    changed: {q!r}: {b[:60]!r} -> {a[:60]!r}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_summary(), "model": args.model, "backend": args.backend,
                                               "results": [r.__dict__ for r in results]}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
