"""Decode speed of the plugin against vLLM without it: every request prefilled first, only decode steps timed.

``python -m witcert.integrations.vllm.bench speed MODEL`` starts one engine process per configuration that
needs its own (plugin off and on; vLLM's own cache ``auto`` and, where the CPU runs it, ``fp8``, ``fp8_e4m3``,
``fp8_e5m2``), keeps them alive, and measures the modes interleaved, round after round (a change of machine
load hits every mode alike). One measurement (:func:`decode_rate`): the observatory's needle prompts are added
to the engine, stepped until every request has its first token (the prefill, not timed; prefix caching keeps
later rounds' prefills short; what the prefill deferred, its journaled writes, is entered before the clock
starts), then every remaining step is timed, and the mode's own deferred work with them (``settle``: the
plugin's deferred rows metered, its audits closed, as when the engine goes idle) before the clock stops: decode tokens after that point over the time of those steps. Each mode is run once untimed first,
as measured (compilation of the shapes the timed rounds meet, the prompts' cached prefix).

A mode is an engine plus per-request switches (``SamplingParams.extra_args``: the scheme, the metering
switches), so the modes of one engine share its process. How the comparison is kept fair:

- what a mode defers is paid in its own window and never in another's: the settle runs inside the window,
  and nothing is left queued when the next measurement begins;
- ``floor`` (plugin on, the request meters no layer: ``witcert_meter_layers: "none"``) is what the plugin
  costs a request that asks for nothing (its cache writes journaled, its cells counted), measured in the
  plugin-on engine beside the metered modes: a metered mode over the floor is the cost of its metering alone,
  free of the difference between two engine processes;
- the order of the modes is shuffled every round after the first (:func:`ordered`), so no mode always follows
  the same one (what a mode leaves behind: cache blocks its prompts took from the next mode's prefix, garbage
  for the collector, which runs before every timed window); every run records its round and place in it
  (``round``, ``position``), so an order effect shows in the record;
- every engine runs on one OpenMP thread, unbound (the repository's benchmarks run one thread on the shared
  machine); every engine is started at once (their startups overlap; an engine waiting for its next
  measurement is idle) and lives until the end.

It prints one line per mode, ``<mode>: <ratio>x of plugin off (<ratio>x in CPU time)`` (the median decode
tokens/s of the mode over the median of plugin off with the same cache, same run; by the wall clock, and per
second of the engine process's CPU time, which other work on a shared machine does not inflate), and returns
every measurement with its per-request token counts. ``--modes`` runs a subset (the record names the modes that
ran), so a run stays within minutes.
"""
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from .sampling import NO_LAYER

SPEED = "WITCERT-SPEED "
CPU_RATE = "decode_tokens_per_cpu_s"
"""Decode tokens per second of the engine process's CPU time (``time.process_time``: all its threads): on a shared
machine, what other work takes of the cores is not counted, as it is in the wall-clock rate."""
READY = "WITCERT-READY"
MODE_KEYS = ("exact", "floor", "scheme", "every", "audit", "caches", "gate", "spot-gate")
"""``--modes`` choices: metering an exact cache, the plugin on with nothing metered, the lossy scheme, every k-th step, the request audit, vLLM's own
caches of ``--kv-cache-dtypes`` other than ``auto`` (each with its own plugin-off engine), and the gate on
:data:`GATE_SCHEME` (an engine with the exact store): meter-only (``gate``) and spot-certified (``spot-gate``)."""
GATE_SCHEME = "kivi-2bit"
"""The gate modes' scheme: its 2-bit keys saturate the deterministic meter (the meter-only gate repairs most cells)."""


@dataclass(frozen=True)
class Mode:
    """One measured configuration: an engine (``plugin``, ``kv_cache_dtype``) and a request's ``xargs``."""

    name: str
    plugin: bool
    kv_cache_dtype: str = "auto"
    xargs: dict = field(default_factory=dict)
    gate: bool = False  # an engine with the gate's exact store (WITCERT_VLLM_GATE=1)

    @property
    def engine(self) -> tuple:
        """The engine this mode runs in (modes with the same one share its process)."""
        return self.plugin, self.kv_cache_dtype, self.gate

    @property
    def baseline(self) -> str:
        return "plugin off" if self.kv_cache_dtype == "auto" else f"plugin off, {self.kv_cache_dtype} cache"


