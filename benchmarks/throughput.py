"""Section 5 -- regression throughput: adversarial per-query trials per second (``witcert fuzz``)."""
from witcert.verification.fuzz import run_fuzz


def run(trials: int) -> dict:
    report = run_fuzz(trials, seed=0)
    return dict(trials=report.trials, seconds=report.seconds, trials_per_second=report.trials / report.seconds,
                sound_violations=report.sound_violations, golden_rechecks=report.golden_rechecks,
                dispersion_violations=report.tallies["dispersion (known false)"].violations)
