"""Section 1d -- generation overhead: tokens/s of SmolLM2 ``generate`` stock vs monitored vs observed.

A prompt of ``context`` tokens (fixed random ids; 512 and 4,096), greedy, ``new_tokens`` new tokens, batch 1,
``rtn-int8``:

* ``stock``: the model as loaded (sdpa attention);
* ``monitored``: ``witcert.monitor(model, "rtn-int8", keep_exact=False)`` -- the meter only, on the
  compressed cache (production mode: no exact shadow, no true TV);
* ``observed``: ``witcert.monitor(model, "rtn-int8")`` with the default ``keep_exact=True``: the
  exact shadow is kept and every cell also gets its true TV;

each with the fused meter pass eager (the default) and, when ``compiled``, with
``WITCERT_COMPILE=1`` (compiled once before timing), and ``monitored, compiled, every 4th step``: production
mode with sampled metering (``witcert.MeterSampling(every=4)``, an operator's option, off by default);
with ``--witness-bits N ...``, also ``monitored, compiled, witness_bits=N``: production mode with another witness
code than the scheme's default (rtn-int8's: the 4-bit fraction of the derived witness).
Runs are interleaved round by round; the figure is the median wall time of ``generate`` (prefill
included, as a user feels it).

``python -m benchmarks.generation --contexts 512 4096 --out benchmarks/results/generation.json`` (and
``make bench``'s generation section, which calls :func:`record`) writes the record the results page
renders (date, machine, command, one run per context).
"""
import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import witcert
from benchmarks import machine
from benchmarks.timing import compile_choice, compiled_available

SCHEME = "rtn-int8"
SAMPLED = "monitored, compiled, every 4th step"


def timed_generate(model, ids, new_tokens: int, keep_exact: bool | None, compiled: bool, every: int = 1,
                   past_key_values=None, scheme: str = SCHEME, audit=None, witness_bits: int | None = None) -> float:
    """Seconds of one greedy ``generate`` of exactly ``new_tokens``: stock (``keep_exact=None``) or under
    ``witcert.monitor(model, scheme, keep_exact=..., audit=audit)`` metering every ``every``-th step (with an audit,
    its picked cells), with the meter's passes compiled or not; ``past_key_values``: a cache holding a prefix of
    ``ids`` (given to ``generate`` as is); ``witness_bits``: the monitor's witness code (``None``: the scheme's default)."""
    sample = witcert.MeterSampling(every=every, seed=0) if every > 1 else None
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=past_key_values,
                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with compile_choice(compiled):
        started = time.perf_counter()
        if keep_exact is None:
            model.generate(**kwargs)
        else:
            with witcert.monitor(model, scheme, keep_exact=keep_exact, sample=sample, audit=audit,
                                 witness_bits=witness_bits):
                model.generate(**kwargs)
        return time.perf_counter() - started


def run(context: int = 512, new_tokens: int = 16, reps: int = 7, compiled: bool = True,
        witness_bits: tuple[int, ...] = ()) -> dict:
    from witcert.integrations.hf.default_model import load_model

    model = load_model().model
    ids = torch.randint(100, 20000, (1, context), generator=torch.Generator().manual_seed(0))
    # (keep_exact, compiled, every, witness_bits): None keeps the monitor's default witness for the scheme
    configs = {"stock": (None, False, 1, None), "monitored": (False, False, 1, None), "observed": (True, False, 1, None)}
    if compiled and compiled_available():
        configs |= {"monitored, compiled": (False, True, 1, None), "observed, compiled": (True, True, 1, None),
                    SAMPLED: (False, True, 4, None)}
        configs |= {f"monitored, compiled, witness_bits={bits}": (False, True, 1, bits) for bits in witness_bits}
    for config in configs.values():  # warm-up: first-call costs (and any recompile) out of the timing
        _generate(model, ids, 2, config)
    samples = {name: [] for name in configs}
    for _ in range(reps):
        for name, config in configs.items():
            samples[name].append(_generate(model, ids, new_tokens, config))
    seconds = {name: statistics.median(v) for name, v in samples.items()}
    rate = {name: new_tokens / s for name, s in seconds.items()}
    out = {"context": context, "new_tokens": new_tokens, "reps": reps, "threads": torch.get_num_threads(),
           "median_s": seconds, "tokens_per_s": rate,
           "ratio_to_stock": {name: rate[name] / rate["stock"] for name in configs if name != "stock"}}
    print("  generation: " + ", ".join(f"{k} {v:.2f}x stock" for k, v in out["ratio_to_stock"].items()), flush=True)
    return out


def _generate(model, ids, new_tokens: int, config: tuple) -> float:
    """:func:`timed_generate` of one configuration ``(keep_exact, compiled, every, witness_bits)``."""
    keep_exact, compiled, every, witness_bits = config
    return timed_generate(model, ids, new_tokens, keep_exact, compiled, every, witness_bits=witness_bits)


def record(contexts, new_tokens: int, reps: int, threads: int, command: str, witness_bits=()) -> dict:
    """The generation record: one :func:`run` per context, with date, machine and the command that measured it."""
    info = machine.describe(threads)
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{info['cpu']} ({info['logical_cpus']} logical CPUs, shared), {threads} torch thread(s)",
            "command": command, "runs": [run(context, new_tokens, reps, witness_bits=witness_bits) for context in contexts]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--witness-bits", type=int, nargs="*", default=[],
                   help="also time the production monitor, compiled, with these witness codes (16, 8, 4, 0)")
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("results") / "generation.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python -m benchmarks.generation " + " ".join(sys.argv[1:] if argv is None else argv)
    done = record(args.contexts, args.new_tokens, args.reps, args.threads, command, tuple(args.witness_bits))
    args.out.write_text(json.dumps(done, indent=1) + "\n")


if __name__ == "__main__":
    main()