def modes(caches: tuple = (), scheme: str = "rtn-int4", every: int = 4, audit_rate: float = 0.02,
          keys: tuple = MODE_KEYS) -> list:
    """The modes of the speed table (those of ``keys``, :data:`MODE_KEYS`): metering an exact cache, the plugin's
    floor (on, the request metering no layer), a lossy scheme,
    every k-th step, the request audit at ``audit_rate``, and vLLM's own ``caches`` (e.g. ``fp8``; where the CPU runs
    them) off and metered; each metered mode with its plugin-off baseline."""
    unknown = set(keys) - set(MODE_KEYS)
    if unknown:
        raise ValueError(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODE_KEYS)}")
    chosen = {"exact": Mode("metering (no scheme)", True),
              "floor": Mode("plugin on, nothing metered", True, xargs={"witcert_meter_layers": NO_LAYER}),
              "scheme": Mode(f"metering, {scheme}", True, xargs={"witcert_scheme": scheme}),
              "every": Mode(f"metering every {every}th step", True, xargs={"witcert_meter_every": every}),
              "audit": Mode(f"audit at rate {audit_rate:g}", True, xargs={"witcert_audit_rate": audit_rate}),
              "gate": Mode(f"meter-only gate, {GATE_SCHEME}", True, xargs={"witcert_scheme": GATE_SCHEME}, gate=True),
              "spot-gate": Mode(f"spot-certified gate, {GATE_SCHEME}", True, gate=True,
                                xargs={"witcert_scheme": GATE_SCHEME, "witcert_certificate": "spot"})}
    out = [m for key, m in chosen.items() if key in keys]
    out = ([Mode("plugin off", False)] if out else []) + out
    if "caches" in keys:
        for dtype in caches:
            out += [Mode(f"plugin off, {dtype} cache", False, dtype), Mode(f"metering, {dtype} cache", True, dtype)]
    return out


def decode_rate(llm, prompts: list, max_tokens: int, xargs: dict, tag: str, prefilled=None, settle=None) -> dict:
    """Decode tokens/s of ``prompts`` in ``llm`` with every request prefilled first; per-request token counts.
    ``prefilled`` (no arguments): what the prefill deferred, run before the clock starts; ``settle``: the mode's
    own deferred work, run after the last step inside the timed window."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=dict(xargs) or None)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    made, prompt_tokens = {rid: 0 for rid in ids}, {}

    def step() -> None:
        for out in engine.step():
            made[out.request_id] = len(out.outputs[0].token_ids)
            prompt_tokens[out.request_id] = len(out.prompt_token_ids or ())

    while min(made.values()) < 1:  # the prefill: every request's first token
        step()
    if prefilled is not None:
        prefilled()
    gc.collect()  # untimed: no mode pays for the garbage of the one before it
    before, steps = sum(made.values()), 0
    started, cpu_started = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        step()
        steps += 1
    if settle is not None:
        settle()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    tokens = sum(made.values()) - before
    return {"decode_tokens_per_s": tokens / elapsed if elapsed > 0 else None, "decode_tokens": tokens,
            "decode_steps": steps, "decode_s": elapsed, "decode_cpu_s": cpu,
            "decode_tokens_per_cpu_s": tokens / cpu if cpu > 0 else None,
            "requests": [{"prompt_tokens": prompt_tokens.get(rid), "generated_tokens": made[rid]} for rid in ids]}


def serve(args) -> None:
    """An engine process for the speed table: reads ``{"xargs": ..., "tag": ...}`` lines, answers ``WITCERT-SPEED``."""
    from .engines import _environment, engine, workload_prompts

    args.shadow, args.scheme, args.jsonl, args.tp = False, "none", None, 1
    _environment(args)
    prompts = workload_prompts(args.model, "needle")
    llm = engine(args)
    llm.generate(["Hello"], _warm(), use_tqdm=False)
    print(READY, flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        before = _gate_counts(args)
        rate = decode_rate(llm, prompts, ask["max_tokens"], ask.get("xargs") or {}, ask["tag"], *_settle(args))
        if before is not None:  # the gate's work in this measurement: tokens paged of those gated, bytes checked
            after = _gate_counts(args)
            rate["gate"] = {k: after[k] - before[k] for k in ("tokens_gated", "tokens_paged", "bytes_paged",
                                                             "spot_cells", "spot_keys", "spot_bytes")}
            gated = rate["gate"]["tokens_gated"]
            rate["gate"]["fraction_paged"] = rate["gate"]["tokens_paged"] / gated if gated else None
        print(SPEED + json.dumps(rate), flush=True)


def _settle(args) -> tuple:
    """``(prefilled, settle)`` of :func:`decode_rate` (``None`` with the plugin off): after the prefill, the writes it
    journaled entered into the metering state (:meth:`.runtime.Runtime.flush`: prefill work, untimed; a full
    prefill's journal would otherwise be entered at the first timed step); at the end, what the mode deferred, as
    when the engine goes idle (:meth:`.runtime.Runtime.idle`: its deferred rows metered, its audits closed)."""
    if not args.plugin:
        return None, None
    from . import runtime

    rt = runtime.get()
    return rt.flush, rt.idle


def _gate_counts(args) -> dict | None:
    """The engine's gate counters now (``None`` without the gate)."""
    if not (args.plugin and args.gate):
        return None
    from . import runtime

    rt = runtime.get()
    rt.telemetry.snapshot()  # queued cells folded in
    return dict(rt.telemetry.gate_counts)


def _warm():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=2, temperature=0)


