"""Rank table parsing and validation: the MindSpore tutorial examples parse, every broken rule is one clear error."""
from __future__ import annotations

import copy
import json

import pytest

from autopar.cluster.ranktable import RankEntry, load_rank_table, rank_from_env
from autopar.errors import ClusterError

S0, S1 = "10.155.111.140", "10.155.111.141"


def _server(server_id: str, first_rank: int, last_octet: int) -> dict:
    """Eight devices as in the MindSpore r1 tutorial: device_ip 192.{1..4}.27.{x, x+1}."""
    devices = [
        {"device_id": str(d), "device_ip": f"192.{d % 4 + 1}.27.{last_octet + d // 4}", "rank_id": str(first_rank + d)}
        for d in range(8)
    ]
    return {"server_id": server_id, "device": devices, "host_nic_ip": "reserve"}


R1_8 = {"version": "1.0", "server_count": "1", "server_list": [_server(S0, 0, 6)], "status": "completed"}
R1_16 = {"version": "1.0", "server_count": "2", "server_list": [_server(S0, 0, 6), _server(S1, 8, 8)],
         "status": "completed"}
R02_2 = {
    "board_id": "0x0000", "chip_info": "910", "deploy_mode": "lab", "group_count": "1",
    "group_list": [{"device_num": "2", "server_num": "1", "group_name": "", "instance_count": "2", "instance_list": [
        {"devices": [{"device_id": "0", "device_ip": "192.1.27.6"}], "rank_id": "0", "server_id": S0},
        {"devices": [{"device_id": "1", "device_ip": "192.2.27.6"}], "rank_id": "1", "server_id": S0}]}],
    "para_plane_nic_location": "device", "para_plane_nic_name": ["eth0", "eth1"], "para_plane_nic_num": "2",
    "status": "completed",
}


@pytest.fixture
def write(tmp_path):
    def _write(doc, name="rank_table.json"):
        p = tmp_path / name
        p.write_text(doc if isinstance(doc, str) else json.dumps(doc, indent=2))
        return str(p)
    return _write


def _fails(path: str, *fragments: str) -> str:
    with pytest.raises(ClusterError) as info:
        load_rank_table(path)
    msg = str(info.value)
    assert "\n" not in msg and path in msg, msg
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"
    return msg


def _edit(doc: dict, fn) -> dict:
    doc = copy.deepcopy(doc)
    fn(doc)
    return doc


# ------------------------------------------------------------------------------------------------------ good tables


def test_r1_8_devices(write):
    t = load_rank_table(write(R1_8))
    assert t.format == "r1" and t.world_size == 8 and t.servers == (S0,)
    assert t.entry(5) == RankEntry(5, S0, 5, "192.2.27.7")
    assert t.master_addr == S0 and t.node_rank(S0) == 0
    assert t.ranks_on(S0) == tuple(range(8))
    assert [t.local_rank(r) for r in range(8)] == list(range(8)) and t.local_size(3) == 8


def test_r1_16_devices_two_servers(write):
    t = load_rank_table(write(R1_16))
    assert t.world_size == 16 and t.servers == (S0, S1)
    assert [e.rank_id for e in t.entries] == list(range(16))
    assert t.entry(9) == RankEntry(9, S1, 1, "192.2.27.8")
    assert t.ranks_on(S1) == tuple(range(8, 16))
    assert t.local_rank(9) == 1 and t.local_size(9) == 8
    assert t.node_rank(S0) == 0 and t.node_rank(S1) == 1 and t.master_addr == S0


def test_r1_servers_in_file_order_rank0_on_second(write):
    # The lexicographically smaller server may come second in the file; it still owns ranks 0..7.
    doc = _edit(R1_16, lambda d: d["server_list"].reverse())
    t = load_rank_table(write(doc))
    assert t.servers == (S1, S0) and t.master_addr == S0
    assert t.node_rank(S0) == 0 and t.node_rank(S1) == 1


def test_r1_accepts_ints_and_missing_device_ip(write):
    doc = {"server_count": 1, "status": "completed", "server_list": [
        {"server_id": "127.0.0.1", "device": [{"device_id": 1, "rank_id": 1}, {"device_id": 0, "rank_id": 0}]}]}
    t = load_rank_table(write(doc))
    assert t.entries == (RankEntry(0, "127.0.0.1", 0, None), RankEntry(1, "127.0.0.1", 1, None))


def test_r02_2_devices(write):
    t = load_rank_table(write(R02_2))
    assert t.format == "r0.2" and t.world_size == 2 and t.servers == (S0,)
    assert t.entries == (RankEntry(0, S0, 0, "192.1.27.6"), RankEntry(1, S0, 1, "192.2.27.6"))
    assert t.local_rank(1) == 1 and t.local_size(0) == 2 and t.master_addr == S0


def test_unknown_rank_and_server_lookups(write):
    t = load_rank_table(write(R1_8))
    with pytest.raises(ClusterError, match="rank 8 is not in rank table"):
        t.entry(8)
    with pytest.raises(ClusterError, match="server '1.2.3.4' is not in rank table"):
        t.node_rank("1.2.3.4")


# ------------------------------------------------------------------------------------------------------ file errors


def test_missing_file(tmp_path):
    _fails(str(tmp_path / "nope.json"), "file not found")


def test_not_json_names_position(write):
    _fails(write('{"version": "1.0",\n  "server_count": "1" "server_list": []}'), "not valid JSON", "line 2 column")


def test_top_level_not_object(write):
    _fails(write([1, 2]), "JSON object", "list")


def test_unknown_format(write):
    _fails(write({"version": "1.0", "status": "completed"}), "server_list", "group_list")


@pytest.mark.parametrize("doc, field", [
    (_edit(R1_8, lambda d: d.pop("server_count")), "server_count"),
    (_edit(R1_8, lambda d: d.pop("status")), "status"),
    (_edit(R1_8, lambda d: d["server_list"][0].pop("server_id")), "server_list[0].server_id"),
    (_edit(R1_8, lambda d: d["server_list"][0].pop("device")), "server_list[0].device"),
    (_edit(R1_8, lambda d: d["server_list"][0]["device"][3].pop("rank_id")), "server_list[0].device[3].rank_id"),
    (_edit(R1_8, lambda d: d["server_list"][0]["device"][3].pop("device_id")), "server_list[0].device[3].device_id"),
    (_edit(R02_2, lambda d: d["group_list"][0]["instance_list"][1].pop("server_id")),
     "group_list[0].instance_list[1].server_id"),
    (_edit(R02_2, lambda d: d["group_list"][0].pop("instance_count")), "group_list[0].instance_count"),
    (_edit(R02_2, lambda d: d.pop("group_count")), "group_count"),
])
def test_missing_required_field(write, doc, field):
    _fails(write(doc), f"{field}: required field is missing")


def test_bad_number(write):
    doc = _edit(R1_8, lambda d: d["server_list"][0]["device"][2].update(rank_id="two"))
    _fails(write(doc), "server_list[0].device[2].rank_id", "'two'")


def test_empty_device_list(write):
    _fails(write(_edit(R1_8, lambda d: d["server_list"][0].update(device=[]))), "server_list[0].device", "non-empty")


# ---------------------------------------------------------------------------------------------------- rule breakers


def test_status_not_completed(write):
    _fails(write(_edit(R1_8, lambda d: d.update(status="initializing"))), "status", "'completed'", "'initializing'")


def test_duplicate_rank_id_names_both_places(write):
    doc = _edit(R1_16, lambda d: d["server_list"][1]["device"][0].update(rank_id="3"))
    _fails(write(doc), "rank_id 3 is used twice", "server_list[1].device[0].rank_id",
           "server_list[0].device[3].rank_id")


def test_rank_gap_names_missing_ids(write):
    doc = _edit(R1_8, lambda d: d["server_list"][0]["device"][7].update(rank_id="9"))
    _fails(write(doc), "missing [7]", "unexpected [9]", "server_list[0].device[7].rank_id", "0..7")


def test_rank_order_against_lexicographic_server_order(write):
    doc = _edit(R1_16, lambda d: (d["server_list"][0].update(server_id=S1), d["server_list"][1].update(server_id=S0)))
    _fails(write(doc), "lexicographic order of server_id", "server '10.155.111.140' (ranks 8..15)",
           "server '10.155.111.141' (ranks 0..7)", "yet holds rank 15 > rank 0")


