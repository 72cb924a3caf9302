"""Several training runs side by side: ``mpicoll compare`` (one ``mpicoll train`` job per method, then a
report), ``mpicoll plot`` (the same report from existing logs) and ``mpicoll reproduce`` (the seeds' claims
over several seeds): their command lines here, the work in :mod:`.compare`, :mod:`.plots` and :mod:`.claims`.
"""

from __future__ import annotations

import sys

from ..train import METHODS

__all__ = ["add_compare_parser", "add_plot_parser", "add_reproduce_parser", "compare_main", "plot_main",
           "reproduce_main", "DEFAULT_PROBLEM"]


# compare's problem unless its options change it (later options win): big enough that the methods' wall times
# differ by more than their noise (the digits' default run takes 0.02-0.08 s per method, measured)
DEFAULT_PROBLEM = ("--data", "mnist1d", "--model", "mlp", "--hidden", "512,512", "--epochs", "20")


def add_compare_parser(commands) -> None:
    compare = commands.add_parser(
        "compare", help="train with several methods (each under mpiexec) and write a report with plots",
        description="Any other option is passed to every 'mpicoll train' run, e.g. --epochs 5 --straggler 3=3. "
        "The problem, unless those options change it: " + " ".join(DEFAULT_PROBLEM) + ", big enough that the "
        "methods differ in wall time (2-4 s each at 4 ranks on 2 cores, about 45 s for all).")
    compare.add_argument("--methods", "--algorithms", default=",".join(METHODS), dest="methods",
                         help="comma-separated (default: all); --algorithms is the old name")
    compare.add_argument("-n", "--ranks", type=int, default=4, help="MPI ranks per run (default 4)")
    compare.add_argument("--output", default="compare-report", help="report folder (default compare-report)")
    compare.add_argument("--compressions", default="none",
                         help="allreduce methods: also train each with these, comma-separated, among none, fp16, "
                         "bf16, fp16+ef, bf16+ef (error feedback) and powersgd (default none); e.g. "
                         "none,fp16,bf16,fp16+ef,powersgd (docs/compression.md)")
    compare.add_argument("--target", type=_target, help="accuracy to time, e.g. 0.9, or 'first': the first "
                         "method's mean final accuracy (default: 90%% of the best method's final accuracy)")
    compare.add_argument("--timeout", type=float, default=600, help="seconds per run before giving up")
    compare.add_argument("--repeats", type=int, default=1,
                         help="runs per method, in alternating order; the report gives means and spreads")
    compare.add_argument("--seeds", help="one run per method and seed, e.g. 1,2,3 (instead of --repeats): the "
                         "spreads are over seeds")
    compare.add_argument("--cluster", action="store_true",
                         help="launch through 'mpicoll cluster run' (an emulated cluster that is up)")


def add_plot_parser(commands) -> None:
    plot = commands.add_parser("plot", help="the compare report (table and plots) from train logs")
    plot.add_argument("logs", nargs="+", help="mpicoll train --output files (JSON lines)")
    plot.add_argument("--output", default="compare-report", help="report folder (default compare-report)")
    plot.add_argument("--target", type=_target, help="accuracy to time, e.g. 0.9, or 'first': the first method's "
                      "mean final accuracy (default: 90%% of the best run's final accuracy)")


