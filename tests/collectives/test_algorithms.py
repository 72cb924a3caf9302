"""mpicoll.collectives.algorithms: the registry, auto's rules, and the chunk arithmetic they share (mpicoll.base.chunks)."""

from __future__ import annotations

import numpy as np
import pytest

from mpicoll.collectives.algorithms import auto, get, names, node
from mpicoll.base.chunks import balanced_bounds, segments


class TestAuto:
    def test_defaults_pick_the_node_on_one_node_else_mpi_small_and_ring_large(self, monkeypatch):
        on_node = "shm" if node.available() else None
        assert auto.choose("allreduce", 8, 4) == (on_node or "mpi")
        assert auto.choose("allreduce", 64 << 20, 4) == (on_node or "hierarchical")   # the ring on one node
        monkeypatch.setattr(auto, "DEFAULT_RULES", auto.WITHOUT_NODE_RULES)
        assert auto.choose("allreduce", 8, 4) == "mpi"
        assert auto.choose("allreduce", 64 << 20, 4) == "hierarchical"
        assert auto.choose("allreduce", 64 << 20, 1) == "mpi"
        assert auto.choose("allreduce", 64 << 20, 4, commutative=False) == "mpi"

    def test_across_nodes_of_several_ranks_the_hierarchical_splits_pay_earlier(self, monkeypatch):
        assert auto.choose("allgather", 1 << 20, 4) == "mpi"
        assert auto.choose("allgather", 1 << 20, 4, across_nodes=True) == "hierarchical"
        assert auto.choose("reduce_scatter_block", 64 << 10, 4, across_nodes=True) == "mpi"
        assert auto.choose("reduce_scatter_block", 1 << 20, 4, across_nodes=True) == "hierarchical"
        assert auto.choose("allreduce", 3 << 20, 4) == ("shm" if node.available() else "hierarchical")
        assert auto.choose("allreduce", 3 << 20, 4, across_nodes=True) == "mpi"
        monkeypatch.setenv("MPICOLL_AUTO_ALLGATHER", "ring")            # a rule set by hand holds everywhere
        assert auto.choose("allgather", 8, 4, across_nodes=True) == "ring"

    def test_under_fault_tolerance_nothing_goes_to_mpis_own_collectives(self, monkeypatch):
        """Across a cut link Open MPI's own collectives under ULFM returned success with wrong data, where the
        point-to-point calls of mpicoll's algorithms reported the failure (docs/elastic.md)."""
        monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "true")
        chosen = {auto.choose(collective, nbytes, 4, across_nodes=across) for collective in auto.DEFAULT_RULES
                  for nbytes in (0, 8, 1 << 16, 3 << 20, 64 << 20) for across in (False, True)}
        assert "mpi" not in chosen and "recursive_doubling" in chosen
        assert auto.choose("allreduce", 8, 4) == "recursive_doubling"
        assert auto.choose("allreduce", 64 << 20, 4) == "hierarchical"
        assert auto.choose("allreduce", 8, 1) == "mpi"                          # one rank: no peer to lose
        monkeypatch.setenv("MPICOLL_AUTO_BCAST", "mpi")                          # a rule set by hand holds
        assert auto.choose("bcast", 8, 4) == "mpi"

    def test_environment_overrides(self, monkeypatch):
        monkeypatch.setenv("MPICOLL_AUTO_ALLREDUCE", "recursive_doubling:4K, parallel:1M, ring")
        assert [auto.choose("allreduce", n, 4) for n in (8, 4096, 1 << 20)] == \
            ["recursive_doubling", "parallel", "ring"]

    @pytest.mark.parametrize("rule, words", [("ring:1M", "no limit"), ("rung", "not an algorithm"), ("mpi:lots,ring", "byte")])
    def test_bad_rules_are_explained(self, monkeypatch, rule, words):
        monkeypatch.setenv("MPICOLL_AUTO_BCAST", rule)
        with pytest.raises(ValueError, match=words):
            auto.choose("bcast", 8, 4)

    def test_registry(self):
        assert set(names()) == {"ring", "parallel", "recursive_doubling", "direct", "hierarchical", "shm", "mpi",
                                "auto"}
        assert set(names(device=True)) == {"direct", "mpi", "auto"}
        assert get("ring").name == "ring"
        with pytest.raises(ValueError, match="Unrecognized algorithm: 'rung'"):
            get("rung")
        with pytest.raises(TypeError, match="does not serve device .* direct, mpi, auto"):
            get("ring", device=True)

    def test_device_arrays_go_to_algorithms_that_serve_them(self, monkeypatch):
        assert auto.choose("allreduce", 64 << 20, 4, device=True) == "direct"
        assert auto.choose("allreduce", 8, 1, commutative=False, device=True) == "direct"
        monkeypatch.setenv("MPICOLL_AUTO_DEVICE_ALLREDUCE", "ring")
        with pytest.raises(ValueError, match="serves device arrays"):
            auto.choose("allreduce", 8, 4, device=True)


def test_chunks_and_segments_cover_everything_once():
    for count in (0, 1, 3, 10, 1001):
        for parts in (1, 2, 3, 7):
            bounds = balanced_bounds(count, parts)
            sizes = np.diff(bounds)
            assert bounds[0] == 0 and bounds[-1] == count and sizes.max() - sizes.min() <= 1
            pieces = [s for a, b in zip(bounds, bounds[1:]) for s in segments(a, b, 4)]
            assert sum(s.stop - s.start for s in pieces) == count