def test_lexicographic_is_string_order_not_numeric(write):
    # "10.0.0.10" < "10.0.0.9" as strings, so the .9 host cannot own ranks 0..7 (HCCL sorts server_id strings).
    doc = _edit(R1_16, lambda d: (d["server_list"][0].update(server_id="10.0.0.9"),
                                  d["server_list"][1].update(server_id="10.0.0.10")))
    _fails(write(doc), "lexicographic", "'10.0.0.10'", "'10.0.0.9'")


def test_interleaved_ranks_across_servers(write):
    def interleave(d):
        a, b = d["server_list"][0]["device"], d["server_list"][1]["device"]
        a[7]["rank_id"], b[0]["rank_id"] = "8", "7"
    _fails(write(_edit(R1_16, interleave)), "lexicographic", "rank 8 > rank 7")


def test_duplicate_device_id_on_one_server(write):
    doc = _edit(R1_8, lambda d: d["server_list"][0]["device"][5].update(device_id="2"))
    _fails(write(doc), "device_id 2 is used twice", repr(S0), "server_list[0].device[5].device_id",
           "server_list[0].device[2].device_id")


def test_same_device_id_on_two_servers_is_fine(write):
    assert load_rank_table(write(R1_16)).entry(8).device_id == 0


def test_r02_duplicate_device_id_across_instances(write):
    doc = _edit(R02_2, lambda d: d["group_list"][0]["instance_list"][1]["devices"][0].update(device_id="0"))
    _fails(write(doc), "device_id 0 is used twice", "group_list[0].instance_list[1].devices[0].device_id")


def test_server_count_mismatch(write):
    _fails(write(_edit(R1_16, lambda d: d.update(server_count="3"))), "server_count", "says 3", "lists 2")


def test_duplicate_server_id(write):
    doc = _edit(R1_16, lambda d: d["server_list"][1].update(server_id=S0))
    _fails(write(doc), "server_list[1].server_id", repr(S0), "listed twice", "server_list[0]")


@pytest.mark.parametrize("field, value, actual", [
    ("server_num", "2", "1"), ("device_num", "4", "2"), ("instance_count", "1", "2"),
])
def test_r02_group_counts(write, field, value, actual):
    doc = _edit(R02_2, lambda d: d["group_list"][0].update({field: value}))
    _fails(write(doc), f"group_list[0].{field}", f"says {value}", f"lists {actual}")


def test_r02_group_count(write):
    _fails(write(_edit(R02_2, lambda d: d.update(group_count="2"))), "group_count", "says 2", "lists 1")


def test_r02_instance_with_two_devices(write):
    doc = _edit(R02_2, lambda d: d["group_list"][0]["instance_list"][0]["devices"].append({"device_id": "5"}))
    _fails(write(doc), "group_list[0].instance_list[0].devices", "exactly one device")


# ---------------------------------------------------------------------------------------------------- rank_from_env


def _env_error(env: dict, *fragments: str) -> None:
    with pytest.raises(ClusterError) as info:
        rank_from_env(env)
    for frag in fragments:
        assert frag in str(info.value), f"{frag!r} not in {str(info.value)!r}"


def test_env_without_table_is_none():
    assert rank_from_env({}) is None
    assert rank_from_env({"RANK_ID": "3", "DEVICE_ID": "3", "RANK_TABLE_FILE": ""}) is None


def test_env_rank_table_file(write):
    path = write(R1_16)
    table, rank = rank_from_env({"RANK_TABLE_FILE": path, "RANK_ID": "9", "RANK_SIZE": "16", "DEVICE_ID": "1"})
    assert rank == 9 and table.world_size == 16 and table.path == path


def test_env_only_rank_id(write):
    assert rank_from_env({"RANK_TABLE_FILE": write(R1_8), "RANK_ID": "4"})[1] == 4