def _seeds(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise SystemExit(f"mpicoll compare: --seeds takes seeds separated by commas, e.g. 1,2,3, not {text!r}") from None


def _target(text: str):
    """``--target``: an accuracy, or "first" (the first method's mean final accuracy)."""
    import argparse
    if text == "first":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give an accuracy such as 0.9, or 'first', not {text!r}") from None


def add_reproduce_parser(commands) -> None:
    reproduce = commands.add_parser(
        "reproduce", help="the seeds' claims (DC-ASGD, stragglers, SGP, Downpour), DiLoCo's across slow links and the newer "
        "asynchronous rules', over several seeds, with a report",
        description="Runs every claim's mpicoll train jobs (each under its own mpiexec) and writes claims.json, "
        "report.md and plots. About 14 minutes on 2 cores; --quick: under a minute.")
    reproduce.add_argument("--output", help="report folder, made new (default reproduce-DATE-TIME in the current "
                           "folder; the project's published results are in docs/results)")
    reproduce.add_argument("--data", default="mnist1d", metavar="mnist1d|digits|FILE.npz",
                           help="the data every claim trains on (default mnist1d)")
    reproduce.add_argument("--claims", default="abcdef", help="which claims, as letters (default abcdef: (e) is "
                           "DiLoCo and local SGD across slow links, (f) Ringmaster and Rescaled ASGD under a straggler)")
    reproduce.add_argument("--seeds", type=int, help="seeds per setting (default 3, and 10 for (b), whose "
                           "1-point accuracy test needs them; --quick 2)")
    reproduce.add_argument("--model", choices=("cnn", "mlp"),
                           help="the small CNN (default: torch's where torch is installed, else numpy's) or a "
                           "numpy MLP 128x128")
    reproduce.add_argument("--max-train", type=int, default=4000,
                           help="larger data: train on a fixed random subset of this many samples (default 4000; "
                           "the test set is cut to a quarter of it), so the claims keep to minutes")
    reproduce.add_argument("--quick", action="store_true",
                           help="the pipeline on a small setting, for CI: 2 seeds, M = 2, 6 epochs, no cluster")


def reproduce_main(args) -> int:
    import importlib.util
    from pathlib import Path
    from .claims import Setting, prepare_data, quick, reproduce
    setting = quick() if args.quick else Setting()
    setting.data = args.data
    setting.max_train, setting.max_test = args.max_train, max(1, args.max_train // 4)
    if args.seeds:
        setting.seeds = setting.straggler_seeds = list(range(1, args.seeds + 1))
    unknown = set(args.claims) - set("abcdef")
    if unknown or not args.claims:
        raise SystemExit(f"mpicoll reproduce: --claims takes letters among abcdef, got {args.claims!r}")
    if args.max_train < 1:
        raise SystemExit(f"mpicoll reproduce: --max-train must be at least 1, got {args.max_train}")
    if args.output is None:                  # a new folder, never an earlier run's (nor the published results)
        import time
        args.output = time.strftime("reproduce-%Y%m%d-%H%M%S")
    try:
        features = prepare_data(setting, Path(args.output) / "runs")
    except ValueError as error:
        raise SystemExit(f"mpicoll reproduce: {error}") from None
    torch_here = importlib.util.find_spec("torch") is not None
    wide = features > 256 and args.model is None and not args.quick     # a CNN over them would take hours
    if args.model == "mlp" or wide:
        setting.model = ["--model", "mlp", "--hidden", "128,128"]
        if wide:
            print(f"mpicoll reproduce: {features} features: the claims train a 128x128 MLP (--model cnn to insist "
                  "on the CNN, whose cost grows with the features)", file=sys.stderr)
    elif args.model == "cnn" or (not args.quick and not torch_here):
        setting.model = ["--framework", "torch", "--model", "cnn"] if torch_here else ["--model", "cnn"]
    result = reproduce(args.output, setting, args.claims,
                       skip_cluster="--quick runs no emulated cluster" if args.quick else None)
    for record in result["claims"]:
        verdict = {True: "reproduced: ", False: "NOT reproduced: ", None: ""}[record["reproduced"]]
        print(f"{record['claim'][:3]} {verdict}{record['note']}", file=sys.stderr)
    print(f"mpicoll reproduce: wrote {args.output}/claims.json, report.md and the plots "
          f"({result['wall_s']:.0f} s)", file=sys.stderr)
    return 0


def compare_main(args) -> int:
    from .compare import compare
    methods = args.methods.split(",")
    if args.methods == ",".join(METHODS):             # every method, by default: those that fit -n
        fit = [m for m in methods if m not in METHODS or METHODS[m].fits(args.ranks)]
        if fit != methods:
            print(f"mpicoll compare: leaving out {', '.join(m for m in methods if m not in fit)}: more than "
                  f"{args.ranks} ranks needed", file=sys.stderr)
        methods = fit
    compare(methods, args.ranks, args.output, [*DEFAULT_PROBLEM, *args.train_args], args.target, args.timeout,
            repeats=args.repeats, cluster=args.cluster, compressions=args.compressions.split(","),
            seeds=_seeds(args.seeds))
    return 0


def plot_main(args) -> int:
    from .compare import report
    try:
        markdown = report(args.logs, args.output, args.target)
    except (ValueError, FileNotFoundError) as error:
        print(f"mpicoll plot: {error}", file=sys.stderr)
        return 2
    print(f"mpicoll plot: wrote {markdown} and the plots beside it", file=sys.stderr)
    return 0
