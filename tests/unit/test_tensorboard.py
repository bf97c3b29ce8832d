"""TensorBoard scalars (`logging.tensorboard=true`, framework/run/dashboards.py): the
records metrics.jsonl gets, read back from the event files (TFRecord framing, Event
protos) as TensorBoard would."""

import struct
from pathlib import Path

from framework.run.dashboards import TensorBoardSink


def read_events(folder: Path) -> list:
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            events.append(Event.FromString(data[at + 12:at + 12 + length]))
            at += 12 + length + 4  # length, its crc, the record, its crc
    return events


def scalars(events) -> dict:
    out = {}
    for e in events:
        for v in e.summary.value:
            if v.HasField("simple_value"):
                out.setdefault(v.tag, []).append((e.step, v.simple_value))
    return out


def test_numbers_become_scalars_and_text_stays_text(tmp_path):
    sink = TensorBoardSink(tmp_path)
    for step in (10, 20):
        sink.log(step, {"train/loss": 5.0 - step / 10, "train/lr": 1e-3, "perf/mfu": None,
                        "eval/sample": "once upon", "perf/bad": float("nan"),
                        "flag": True})
    sink.finish({"status": "completed"})
    events = read_events(tmp_path / "tensorboard")
    got = scalars(events)
    assert got["train/loss"] == [(10, 4.0), (20, 3.0)]
    assert [s for s, _ in got["train/lr"]] == [10, 20]
    assert not {"perf/mfu", "perf/bad", "flag"} & set(got)
    texts = [v.tag for e in events for v in e.summary.value if not v.HasField("simple_value")]
    assert any(t.startswith("eval/sample") for t in texts)


def test_a_resumed_run_purges_from_its_checkpoint(tmp_path):
    first = TensorBoardSink(tmp_path)
    for step in (10, 20, 30):
        first.log(step, {"train/loss": float(step)})
    first.finish({})
    again = TensorBoardSink(tmp_path, resumed_at=20)
    again.log(30, {"train/loss": 3.0})
    again.finish({})
    events = read_events(tmp_path / "tensorboard")
    purges = [e for e in events if e.HasField("session_log") and e.step == 20]
    assert purges and purges[0].session_log.status == purges[0].session_log.START
    assert scalars(events)["train/loss"][-1] == (30, 3.0)
