"""The speed mode's table logic (no engine): the modes, each against the plugin off with its own cache, one line each."""
import pytest

from witcert.integrations.vllm.speed import CPU_RATE, floor_ratios, lines, modes, ordered, ratios


def _runs(*rates):
    return [{"decode_tokens_per_s": r} for r in rates]


def test_each_metered_mode_is_the_median_over_its_own_caches_plugin_off():
    chosen = modes(("fp8",), scheme="rtn-int4", every=4, keys=("exact", "scheme", "every", "caches"))
    names = [m.name for m in chosen]
    assert names == ["plugin off", "metering (no scheme)", "metering, rtn-int4", "metering every 4th step",
                     "plugin off, fp8 cache", "metering, fp8 cache"]
    assert {m.name: m.xargs for m in chosen}["metering every 4th step"] == {"witcert_meter_every": 4}
    runs = {"plugin off": _runs(10, 30, 20), "metering (no scheme)": _runs(17, 1, 18),
            "metering, rtn-int4": _runs(14, 14, 100), "metering every 4th step": _runs(19, 19, 19),
            "plugin off, fp8 cache": _runs(40, 40, 40), "metering, fp8 cache": _runs(30, 36, 34)}
    got = ratios(runs, chosen)
    assert set(got) == {n for n in names if not n.startswith("plugin off")}  # baselines have no ratio
    assert got["metering (no scheme)"] == 17 / 20 and got["metering, rtn-int4"] == 14 / 20  # medians, not means
    assert got["metering, fp8 cache"] == 34 / 40  # against the fp8 cache's own plugin-off engine
    record = {"ratios": got, "modes": {m.name: {"baseline": m.baseline} for m in chosen}}
    assert lines(record) == ["metering (no scheme): 0.85x of plugin off", "metering, rtn-int4: 0.70x of plugin off",
                             "metering every 4th step: 0.95x of plugin off",
                             "metering, fp8 cache: 0.85x of plugin off, fp8 cache"]


def test_without_fp8_only_the_auto_cache_is_measured():
    assert all(m.kv_cache_dtype == "auto" for m in modes(()))


def test_a_subset_of_modes_and_every_fp8_cache_with_its_own_baseline():
    assert [m.name for m in modes(("fp8_e4m3", "fp8_e5m2"), keys=("caches",))] == [
        "plugin off, fp8_e4m3 cache", "metering, fp8_e4m3 cache", "plugin off, fp8_e5m2 cache",
        "metering, fp8_e5m2 cache"]
    audit = modes((), audit_rate=0.02, keys=("audit",))
    assert [(m.name, m.xargs) for m in audit] == [("plugin off", {}), ("audit at rate 0.02",
                                                                       {"witcert_audit_rate": 0.02})]
    with pytest.raises(ValueError, match="--modes: unknown"):
        modes((), keys=("fast",))


def test_cpu_time_ratios_beside_the_wall_clock_ones():
    chosen = modes((), keys=("exact",))
    runs = {"plugin off": [{"decode_tokens_per_s": 20, "decode_tokens_per_cpu_s": 40}] * 3,
            "metering (no scheme)": [{"decode_tokens_per_s": 10, "decode_tokens_per_cpu_s": 36}] * 3}
    record = {"ratios": ratios(runs, chosen), "cpu_ratios": ratios(runs, chosen, CPU_RATE),
              "modes": {m.name: {"baseline": m.baseline} for m in chosen}}
    assert record["cpu_ratios"] == {"metering (no scheme)": 0.9}
    assert lines(record) == ["metering (no scheme): 0.50x of plugin off (0.90x in CPU time)"]
    old = {"plugin off": _runs(20), "metering (no scheme)": _runs(10)}  # a record from before the CPU rate
    assert ratios(old, chosen, CPU_RATE) == {}


def test_the_floor_meters_no_layer_and_the_engine_s_modes_are_also_given_over_it():
    chosen = modes((), keys=("exact", "floor", "every"))
    assert [(m.name, m.xargs) for m in chosen] == [
        ("plugin off", {}), ("metering (no scheme)", {}),
        ("plugin on, nothing metered", {"witcert_meter_layers": "none"}),
        ("metering every 4th step", {"witcert_meter_every": 4})]
    runs = {"plugin off": _runs(20, 20, 20), "metering (no scheme)": _runs(17, 17, 17),
            "plugin on, nothing metered": _runs(19, 19, 19), "metering every 4th step": _runs(18.05, 18.05, 18.05)}
    record = {"ratios": ratios(runs, chosen), "floor_ratios": floor_ratios(runs, chosen),
              "modes": {m.name: {"baseline": m.baseline} for m in chosen}}
    assert record["floor_ratios"] == pytest.approx({"metering (no scheme)": 17 / 19, "metering every 4th step": 0.95})
    assert lines(record) == ["metering (no scheme): 0.85x of plugin off, 0.89x of the floor",
                             "plugin on, nothing metered: 0.95x of plugin off",
                             "metering every 4th step: 0.90x of plugin off, 0.95x of the floor"]
    assert floor_ratios(runs, modes((), keys=("exact",))) == {}  # no floor measured: no ratio over it
    cpu = {name: [dict(r, decode_tokens_per_cpu_s=2 * r["decode_tokens_per_s"]) for r in values]
           for name, values in runs.items()}
    assert floor_ratios(cpu, chosen, CPU_RATE) == pytest.approx(record["floor_ratios"])  # per CPU second too


def test_every_round_runs_every_mode_once_and_later_rounds_change_what_precedes_a_mode():
    chosen = modes((), keys=("exact", "floor", "scheme", "every", "audit"))
    orders = [[m.name for m in ordered(chosen, r)] for r in range(3)]
    assert orders[0] == [m.name for m in chosen] and orders == [[m.name for m in ordered(chosen, r)] for r in range(3)]
    assert all(sorted(o) == sorted(orders[0]) for o in orders)  # every mode once per round, replayable
    before = [{o[i]: o[i - 1] for i in range(1, len(o))} for o in orders]
    assert any(len({b.get(name) for b in before}) > 1 for name in orders[0])
