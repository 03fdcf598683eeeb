#!/usr/bin/python3
"""Checks that every metric the rules and the dashboard name exists.

usage: check_metric_names.py MONITORING_DIR SCRAPE_FILE
Raw names (epserve_...) must be families of the scrape (histogram _bucket/_sum/_count
suffixes allowed); recording-rule names (epserve:...) must be recorded by the rules.
"""
import json
import re
import sys
from pathlib import Path

monitoring, scrape_file = Path(sys.argv[1]), Path(sys.argv[2])
families = set(re.findall(r"^# TYPE (\S+) ", scrape_file.read_text(), re.M))
rules_text = "".join(p.read_text() for p in sorted((monitoring / "rules").glob("*.yml")))
recorded = set(re.findall(r"^\s*- record: (\S+)", rules_text, re.M))

exprs = re.findall(r"expr: (.*(?:\n {10,}.*)*)", rules_text)
dashboard = json.loads((monitoring / "grafana" / "epserve-dashboard.json").read_text())
for panel in dashboard["panels"]:
    exprs += [t["expr"] for t in panel["targets"]]

missing = []
for expr in exprs:
    for name in re.findall(r"\bepserve[_:][a-zA-Z0-9_:]*", expr):
        if ":" in name:
            if name not in recorded:
                missing.append(f"recording rule {name}")
            continue
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name not in families and base not in families:
            missing.append(f"metric {name}")
if missing:
    print("named but not exported:", *sorted(set(missing)), sep="\n  ")
    sys.exit(1)
print(f"ok: {len(exprs)} expressions; every epserve metric they name is exported")