def test_env_mindspore_hccl_config_path_fallback(write):
    table, rank = rank_from_env({"MINDSPORE_HCCL_CONFIG_PATH": write(R02_2), "RANK_ID": "1", "DEVICE_ID": "1",
                                 "RANK_SIZE": "2"})
    assert table.format == "r0.2" and rank == 1


def test_env_rank_table_file_wins(write):
    new, old = write(R1_8, "new.json"), write(R02_2, "old.json")
    table, _ = rank_from_env({"RANK_TABLE_FILE": new, "MINDSPORE_HCCL_CONFIG_PATH": old, "RANK_ID": "0"})
    assert table.path == new


def test_env_defaults_to_os_environ(write, monkeypatch):
    monkeypatch.setenv("RANK_TABLE_FILE", write(R1_8))
    monkeypatch.setenv("RANK_ID", "2")
    for var in ("MINDSPORE_HCCL_CONFIG_PATH", "RANK_SIZE", "DEVICE_ID"):
        monkeypatch.delenv(var, raising=False)
    assert rank_from_env()[1] == 2


def test_env_table_errors_propagate(tmp_path):
    _env_error({"RANK_TABLE_FILE": str(tmp_path / "missing.json"), "RANK_ID": "0"}, "file not found")


def test_env_rank_id_missing(write):
    path = write(R1_8)
    _env_error({"RANK_TABLE_FILE": path}, "RANK_ID is not, nor DEVICE_ID", "RANK_TABLE_FILE", path, "0..7")


def test_env_rank_from_device_id_as_mindspore_0x(write, monkeypatch):
    """r0.2's run.sh sets DEVICE_ID but no RANK_ID: the rank is the table's entry for that device on this host."""
    import autopar.cluster.netutil as netutil

    path = write(R1_8)
    for device in (0, 5):
        assert rank_from_env({"MINDSPORE_HCCL_CONFIG_PATH": path, "DEVICE_ID": str(device), "RANK_SIZE": "8"})[1] == \
            device
    _env_error({"RANK_TABLE_FILE": path, "DEVICE_ID": "9"}, "RANK_ID is not, and DEVICE_ID=9 is no device of the "
               "table (devices [0, 1, 2, 3, 4, 5, 6, 7])")
    two = write(R1_16)  # device 2 on both servers: this host's address decides
    _env_error({"RANK_TABLE_FILE": two, "DEVICE_ID": "2"}, f"DEVICE_ID=2 is on servers {S0}, {S1}, none of them an "
               "address of this host: set RANK_ID")
    monkeypatch.setattr(netutil, "local_addresses", lambda: {"127.0.0.1": "lo", S1: "eth0"})
    assert rank_from_env({"RANK_TABLE_FILE": two, "DEVICE_ID": "2"})[1] == 10


def test_env_rank_id_not_int(write):
    _env_error({"RANK_TABLE_FILE": write(R1_8), "RANK_ID": "one"}, "RANK_ID='one'", "not a non-negative integer")
    _env_error({"RANK_TABLE_FILE": write(R1_8), "RANK_ID": "-1"}, "RANK_ID='-1'")


def test_env_rank_id_out_of_range(write):
    _env_error({"RANK_TABLE_FILE": write(R1_8), "RANK_ID": "8"}, "RANK_ID=8", "out of range", "0..7")


def test_env_rank_size_mismatch(write):
    _env_error({"RANK_TABLE_FILE": write(R1_16), "RANK_ID": "0", "RANK_SIZE": "8"}, "RANK_SIZE=8", "16 ranks")
    _env_error({"RANK_TABLE_FILE": write(R1_16), "RANK_ID": "0", "RANK_SIZE": "x"}, "RANK_SIZE='x'")


def test_env_device_id_mismatch(write):
    # run_cluster.sh on the second server: RANK_ID=8+i, DEVICE_ID=i; DEVICE_ID=8 is the classic mistake.
    _env_error({"RANK_TABLE_FILE": write(R1_16), "RANK_ID": "8", "DEVICE_ID": "8"},
               "DEVICE_ID=8", "rank 8", "device_id 0", repr(S1))
    _env_error({"RANK_TABLE_FILE": write(R1_16), "RANK_ID": "8", "DEVICE_ID": "zero"}, "DEVICE_ID='zero'")