class _Engine:
    """A :func:`serve` process (its own engine), driven over stdin/stdout."""

    def __init__(self, model: str, mode: Mode, args, schemes: str):
        flags = ["--kv-cache-dtype", mode.kv_cache_dtype, "--dtype", args.dtype, "--schemes", schemes]
        if mode.plugin:
            flags.append("--plugin")
        if mode.gate:
            flags.append("--gate")
        # one OpenMP thread per engine, not bound to a core (the machine is shared: a thread pinned to a busy core,
        # or two threads meeting at every parallel region, measure the other tenants more than the engine)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
        env.pop("WITCERT_VLLM_METRICS_DIR", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "witcert.integrations.vllm.bench", "speed-engine", model,
                                      *flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def wait_ready(self) -> None:
        """Block until the engine has loaded, compiled and served its first request."""
        self._expect(READY)

    def measure(self, mode: Mode, max_tokens: int, tag: str) -> dict:
        self.proc.stdin.write(json.dumps({"xargs": mode.xargs, "max_tokens": max_tokens, "tag": tag}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect(SPEED)[len(SPEED):])

    def _expect(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line.strip()
        raise RuntimeError(f"speed engine exited (rc={self.proc.wait()}) before answering {prefix.strip()}")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def speed(args) -> dict:
    """Every mode, interleaved over ``args.repeats`` rounds: the measurements and the ratios."""
    from .engines import fp8_unsupported_reason

    started = time.perf_counter()
    asked = tuple(d for d in args.kv_cache_dtypes if d != "auto")
    caches = () if fp8_unsupported_reason() else asked
    chosen = modes(caches, args.scheme, args.every, args.audit_rate, args.modes)
    runs = {m.name: [] for m in chosen}
    engines = {}
    try:
        for m in chosen:  # every engine started before any is waited for: their startups overlap
            if m.engine not in engines:
                engines[m.engine] = _Engine(args.model, m, args, f"{args.scheme},{GATE_SCHEME}")
        for e in engines.values():
            e.wait_ready()
        for i, m in enumerate(chosen):  # untimed: every graph compiled, every prompt's prefix cached, in every mode
            engines[m.engine].measure(m, args.max_tokens, f"warm-{i}")
        for round_ in range(args.repeats):
            for position, m in enumerate(ordered(chosen, round_)):
                run = engines[m.engine].measure(m, args.max_tokens, f"r{round_}-{position}")
                runs[m.name].append(dict(run, round=round_, position=position))
    finally:
        for e in engines.values():
            e.close()
    result = {"modes": {m.name: {"plugin": m.plugin, "kv_cache_dtype": m.kv_cache_dtype, "xargs": m.xargs,
                                 "gate": m.gate, "baseline": m.baseline, "runs": runs[m.name],
                                 **_paged(runs[m.name])} for m in chosen},
              "ratios": ratios(runs, chosen), "cpu_ratios": ratios(runs, chosen, CPU_RATE),
              "floor_ratios": floor_ratios(runs, chosen), "cpu_floor_ratios": floor_ratios(runs, chosen, CPU_RATE),
              "max_tokens": args.max_tokens, "repeats": args.repeats,
              "workload": "needle", "modes_run": list(args.modes), "wall_s": time.perf_counter() - started}
    if asked and not caches:
        result["fp8_skipped"] = fp8_unsupported_reason()
    return result


def ordered(chosen: list, round_: int) -> list:
    """The modes in round ``round_``'s order: as listed in round 0, shuffled in later rounds (seeded by the round,
    so replayable). A rotation would keep every mode behind the same one; a shuffle changes what precedes it."""
    if round_ == 0:
        return list(chosen)
    out = list(chosen)
    random.Random(round_).shuffle(out)
    return out


def ratios(runs: dict, chosen: list, rate: str = "decode_tokens_per_s") -> dict:
    """Median decode tokens/s of each mode over the median of its baseline (plugin off, same cache); ``rate``
    :data:`CPU_RATE`: per second of the engine process's CPU time instead of the wall clock."""
    median = {name: statistics.median(r[rate] for r in values) for name, values in runs.items()
              if values and all(r.get(rate) for r in values)}
    return {m.name: median[m.name] / median[m.baseline] for m in chosen if m.plugin and m.name in median}


def floor_ratios(runs: dict, chosen: list, rate: str = "decode_tokens_per_s") -> dict:
    """Median decode tokens/s of each metered mode of the plugin-on ``auto`` engine over the median of the floor
    (the same engine, nothing metered): what its metering costs beyond the plugin's floor (empty without a floor);
    ``rate`` :data:`CPU_RATE`: per second of the engine process's CPU time."""
    floor = next((m for m in chosen if m.xargs.get("witcert_meter_layers") == NO_LAYER and not m.gate), None)
    if floor is None or not runs.get(floor.name):
        return {}
    base = statistics.median(r[rate] for r in runs[floor.name])
    return {m.name: statistics.median(r[rate] for r in runs[m.name]) / base for m in chosen
            if m.plugin and m.engine == floor.engine and m is not floor and runs.get(m.name)}


def _paged(runs: list) -> dict:
    """A gate mode's median fraction of tokens paged (of the tokens its gated cells' rows attended)."""
    fractions = [r["gate"]["fraction_paged"] for r in runs if (r.get("gate") or {}).get("fraction_paged") is not None]
    return {"fraction_paged": statistics.median(fractions)} if fractions else {}


def lines(result: dict) -> list:
    """``<mode>: <ratio>x of plugin off`` per metered mode (a gate mode: and its fraction of tokens paged; a mode of
    the floor's engine: ``, <ratio>x of the floor``; and `` (<ratio>x in CPU time)`` where measured)."""
    cpu, over_floor = result.get("cpu_ratios") or {}, result.get("floor_ratios") or {}
    out = []
    for name, ratio in result["ratios"].items():
        mode = result["modes"][name]
        paged = f", {mode['fraction_paged']:.3f} of tokens paged" if "fraction_paged" in mode else ""
        in_cpu = f" ({cpu[name]:.2f}x in CPU time)" if name in cpu else ""
        floor = f", {over_floor[name]:.2f}x of the floor" if name in over_floor else ""
        out.append(f"{name}: {ratio:.2f}x of {mode['baseline']}{paged}{floor}{in_cpu}")
    return out
