#!/usr/bin/env python3
"""Sums an `ncu --csv --metrics gpu__time_duration.sum` report by kernel: one line per
kernel name (templates and arguments cut), its total ms and call count, largest first.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv PROGRAM ... > report.csv
    python3 scripts/ncu_kernel_times.py report.csv
"""
import collections
import csv
import sys

SCALE_TO_MS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3, "second": 1e3}


def main(path):
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    if not rows:
        sys.exit(f"ncu_kernel_times: no kernel rows in {path}")
    header = rows[0]
    name_at, value_at, unit_at = (header.index(k) for k in ("Kernel Name", "Metric Value", "Metric Unit"))
    total, calls = collections.Counter(), collections.Counter()
    for r in rows[1:]:
        unit = r[unit_at]
        if unit not in SCALE_TO_MS:
            sys.exit(f"ncu_kernel_times: unknown unit {unit!r} in {path}")
        name = r[name_at].replace("(anonymous namespace)::", "").split("(")[0].split("<")[0].replace("void ", "")
        name = name.strip().split("::")[-1]
        total[name] += float(r[value_at].replace(",", "")) * SCALE_TO_MS[unit]
        calls[name] += 1
    for name, ms in total.most_common():
        print(f"  {ms:9.3f} ms  x{calls[name]:3d}  {name}")
    print(f"  {sum(total.values()):9.3f} ms in all")


if __name__ == "__main__":
    main(sys.argv[1])
