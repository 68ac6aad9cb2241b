"""A monitor's state across threads and across a cache's calls: active scopes per thread, ``non_adaptive`` per thread
and per cache.

Implementation: :mod:`witcert.integrations.hf.monitoring` (``_ThreadState``, ``_Live.adaptive``) and the
per-thread active scopes of :mod:`witcert.integrations.hf.attention`. Oracles: the same requests run on one
thread (bit-identical meters), the fp64 true TV of every cell, the ``adaptive`` flag each cell records.
Domain: tiny random Llama and Qwen2 decoders, ``generate`` and forward calls, Tier A and the dithered
Tier B cache. Tolerance: none.
"""
import threading

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import witcert
from tests.tiny_models import VOCAB, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def ids_of(seed: int, rows: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def monitored_generate(model, ids, start: threading.Barrier | None = None) -> torch.Tensor:
    with torch.no_grad(), witcert.monitor(model, "rtn-int4") as mon:
        if start is not None:
            start.wait()
        model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    table = mon.table()
    assert (table["true_tv"] <= table["meter"]).all()
    return mon.tensor("meter")


def test_two_threads_each_generating_under_their_own_monitor_meter_as_alone():
    """Before the fix the active scopes were one global stack: a thread's attention read the other thread's
    call (its cache, its stores). Now each thread's meters equal those of the same run on one thread."""
    models = {"llama": tiny("llama"), "qwen2": tiny("qwen2")}
    alone = {name: monitored_generate(model, ids_of(i)) for i, (name, model) in enumerate(models.items())}
    together, errors = {}, []
    start = threading.Barrier(len(models))

    def run(i, name, model):
        try:
            together[name] = monitored_generate(model, ids_of(i), start)
        except Exception as err:  # reported below, with the thread's name
            errors.append((name, err))

    threads = [threading.Thread(target=run, args=(i, name, model)) for i, (name, model) in enumerate(models.items())]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name in models:
        assert torch.equal(together[name], alone[name]), name


def test_non_adaptive_on_one_thread_does_not_declare_another_threads_calls():
    """One monitor, two threads: a thread inside ``non_adaptive()`` does not make the other thread's undeclared
    forward calls non-adaptive (before the fix the counter was shared: the other thread's Tier B cells used the
    probabilistic branch)."""
    model = tiny("llama")
    declared, release = threading.Event(), threading.Event()
    with torch.no_grad(), witcert.monitor(model, "dithered-int8") as mon:
        def hold_declaration():
            with mon.non_adaptive():
                declared.set()
                release.wait(timeout=60)

        holder = threading.Thread(target=hold_declaration)
        holder.start()
        try:
            assert declared.wait(timeout=60)
            cache = DynamicCache(config=model.config)
            model(ids_of(3)[:, :5], past_key_values=cache)
            model(ids_of(3)[:, 5:], past_key_values=cache)
        finally:
            release.set()
            holder.join()
    table = mon.table()
    assert len(table) > 0 and table["adaptive"].all()


def test_a_cache_that_served_an_adaptive_call_stays_deterministic_under_non_adaptive():
    """Tokens the model chose (inside ``generate``, or after an undeclared call) have keys and successors that
    depend on the dither: a later ``non_adaptive()`` call over that cache uses Tier B's deterministic branch;
    a fresh cache inside the block uses the probabilistic one. Every cell is sound."""
    model, ids = tiny("llama"), ids_of(5)
    with torch.no_grad(), witcert.monitor(model, "dithered-int8") as mon:
        generated = DynamicCache(config=model.config)
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0,
                             past_key_values=generated)  # requests 0-1
        undeclared = DynamicCache(config=model.config)
        model(ids[:, :5], past_key_values=undeclared)  # requests 2-3: an undeclared call
        fresh = DynamicCache(config=model.config)
        with mon.non_adaptive():
            model(out[:, -1:], past_key_values=generated)
            model(ids[:, 5:], past_key_values=undeclared)
            model(ids, past_key_values=fresh)  # requests 4-5: declared from the start
            model(ids[:, :2], past_key_values=fresh)
    table = mon.table()
    requests = table["request"]
    assert (requests < 4).any() and (requests >= 4).any()
    assert table["adaptive"][requests < 4].all()
    assert not table["adaptive"][requests >= 4].any()
    assert np.all(table["true_tv"] <= table["meter"])
