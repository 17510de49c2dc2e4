"""The Markdown form of ``ms_names.py``'s report (coverage, the 15 samples, names not covered, every file)."""
from __future__ import annotations


def markdown(rep: dict, before: dict | None = None) -> str:
    out = ["# MindSpore names in MindSpore's distributed samples, resolved by autopar", "",
           "Written by `tools/ms_names.py` (see its docstring for how names are found and looked up). Read from "
           "the MindSpore docs repository's distributed sample folders and parallel tutorials, branches r1.5 .. "
           "master (identical files read once). A name is `mindspore.x.y`, a member `Class.member` of an object "
           "the script made, or a keyword `callable(key=)`. *refused*: autopar defines the name only to stop "
           "at its first use with one line saying what to use instead.", "", "## Coverage", "",
           "| names in | " + ("before | " if before else "") + "now |", "|---|" + ("---|" if before else "") + "---|"]
    for group, fig in rep["coverage"].items():
        out.append(f"| {group} | " + (f"{before['coverage'].get(group, '')} | " if before else "") + f"{fig} |")
    out += ["", "## The 15 distributed samples", "", "| sample | files | names | covered | not covered |",
            "|---|---|---|---|---|"]
    for row in rep["core"]:
        missing = ", ".join(f"`{n}` ({rep['names'][n]['status']})" for n in row["not_covered"]) or "-"
        files = "<br>".join(row["files"]) + ("" if row["present"] else " (absent)")
        out.append(f"| {row['sample']} | {files} | {row['names']} | {row['covered']} | {missing} |")
    out += ["", "### Every name each of the 15 uses (not covered ones struck through)", ""]
    for row in rep["core"]:
        used = ", ".join(f"`{n}`" if rep["names"][n]["status"] == "ok" else f"~~`{n}`~~" for n in row["used"])
        out += [f"- **{row['sample']}**: {used}"]
    out += ["", "## Names not covered", "", "| name | status | files using it | in the 15 | detail |",
            "|---|---|---|---|---|"]
    for n, info in sorted(rep["names"].items(), key=lambda kv: (not kv[1]["core"], -kv[1]["files"], kv[0])):
        if info["status"] != "ok":
            out.append(f"| `{n}` | {info['status']} | {info['files']} | {'yes' if info['core'] else ''} | "
                       f"{info['detail'].replace('|', '/')} |")
    out += ["", "## Every file read", "", "| file (and identical copies) | names | covered | not covered |",
            "|---|---|---|---|"]
    for k, f in rep["files"].items():
        copies = f" (= {len(f['same_as'])} more: {', '.join(f['same_as'][:3])}{' ...' if len(f['same_as']) > 3 else ''})" \
            if f["same_as"] else ""
        miss = ", ".join(f"`{n}`" for n in f["not_covered"]) or "-"
        out.append(f"| {k}{copies} | {len(f['names'])} | {f['covered']} | {miss} |")
    out += ["", "## Every name", "", "| name | status | files using it |", "|---|---|---|"]
    for n, info in rep["names"].items():
        out.append(f"| `{n}` | {info['status']} | {info['files']} |")
    return "\n".join(out) + "\n"
