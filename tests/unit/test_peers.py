"""A vanished peer of a multi-process run, read from what JAX's runtime logs
(framework/runtime/peers.py). The lines below are recorded from two-process runs on this
stack (jax 0.10.2, gloo); the end-to-end test is in tests/e2e/test_faults.py."""

import json

from framework.runtime import peers

# Process 0's log when process 1 was SIGKILLed: its coordination service declares it.
SERVICE_SIDE = """\
E1124 04:59:58.735654   21087 coordination_service.cc:1520] [8056369611311098893] Shutdown barrier in coordination service has failed:
INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 1 heartbeat timeout. This indicates that the remote task has failed, got preempted, or crashed unexpectedly.
E1124 04:59:58.735812   21087 coordination_service.cc:1549] [8056369611311098893] Use error polling to propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']
F1124 04:59:58.736635   21098 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died
""".splitlines()

# Process 1's log when process 0 (and its service) was SIGKILLed.
CLIENT_SIDE = """\
E1124 05:09:37.546453   26201 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
F1124 05:09:37.546749   26201 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died
Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/PollForError:
:UNKNOWN:Error received from peer  {grpc_message:"recvmsg:Connection reset by peer", grpc_status:14}
*** Check failure stack trace: ***
    @     0x7f643d7040ee  xla::CoordinationServiceAgent::SetError()
""".splitlines()

ORDINARY = """\
[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1
W1124 05:01:40.220101   22428 cpu_client.cc:1] some warning about something else
""".splitlines()


def test_the_verdict_names_the_vanished_process_on_either_side():
    assert peers.verdict(SERVICE_SIDE, me=0) == [1]
    assert peers.verdict(CLIENT_SIDE, me=1) == [0]
    assert peers.verdict(ORDINARY, me=0) is None  # a normal end: nothing to say
    # JAX's verdict without a name still gives a line (who: "a process of this run").
    assert peers.verdict(SERVICE_SIDE[-1:], me=1) == []


def test_the_line_and_summary_name_the_newest_complete_checkpoint(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for step, complete in ((4, True), (6, True), (8, False)):
        folder = ckpts / str(step)
        (folder / "meta").mkdir(parents=True)
        if complete:
            (folder / "done").write_text("")
    (ckpts / "9.orbax-checkpoint-tmp-12").mkdir()
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in range(1, 10)))
    (tmp_path / "summary.json").write_text(json.dumps({"status": "running", "step": 3}))
    settings = {"run_dir": str(tmp_path), "checkpoints": str(ckpts), "markers": ["done"],
                "processes": 2, "process": 0, "heartbeat_timeout_s": 5}
    line = peers.line_for([1], settings)
    assert line == (f"error: process 1 of 2 vanished after step 9 (no heartbeat for 5 s); "
                    f"the newest complete checkpoint is step 6 in {ckpts} (8, "
                    f"9.orbax-checkpoint-tmp-12: unfinished, never read); restart every "
                    f"process with the same command to resume")
    peers._mark_summary(settings, line[len("error: "):])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["step"] == 9
    assert summary["reason"].startswith("process 1 of 2 vanished")
    assert [p.name for p in tmp_path.iterdir() if "tmp" in p.name] == []


def test_only_errors_that_look_like_a_lost_peer_wait_for_the_verdict():
    lost = RuntimeError("could not save the checkpoint of step 6: JaxRuntimeError: UNKNOWN: "
                        "Gloo AllGather failed: Read error: Connection reset by peer")
    assert peers.looks_like_peer_loss(lost)
    assert not peers.looks_like_peer_loss(ValueError("train.steps=0 must be >= 1"))
