"""The observatory's main job: run workloads on a real model under a compressed cache and measure.

For each case the context is prefilled (exact in-flight attention, compressed on write), then a
*probe* chunk is fed on top of the compressed cache: the needle question (followed by greedy
decoding of the answer), the teacher-forced continuation of a text/code source, or the last token
of the user's own prompt (``task="prompt"``, followed by greedy decoding). The model runs
under :func:`witcert.monitor` (the same attention path, stores and cells as any user's monitored
model), one request per case; the prefill and the probe are declared non-adaptive
(:meth:`~witcert.integrations.hf.monitoring.Monitor.non_adaptive`), the greedy answer is not. Every
probe query and decode step is a measured cell. The same case run on the stock model (no
compression) is the quality reference: teacher-forced KL(p_exact || p_compressed) and top-1
agreement on the probe tokens, and needle exact-match accuracy.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from witcert.core.thresholds import check_certified_tau
from witcert.gate.policy import Gate
from witcert.integrations.hf import telemetry
from witcert.integrations.hf.monitoring import DITHERED, Monitor
from witcert.observatory import plan, workloads
from witcert.spot.cells import CERTIFICATES
from witcert.tier_b.certificate import delta_local
from witcert.tier_b.counters import check_seed

SWEEP_DELTAS = (0.5, 1e-1, 1e-3, 1e-5)  # Tier B request budgets recorded beside delta_req (risk-coverage)


@dataclass(frozen=True)
class ObserveConfig:
    """What one ``witcert observe`` run does."""

    schemes: tuple[str, ...]
    task: str = "needle"
    tier: str = "auto"  # auto: Tier B for the dithered-int8 cache, Tier A otherwise
    delta_req: float = 1e-2
    tau: float = 0.2
    gate: bool = False
    context_tokens: int = 512
    probe_tokens: int = 32  # teacher-forced continuation length (text/code)
    new_tokens: int = 6  # greedy answer tokens (needle)
    cases: int = 4
    bands: int = 16
    keep_exact: bool = True  # False: production mode (no exact cache, no true TV)
    seed: int | None = None  # dithered cache: None draws a secret seed per case (recorded); an int replays
    certificate: str = "deterministic"  # "spot": cells above tau are spot-checked (witcert.spot)
    spot_keys: int = 256  # exact keys per spot check
    prompt: str | None = None  # task "prompt": the user's own prompt, run once

    def __post_init__(self):
        if not self.schemes:
            raise ValueError("schemes: give at least one scheme")
        if self.tier not in ("auto", "A", "B"):
            raise ValueError(f"tier must be 'auto', 'A' or 'B', got {self.tier!r}")
        if self.tier == "B" and any(s != DITHERED for s in self.schemes):
            raise ValueError(f"tier B certifies the {DITHERED!r} cache only; got schemes {', '.join(self.schemes)}")
        if not 0.0 < self.delta_req < 1.0:
            raise ValueError(f"delta_req must lie in (0, 1), got {self.delta_req}")
        check_certified_tau(self.tau)
        for name in ("context_tokens", "probe_tokens", "new_tokens", "cases", "bands", "spot_keys"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.certificate not in CERTIFICATES:
            raise ValueError(f"certificate must be one of {CERTIFICATES}, got {self.certificate!r}")
        if (self.task == "prompt") != (self.prompt is not None) or (self.prompt is not None and not self.prompt.strip()):
            raise ValueError("prompt: task 'prompt' runs a non-empty prompt, and a prompt needs task 'prompt'")
        if self.seed is not None:
            check_seed(self.seed)

    def tier_of(self, scheme: str) -> str:
        """The certificate a scheme gets: Tier B (with the Tier A minimum) for the dithered cache."""
        return "B" if scheme == DITHERED and self.tier != "A" else "A"


@dataclass
class CaseOutput:
    probe_logits: torch.Tensor  # (Tp, V) fp32
    answer: str = ""  # greedy continuation (needle)
    cells: telemetry.CellTable | None = None


@dataclass
class SchemeResult:
    """Everything measured for one scheme on one task."""

    scheme: str
    task: str
    raw: telemetry.CellTable
    quality: dict
    gated: telemetry.CellTable | None = None
    wall_s: float = 0.0
    tier: str = "A"
    extra: dict = field(default_factory=dict)


def build_cases(tokenizer, config: ObserveConfig) -> list:
    """The workload cases of ``config.task``.

    Needle: about three quarters single-passkey cases at spread depths, the rest four-key
    cases (one key asked) at spread depths; text/code/file: evenly spaced windows; prompt: the
    prompt, once (:func:`witcert.observatory.workloads.prompt_case`).
    """
    if config.task == "prompt":
        return [workloads.prompt_case(tokenizer, config.prompt)]
    if config.task == "needle":
        n_multi = config.cases // 4
        n_single = config.cases - n_multi
        cases = workloads.needle_cases(tokenizer, config.context_tokens, depths=_depths(n_single), keys=(1,))
        if n_multi:
            cases += workloads.needle_cases(tokenizer, config.context_tokens, depths=_depths(n_multi), keys=(4,), seed=1)
        return cases
    return workloads.text_cases(tokenizer, config.task, config.context_tokens, config.probe_tokens, count=config.cases)


def _depths(n: int) -> tuple[float, ...]:
    return (0.5,) if n == 1 else tuple(float(d) for d in np.linspace(0.1, 0.9, n))


def run_case(model, tokenizer, case, new_tokens: int, monitor: Monitor | None = None,
             delta_req: float = 1e-2) -> CaseOutput:
    """Prefill the context, feed the probe chunk, and (needle) decode the answer greedily.

    With a monitor (active around the call), the case is one new request (its own cache, so
    fresh stores and a fresh secret dither seed unless the monitor's seed is fixed; the cells
    record it), and its Tier B budget is ``delta_req`` spread over the request's cells (Lemma 3:
    layers x query heads x measured steps).
    """
    ctx_ids, probe_ids = _token_ids(tokenizer, case)
    with torch.no_grad():
        if monitor is None:
            return _forward_case(model, tokenizer, ctx_ids, probe_ids, case, new_tokens)
        steps = probe_ids.shape[1] + (new_tokens if workloads.generates(case) else 0)
        config = model.config
        n_layers, n_heads = config.num_hidden_layers, config.num_attention_heads
        monitor.delta_loc = delta_local(delta_req, n_layers, n_heads, steps)
        monitor.delta_sweep = {f"meter_delta={d:g}": delta_local(d, n_layers, n_heads, steps) for d in SWEEP_DELTAS}
        before = len(monitor.batches)
        out = _forward_case(model, tokenizer, ctx_ids, probe_ids, case, new_tokens, monitor)
        out.cells = telemetry.cell_table(monitor.batches[before:])
        return out


def _token_ids(tokenizer, case) -> tuple[torch.Tensor, torch.Tensor]:
    """``(context ids, probe ids)``, each (1, n): a prompt case splits its own ids, the others tokenize their text."""
    if isinstance(case, workloads.PromptCase):
        return case.context_ids, case.probe_ids
    probe = case.question if isinstance(case, workloads.NeedleCase) else case.continuation
    return (tokenizer(case.context, return_tensors="pt").input_ids,
            tokenizer(probe, return_tensors="pt", add_special_tokens=False).input_ids)


def _forward_case(model, tokenizer, ctx_ids, probe_ids, case, new_tokens, monitor=None) -> CaseOutput:
    cache = DynamicCache(config=model.config)
    # the context and the probe are given text: their queries do not depend on the dither
    with monitor.non_adaptive() if monitor is not None else contextlib.nullcontext():
        model(ctx_ids, past_key_values=cache, use_cache=True)
        logits = model(probe_ids, past_key_values=cache, use_cache=True).logits[0]  # (Tp, V)
    answer = ""
    if workloads.generates(case):  # greedy decoding: from here on the queries depend on the compressed cache
        generated = []
        next_id = logits[-1].argmax()
        for _ in range(new_tokens):
            generated.append(int(next_id))
            step = model(next_id.view(1, 1), past_key_values=cache, use_cache=True).logits[0, -1]
            next_id = step.argmax()
        answer = tokenizer.decode(generated)
    return CaseOutput(probe_logits=logits.float(), answer=answer)


def quality(reference: list[CaseOutput], outputs: list[CaseOutput], cases) -> dict:
    """Teacher-forced KL(p_exact || p_compressed) and top-1 agreement on the probe tokens;
    needle exact-match accuracy when the cases are needles."""
    kls, top1 = [], []
    for ref, out in zip(reference, outputs):
        log_p = torch.log_softmax(ref.probe_logits.double(), -1)
        log_q = torch.log_softmax(out.probe_logits.double(), -1)
        kls.append((log_p.exp() * (log_p - log_q)).sum(-1))
        top1.append(ref.probe_logits.argmax(-1) == out.probe_logits.argmax(-1))
    result = {"kl": float(torch.cat(kls).mean()), "top1": float(torch.cat(top1).float().mean())}
    if cases and isinstance(cases[0], workloads.NeedleCase):
        result["needle_acc"] = float(np.mean([c.score(o.answer) for c, o in zip(cases, outputs)]))
    return result


def run_observe(loaded, config: ObserveConfig, progress=None, on_result=None) -> tuple[list[SchemeResult], dict]:
    """Run every scheme of ``config`` on its task; returns the results and the reference quality.

    ``on_result(result, baseline)``, if given, is called as each scheme finishes (the CLI prints its row then).
    ``progress.start(steps)`` receives the run's :func:`witcert.observatory.plan.steps` and returns
    ``tick(label)``, called as each step finishes.
    """
    model, tokenizer = loaded.model, loaded.tokenizer
    cases = build_cases(tokenizer, config)
    tick = progress.start(plan.steps(config, len(cases))) if progress else (lambda *_: None)
    reference = []
    for case in cases:
        reference.append(run_case(model, tokenizer, case, config.new_tokens))
        tick("uncompressed reference")
    baseline = {}
    if isinstance(cases[0], workloads.NeedleCase):
        baseline["needle_acc"] = float(np.mean([c.score(o.answer) for c, o in zip(cases, reference)]))
    results = []
    for scheme in config.schemes:
        start = time.perf_counter()
        tier = config.tier_of(scheme)
        raw = _run_scheme(model, tokenizer, cases, config, _monitor(model, scheme, config, tier), tick)
        result = SchemeResult(
            scheme=scheme, task=config.task, raw=_tables(raw), quality=quality(reference, raw, cases), tier=tier
        )
        if config.gate:
            monitor = _monitor(model, scheme, config, tier, gate=Gate(tau=config.tau))
            gated = _run_scheme(model, tokenizer, cases, config, monitor, tick)
            result.gated = _tables(gated)
            result.extra["gated_quality"] = quality(reference, gated, cases)
        result.wall_s = time.perf_counter() - start
        results.append(result)
        if on_result is not None:
            on_result(result, baseline)
    return results, baseline


def _monitor(model, scheme, config: ObserveConfig, tier: str, gate: Gate | None = None) -> Monitor:
    """One monitor per (scheme, gated) run: one request per case, numbered from 0 like the cases; the full
    meter (``P1r`` and ``MS`` too), as the observatory measures how tight the certificate can be; the
    config's certificate (the spot check: ``spot_keys`` exact keys per checked cell at the monitor's
    default ``spot_delta``) and mode (``keep_exact``)."""
    return Monitor(model, scheme, tier=tier, gate=gate, keep_exact=config.keep_exact, bands=config.bands,
                   seed=config.seed, tau=config.tau, meter="full", certificate=config.certificate,
                   spot_keys=config.spot_keys)


def _run_scheme(model, tokenizer, cases, config, monitor: Monitor, tick) -> list[CaseOutput]:
    outputs = []
    with monitor:
        for i, case in enumerate(cases):
            out = run_case(model, tokenizer, case, config.new_tokens, monitor, config.delta_req)
            out.cells.columns["case"][:] = i
            outputs.append(out)
            tick(f"{monitor.scheme}{' gated' if monitor.gate else ''}")
    return outputs


def _tables(outputs: list[CaseOutput]) -> telemetry.CellTable:
    return telemetry.concat([o.cells for o in outputs])
