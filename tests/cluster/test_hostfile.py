"""Hostfile parsing (mpirun / DeepSpeed syntax), rank layout helpers, and one clear error per malformed line."""
from __future__ import annotations

import pytest

from autopar.cluster.hostfile import HostSlots, load_hostfile, node_rank_of, rank_range, world_size
from autopar.errors import ClusterError


@pytest.fixture
def write(tmp_path):
    def _write(text, name="hostfile"):
        p = tmp_path / name
        p.write_text(text)
        return str(p)
    return _write


def _fails(path: str, *fragments: str) -> None:
    with pytest.raises(ClusterError) as info:
        load_hostfile(path)
    msg = str(info.value)
    assert "\n" not in msg and path in msg, msg
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"


def test_parse_all_accepted_forms(write):
    text = (
        "# cluster of three\n"
        "\n"
        "worker-0 slots=8   \n"
        "  10.0.0.2\tslots=4 max_slots=8  # trailing comment\n"
        "worker-2\n"
        "worker-3 max-slots=2 slots=2\n"
    )
    hosts = load_hostfile(write(text))
    assert hosts == (HostSlots("worker-0", 8), HostSlots("10.0.0.2", 4), HostSlots("worker-2", 1),
                     HostSlots("worker-3", 2))
    assert world_size(hosts) == 15


def test_rank_ranges_follow_file_order(write):
    hosts = load_hostfile(write("a slots=8\nb slots=4\nc\n"))
    assert [rank_range(hosts, i) for i in range(3)] == [range(0, 8), range(8, 12), range(12, 13)]
    with pytest.raises(ClusterError, match="node rank 3 is out of range"):
        rank_range(hosts, 3)


def test_node_rank_of(write):
    hosts = load_hostfile(write("Worker-A slots=2\n10.0.0.2 slots=2\n::1\n"))
    assert node_rank_of(hosts, "Worker-A") == 0
    assert node_rank_of(hosts, "worker-a") == 0  # DNS names are case-insensitive
    assert node_rank_of(hosts, "10.0.0.2") == 1
    assert node_rank_of(hosts, "0:0::1") == 2  # IPs compare by value
    with pytest.raises(ClusterError, match="'worker-z' is not in the hostfile"):
        node_rank_of(hosts, "worker-z")


def test_missing_file(tmp_path):
    _fails(str(tmp_path / "nope"), "file not found")


def test_unreadable_directory(tmp_path):
    _fails(str(tmp_path), "cannot read")


@pytest.mark.parametrize("line, fragment", [
    ("slots=4", "expected a host name first"),
    ("worker-1 slots 4", "unexpected 'slots'"),
    ("worker-1 cpus=4", "unexpected 'cpus=4'"),
    ("worker-1 slots=2 slots=4", "slots= is given twice"),
])
def test_bad_syntax_names_line(write, line, fragment):
    _fails(write(f"worker-0 slots=1\n# c\n{line}\n"), ":3:", fragment)


@pytest.mark.parametrize("value", ["0", "-2", "four", "", "2.5"])
def test_slots_not_positive_int(write, value):
    _fails(write(f"worker-0 slots={value}\n"), ":1:", "slots must be a positive integer", repr(value))


def test_duplicate_host(write):
    _fails(write("a slots=2\nb slots=2\na slots=2\n"), ":3:", "'a' is listed twice", "first on line 1")


def test_duplicate_host_by_ip_value(write):
    _fails(write("::1\n0:0::1\n"), ":2:", "listed twice")


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n   \n"])
def test_empty_file(write, text):
    _fails(write(text), "no hosts")
