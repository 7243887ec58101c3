"""The process's UCX worker (``transport.Transport``) over real UCX, in a child process."""

from __future__ import annotations

import subprocess
import sys

# Receives matched by a send from the same worker, cancelled right after the send is posted,
# while a second thread progresses the worker: the receive often completes inside that progress
# call as it is cancelled. Without ``Transport.cancel`` serialising the two, ucxx deadlocks
# (cancel holds the request's mutex and waits for the worker's lock; progress holds the worker's
# lock and waits for the request's mutex) within a few hundred rounds.
_CANCEL_WHILE_PROGRESSING = """
import threading, time
import numpy as np
from freescale_comm.transport import Transport

transport = Transport.acquire()
endpoint = transport.endpoint(transport.address)
stop = threading.Event()

def progress():
    while not stop.is_set():
        transport.progress()

thread = threading.Thread(target=progress)
thread.start()
received, sent = np.zeros(64, np.uint8), np.ones(64, np.uint8)
rounds, until = 0, time.monotonic() + 2.0
while time.monotonic() < until:
    in_flight = [transport.recv(endpoint, received, rounds)]
    send = transport.send(endpoint, sent, rounds)
    transport.cancel(in_flight)
    while not send.completed:
        time.sleep(0)
    del send
    rounds += 1
stop.set()
thread.join()
transport.release()
print("rounds", rounds)
"""


def test_cancelling_while_another_thread_progresses_does_not_deadlock():
    child = subprocess.run(
        [sys.executable, "-c", _CANCEL_WHILE_PROGRESSING],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr
    rounds = int(child.stdout.split()[-1])
    assert rounds >= 1000, f"only {rounds} rounds: too few to have raced the progress thread"


def test_ucx_cross_memory_attach_is_left_out_where_the_host_identity_is_overridden(monkeypatch):
    from freescale_comm.options import HOST_ENV
    from freescale_comm.transport import context_config

    monkeypatch.delenv(HOST_ENV, raising=False)
    monkeypatch.delenv("UCX_TLS", raising=False)
    assert context_config() == {}
    monkeypatch.setenv(HOST_ENV, "pretend-host-0")
    assert context_config() == {"TLS": "^cma"}
    monkeypatch.setenv("UCX_TLS", "tcp,cma")  # the user's choice stands
    assert context_config() == {}
