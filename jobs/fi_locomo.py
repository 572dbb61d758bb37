"""Ray job entry point for the FI-LoCoMo benchmark. No logic here: arguments or a YAML config -> the library.

    ray job submit --working-dir . -- python jobs/fi_locomo.py --locomo /data/locomo10.json --out /results/fi
    python jobs/fi_locomo.py --config fi.yaml --out /results/fi  # keys: the fields of pipeline.bench.config.EvalConfig

With --config, the YAML holds EvalConfig fields (locomo, conversations, max_cases, methods, utility, budgets,
eval_budgets, seed,
replicates, top_k, redundancy, tau, kappa, filter_threshold, dense, agent, agent_options, executor, actors,
gpus_per_actor); unknown keys are an error. Without it, the flags are those of `meclear eval`. Under `ray job submit`
RAY_ADDRESS is set, so the run joins that cluster and shards conversations and case chunks over its actors.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--out")
    pre.add_argument("--no-progress", action="store_true")
    known, rest = pre.parse_known_args(argv)
    if known.config is None:
        from pipeline.cli.main import main as cli_main

        return cli_main(["eval", *(argv if argv is not None else sys.argv[1:])])

    import yaml

    from pipeline.bench.run import EvalConfig, evaluate
    from pipeline.core.errors import ConfigError, MeClearError
    from pipeline.core.text import safe
    from pipeline.core.validation import from_mapping

    try:
        if rest:
            raise ConfigError(f"with --config, only --out and --no-progress may be given; got {rest}")
        if not known.out:
            raise ConfigError("--out is required")
        with open(known.config, encoding="utf-8") as fh:
            config = from_mapping(EvalConfig, yaml.safe_load(fh) or {}, f"config {known.config}")
        summary = evaluate(config, known.out, progress=not known.no_progress)
    except MeClearError as exc:
        print(f"fi_locomo: error: {safe(exc)}", file=sys.stderr)
        return exc.exit_code
    print(f"fi_locomo: {summary['n_cases']} cases, run {summary['run_id']}, outputs in {known.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
