"""Every ``mpicoll bench*`` command run as a user would (real ``mpiexec`` jobs): its table, records and plot."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mpicoll.collectives.algorithms
from tests.support.jobs import ROOT, launch, script_env


def bench(tmp_path, ranks: int, command: str, *options: str):
    """Run ``mpicoll COMMAND OPTIONS --output FILE`` under mpiexec: (its result, the records it wrote)."""
    out = tmp_path / f"{command}.json"
    result = launch(ranks, "-m", "mpicoll", command, *options, "--output", str(out))
    assert result.returncode == 0, result.stderr
    return result, json.loads(out.read_text())


def test_bench_writes_table_json_and_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = launch(2, "-m", "mpicoll", "bench", "--sizes", "8,64K,3M", "--iters", "3", "--min-iters", "2",
                    "--warmup", "1", "--fingerprint-seconds", "0.1", "--output", str(out), "--plot", str(png))
    assert result.returncode == 0, result.stderr
    records = json.loads(out.read_text())
    algorithms = set(mpicoll.collectives.algorithms.names())
    assert {r["algorithm"] for r in records} == algorithms
    assert sorted({r["bytes"] for r in records}) == [8, 65536, 3 << 20]
    for record in records:
        assert {"algorithm", "bytes", "ranks", "dtype", "time_s", "algbw_gbps", "busbw_gbps"} <= set(record)
        assert record["ranks"] == 2 and record["dtype"] == "float32" and record["time_s"] > 0
        assert record["busbw_gbps"] == pytest.approx(record["algbw_gbps"] * 2 * (2 - 1) / 2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "per-call overhead of the Python layer" in result.stdout
    # one node: from 1 MiB each time against every rank copying the buffer at once (a bound no allreduce beats)
    bounded = [r for r in records if "copy_s" in r]
    assert bounded and all(r["bytes"] == 3 << 20 for r in bounded), records
    assert all(r["of_copy_bound"] == pytest.approx(r["copy_s"] / r["time_s"]) and r["busbw_bound_gbps"] ==
               pytest.approx(r["bytes"] / r["copy_s"] / 1e9 * 2 * (2 - 1) / 2) for r in bounded), bounded
    assert "# memory bound: all 2 ranks copying" in result.stdout and "busbw bound" in result.stdout
    assert all(name in result.stdout for name in algorithms)
    # what the cross-rank fingerprint adds, at the one size from 512 KiB, for each own algorithm (not mpi, auto)
    added = re.findall(r"^#\s+3 MiB (\S+)\s+[-+][\d.]+ us on .* rounds\)$", result.stdout, re.M)
    assert sorted(added) == sorted(algorithms - {"mpi", "auto"}), result.stdout


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "bcast"])
def test_bench_times_every_collective(tmp_path, collective):
    _, records = bench(tmp_path, 2, "bench", "--collective", collective, "--sizes", "8,256K", "--iters", "3",
                       "--min-iters", "2", "--warmup", "1", "--algorithms", "ring,auto")
    assert {r["collective"] for r in records} == {collective}
    assert {r["algorithm"] for r in records} == {"mpi", "ring", "auto"}
    factor = {"reduce_scatter": 0.5, "allgather": 0.5, "bcast": 1.0}[collective]
    for record in records:
        assert record["busbw_gbps"] == pytest.approx(record["algbw_gbps"] * factor)


def test_bench_times_compressed_allreduces_beside_the_rest_against_the_bound_of_their_bytes(tmp_path):
    result, records = bench(tmp_path, 2, "bench", "--sizes", "4,256K", "--iters", "3", "--min-iters", "2",
                            "--warmup", "1", "--algorithms", "ring", "--compression", "fp16,bf16", "--link-gbps", "1")
    assert {r["algorithm"] for r in records} == {"mpi", "ring", "ring+fp16", "ring+bf16"}
    assert all(r["wire_bytes"] == r["bytes"] // (2 if "+" in r["algorithm"] else 1) for r in records), records
    refused = launch(2, "-m", "mpicoll", "bench", "--collective", "bcast", "--compression", "fp16")
    assert refused.returncode == 2 and refused.stderr.count("--compression takes fp16, bf16") == 1, refused.stderr


def test_bench_kernels_reports_bandwidth_against_copy(tmp_path):
    out = tmp_path / "kernels.json"
    result = subprocess.run([sys.executable, "-m", "mpicoll", "bench-kernels", "--elements", "100003", "--iters", "2",
                             "--threads", "1", "--backends", "numpy,numba,cupy", "--output", str(out)],
                            cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    records = json.loads(out.read_text())
    for record in records:
        assert {"kernel", "backend", "elements", "dtype", "time_s", "gbps", "fraction_of_copy"} <= set(record)
        assert record["elements"] == 100003 and record["time_s"] > 0 and record["gbps"] > 0
    numpy_rows = {r["kernel"]: r for r in records if r["backend"] == "numpy"}
    assert numpy_rows["copy"]["fraction_of_copy"] == pytest.approx(1.0)
    assert {"dcasgd", "dcasgd_adaptive", "adagrad", "sgd", "scaled_accumulate", "reduce_sum"} <= set(numpy_rows)
    if "numba" in result.stdout.split("skipped")[0]:
        assert any(r["backend"] == "numba" and r["kernel"] == "dcasgd" for r in records)
    import importlib.util
    if importlib.util.find_spec("cupy") is None:
        assert "# cupy: skipped" in result.stdout


def test_bench_ps_reports_every_rule(tmp_path):
    result, records = bench(tmp_path, 3, "bench-ps", "--sizes", "64K", "--seconds", "0.3", "--compute-ms", "2",
                            "--rules", "sync,async,dcasgd", "--straggler", "2=3", "--link-gbps", "1")
    assert result.stdout.count("every worker on the server's node, no link crossed") == 6, result.stdout
    assert {(r["rule"], r["straggler"]) for r in records} == {(rule, s) for rule in ("sync", "async", "dcasgd")
                                                              for s in ("", "2=3")}
    for record in records:
        assert record["params"] == 65536 // 4 and record["workers"] == 2 and record["updates_per_s"] > 0
        assert 0 < record["update_fraction_of_copy"] and record["gbps"] > 0
        assert record["remote_workers"] == 0 and record["of_link_bound"] == 0


def test_bench_sandblaster_times_every_worker_count_and_case(tmp_path):
    result, records = bench(tmp_path, 4, "bench-sandblaster", "--params", "4096", "--rows", "64", "--compute-ms", "4",
                            "--iterations", "2")
    assert [(r["workers"], r["straggler"], r["backup"]) for r in records] == \
        [(1, False, True), (2, False, True), (2, True, False), (2, True, True)]
    for record in records:
        assert record["iterations"] == 2 and record["evaluation_s"] > 0 and 0 < record["efficiency"]
        assert (record["backups"] == 0) if not record["backup"] else record["backups"] >= 0
    assert "efficiency" in result.stdout


def test_bench_gossip_reports_sgp_against_allreduce(tmp_path):
    result, records = bench(tmp_path, 3, "bench-gossip", "--sizes", "64K", "--iters", "3", "--compute-ms", "1",
                            "--straggler", "2=2")
    averaging = [r for r in records if r["kind"] == "averaging"]
    assert {r["graph"] for r in averaging} == {"time-varying-exponential", "exponential"}
    assert all(r["rounds"] and r["theory_rounds"] for r in averaging), averaging
    runs = [r for r in records if r["kind"] == "iterations"]
    assert {(r["method"], r["mailbox"], r["tau"], r["straggler"]) for r in runs} >= {
        ("allreduce", "-", 0, ""), ("sgp", "onesided", 1, "2=2"), ("sgp", "p2p", 0, "")}
    for record in runs:
        assert record["iterations_per_s"] > 0 and record["bytes_per_iteration"] > 0 and record["ranks"] == 3
        assert record["method"] != "allreduce" or record["ratio_to_allreduce"] == 1.0


def test_bench_gossip_sets_iterations_against_what_the_links_allow():
    from mpicoll.benchmarks.gossip import link_report
    records = [{"method": "allreduce", "mailbox": "-", "tau": 0, "params": 1 << 20, "dtype": "float32",
                "straggler": "", "iterations_per_s": 10.0, "bytes_per_iteration": 6 << 20},
               {"method": "sgp", "mailbox": "p2p", "tau": 1, "params": 1 << 20, "dtype": "float32",
                "straggler": "", "iterations_per_s": 20.0, "bytes_per_iteration": 4 << 20}]
    lines = link_report(records, nodes=4, ranks=4, gbps=1.0, compute_ms=30.0)
    ring, sgp = records
    assert ring["link_ms"] == pytest.approx((6 << 20) * 8 / 1e6) and sgp["link_ms"] == pytest.approx((4 << 20) * 8 / 1e6)
    assert ring["of_link_bound"] == pytest.approx((30 + ring["link_ms"]) / 100)    # no overlap: computation + link
    assert sgp["of_link_bound"] == pytest.approx(max(30, sgp["link_ms"]) / 50)    # tau > 0: the larger of the two
    assert len(lines) == 3 and "4 nodes at 1 Gbit/s" in lines[0]
    assert "no link crossed" in link_report(records, nodes=1, ranks=4, gbps=1.0, compute_ms=30.0)[0]


def test_bench_torch_times_mpicoll_against_gloo_and_mpi(tmp_path):
    pytest.importorskip("torch", reason="the torch extra is not installed")
    result, records = bench(tmp_path, 2, "bench-torch", "--sizes", "4K,64K", "--algorithms", "auto,ring", "--iters", "2")
    assert [r["bytes"] for r in records] == [4096, 65536] and all(r["ranks"] == 2 for r in records)
    assert all(r[f"{peer}_s"] > 0 for r in records for peer in ("gloo", "mpi", "auto", "ring")), records
    assert "x gloo" in result.stdout and "x MPI" in result.stdout


def test_bench_torch_times_only_the_peers_asked_for(tmp_path):
    """``--peers mpi,floor,dist --algorithms ''``: the price of a small call beside MPI and torch's floor alone
    (no gloo, whose threads spin on between calls); a peer it does not know is refused, naming those it does."""
    pytest.importorskip("torch", reason="the torch extra is not installed")
    result, records = bench(tmp_path, 2, "bench-torch", "--sizes", "8,1K", "--peers", "mpi,floor,dist",
                            "--algorithms", "", "--iters", "3")
    assert [r["bytes"] for r in records] == [8, 1024], records
    assert all(set(r) == {"bytes", "ranks", "dtype", "mpi_s", "floor_s", "dist_s"} for r in records), records
    assert "dist x (MPI+floor)" in result.stdout and "gloo" not in result.stdout.split("\n", 2)[1], result.stdout
    refused = launch(2, "-m", "mpicoll", "bench-torch", "--peers", "mpi,nccl", "--sizes", "8")
    assert refused.returncode != 0 and "--peers takes some of gloo, mpi, floor, dist, deepspeed" in refused.stderr, \
        refused.stderr


def test_bench_torch_times_bfloat16_tensors_without_mpis_own_call(tmp_path):
    """``--dtype bfloat16``: the tensors are bfloat16 (each peer's sum checked first), and MPI's own call, which has
    no such type, is left out, or refused when asked for."""
    pytest.importorskip("torch", reason="the torch extra is not installed")
    result, records = bench(tmp_path, 2, "bench-torch", "--dtype", "bfloat16", "--sizes", "8,4K", "--peers",
                            "floor", "--iters", "2")
    assert [(r["bytes"], r["dtype"]) for r in records] == [(8, "bfloat16"), (4096, "bfloat16")], records
    assert all("auto_s" in r and "mpi_s" not in r for r in records) and "bfloat16" in result.stdout, records
    refused = launch(2, "-m", "mpicoll", "bench-torch", "--dtype", "bfloat16", "--peers", "mpi", "--sizes", "8")
    assert refused.returncode != 0 and "MPI has no bfloat16 type" in refused.stderr, refused.stderr


def test_bench_torch_times_deepspeeds_kernel_checked_with_its_share_of_the_copy_bound_and_leaves_no_segment(
        tmp_path):
    """Where deepspeed is installed: its shared-memory allreduce is a peer (its sum checked first, as every
    peer's), each peer's share of the copy bound is measured beside it from 1 MiB, and the kernel's /dev/shm
    segments (which DeepSpeed never unlinks) are gone after the run."""
    pytest.importorskip("torch", reason="the torch extra is not installed")
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")
    before = {p.name for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")}
    result, records = bench(tmp_path, 2, "bench-torch", "--sizes", "64K,1M", "--peers", "mpi,deepspeed",
                            "--iters", "3")
    assert [set(r) for r in records] == [{"bytes", "ranks", "dtype", "mpi_s", "deepspeed_s", "auto_s"},
                                         {"bytes", "ranks", "dtype", "mpi_s", "deepspeed_s", "auto_s", "copy_s"}], \
        records
    assert "x DS" in result.stdout and "share of it: mpi" in result.stdout, result.stdout
    assert {p.name for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")} == before
