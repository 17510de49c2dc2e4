"""SLURM's compressed host lists and task counts, as ``srun`` exports them.

``SLURM_JOB_NODELIST=node[01-04,07]`` names nodes node01..node04 and node07; brackets may repeat in one name
(``rack[1-2]-n[1-2]``: rack1-n1, rack1-n2, rack2-n1, rack2-n2) and lists join with commas outside brackets. Zero
padding follows the range's first bound. ``SLURM_TASKS_PER_NODE=2(x3),1`` means 2, 2, 2, 1 tasks on the nodes in
order. ``srun`` puts task 0 on the first node of the step, so that node hosts the rendezvous.
"""
from __future__ import annotations

import re

from autopar.errors import ClusterError


def _split_top(text: str, what: str) -> list[str]:
    """Split on the commas that are outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ClusterError(f"{what}: nested brackets in {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ClusterError(f"{what}: ']' without '[' in {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ClusterError(f"{what}: '[' without ']' in {text!r}")
    parts.append(text[start:])
    return parts


def _expand_range(body: str, text: str, what: str) -> list[str]:
    out = []
    for item in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not m:
            raise ClusterError(f"{what}: {item!r} in {text!r} is not a number or a range a-b")
        lo, hi = m[1], m[2] if m[2] is not None else m[1]
        if int(hi) < int(lo):
            raise ClusterError(f"{what}: range {item!r} in {text!r} runs backwards")
        out += [str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1)]
    return out


def expand_nodelist(text: str, what: str = "SLURM_JOB_NODELIST") -> list[str]:
    """``node[01-04,07],login`` -> ['node01', 'node02', 'node03', 'node04', 'node07', 'login']."""
    text = text.strip()
    if not text:
        raise ClusterError(f"{what} is empty")
    hosts: list[str] = []
    for part in _split_top(text, what):
        if not part:
            raise ClusterError(f"{what}: an empty name in {text!r}")
        names = [""]
        for literal, body in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
            suffixes = _expand_range(body, text, what) if body else [""]
            names = [n + literal + s for n in names for s in suffixes]
        hosts += names
    return hosts


def expand_tasks_per_node(text: str, what: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m or int(m[1]) < 1:
            raise ClusterError(f"{what}={text!r}: {item!r} is not 'N' or 'N(xK)'")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts
