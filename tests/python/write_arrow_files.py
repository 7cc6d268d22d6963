"""Writes DOCS (a JSON list of strings) with the pinned pyarrow (scripts/python-requirements.txt),
as another library writes them for kiln to read (tests/test_data_arrow.cpp):
  OUT/corpus.parquet   zstd, 5 rows per row group, the text column after an int64 one
  OUT/corpus.arrow     an Arrow IPC stream of 4-row record batches, large_string text
Usage: write_arrow_files.py DOCS.json OUT
"""
import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq

docs = json.load(open(sys.argv[1], encoding="utf-8"))
out = sys.argv[2]
ids = pa.array(range(len(docs)), pa.int64())
table = pa.table({"id": ids, "text": pa.array(docs, pa.string())})
pq.write_table(table, f"{out}/corpus.parquet", row_group_size=5, compression="zstd")
large = pa.table({"id": ids, "text": pa.array(docs, pa.large_string())})
with pa.OSFile(f"{out}/corpus.arrow", "wb") as sink, pa.ipc.new_stream(sink, large.schema) as writer:
    for batch in large.to_batches(max_chunksize=4):
        writer.write_batch(batch)
