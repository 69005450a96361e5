"""The embedded bus's recording: every record and every group's offsets, in a directory.

One JSON line per record under ``DIR/<topic>/<partition>.jsonl`` (values as
text when they are UTF-8, base64 otherwise) and one file per group under
``DIR/_groups/``, replaced atomically. Reopening the directory gives the same
topics and committed offsets, so a recorded run can be replayed or audited.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import IO

from spikeguard.bus.base import Record, TopicPartition

# (key, value, headers, timestamp_ms) of one stored record, in offset order.
Stored = tuple[bytes | None, bytes | None, tuple[tuple[str, bytes], ...], int]
_GROUPS = "_groups"


class Recording:
    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files: dict[TopicPartition, IO[str]] = {}

    def append(self, record: Record) -> None:
        tp = (record.topic, record.partition)
        handle = self._files.get(tp)
        if handle is None:
            path = self.directory / record.topic / f"{record.partition}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = self._files[tp] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open, closed by close()
        line: dict[str, object] = {"o": record.offset, "t": record.timestamp_ms}
        if record.key is not None:
            line["k"] = base64.b64encode(record.key).decode()
        value = record.value
        if value is None:  # a tombstone
            line["n"] = 1
        else:
            try:
                line["v"] = value.decode("utf-8")
            except UnicodeDecodeError:
                line["vb"] = base64.b64encode(value).decode()
        if record.headers:
            line["h"] = [[k, base64.b64encode(v).decode()] for k, v in record.headers]
        handle.write(json.dumps(line) + "\n")

    def flush(self) -> None:
        for handle in self._files.values():
            handle.flush()

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def save_offsets(self, group: str, committed: dict[TopicPartition, int]) -> None:
        path = self.directory / _GROUPS / f"{group}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([[t, p, o] for (t, p), o in sorted(committed.items())]))
        os.replace(tmp, path)

    def load(self, partitions: int) -> tuple[dict[str, list[list[Stored]]], dict[str, dict]]:
        """(records per topic and partition, committed offsets per group) as recorded."""
        topics: dict[str, list[list[Stored]]] = {}
        groups: dict[str, dict[TopicPartition, int]] = {}
        for topic_dir in sorted(p for p in self.directory.iterdir() if p.is_dir()):
            if topic_dir.name == _GROUPS:
                for offsets in topic_dir.glob("*.json"):
                    groups[offsets.stem] = {
                        (t, p): o for t, p, o in json.loads(offsets.read_text())
                    }
                continue
            logs = topics[topic_dir.name] = [[] for _ in range(partitions)]
            for log_file in sorted(topic_dir.glob("*.jsonl")):
                partition = int(log_file.stem)
                if partition >= partitions:
                    raise ValueError(
                        f"{log_file} has partition {partition}; open this directory "
                        f"with partitions >= {partition + 1}"
                    )
                logs[partition] = _read_log(log_file)
        return topics, groups


def _read_log(path: Path) -> list[Stored]:
    stored: list[Stored] = []
    with open(path, "rb+") as handle:
        good = 0  # byte offset just past the last whole line
        for raw in handle:
            try:
                line = json.loads(raw)
            except ValueError:
                # A torn last line from a crash: everything before it stands, and it
                # is cut off so that the next append starts on a line of its own.
                handle.truncate(good)
                break
            good += len(raw)
            value = (
                None
                if "n" in line
                else line["v"].encode()
                if "v" in line
                else base64.b64decode(line["vb"])
            )
            key = base64.b64decode(line["k"]) if "k" in line else None
            headers = tuple((k, base64.b64decode(v)) for k, v in line.get("h", ()))
            stored.append((key, value, headers, line["t"]))
    return stored
