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


def _run_child(script: str) -> subprocess.CompletedProcess[str]:
    """Runs ``script`` in a Python process of its own (the transport is one per process); it
    must exit with status 0 within a minute."""
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr
    return child


def test_cancelling_while_another_thread_progresses_does_not_deadlock():
    child = _run_child(_CANCEL_WHILE_PROGRESSING)
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


# A peer worker in the same process that is never progressed, as a stopped or stuck peer
# process: the rendezvous send to it never completes, so closing its endpoint (a flush) never
# does either. ucxx's ``close_blocking`` waited for it for ever.
_RELEASE_BESIDE_A_SILENT_PEER = """
import time
import numpy as np
from freescale_comm.transport import Transport

transport = Transport.acquire()
peer = transport._ucx.UCXWorker(transport.context)
endpoint = transport.endpoint(bytes(peer.address))
payload = np.ones(64 << 20, np.uint8)
send = transport.send(endpoint, payload, 7)
for _ in range(100):
    transport.progress()
assert not send.completed
start = time.monotonic()
transport.release()
print("released after", time.monotonic() - start)
"""


def test_a_release_beside_a_peer_that_never_progresses_ends_within_its_bound():
    from freescale_comm.transport import CLOSE_S

    child = _run_child(_RELEASE_BESIDE_A_SILENT_PEER)
    seconds = float(child.stdout.split()[-1])
    assert CLOSE_S <= seconds < CLOSE_S + 2.0, seconds
    assert "1 UCX endpoint(s) did not close within 3 s" in child.stderr, child.stderr


# A peer sends a rendezvous message to a process whose engine has nothing in flight; the
# receive is posted and never progressed by its poster. The engine, idle on its condition,
# must still progress the worker, or the peer's send (and a close of its endpoint, which
# flushes it) never completes.
_PEER_OF_AN_IDLE_ENGINE = """
import time
import numpy as np
from freescale_comm.engine import Engine
from freescale_comm.transport import Transport

transport = Transport.acquire()
engine = Engine.acquire(transport)
peer = transport._ucx.UCXWorker(transport.context)
blob = transport._ucx.UCXAddress.create_from_buffer(transport.address)
peer_endpoint = peer.create_endpoint_from_worker_address(blob, False)
sent, received = np.ones(16 << 20, np.uint8), np.zeros(16 << 20, np.uint8)
send = peer_endpoint.tag_send(transport._array(sent), transport._ucx.UCXXTag(7))
receive = transport.recv(transport.endpoint(bytes(peer.address)), received, 7)
start = time.monotonic()
while not send.completed and time.monotonic() < start + 10:
    peer.progress()
    time.sleep(0.001)
print(send.completed, receive.completed, int(received.min()), time.monotonic() - start)
del send, receive
peer_endpoint.close_blocking()
del peer_endpoint
engine.release()
transport.release()
"""


def test_an_idle_engine_progresses_ucx_for_its_peers():
    child = _run_child(_PEER_OF_AN_IDLE_ENGINE)
    send_done, receive_done, smallest, seconds = child.stdout.split()
    assert (send_done, receive_done, smallest) == ("True", "True", "1"), child.stdout
    assert float(seconds) < 2.0, seconds  # two wakes of the idle engine (0.25 s apart) do it
