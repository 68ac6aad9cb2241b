"""Section 1d -- generation overhead: tokens/s of SmolLM2 ``generate`` stock vs monitored vs observed.

A 512-token prompt (fixed random ids), greedy, ``new_tokens`` new tokens, batch 1, ``rtn-int8``:

* ``stock``: the model as loaded (sdpa attention);
* ``monitored``: ``witcert.monitor(model, "rtn-int8", keep_exact=False)`` -- the meter only, on the
  compressed cache (production mode: no exact shadow, no true TV);
* ``observed``: ``witcert.monitor(model, "rtn-int8")`` with the default ``keep_exact=True``: the
  exact shadow is kept and every cell also gets its true TV;

each with the fused meter pass eager (the default) and, when ``compiled``, with
``WITCERT_COMPILE=1`` (compiled once before timing). Runs are interleaved round by round; the
figure is the median wall time of ``generate`` (prefill included, as a user feels it).
"""
import statistics
import time

import torch

import witcert
from benchmarks.timing import compile_choice


def _generate(model, ids, new_tokens: int):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False)


def _timed(model, ids, new_tokens, keep_exact: bool | None, compiled: bool) -> float:
    with compile_choice(compiled):
        started = time.perf_counter()
        if keep_exact is None:
            _generate(model, ids, new_tokens)
        else:
            with witcert.monitor(model, "rtn-int8", keep_exact=keep_exact):
                _generate(model, ids, new_tokens)
        return time.perf_counter() - started


def run(context: int = 512, new_tokens: int = 16, reps: int = 7, compiled: bool = True) -> dict:
    from witcert.fastpath import budgeted_pass
    from witcert.fastpath import compiled as compiled_mod
    from witcert.integrations.hf.default_model import load_model

    model = load_model().model
    ids = torch.randint(100, 20000, (1, context), generator=torch.Generator().manual_seed(0))
    configs = {"stock": (None, False), "monitored": (False, False), "observed": (True, False)}
    if compiled and compiled_mod.compiled_of(budgeted_pass.lean_pass, budgeted_pass.probe) is not None:
        configs |= {"monitored, compiled": (False, True), "observed, compiled": (True, True)}
    for keep, comp in configs.values():  # warm-up: first-call costs (and any recompile) out of the timing
        _timed(model, ids, 2, keep, comp)
    samples = {name: [] for name in configs}
    for _ in range(reps):
        for name, (keep, comp) in configs.items():
            samples[name].append(_timed(model, ids, new_tokens, keep, comp))
    seconds = {name: statistics.median(v) for name, v in samples.items()}
    rate = {name: new_tokens / s for name, s in seconds.items()}
    out = {"context": context, "new_tokens": new_tokens, "reps": reps, "threads": torch.get_num_threads(),
           "median_s": seconds, "tokens_per_s": rate,
           "ratio_to_stock": {name: rate[name] / rate["stock"] for name in configs if name != "stock"}}
    print("  generation: " + ", ".join(f"{k} {v:.2f}x stock" for k, v in out["ratio_to_stock"].items()), flush=True)
    return out
