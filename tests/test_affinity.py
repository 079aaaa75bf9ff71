"""The trainer's CPU binding: which cores a GPU rank is put on (megascope.trainer.affinity)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from megascope.trainer.affinity import choose_cores, describe, device_cores, parse_cpulist, pci_address


def test_a_cpulist_reads_ranges_and_single_cores() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("5") == {5}
    with pytest.raises(ValueError):
        parse_cpulist("4-2")
    with pytest.raises(ValueError):
        parse_cpulist("a-b")


def test_describe_writes_back_the_shortest_cpulist() -> None:
    cores = {0, 1, 2, 3, 8, 10, 11, 30}
    assert describe(cores) == "0-3,8,10-11,30"
    assert parse_cpulist(describe(cores)) == cores
    assert describe(None) == "unbound"


def test_the_pci_address_is_sysfs_spelling() -> None:
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x9B, pci_device_id=0)
    assert pci_address(props) == "0000:9b:00.0"


def test_the_device_cores_come_from_sysfs_and_nothing_is_a_none(tmp_path) -> None:
    dev = tmp_path / "0000:9b:00.0"
    dev.mkdir()
    (dev / "local_cpulist").write_text("32-63\n")
    assert device_cores("0000:9b:00.0", root=tmp_path) == set(range(32, 64))
    assert device_cores("0000:1a:00.0", root=tmp_path) is None  # no such device
    (dev / "local_cpulist").write_text("\n")  # a machine without NUMA information
    assert device_cores("0000:9b:00.0", root=tmp_path) is None


def test_a_rank_is_bound_only_where_that_narrows_its_cores() -> None:
    allowed = set(range(64))
    assert choose_cores(set(range(32, 64)), allowed) == set(range(32, 64))
    # A container's cpuset: only the local cores it may use.
    assert choose_cores(set(range(32, 64)), set(range(24, 40))) == set(range(32, 40))
    # The local cores lie outside the cpuset, or are all of it, or are unknown: left as it is.
    assert choose_cores(set(range(32, 64)), set(range(0, 16))) is None
    assert choose_cores(set(range(64)), allowed) is None
    assert choose_cores(None, allowed) is None


def test_the_cli_refuses_an_unknown_binding_in_one_line(tmp_path) -> None:
    from megascope.cli import main

    result = CliRunner().invoke(main, ["train", "--cpu-bind", "socket", "-o", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert "--cpu-bind" in result.output and "Traceback" not in result.output


def test_ranks_on_one_node_get_disjoint_slices_of_it() -> None:
    from megascope.trainer.affinity import share_of

    node = set(range(64))
    slices = [share_of(node, i, 4) for i in range(4)]
    assert [min(s) for s in slices] == [0, 16, 32, 48] and all(len(s) == 16 for s in slices)
    assert set().union(*slices) == node
    # Too few cores to split: every rank keeps the whole node.
    assert share_of(set(range(8)), 1, 4) == set(range(8))
    assert share_of(node, 0, 1) == node
