#!/usr/bin/env python3
"""Reads a kiln run's TensorBoard directory with the `tensorboard` package's own readers
and prints what they found as JSON, for tests/test_tensorboard.cpp to compare with
metrics.jsonl.

usage: read_tensorboard.py DIR

Two readers, both TensorBoard's:
  - its record reader (tensorflow_stub's PyRecordReader_New, what TensorBoard reads event
    files with when TensorFlow is absent) over each event file, which raises on a torn
    record or a wrong CRC (the event loader above it would stop at such a record without
    a word, so a damaged file could pass as a short one): every record must read back and
    parse as an Event, the first one a file version;
  - event_accumulator.EventAccumulator over DIR, the reader scripts and notebooks use:
    event files in name order, a session start purging the events before it at its step
    and later;
  - plugin_event_accumulator.EventAccumulator over DIR, what the TensorBoard server loads a
    run with (--load_fast=false), which purges from a run's second session start on: the
    steps it holds per scalar tag.

Output: {"files": [{"name", "file_version", "events", "session_starts": [step...],
                    "scalar_steps": {tag: [step...]}}],
         "scalars": {tag: [[step, value], ...]}, "text": {tag: [[step, text], ...]},
         "server_scalar_steps": {tag: [step...]}}
Non-finite values are written as the strings "nan", "inf", "-inf" (JSON has no NaN).
"""

import json
import math
import os
import sys

from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New
from tensorboard.util import tensor_util


def number(x):
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def read_records(path):
    """Every record of one event file; raises on a torn record or a CRC mismatch."""
    reader = PyRecordReader_New(path.encode())
    records = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return records
        records.append(reader.record())


def read_file(path):
    events = [event_pb2.Event.FromString(r) for r in read_records(path)]
    if not events or not events[0].HasField("file_version"):
        raise SystemExit(f"{path}: the first event is not a file version")
    scalar_steps = {}
    for e in events:
        for v in e.summary.value:
            if v.HasField("simple_value"):
                scalar_steps.setdefault(v.tag, []).append(e.step)
    return {
        "name": os.path.basename(path),
        "file_version": events[0].file_version,
        "events": len(events),
        "session_starts": [
            e.step for e in events if e.HasField("session_log") and e.session_log.status == event_pb2.SessionLog.START
        ],
        "scalar_steps": scalar_steps,
    }


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    run_dir = sys.argv[1]
    names = sorted(n for n in os.listdir(run_dir) if "tfevents" in n)
    files = [read_file(os.path.join(run_dir, n)) for n in names]

    # 0: keep every event (no reservoir sampling), so each step can be compared.
    acc = event_accumulator.EventAccumulator(
        run_dir, size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [[e.step, number(e.value)] for e in acc.Scalars(t)] for t in tags["scalars"]}
    # The tensors the text plugin claims (its plugin_name in the summary metadata).
    text = {}
    for tag in tags["tensors"]:
        if acc.SummaryMetadata(tag).plugin_data.plugin_name != "text":
            raise SystemExit(f"{run_dir}: tensor summary {tag!r} is not the text plugin's")
        text[tag] = [
            [e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode("utf-8")] for e in acc.Tensors(tag)
        ]
    server = plugin_event_accumulator.EventAccumulator(run_dir, size_guidance={plugin_event_accumulator.TENSORS: 0})
    server.Reload()
    server_scalar_steps = {
        tag: [e.step for e in server.Tensors(tag)] for tag in server.PluginTagToContent("scalars")
    }
    json.dump(
        {"files": files, "scalars": scalars, "text": text, "server_scalar_steps": server_scalar_steps}, sys.stdout
    )


if __name__ == "__main__":
    main()
